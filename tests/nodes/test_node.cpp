// Nodes in one process (each Node has its own actor system and talks to the
// others over loopback through CAF's middleman): a head and two workers give
// generate()'s tokens, a wrong secret is refused, bad setups get typed
// errors; the cluster secret helpers. tests/nodes/check_nodes.py runs the
// same over real processes (kill -9, SIGSTOP).
#include <doctest/doctest.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include "actors/node.h"
#include "model/generate.h"
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
node { name = "x0", actors = { expert = 2 } }
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

int port_of(const Node& head) {
  const std::string a = head.address();
  return std::stoi(a.substr(a.rfind(':') + 1));
}

GenerateRequest request_of(uint64_t id, int prompt_len, int max_tokens) {
  GenerateRequest r;
  r.request_id = id;
  r.prompt = prompt_of(prompt_len, int(id));
  r.sampling.temperature = id % 2 ? 0.8f : 0.0f;
  r.sampling.seed = 7;
  r.sampling.max_tokens = max_tokens;
  r.ignore_eos = true;
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

TEST_CASE("Node::start: unknown node and worker without the head port and unknown kinds are typed errors") {
  auto unknown = Node::start(options_for("nope", 0, std::nullopt));
  CHECK(unknown.status().code() == Code::invalid_argument);
  CHECK(unknown.status().message().find("'nope'") != std::string::npos);
  CHECK(unknown.status().message().find("d0") != std::string::npos);

  auto no_port = Node::start(options_for("d0", 0, std::nullopt));
  CHECK(no_port.status().code() == Code::invalid_argument);
  CHECK(no_port.status().message().find("port 0") != std::string::npos);

  auto expert = Node::start(options_for("x0", 1, std::nullopt));
  CHECK(expert.status().code() == Code::unsupported);
  CHECK(expert.status().message().find("expert") != std::string::npos);

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

TEST_CASE("nodes over loopback: a head with a prefill and a decode worker give generate()'s tokens") {
  auto head = Node::start(options_for("head", 0, std::string("s3cret")));
  REQUIRE_MESSAGE(head.ok(), head.status().to_string());
  CHECK((*head)->is_head());
  const int port = port_of(**head);
  REQUIRE(port > 0);
  auto p0 = Node::start(options_for("p0", port, std::string("s3cret")));
  REQUIRE_MESSAGE(p0.ok(), p0.status().to_string());
  auto d0 = Node::start(options_for("d0", port, std::string("s3cret")));
  REQUIRE_MESSAGE(d0.ok(), d0.status().to_string());
  CHECK((*head)->stages() == 2);
  CHECK((*d0)->stages() == 1);
  CHECK((*d0)->submit(request_of(1, 4, 4), [](const msg::StreamEvent&) {}).code() == Code::unsupported);

  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, Status> errors;
  size_t done = 0;
  std::vector<GenerateRequest> requests;
  for (uint64_t id = 1; id <= 12; ++id) requests.push_back(request_of(id, 5 + int(id) * 3, 10));
  for (const GenerateRequest& r : requests) {
    Status st = (*head)->submit(r, [&, id = r.request_id](const msg::StreamEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (e.kind == msg::StreamEvent::Kind::token) tokens[id].push_back(e.token);
      if (e.kind == msg::StreamEvent::Kind::failed) errors[id] = e.error;
      if (e.kind != msg::StreamEvent::Kind::token) {
        ++done;
        cv.notify_all();
      }
    });
    REQUIRE_MESSAGE(st.ok(), st.to_string());
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return done == requests.size(); }));
  }
  CHECK(errors.empty());
  auto engine = make_engine(model_path(small_dense(), "node-dense"), 1);
  for (const GenerateRequest& r : requests) {
    auto mono = generate(*engine, nullptr, r);
    REQUIRE(mono.ok());
    CHECK_MESSAGE(tokens[r.request_id] == mono->tokens, "request " << r.request_id);
  }
  // The KV crossed processes' worth of wire: prefill -> head's store -> decode.
  for (const msg::Stats& s : (*head)->stats())
    if (s.actor == "kv_store") CHECK(s.get("kv_blocks_served") > 0);
}

TEST_CASE("nodes over loopback: a worker with the wrong secret is refused with the reason") {
  auto head = Node::start(options_for("head", 0, std::string("right")));
  REQUIRE_MESSAGE(head.ok(), head.status().to_string());
  const int port = port_of(**head);
  auto wrong = Node::start(options_for("d0", port, std::string("wrong")));
  CHECK(wrong.status().code() == Code::unavailable);
  CHECK(wrong.status().message().find("wrong cluster secret") != std::string::npos);
  CHECK(wrong.status().message().find("d0") != std::string::npos);
  auto none = Node::start(options_for("d0", port, std::nullopt));
  CHECK(none.status().code() == Code::unavailable);
  CHECK((*head)->stages() == 0);
  auto right = Node::start(options_for("d0", port, std::string("right")));
  REQUIRE_MESSAGE(right.ok(), right.status().to_string());
  CHECK((*head)->stages() == 1);
}
