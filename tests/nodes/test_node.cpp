// The node runtime's typed errors and the cluster secret helpers, without
// a cluster. Clusters run as real processes in tests/nodes/check_nodes.py
// (pd = mono for 100 requests, refused secrets, kill -9, SIGSTOP): nodes in
// one process hang now and then in CAF 0.17's actor_system teardown.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "actors/node.h"
#include "tests/model/model_fixtures.h"

using namespace cleave;
using namespace cleave::fixtures;
namespace fs = std::filesystem;

namespace {

const char* kScript = R"(
cluster { secret_env = "CLEAVE_TEST_NODE_SECRET" }
node { name = "head", head = true, port = param("head_port", 0), actors = { kv_store = 1 } }
node { name = "p0", threads = 1, actors = { prefill = 1 } }
node { name = "d0", threads = 1, actors = { decode = 1 } }
node { name = "g0", device = "cuda:0", actors = { decode = 1 } }
)";

ClusterSpec spec_with_head_port(int port) {
  auto spec = load_topology_string(kScript, "test", {{"head_port", std::to_string(port)}});
  REQUIRE_MESSAGE(spec.ok(), spec.status().to_string());
  return *spec;
}

NodeOptions options_for(const std::string& name, int head_port, std::optional<std::string> secret) {
  NodeOptions o;
  o.spec = spec_with_head_port(head_port);
  o.name = name;
  o.file = open_model(model_path(small_dense(), "node-dense"));
  o.engine.threads = 1;
  o.engine.max_seqs = 4;
  o.secret = std::move(secret);
  o.join_timeout_s = 10;
  return o;
}

GenerateRequest request_of(uint64_t id, int prompt_len, int max_tokens) {
  GenerateRequest r;
  r.request_id = id;
  r.prompt = prompt_of(prompt_len, int(id));
  r.sampling.max_tokens = max_tokens;
  return r;
}

}  // namespace

TEST_CASE("secrets_equal: equal only for the same bytes and the same length") {
  CHECK(secrets_equal("", ""));
  CHECK(secrets_equal("s3cret", "s3cret"));
  CHECK_FALSE(secrets_equal("s3cret", "s3creT"));
  CHECK_FALSE(secrets_equal("s3cret", "s3cret2"));
  CHECK_FALSE(secrets_equal("s3cret2", "s3cret"));
  CHECK_FALSE(secrets_equal("", "x"));
  CHECK_FALSE(secrets_equal(std::string_view("a\0b", 3), std::string_view("a\0c", 3)));
  CHECK_FALSE(secrets_equal(std::string_view("a\0", 2), "a"));
}

TEST_CASE("read_cluster_secret: the file wins over the environment and bad files get typed errors") {
  const fs::path dir = fs::temp_directory_path() / ("cleave-node-secret-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  ClusterSpec spec;
  spec.secret_env = "CLEAVE_TEST_NODE_SECRET_ENV";
  ::unsetenv(spec.secret_env.c_str());
  auto none = read_cluster_secret(spec);
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());

  ::setenv(spec.secret_env.c_str(), "from-env", 1);
  auto env = read_cluster_secret(spec);
  REQUIRE(env.ok());
  CHECK(env->value_or("") == "from-env");

  spec.secret_file = (dir / "secret").string();
  std::ofstream(spec.secret_file) << "from-file\r\n\n";
  auto file = read_cluster_secret(spec);
  REQUIRE(file.ok());
  CHECK(file->value_or("") == "from-file");

  std::ofstream(spec.secret_file) << "\n";
  auto empty = read_cluster_secret(spec);
  CHECK(empty.status().code() == Code::invalid_argument);
  CHECK(empty.status().message().find("empty") != std::string::npos);

  spec.secret_file = (dir / "missing").string();
  auto missing = read_cluster_secret(spec);
  CHECK(missing.status().code() == Code::io_error);
  CHECK(missing.status().message().find("missing") != std::string::npos);
  ::unsetenv(spec.secret_env.c_str());
  fs::remove_all(dir);
}

TEST_CASE("Node::start: unknown node, worker without the head port and a device it cannot run on are typed errors") {
  auto unknown = Node::start(options_for("nope", 0, std::nullopt));
  CHECK(unknown.status().code() == Code::invalid_argument);
  CHECK(unknown.status().message().find("'nope'") != std::string::npos);
  CHECK(unknown.status().message().find("d0") != std::string::npos);

  auto no_port = Node::start(options_for("d0", 0, std::nullopt));
  CHECK(no_port.status().code() == Code::invalid_argument);
  CHECK(no_port.status().message().find("port 0") != std::string::npos);

  // device = "cuda:0": refused at start, before the node joins, naming the
  // device (no GPU or no CUDA backend here: unavailable; on a GPU machine
  // the engine cannot run there yet: unsupported). Never ignored.
  auto gpu = Node::start(options_for("g0", 1, std::nullopt));
  REQUIRE_FALSE(gpu.ok());
  CHECK((gpu.status().code() == Code::unavailable || gpu.status().code() == Code::unsupported));
  CHECK_MESSAGE(gpu.status().message().find("node 'g0': device cuda:0: ") == 0, gpu.status().message());
  CHECK(gpu.status().message().find("127.0.0.1:1") == std::string::npos);  // it never dialled the head

  NodeOptions no_model = options_for("head", 0, std::nullopt);
  no_model.file = nullptr;
  CHECK(Node::start(no_model).status().code() == Code::invalid_argument);
}

TEST_CASE("Node::start: a worker gives up on an unreachable head at its deadline") {
  // Port 1 on loopback: nothing listens there, connects are refused at once.
  NodeOptions o = options_for("d0", 1, std::nullopt);
  o.join_timeout_s = 0.3;
  auto worker = Node::start(o);
  CHECK(worker.status().code() == Code::unavailable);
  CHECK(worker.status().message().find("127.0.0.1:1") != std::string::npos);
}

TEST_CASE("a head alone listens on an ephemeral port and answers unavailable without stages") {
  auto head = Node::start(options_for("head", 0, std::nullopt));
  REQUIRE_MESSAGE(head.ok(), head.status().to_string());
  CHECK((*head)->is_head());
  CHECK_FALSE((*head)->lost_head());
  const std::string address = (*head)->address();
  CHECK(address.rfind("127.0.0.1:", 0) == 0);
  CHECK(std::stoi(address.substr(address.rfind(':') + 1)) > 0);
  CHECK((*head)->stages() == 0);
  Status st = (*head)->submit(request_of(1, 4, 4), [](const msg::StreamEvent&) {});
  CHECK(st.code() == Code::unavailable);
  GenerateRequest bad = request_of(2, 4, 4);
  bad.prompt.push_back(1 << 30);  // outside the vocabulary
  CHECK((*head)->submit(bad, [](const msg::StreamEvent&) {}).code() != Code::ok);
}

TEST_CASE("a head that cannot listen on its address gets unavailable naming it") {
  NodeOptions o = options_for("head", 0, std::nullopt);
  o.spec.nodes[0].host = "203.0.113.7";  // TEST-NET-3: no local interface has it
  auto head = Node::start(o);
  CHECK(head.status().code() == Code::unavailable);
  CHECK(head.status().message().find("203.0.113.7") != std::string::npos);
}
