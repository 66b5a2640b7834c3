// Private to server/: the state the routes share.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "server/metrics.h"
#include "server/server.h"

namespace cleave::server {

struct Server::Impl {
  ServeOptions options;
  ServerMetrics metrics;
  std::unique_ptr<HttpServer> http;  // last member to be set, first to go

  // Set once by ready(); read by every route after `loaded` turns true.
  std::vector<ServedEntry> models;  // the first: requests that name none
  std::atomic<bool> loaded{false};
  // The entry a request's "model" names (empty: the first); null when none does.
  const ServedEntry* find_model(std::string_view name) const {
    if (name.empty()) return &models.front();
    for (const ServedEntry& e : models)
      if (e.model.name == name) return &e;
    return nullptr;
  }
  static ApiError unknown_model(std::string_view name) {
    return ApiError{404, "The model `" + std::string(name.substr(0, 200)) + "` does not exist.",
                    "not_found_error", "model", "model_not_found"};
  }

  std::atomic<uint64_t> next_request_id{1};  // runtime ids, one per choice
  std::atomic<uint64_t> next_response{1};
  // Runtime requests admitted and not ended, with the front end that took
  // each: the destructor cancels them there and waits, since their
  // callbacks reach into this object.
  std::mutex live_mu;
  std::condition_variable live_cv;
  std::unordered_map<uint64_t, Frontend*> live;
  void track(uint64_t id, Frontend* frontend) {
    std::lock_guard<std::mutex> lock(live_mu);
    live.emplace(id, frontend);
  }
  void untrack(uint64_t id) {
    std::lock_guard<std::mutex> lock(live_mu);
    live.erase(id);
    if (live.empty()) live_cv.notify_all();
  }

  std::mutex seed_mu;
  std::mt19937_64 seed_rng{std::random_device{}()};
  uint64_t random_seed() {
    std::lock_guard<std::mutex> lock(seed_mu);
    return seed_rng();
  }

  // add_routes(): prefix -> handler, fixed before ready().
  std::vector<std::pair<std::string, Server::RouteHandler>> extra_routes;
  const std::pair<std::string, Server::RouteHandler>* find_extra(std::string_view target) const;

  void handle(HttpRequest request, std::shared_ptr<HttpResponder> out);
  // The API key check: true when the request may go on (else answered).
  bool authorized(const HttpRequest& request, const std::shared_ptr<HttpResponder>& out, std::string_view route);
  // POST /v1/completions and /v1/chat/completions (generate_route.cpp).
  void generate(RequestKind kind, const HttpRequest& request, std::shared_ptr<HttpResponder> out);
  void reply_error(const std::shared_ptr<HttpResponder>& out, std::string_view route, const ApiError& e,
                   HttpHeaders extra = {});
  void reply(const std::shared_ptr<HttpResponder>& out, std::string_view route, int status,
             std::string content_type, std::string body);
};

}  // namespace cleave::server
