// A plain POSIX HTTP client for the transport's tests (test_http_server.cpp,
// test_http_streams.cpp): it checks the bytes on the wire, so the server is
// tested against what a client receives rather than against itself.
#pragma once

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "server/http_server.h"

namespace cleave::server::testing {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

template <class Pred>
inline bool eventually(Pred pred, double timeout_s = 3) {
  auto t0 = Clock::now();
  while (!pred()) {
    if (seconds_since(t0) > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

struct Reply {
  std::string version;  // "HTTP/1.1"
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-cased names
  std::string body;                            // de-chunked
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

// A blocking client socket; `in` keeps bytes received past the last reply.
struct Client {
  int fd = -1;
  std::string in;

  explicit Client(int port, int receive_buffer = 0) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    if (receive_buffer > 0)  // before connect, so the window is small from the start
      ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
    timeval tv{5, 0};  // a hung server fails the test instead of hanging it
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  }
  ~Client() { close(); }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  bool send(std::string_view s) {
    while (!s.empty()) {
      ssize_t n = ::send(fd, s.data(), s.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      s.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }
  // One recv into `in`; false on EOF, error or the 5 s timeout.
  bool fill() {
    char buf[16384];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return false;
    in.append(buf, static_cast<size_t>(n));
    return true;
  }
  std::string take(size_t n) {
    while (in.size() < n)
      if (!fill()) break;
    std::string out = in.substr(0, std::min(n, in.size()));
    in.erase(0, out.size());
    return out;
  }
  // True when the server closes the connection (not the 5 s timeout);
  // what arrives before is appended to `in`.
  bool closed_by_server() {
    char buf[4096];
    for (;;) {
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
      in.append(buf, static_cast<size_t>(n));
    }
  }

  Reply reply() {
    Reply r;
    size_t end;
    while ((end = in.find("\r\n\r\n")) == std::string::npos)
      if (!fill()) return r;  // status 0
    std::string head = in.substr(0, end);
    in.erase(0, end + 4);
    size_t line_end = head.find("\r\n");
    std::string status_line = head.substr(0, line_end);
    r.version = status_line.substr(0, status_line.find(' '));
    if (r.version.size() >= status_line.size()) return r;
    r.status = std::atoi(status_line.c_str() + r.version.size() + 1);
    size_t pos = line_end;
    while (pos != std::string::npos && pos < head.size()) {
      size_t next = head.find("\r\n", pos + 2);
      std::string line = head.substr(pos + 2, next == std::string::npos ? std::string::npos : next - pos - 2);
      size_t colon = line.find(':');
      if (colon != std::string::npos) {
        std::string name = line.substr(0, colon);
        for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        size_t v = line.find_first_not_of(' ', colon + 1);
        r.headers[name] = v == std::string::npos ? "" : line.substr(v);
      }
      pos = next;
    }
    if (r.status / 100 == 1) return r;  // interim: no body
    if (r.header("transfer-encoding") == "chunked") {
      for (;;) {
        size_t eol;
        while ((eol = in.find("\r\n")) == std::string::npos)
          if (!fill()) return r;
        size_t size = std::stoul(in.substr(0, eol), nullptr, 16);
        in.erase(0, eol + 2);
        std::string chunk = take(size + 2);
        if (size == 0) break;
        r.body += chunk.substr(0, size);
      }
    } else if (!r.header("content-length").empty()) {
      r.body = take(std::stoul(r.header("content-length")));
    } else {  // connection-close framing
      while (fill()) {
      }
      r.body = std::move(in);
      in.clear();
    }
    return r;
  }
};

inline std::unique_ptr<HttpServer> start_server(HttpHandler handler, HttpServerOptions opt = {}) {
  opt.port = 0;
  auto r = HttpServer::start(opt, std::move(handler));
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(r.value());
}

// Responders a handler kept, for the test thread to answer or inspect.
struct Stash {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<HttpResponder>> responders;
  void add(std::shared_ptr<HttpResponder> r) {
    std::lock_guard lock(mu);
    responders.push_back(std::move(r));
    cv.notify_all();
  }
  bool wait_for(size_t n, double timeout_s = 5) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::duration<double>(timeout_s),
                       [&] { return responders.size() >= n; });
  }
  std::shared_ptr<HttpResponder> at(size_t i) {
    std::lock_guard lock(mu);
    return responders.at(i);
  }
};

// A handler that counts each responder's on_close in `closes`, opens an
// SSE stream with one event for /stream (any other target waits), and
// stashes every responder for the test to answer or inspect.
inline HttpHandler stashing_handler(Stash& stash, std::atomic<int>& closes) {
  return [&stash, &closes](HttpRequest req, std::shared_ptr<HttpResponder> res) {
    res->on_close([&closes] { ++closes; });
    if (req.target == "/stream") {
      res->start_stream();
      res->write_event("data: 1\n\n");
    }
    stash.add(res);
  };
}

inline nlohmann::json error_of(const Reply& r) {
  CHECK(r.header("content-type") == "application/json");
  auto j = nlohmann::json::parse(r.body, nullptr, false);
  REQUIRE_MESSAGE(!j.is_discarded(), r.body);
  REQUIRE(j.contains("error"));
  return j["error"];
}

inline std::string chunk(const std::string& data) {
  char size[20];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  return size + data + "\r\n";
}

inline long rss_kb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  return -1;
}

inline void echo(HttpRequest req, std::shared_ptr<HttpResponder> res) {
  nlohmann::json j;
  j["method"] = req.method;
  j["target"] = req.target;
  j["query"] = req.query;
  j["body"] = req.body;
  const std::string* x = req.header("x-test");
  j["x-test"] = x ? *x : "(absent)";
  j["absent"] = req.header("x-absent") == nullptr;
  res->send(200, "application/json", j.dump(), {{"X-Reply", "yes"}});
}

}  // namespace cleave::server::testing
