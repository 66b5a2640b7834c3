// Request id -> the client's callback (no CAF). The router delivers events
// on its own thread; the terminal event removes the entry, so each callback
// sees exactly one.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>

#include "frontend/frontend.h"

namespace cleave {

class EventSinks {
 public:
  bool add(uint64_t id, EventCallback cb) {
    std::lock_guard<std::mutex> lock(mu_);
    return map_.emplace(id, std::make_shared<EventCallback>(std::move(cb))).second;
  }
  void remove(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    map_.erase(id);
  }
  bool has(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return map_.count(id) > 0;
  }
  void emit(const msg::StreamEvent& e) {
    std::shared_ptr<EventCallback> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(e.request_id);
      if (it == map_.end()) return;
      cb = it->second;
      if (e.kind != msg::StreamEvent::Kind::token) map_.erase(it);
    }
    (*cb)(e);
  }

 private:
  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<EventCallback>> map_;
};

}  // namespace cleave
