#include "frontend/frontend.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

namespace cleave {

bool fold_event(Completion& c, const msg::StreamEvent& e, double seconds) {
  if (!e.origin.empty()) {
    auto& s = c.stages[e.origin];
    s.tokens += e.kind == msg::StreamEvent::Kind::token;
    s.seconds += e.stage_seconds;
  }
  if (!e.encode_origin.empty()) {
    c.encode_origin = e.encode_origin;
    c.encode_seconds = e.encode_seconds;
    c.stages[e.encode_origin].seconds += e.encode_seconds;
  }
  c.text += e.text;
  switch (e.kind) {
    case msg::StreamEvent::Kind::token:
      if (c.tokens.empty()) {
        c.ttft_seconds = seconds;
        c.cached_tokens = e.cached_tokens;
      }
      c.tokens.push_back(e.token);
      if (e.has_logprobs) c.logprobs.push_back(e.logprobs);
      c.logits_hashes.push_back(e.logits_hash);
      return false;
    case msg::StreamEvent::Kind::finished:
      c.finish_reason = e.finish_reason;
      c.logits = e.logits;
      break;
    case msg::StreamEvent::Kind::failed:
      c.error = e.error.ok() ? Status(Code::aborted, "failed without a reason") : e.error;
      break;
  }
  c.total_seconds = seconds;
  c.done = true;
  return true;
}

Result<std::vector<Completion>> run_to_completion(Frontend& frontend, const std::vector<GenerateRequest>& requests,
                                        const std::atomic<bool>* stop,
                                        const std::function<void()>& on_submitted) {
  using Clock = std::chrono::steady_clock;
  // Shared with the callbacks, which may outlive this call when it stops early.
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    size_t done = 0;
    std::vector<Completion> out;
  };
  auto shared = std::make_shared<Shared>();
  shared->out.resize(requests.size());
  auto stopped = [&] { return stop && stop->load(); };
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto start = Clock::now();
    auto on_event = [shared, i, start](const msg::StreamEvent& e) {
      const double t = std::chrono::duration<double>(Clock::now() - start).count();
      std::lock_guard<std::mutex> lock(shared->mu);
      if (fold_event(shared->out[i], e, t)) {
        ++shared->done;
        shared->cv.notify_all();
      }
    };
    for (;;) {
      size_t done_before;
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        done_before = shared->done;
      }
      Status st = frontend.submit(requests[i], on_event);
      if (st.code() == Code::busy && !stopped()) {  // wait for one to finish, then retry
        std::unique_lock<std::mutex> lock(shared->mu);
        shared->cv.wait_for(lock, std::chrono::milliseconds(50),
                            [&] { return shared->done != done_before; });
        continue;
      }
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->out[i].error = st;
        shared->out[i].done = true;
        ++shared->done;
      }
      break;
    }
    if (stopped()) break;
  }
  if (on_submitted && !stopped()) on_submitted();
  std::unique_lock<std::mutex> lock(shared->mu);
  while (shared->done < requests.size()) {
    if (stopped())
      return Status(Code::aborted, "stopped with " + std::to_string(requests.size() - shared->done) +
                                       " requests running");
    shared->cv.wait_for(lock, std::chrono::milliseconds(100));
  }
  return shared->out;
}

}  // namespace cleave
