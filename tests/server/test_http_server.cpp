// The HTTP transport over real sockets on 127.0.0.1 (port 0), with a plain
// POSIX client that checks the bytes on the wire (http_test_client.h):
// routing, keep-alive, the transport's own errors (400/408/413/431/501/503),
// a handler's failures (500), 100-continue and start-up errors. Streams are
// in test_http_streams.cpp.
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

TEST_CASE("http: a request reaches the handler with method, target, query, headers and body") {
  auto server = start_server(echo);
  Client c(server->port());
  std::string body = "hello world";
  c.send("POST /v1/echo?a=1&b=2 HTTP/1.1\r\nHost: x\r\nX-TEST: Mixed Case\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body);
  Reply r = c.reply();
  CHECK(r.status == 200);
  CHECK(r.version == "HTTP/1.1");
  CHECK(r.header("content-type") == "application/json");
  CHECK(r.header("content-length") == std::to_string(r.body.size()));
  CHECK(r.header("x-reply") == "yes");
  auto j = nlohmann::json::parse(r.body);
  CHECK(j["method"] == "POST");
  CHECK(j["target"] == "/v1/echo");
  CHECK(j["query"] == "a=1&b=2");
  CHECK(j["body"] == body);
  CHECK(j["x-test"] == "Mixed Case");  // names lower-cased, values as sent
  CHECK(j["absent"] == true);

  // A chunked request body arrives de-chunked.
  c.send("PUT /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
  r = c.reply();
  CHECK(r.status == 200);
  j = nlohmann::json::parse(r.body);
  CHECK(j["method"] == "PUT");
  CHECK(j["query"] == "");
  CHECK(j["body"] == "hello world");
  CHECK(j["x-test"] == "(absent)");

  // HEAD: the headers of the answer, no body.
  c.send("HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string head = c.take(c.in.size());
  while (head.find("\r\n\r\n") == std::string::npos && c.fill()) head += c.take(c.in.size());
  CHECK(head.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
  CHECK(head.size() == head.find("\r\n\r\n") + 4);  // nothing after the headers
  c.send("GET /after-head HTTP/1.1\r\nHost: x\r\n\r\n");
  r = c.reply();
  CHECK(nlohmann::json::parse(r.body)["target"] == "/after-head");
}

TEST_CASE("http: keep-alive serves requests one after another on one connection, 1.0 and Connection: close end it") {
  std::atomic<int> calls{0};
  auto server = start_server([&](HttpRequest req, std::shared_ptr<HttpResponder> res) {
    ++calls;
    res->send(200, "text/plain", req.target);
  });
  {
    Client c(server->port());
    c.send("GET /one HTTP/1.1\r\nHost: x\r\n\r\n");
    Reply r1 = c.reply();
    c.send("GET /two HTTP/1.1\r\nHost: x\r\n\r\n");
    Reply r2 = c.reply();
    CHECK(r1.status == 200);
    CHECK(r1.body == "/one");
    CHECK(r1.header("connection") == "");
    CHECK(r2.status == 200);
    CHECK(r2.body == "/two");
    CHECK(server->open_connections() == 1);
    // Pipelined: answered in order.
    c.send("GET /three HTTP/1.1\r\nHost: x\r\n\r\nGET /four HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(c.reply().body == "/three");
    CHECK(c.reply().body == "/four");
    CHECK(calls == 4);
  }
  {
    Client c(server->port());
    c.send("GET /old HTTP/1.0\r\n\r\n");
    Reply r = c.reply();
    CHECK(r.version == "HTTP/1.0");
    CHECK(r.body == "/old");
    CHECK(r.header("connection") == "close");
    CHECK(c.closed_by_server());
  }
  {
    Client c(server->port());
    c.send("GET /old-keep HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    Reply r = c.reply();
    CHECK(r.header("connection") == "keep-alive");
    c.send("GET /again HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    CHECK(c.reply().body == "/again");
  }
  {
    Client c(server->port());
    c.send("GET /bye HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    Reply r = c.reply();
    CHECK(r.body == "/bye");
    CHECK(r.header("connection") == "close");
    CHECK(c.closed_by_server());
  }
  CHECK(eventually([&] { return server->open_connections() == 0; }));
}

TEST_CASE("http: a Content-Length over max_body_bytes gets 413 before the body is sent") {
  HttpServerOptions opt;
  opt.max_body_bytes = 1000;
  std::atomic<int> calls{0};
  auto server = start_server([&](HttpRequest req, std::shared_ptr<HttpResponder> res) {
    ++calls;
    res->send(200, "text/plain", std::to_string(req.body.size()));
  }, opt);
  {
    Client c(server->port());
    c.send("POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n");  // and no body
    Reply r = c.reply();
    CHECK(r.status == 413);
    CHECK(error_of(r)["code"] == "request_too_large");
    CHECK(r.header("connection") == "close");
    CHECK(c.closed_by_server());
  }
  {  // A chunked body is counted as it arrives.
    Client c(server->port());
    c.send("POST /big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
           chunk(std::string(800, 'a')) + chunk(std::string(800, 'b')));
    CHECK(c.reply().status == 413);
  }
  {  // At the limit it passes.
    Client c(server->port());
    c.send("POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + std::string(1000, 'z'));
    Reply r = c.reply();
    CHECK(r.status == 200);
    CHECK(r.body == "1000");
  }
  CHECK(calls == 1);
}

TEST_CASE("http: headers over max_header_bytes get 431") {
  HttpServerOptions opt;
  opt.max_header_bytes = 1024;
  std::atomic<int> calls{0};
  auto server = start_server([&](HttpRequest, std::shared_ptr<HttpResponder> res) {
    ++calls;
    res->send(200, "text/plain", "ok");
  }, opt);
  {
    Client c(server->port());
    c.send("GET / HTTP/1.1\r\nHost: x\r\nX-Small: " + std::string(500, 'a') + "\r\n\r\n");
    CHECK(c.reply().status == 200);
  }
  {
    Client c(server->port());
    c.send("GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(4000, 'a') + "\r\n\r\n");
    Reply r = c.reply();
    CHECK(r.status == 431);
    CHECK(error_of(r)["code"] == "request_header_fields_too_large");
    CHECK(c.closed_by_server());
  }
  CHECK(calls == 1);
}

TEST_CASE("http: malformed requests get 400 (unsupported Transfer-Encoding 501), no byte sequence brings the server down") {
  HttpServerOptions opt;
  opt.read_timeout_s = 2;
  std::atomic<int> calls{0};
  auto server = start_server([&](HttpRequest, std::shared_ptr<HttpResponder> res) {
    ++calls;
    res->send(200, "text/plain", "ok");
  }, opt);
  auto answer = [&](const std::string& bytes) {
    Client c(server->port());
    c.send(bytes);
    Reply r = c.reply();
    CHECK(c.closed_by_server());
    return r;
  };
  // A TLS ClientHello sent to the plain-text port.
  Reply tls = answer(std::string("\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", 11) + std::string(64, '\x7f') + "\r\n\r\n");
  CHECK(tls.status == 400);
  CHECK(error_of(tls)["type"] == "invalid_request_error");
  CHECK(answer("GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n").status == 400);
  CHECK(answer("GET / HTTP/9\r\n\r\n").status == 400);
  CHECK(answer("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n").status == 400);
  CHECK(answer("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n").status == 400);
  Reply te = answer("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\nxyz");
  CHECK(te.status == 501);
  CHECK(error_of(te)["code"] == "unsupported_transfer_encoding");
  CHECK(answer("POST / HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\nContent-Length: 1\r\n\r\n").status == 417);
  CHECK(calls == 0);

  // Random bytes, raw and after a valid request line; each client then
  // half-closes and must see the server close (answer or not) in time.
  std::mt19937 rng(7);
  const std::string prefixes[] = {"", "GET / HTTP/1.1\r\n", "POST /x HTTP/1.1\r\nContent-Length: 5\r\n",
                                  "GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"};
  int answered = 0;
  for (int i = 0; i < 200; ++i) {
    std::string bytes = prefixes[i % 4];
    size_t n = 1 + rng() % 300;
    for (size_t k = 0; k < n; ++k) bytes += static_cast<char>(rng() % 256);
    Client c(server->port());
    c.send(bytes);
    ::shutdown(c.fd, SHUT_WR);
    CHECK(c.closed_by_server());  // not the 5 s receive timeout
    if (!c.in.empty()) {
      ++answered;
      CHECK_MESSAGE(c.in.rfind("HTTP/1.1 4", 0) == 0, c.in.substr(0, 40));
    }
  }
  CHECK(answered > 0);
  // Still serving.
  Client ok(server->port());
  ok.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(ok.reply().status == 200);
}

TEST_CASE("http: a request not read within read_timeout_s gets 408, an idle connection is not cut by it") {
  HttpServerOptions opt;
  opt.read_timeout_s = 0.3;
  opt.idle_timeout_s = 5;
  auto server = start_server([](HttpRequest, std::shared_ptr<HttpResponder> res) {
    res->send(200, "text/plain", "ok");
  }, opt);
  Client idle(server->port());  // sends nothing for a while
  {
    Client c(server->port());
    auto t0 = Clock::now();
    c.send("GET / HTTP/1.1\r\nHost: x\r\n");  // headers never end
    Reply r = c.reply();
    double took = seconds_since(t0);
    CHECK(r.status == 408);
    CHECK(error_of(r)["code"] == "request_timeout");
    CHECK(took >= 0.25);
    CHECK(took < 2.0);
    CHECK(c.closed_by_server());
  }
  {  // Slowloris: a header line every 50 ms does not extend the deadline.
    Client c(server->port());
    std::atomic<bool> stop{false};
    std::thread trickle([&] {
      c.send("GET / HTTP/1.1\r\n");
      for (int i = 0; i < 60 && !stop; ++i) {
        c.send("X-" + std::to_string(i) + ": y\r\n");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
    auto t0 = Clock::now();
    Reply r = c.reply();
    double took = seconds_since(t0);
    stop = true;
    trickle.join();
    CHECK(r.status == 408);
    CHECK(took < 1.5);
  }
  idle.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");  // idle for > read_timeout_s: still served
  CHECK(idle.reply().status == 200);
}

TEST_CASE("http: an idle keep-alive connection is closed after idle_timeout_s") {
  HttpServerOptions opt;
  opt.idle_timeout_s = 0.3;
  auto server = start_server([](HttpRequest, std::shared_ptr<HttpResponder> res) {
    res->send(200, "text/plain", "ok");
  }, opt);
  Client c(server->port());
  c.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(c.reply().status == 200);
  auto t0 = Clock::now();
  CHECK(c.closed_by_server());
  CHECK(seconds_since(t0) >= 0.25);
  CHECK(seconds_since(t0) < 2.0);
  CHECK(eventually([&] { return server->open_connections() == 0; }));
}

TEST_CASE("http: beyond max_connections a new connection gets 503 with Retry-After and is closed") {
  HttpServerOptions opt;
  opt.max_connections = 2;
  auto server = start_server([](HttpRequest, std::shared_ptr<HttpResponder> res) {
    res->send(200, "text/plain", "ok");
  }, opt);
  auto c1 = std::make_unique<Client>(server->port());
  Client c2(server->port());
  for (Client* c : {c1.get(), &c2}) {
    c->send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(c->reply().status == 200);
  }
  CHECK(server->open_connections() == 2);
  {
    Client c3(server->port());
    c3.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    Reply r = c3.reply();
    CHECK(r.status == 503);
    CHECK(r.header("retry-after") == "1");
    CHECK(error_of(r)["code"] == "server_busy");
    CHECK(c3.closed_by_server());
  }
  CHECK(server->refused_connections() == 1);
  c1.reset();
  REQUIRE(eventually([&] { return server->open_connections() == 1; }));
  Client c4(server->port());
  c4.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(c4.reply().status == 200);
  CHECK(server->refused_connections() == 1);
}

TEST_CASE("http: a responder dropped unanswered gives 500, so does a handler that throws") {
  auto server = start_server([](HttpRequest req, std::shared_ptr<HttpResponder> res) {
    if (req.target == "/throw") throw std::runtime_error("boom");
    if (req.target == "/answered-then-throw") {
      res->send(200, "text/plain", "fine");
      throw std::runtime_error("ignored");
    }
    if (req.target == "/drop-stream") {
      res->start_stream();
      res->write_event("data: 1\n\n");
    }
    // dropped
  });
  Client c(server->port());
  c.send("GET /drop HTTP/1.1\r\nHost: x\r\n\r\n");
  Reply r = c.reply();
  CHECK(r.status == 500);
  CHECK(error_of(r)["type"] == "internal_error");
  c.send("GET /throw HTTP/1.1\r\nHost: x\r\n\r\n");
  r = c.reply();
  CHECK(r.status == 500);
  CHECK(error_of(r)["message"].get<std::string>().find("boom") != std::string::npos);
  c.send("GET /answered-then-throw HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(c.reply().body == "fine");
  // A stream its responder abandoned is cut, not ended with the final chunk.
  c.send("GET /drop-stream HTTP/1.1\r\nHost: x\r\n\r\n");
  while (c.fill()) {
  }
  CHECK(c.in.find(chunk("data: 1\n\n")) != std::string::npos);
  CHECK(c.in.find("0\r\n\r\n") == std::string::npos);
}

TEST_CASE("http: Expect: 100-continue gets 100 Continue before the body is sent") {
  auto server = start_server(echo);
  Client c(server->port());
  c.send("POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n");
  const std::string cont = "HTTP/1.1 100 Continue\r\n\r\n";
  CHECK(c.take(cont.size()) == cont);
  c.send("hello");
  Reply r = c.reply();
  CHECK(r.status == 200);
  CHECK(nlohmann::json::parse(r.body)["body"] == "hello");
}

TEST_CASE("http: start reports bad options and a port in use") {
  auto code_of = [](HttpServerOptions opt, HttpHandler h = echo) {
    auto r = HttpServer::start(opt, std::move(h));
    return r.ok() ? Code::ok : r.status().code();
  };
  HttpServerOptions opt;
  opt.port = 0;
  auto bad = opt;
  bad.threads = 0;
  CHECK(code_of(bad) == Code::invalid_argument);
  bad = opt;
  bad.port = 70000;
  CHECK(code_of(bad) == Code::invalid_argument);
  bad = opt;
  bad.host = "example.com";
  CHECK(code_of(bad) == Code::invalid_argument);
  bad = opt;
  bad.read_timeout_s = 0;
  CHECK(code_of(bad) == Code::invalid_argument);
  CHECK(code_of(opt, nullptr) == Code::invalid_argument);
  CHECK(code_of(opt) == Code::ok);

  auto first = start_server(echo);
  HttpServerOptions same = opt;
  same.port = first->port();
  auto second = HttpServer::start(same, echo);
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == Code::io_error);
  CHECK(second.status().message().find("127.0.0.1:" + std::to_string(first->port())) != std::string::npos);
}
