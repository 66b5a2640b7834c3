// The expert data socket (actors/expert_socket.h) over real loopback sockets
// in one process: batches come back with the host's own bits, several in
// flight are answered in order, a wrong token or index is refused, a bad
// batch gets an error answer, and a silent or vanished server gives a typed
// error within the deadline.
#include <doctest/doctest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "actors/expert_socket.h"
#include "tests/actors/pipeline_load.h"

using namespace cleave;
using namespace cleave::testing;

namespace {

ModelSpec moe4() {
  ModelSpec s = small_dense();
  s.n_layers = 2;
  s.n_experts = 4;
  s.n_experts_used = 2;
  s.ffn = 64;
  s.name = "socket-moe4";
  return s;
}

std::shared_ptr<ExpertHost> host_of(const Model& m, ExpertSet set) {
  auto h = ExpertHost::create(m.file, std::move(set), 1);
  REQUIRE_MESSAGE(h.ok(), h.status().to_string());
  return std::shared_ptr<ExpertHost>(std::move(h.value()));
}

// rows x dim floats for expert e of layer l, as the attention side sends them.
msg::ExpertBatch batch_of(int32_t layer, int32_t dim, const std::vector<std::pair<int32_t, int32_t>>& pieces,
                          float seed) {
  msg::ExpertBatch b;
  b.layer = layer;
  b.dim = uint32_t(dim);
  std::vector<float> x;
  for (auto [e, rows] : pieces) {
    b.pieces.push_back(msg::ExpertPiece{e, uint32_t(rows)});
    for (int32_t i = 0; i < rows * dim; ++i) x.push_back(seed + 0.01f * float(i % 97) - 0.3f * float(e));
  }
  b.data.resize(x.size() * sizeof(float));
  std::memcpy(b.data.data(), x.data(), b.data.size());
  b.checksum = checksum_bytes(b.data.data(), b.data.size());
  return b;
}

std::chrono::steady_clock::time_point in(int ms) {
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
}

std::string with_token(const std::string& endpoint, char c) {
  std::string e = endpoint;
  const size_t slash = e.find('/');
  e[slash + 1] = e[slash + 1] == c ? char(c + 1) : c;
  return e;
}

}  // namespace

TEST_CASE("expert socket: batches give the host's own bits, in order, several in flight") {
  const Model& m = model(moe4());
  auto h0 = host_of(m, expert_set({0, 1}));
  auto h1 = host_of(m, expert_set({2, 3}));
  auto server = ExpertSocketServer::listen("127.0.0.1", {h0, h1});
  REQUIRE_MESSAGE(server.ok(), server.status().to_string());
  const int32_t dim = h0->config().dim;
  auto reference = host_of(m, ExpertSet{});  // computes in process

  auto client = ExpertSocketClient::connect((*server)->endpoint(1));
  REQUIRE_MESSAGE(client.ok(), client.status().to_string());
  std::vector<msg::ExpertBatch> sent;
  for (int i = 0; i < 5; ++i) {  // five in flight before the first answer is read
    sent.push_back(batch_of(i % 2, dim, {{2, 1 + i}, {3, 3}}, float(i)));
    REQUIRE((*client)->send(codec::encode(sent.back())).ok());
  }
  for (const msg::ExpertBatch& b : sent) {
    auto got = (*client)->answer(in(5000));
    REQUIRE_MESSAGE(got.ok(), got.status().to_string());
    auto want = serve_expert_batch(*reference, codec::encode(b));
    REQUIRE(want.ok());
    CHECK(got.value() == want.value());  // bit for bit, and the answer to this batch
  }
  CHECK((*server)->batches() == 5);

  // A batch for experts host 1 does not hold: an error answer, the host
  // stays reachable for the next connection.
  REQUIRE((*client)->send(codec::encode(batch_of(0, dim, {{0, 2}}, 1.f))).ok());
  auto refused = (*client)->answer(in(5000));
  CHECK(refused.status().code() == Code::unavailable);
  CHECK(refused.status().message().find("expert 0 of layer 0 is not held here") != std::string::npos);
  CHECK((*server)->refused() == 1);
  // Bytes that are no batch: refused the same way.
  REQUIRE((*client)->send(codec::Bytes{'n', 'o', 'p', 'e'}).ok());
  CHECK(!(*client)->answer(in(5000)).ok());
  CHECK((*server)->refused() == 2);
}

TEST_CASE("expert socket: a wrong token, index or endpoint is refused") {
  const Model& m = model(moe4());
  auto server = ExpertSocketServer::listen("127.0.0.1", {host_of(m, ExpertSet{})});
  REQUIRE(server.ok());
  const int32_t dim = host_of(m, ExpertSet{})->config().dim;
  const std::string good = (*server)->endpoint(0);
  for (const std::string& bad : {with_token(good, 'a'), good.substr(0, good.rfind('/')) + "/7"}) {
    CAPTURE(bad);
    auto c = ExpertSocketClient::connect(bad);
    REQUIRE(c.ok());  // the hello is sent; the server answers by closing
    (void)(*c)->send(codec::encode(batch_of(0, dim, {{0, 1}}, 0.f)));
    auto got = (*c)->answer(in(5000));
    CHECK(got.status().code() == Code::unavailable);
  }
  CHECK((*server)->batches() == 0);
  for (const char* endpoint : {"no-port", "127.0.0.1:1/short/0", "127.0.0.1:0/0123456789abcdef0123456789abcdef/0"})
    CHECK(ExpertSocketClient::connect(endpoint).status().code() == Code::invalid_argument);
}

TEST_CASE("expert socket: a silent server times out at the deadline, a gone one fails at once") {
  // A listener that accepts and never answers (a stopped process).
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const std::string endpoint =
      "127.0.0.1:" + std::to_string(ntohs(a.sin_port)) + "/0123456789abcdef0123456789abcdef/0";
  auto c = ExpertSocketClient::connect(endpoint);
  REQUIRE(c.ok());
  REQUIRE((*c)->send(codec::Bytes(64, 'x')).ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto got = (*c)->answer(in(300));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(got.status().code() == Code::timed_out);
  CHECK(waited >= 0.25);
  CHECK(waited < 3.0);
  ::close(fd);

  const Model& m = model(moe4());
  auto server = ExpertSocketServer::listen("127.0.0.1", {host_of(m, ExpertSet{})});
  REQUIRE(server.ok());
  auto c2 = ExpertSocketClient::connect((*server)->endpoint(0));
  REQUIRE(c2.ok());
  server->reset();  // the process hosting the experts goes
  (void)(*c2)->send(codec::Bytes(64, 'x'));
  CHECK((*c2)->answer(in(5000)).status().code() == Code::unavailable);
}

TEST_CASE("expert socket: batches of one layer from several stages are computed together, same bits") {
  const Model& m = model(moe4());
  auto host = host_of(m, ExpertSet{});
  // The first batch waits 200 ms for others (a test seam; 0 in service).
  auto server = ExpertSocketServer::listen("127.0.0.1", {host}, std::chrono::seconds(5), std::chrono::milliseconds(200));
  REQUIRE(server.ok());
  const int32_t dim = host->config().dim;
  auto reference = host_of(m, ExpertSet{});
  std::vector<std::unique_ptr<ExpertSocketClient>> stages;
  std::vector<msg::ExpertBatch> sent;
  for (int i = 0; i < 3; ++i) {  // three stages, each its own connection, the same layer
    auto c = ExpertSocketClient::connect((*server)->endpoint(0));
    REQUIRE(c.ok());
    stages.push_back(std::move(c.value()));
    sent.push_back(batch_of(1, dim, {{i % 4, 2 + i}, {3, 1 + 2 * i}}, 0.5f * float(i)));
  }
  for (int i = 0; i < 3; ++i) REQUIRE(stages[size_t(i)]->send(codec::encode(sent[size_t(i)])).ok());
  for (int i = 0; i < 3; ++i) {
    auto got = stages[size_t(i)]->answer(in(5000));
    REQUIRE_MESSAGE(got.ok(), got.status().to_string());
    CHECK(got.value() == serve_expert_batch(*reference, codec::encode(sent[size_t(i)])).value());
  }
  CHECK((*server)->merged() == 3);
  CHECK((*server)->batches() == 3);
  CHECK(host->stats().calls == 1);  // one compute for the three
}
