// The KV data socket (actors/kv_socket.h) over real loopback sockets in
// one process: streams come back bit for bit, a wrong token is refused, a
// cut or stalled connection and a corrupt chunk get typed errors.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "actors/kv_socket.h"
#include "tests/actors/kv_records.h"

using namespace cleave;
using cleave::test::make_records;
using cleave::test::small_layout;

namespace {

msg::KvPull pull_of(uint64_t id, int32_t first, uint32_t chunk) {
  msg::KvPull p;
  p.request_id = id;
  p.first_block = first;
  p.chunk_bytes = chunk;
  p.window = 1;
  return p;
}

// A listening socket on 127.0.0.1 that runs `peer` on the first connection
// (the stand-in for a sender that misbehaves).
struct FakeSender {
  int listener = -1;
  uint16_t port = 0;
  std::thread thread;
  template <class Fn>
  explicit FakeSender(Fn peer) {
    listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), len) == 0);
    REQUIRE(::listen(listener, 1) == 0);
    REQUIRE(::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port = ntohs(a.sin_port);
    thread = std::thread([this, peer] {
      const int fd = ::accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      char hello[44];
      (void)::recv(fd, hello, sizeof hello, MSG_WAITALL);
      peer(fd);
      ::close(fd);
    });
  }
  ~FakeSender() {
    thread.join();
    ::close(listener);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

}  // namespace

TEST_CASE("kv socket: blocks come back bit for bit over loopback") {
  auto records = make_records(5);
  auto sent = std::make_shared<KvStreamCounters>();
  auto server = KvSocketServer::listen("127.0.0.1", sent);
  REQUIRE_MESSAGE(server.ok(), server.status().to_string());
  std::atomic<int> completed{0};
  uint64_t id = 0;
  for (uint32_t chunk : {64u, 100u, 1000u, uint32_t(small_layout().block_bytes()), 1u << 20}) {
    for (int32_t first : {0, 3}) {
      CAPTURE(chunk);
      CAPTURE(first);
      ++id;
      const std::string token = (*server)->offer(id, records, first, chunk,
                                                 [&](bool ok) { completed += ok ? 1 : 100; });
      CHECK(token.size() == 32);
      KvStreamCounters received;
      auto got = fetch_kv_socket((*server)->address(), token, pull_of(id, first, chunk),
                                 uint64_t(1) << 30, received);
      REQUIRE_MESSAGE(got.ok(), got.status().to_string());
      REQUIRE(got->size() == size_t(5 - first));
      for (size_t b = 0; b < got->size(); ++b) {
        const BlockRecord& want = (*records)[size_t(first) + b];
        CHECK((*got)[b].header.key == want.header.key);
        CHECK((*got)[b].bytes == want.bytes);
        CHECK(verify((*got)[b], 1234, small_layout()).ok());
      }
      const uint64_t bytes = small_layout().block_bytes() * uint64_t(5 - first);
      CHECK(received.bytes_received == bytes);
      CHECK(received.chunks_received == (bytes + chunk - 1) / chunk);
    }
  }
  // The sender counts a stream once the receiver acknowledged it.
  for (int i = 0; i < 200 && completed < int(id); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(completed == int(id));
  CHECK(sent->transfers_sent == id);
  CHECK((*server)->offers() == 0);
}

TEST_CASE("kv socket: a wrong token is refused and the right one still works") {
  auto records = make_records(2);
  auto server = KvSocketServer::listen("127.0.0.1", std::make_shared<KvStreamCounters>());
  REQUIRE(server.ok());
  const std::string token = (*server)->offer(7, records, 0, 256, nullptr);
  std::string wrong = token;
  wrong[31] = wrong[31] == '0' ? '1' : '0';
  KvStreamCounters c;
  auto refused = fetch_kv_socket((*server)->address(), wrong, pull_of(7, 0, 256), 1 << 30, c);
  CHECK(refused.status().code() == Code::unavailable);
  CHECK(c.bytes_received == 0);
  // Another request's token does not open this one either.
  const std::string other = (*server)->offer(8, records, 0, 256, nullptr);
  CHECK(fetch_kv_socket((*server)->address(), other, pull_of(7, 0, 256), 1 << 30, c)
            .status()
            .code() == Code::unavailable);
  auto ok = fetch_kv_socket((*server)->address(), token, pull_of(7, 0, 256), 1 << 30, c);
  REQUIRE_MESSAGE(ok.ok(), ok.status().to_string());
  CHECK((*ok)[1].bytes == (*records)[1].bytes);
  // Used once: the same token does not stream it again.
  CHECK(fetch_kv_socket((*server)->address(), token, pull_of(7, 0, 256), 1 << 30, c)
            .status()
            .code() == Code::unavailable);
}

TEST_CASE("kv socket: streams share one kept connection, one closed while idle is replaced") {
  auto records = make_records(3);
  auto server = KvSocketServer::listen("127.0.0.1", std::make_shared<KvStreamCounters>(), -1,
                                       std::chrono::seconds(5), std::chrono::seconds(30),
                                       /*idle_timeout=*/std::chrono::milliseconds(200));
  REQUIRE(server.ok());
  auto stream = [&](uint64_t id) {
    const std::string token = (*server)->offer(id, records, 0, 1000, nullptr);
    KvStreamCounters c;
    auto got = fetch_kv_socket((*server)->address(), token, pull_of(id, 0, 1000), 1 << 30, c);
    REQUIRE_MESSAGE(got.ok(), got.status().to_string());
    REQUIRE(got->size() == 3);
    for (size_t b = 0; b < 3; ++b) CHECK((*got)[b].bytes == (*records)[b].bytes);
  };
  for (uint64_t id = 1; id <= 4; ++id) stream(id);
  CHECK((*server)->accepted() == 1);
  // The sender closes the kept connection after 200 ms without a hello; the
  // next stream notices and connects again.
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  stream(5);
  stream(6);
  CHECK((*server)->accepted() == 2);
}

TEST_CASE("kv socket: a corrupt chunk gives a corruption error") {
  auto records = make_records(3);
  auto sent = std::make_shared<KvStreamCounters>();
  auto server = KvSocketServer::listen("127.0.0.1", sent, /*corrupt_chunk=*/2);
  REQUIRE(server.ok());
  std::atomic<int> outcome{-1};
  const std::string token =
      (*server)->offer(5, records, 0, 128, [&](bool ok) { outcome = ok ? 1 : 0; });
  KvStreamCounters c;
  auto got = fetch_kv_socket((*server)->address(), token, pull_of(5, 0, 128), 1 << 30, c);
  CHECK(got.status().code() == Code::corruption);
  CHECK(c.chunks_rejected == 1);
  CHECK(c.chunks_received == 2);
  for (int i = 0; i < 200 && outcome < 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(outcome == 0);  // no ack: the sender counts it aborted
  CHECK(sent->transfers_aborted == 1);
}

TEST_CASE("kv socket: a cut connection gives an unavailable error") {
  // The sender closes after half a frame header.
  FakeSender cut([](int fd) {
    const char half[8] = {};
    (void)::send(fd, half, sizeof half, MSG_NOSIGNAL);
  });
  KvStreamCounters c;
  auto got = fetch_kv_socket(cut.address(), std::string(32, 'a'), pull_of(1, 0, 256), 1 << 30, c);
  CHECK(got.status().code() == Code::unavailable);
  CHECK(got.status().message().find("closed") != std::string::npos);
}

TEST_CASE("kv socket: a stalled sender times out") {
  FakeSender stalled([](int) { std::this_thread::sleep_for(std::chrono::milliseconds(600)); });
  KvStreamCounters c;
  auto got = fetch_kv_socket(stalled.address(), std::string(32, 'a'), pull_of(1, 0, 256), 1 << 30,
                             c, std::chrono::milliseconds(200));
  CHECK(got.status().code() == Code::timed_out);
}

TEST_CASE("kv socket: a malformed frame is refused") {
  FakeSender garbage([](int fd) {
    const uint32_t frame[4] = {uint32_t(1) << 30, 0, 0, 0};  // meta past the bound
    (void)::send(fd, frame, sizeof frame, MSG_NOSIGNAL);
  });
  KvStreamCounters c;
  auto got = fetch_kv_socket(garbage.address(), std::string(32, 'a'), pull_of(1, 0, 256), 1 << 30, c);
  CHECK(got.status().code() == Code::invalid_argument);
}

TEST_CASE("kv socket: an unreachable sender or a bad address is a typed error") {
  KvStreamCounters c;
  uint16_t closed_port = 0;
  {
    auto server = KvSocketServer::listen("127.0.0.1", std::make_shared<KvStreamCounters>());
    REQUIRE(server.ok());
    closed_port = (*server)->port();
  }
  CHECK(fetch_kv_socket("127.0.0.1:" + std::to_string(closed_port), std::string(32, 'a'),
                        pull_of(1, 0, 256), 1 << 30, c)
            .status()
            .code() == Code::unavailable);
  CHECK(fetch_kv_socket("nowhere", std::string(32, 'a'), pull_of(1, 0, 256), 1 << 30, c)
            .status()
            .code() == Code::invalid_argument);
  CHECK(fetch_kv_socket("127.0.0.1:1", "short", pull_of(1, 0, 256), 1 << 30, c).status().code() ==
        Code::invalid_argument);
}
