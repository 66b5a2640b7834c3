// Private to server/: the state the routes share.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <random>

#include "server/metrics.h"
#include "server/server.h"

namespace cleave::server {

struct Server::Impl {
  ServeOptions options;
  ServerMetrics metrics;
  std::unique_ptr<HttpServer> http;  // last member to be set, first to go

  // Set once by ready(); read by every route after `loaded` turns true.
  ServedModel model;
  Frontend* frontend = nullptr;
  std::atomic<bool> loaded{false};

  std::atomic<uint64_t> next_request_id{1};  // runtime ids, one per choice
  std::atomic<uint64_t> next_response{1};
  std::atomic<int64_t> in_flight{0};         // choices admitted and not ended

  std::mutex seed_mu;
  std::mt19937_64 seed_rng{std::random_device{}()};
  uint64_t random_seed() {
    std::lock_guard<std::mutex> lock(seed_mu);
    return seed_rng();
  }

  void handle(HttpRequest request, std::shared_ptr<HttpResponder> out);
  // POST /v1/completions and /v1/chat/completions (generate_route.cpp).
  void generate(RequestKind kind, const HttpRequest& request, std::shared_ptr<HttpResponder> out);
  void reply_error(const std::shared_ptr<HttpResponder>& out, std::string_view route, const ApiError& e,
                   HttpHeaders extra = {});
  void reply(const std::shared_ptr<HttpResponder>& out, std::string_view route, int status,
             std::string content_type, std::string body);
};

}  // namespace cleave::server
