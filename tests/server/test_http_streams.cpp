// The HTTP transport's streams over real sockets on 127.0.0.1 (port 0), with
// the plain client of http_test_client.h: SSE framing on the wire, client
// disconnects, slow readers, answers from other threads, responders
// outliving the server, and 1000 concurrent streams in bounded memory.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "server/http_server.h"
#include "tests/server/http_test_client.h"


using namespace cleave;
using namespace cleave::server;
using namespace cleave::server::testing;

TEST_CASE("http: an SSE stream arrives in order in the exact wire format, then the connection is reused") {
  std::atomic<int> closes{0};
  auto server = start_server([&](HttpRequest req, std::shared_ptr<HttpResponder> res) {
    if (req.target != "/stream") return res->send(200, "text/plain", "after");
    res->on_close([&] { ++closes; });
    res->start_stream();
    for (int i = 0; i < 5; ++i) res->write_event("data: {\"i\":" + std::to_string(i) + "}\n\n");
    res->write_event("");  // nothing: an empty chunk would end the stream
    res->end_stream();
    res->write_event("data: after the end\n\n");  // dropped
  });
  std::string expected =
      "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
      "Transfer-Encoding: chunked\r\n\r\n";
  for (int i = 0; i < 5; ++i) expected += chunk("data: {\"i\":" + std::to_string(i) + "}\n\n");
  expected += "0\r\n\r\n";
  {
    Client c(server->port());
    c.send("GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(c.take(expected.size()) == expected);
    c.send("GET /next HTTP/1.1\r\nHost: x\r\n\r\n");
    Reply r = c.reply();
    CHECK(r.status == 200);
    CHECK(r.body == "after");
  }
  {  // HTTP/1.0: no chunked; the close ends the stream.
    Client c(server->port());
    c.send("GET /stream HTTP/1.0\r\n\r\n");
    std::string old =
        "HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        "Connection: close\r\n\r\n";
    for (int i = 0; i < 5; ++i) old += "data: {\"i\":" + std::to_string(i) + "}\n\n";
    CHECK(c.take(old.size() + 1) == old);  // and not a byte more
    CHECK(c.closed_by_server());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(closes == 0);  // both ended before the clients left
}

TEST_CASE("http: a client that leaves mid-stream or while waiting fires on_close once and closed() turns true") {
  Stash stash;
  std::atomic<int> closes{0};
  auto server = start_server(stashing_handler(stash, closes));
  {
    Client c(server->port());
    c.send("GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
    REQUIRE(stash.wait_for(1));
    std::string first = c.take(c.in.size());
    while (first.find(chunk("data: 1\n\n")) == std::string::npos && c.fill()) first += c.take(c.in.size());
    CHECK(first.find("text/event-stream") != std::string::npos);
    CHECK_FALSE(stash.at(0)->closed());
    CHECK(closes == 0);
  }  // the client goes away
  CHECK(eventually([&] { return closes == 1; }, 2));
  CHECK(stash.at(0)->closed());
  stash.at(0)->write_event("data: 2\n\n");  // harmless
  stash.at(0)->end_stream();
  {  // Waiting for a non-streamed answer: a disconnect cancels it too.
    Client c(server->port());
    c.send("POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi");
    REQUIRE(stash.wait_for(2));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK_FALSE(stash.at(1)->closed());
  }
  CHECK(eventually([&] { return closes == 2; }, 2));
  CHECK(stash.at(1)->closed());
  stash.at(1)->send(200, "text/plain", "too late");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(closes == 2);  // once each
  CHECK(eventually([&] { return server->open_connections() == 0; }));
}

TEST_CASE("http: a client that reads slower than the stream is written is closed at max_queued_stream_bytes") {
  HttpServerOptions opt;
  opt.max_queued_stream_bytes = 256 * 1024;
  Stash stash;
  std::atomic<int> closes{0};
  auto server = start_server([&](HttpRequest, std::shared_ptr<HttpResponder> res) {
    res->on_close([&] { ++closes; });
    res->start_stream();
    stash.add(res);
  }, opt);
  Client c(server->port(), 4096);
  c.send("GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");  // and never reads
  REQUIRE(stash.wait_for(1));
  auto res = stash.at(0);
  const std::string event = "data: " + std::string(64 * 1024, 'x') + "\n\n";
  size_t written = 0;
  while (!res->closed() && written < (size_t{512} << 20)) {
    res->write_event(event);
    written += event.size();
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  MESSAGE("closed after " << written / 1024 << " KiB written");
  CHECK(res->closed());
  CHECK(written < (size_t{64} << 20));  // kernel buffers + the queue limit, not everything
  CHECK(eventually([&] { return closes == 1; }));
}

TEST_CASE("http: the answer may come later from another thread, streamed events in order") {
  std::vector<std::thread> workers;
  std::mutex workers_mu;
  auto server = start_server([&](HttpRequest req, std::shared_ptr<HttpResponder> res) {
    std::lock_guard lock(workers_mu);
    workers.emplace_back([req = std::move(req), res] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      if (req.target == "/late") return res->send(200, "text/plain", "late " + req.body);
      res->start_stream();
      for (int i = 0; i < 2000; ++i) res->write_event("data: " + std::to_string(i) + "\n\n");
      res->end_stream();
    });
  });
  Client c(server->port());
  c.send("POST /late HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc");
  Reply r = c.reply();
  CHECK(r.status == 200);
  CHECK(r.body == "late abc");
  c.send("GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
  r = c.reply();
  std::string expected;
  for (int i = 0; i < 2000; ++i) expected += "data: " + std::to_string(i) + "\n\n";
  CHECK(r.header("content-type") == "text/event-stream");
  CHECK(r.body == expected);
  for (auto& t : workers) t.join();
}

TEST_CASE("http: responders outlive the server, its destructor does not hang and later calls are dropped") {
  Stash stash;
  std::atomic<int> closes{0};
  auto server = start_server(stashing_handler(stash, closes));
  Client waiting(server->port());
  Client streaming(server->port());
  Client idle(server->port());
  waiting.send("GET /wait HTTP/1.1\r\nHost: x\r\n\r\n");
  streaming.send("GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
  REQUIRE(stash.wait_for(2));
  CHECK_FALSE(stash.at(0)->closed());
  auto t0 = Clock::now();
  server.reset();
  CHECK(seconds_since(t0) < 2.0);
  CHECK(closes == 2);  // the unfinished responses learn the server stopped
  for (size_t i = 0; i < 2; ++i) {
    auto res = stash.at(i);
    CHECK(res->closed());
    res->send(200, "text/plain", "after stop");
    res->start_stream();
    res->write_event("data: after stop\n\n");
    res->end_stream();
    bool ran = false;
    res->on_close([&] { ran = true; });  // the client is gone already: runs at once
    CHECK(ran);
  }
  CHECK(waiting.closed_by_server());
  CHECK(streaming.closed_by_server());
  CHECK(idle.closed_by_server());
  std::lock_guard lock(stash.mu);
  stash.responders.clear();  // their destructors post nothing now
}

TEST_CASE("http: 1000 concurrent SSE streams, each held open, in bounded memory") {
  constexpr int kStreams = 1000;
  constexpr int kEvents = 3;
  HttpServerOptions opt;
  opt.threads = 2;
  Stash stash;
  auto server = start_server([&](HttpRequest req, std::shared_ptr<HttpResponder> res) {
    res->start_stream();
    for (int k = 0; k < kEvents; ++k) res->write_event("data: " + req.target + " " + std::to_string(k) + "\n\n");
    stash.add(std::move(res));  // held open
  }, opt);
  const long rss_before = rss_kb();

  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::string> expected;
  for (int i = 0; i < kStreams; ++i) {
    clients.push_back(std::make_unique<Client>(server->port()));
    std::string target = "/s" + std::to_string(i);
    REQUIRE(clients.back()->send("GET " + target + " HTTP/1.1\r\nHost: x\r\n\r\n"));
    std::string e = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n";
    for (int k = 0; k < kEvents; ++k) e += chunk("data: " + target + " " + std::to_string(k) + "\n\n");
    expected.push_back(std::move(e));
  }
  // Read all of them with poll until every one has its events.
  std::vector<pollfd> fds(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    ::fcntl(clients[i]->fd, F_SETFL, O_NONBLOCK);
    fds[i] = {clients[i]->fd, POLLIN, 0};
  }
  int complete = 0;
  auto t0 = Clock::now();
  while (complete < kStreams && seconds_since(t0) < 20) {
    if (::poll(fds.data(), fds.size(), 1000) <= 0) continue;
    for (int i = 0; i < kStreams; ++i) {
      if (!(fds[i].revents & POLLIN)) continue;
      while (clients[i]->fill()) {
      }
      if (clients[i]->in.size() >= expected[i].size()) {
        fds[i].fd = -1;  // done: poll ignores it
        ++complete;
      }
    }
  }
  const long rss_after = rss_kb();
  MESSAGE(kStreams << " streams in " << seconds_since(t0) << " s; RSS " << rss_before / 1024 << " -> "
                   << rss_after / 1024 << " MiB (+" << (rss_after - rss_before) / 1024 << " MiB)");
  CHECK(complete == kStreams);
  int exact = 0;
  for (int i = 0; i < kStreams; ++i) exact += clients[i]->in == expected[i];
  CHECK(exact == kStreams);
  CHECK(server->open_connections() == kStreams);
  CHECK(stash.wait_for(kStreams, 1));
  // Server and clients together: under 64 KiB per stream (measured: ~4 KiB;
  // ~26 KiB under TSan).
  CHECK(rss_after - rss_before < 64 * 1024);

  // Half end cleanly; the rest are still open when the server goes.
  for (int i = 0; i < kStreams / 2; ++i) stash.at(static_cast<size_t>(i))->end_stream();
  auto t1 = Clock::now();
  server.reset();
  CHECK(seconds_since(t1) < 3.0);
}
