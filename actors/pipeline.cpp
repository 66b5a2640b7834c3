// Pipeline: the mono topology (a StageCore on a thread, no actors), run(),
// and the dispatch to the actor topologies (actors/actors.cpp). No CAF here.
#include "actors/pipeline.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "actors/actor_pipeline.h"
#include "actors/stage_core.h"

namespace cleave {

const char* topology_name(Topology t) {
  switch (t) {
    case Topology::mono: return "mono";
    case Topology::colocated: return "colocated";
    case Topology::pd: return "pd";
  }
  return "unknown";
}

Result<Topology> parse_topology(const std::string& name) {
  for (Topology t : {Topology::mono, Topology::colocated, Topology::pd})
    if (name == topology_name(t)) return t;
  return Status(Code::invalid_argument,
                "topology '" + name + "': expected one of mono, colocated, pd");
}

namespace {

class MonoPipeline final : public Pipeline {
 public:
  MonoPipeline(const PipelineOptions& options, std::unique_ptr<StageCore> core)
      : options_(options), core_(std::move(core)) {
    snapshot_ = core_->stats();
    thread_ = std::thread([this] { loop(); });
  }

  ~MonoPipeline() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    // Every admitted request gets its one final event.
    std::unordered_map<uint64_t, EventCallback> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left.swap(callbacks_);
    }
    for (auto& [id, cb] : left) {
      msg::StreamEvent e;
      e.kind = msg::StreamEvent::Kind::failed;
      e.request_id = id;
      e.error = Status(Code::aborted, "pipeline shut down");
      e.origin = "mono";
      cb(e);
    }
  }

  Status submit(GenerateRequest request, EventCallback on_event) override {
    Status st = core_->check_request(request);  // only reads sizes fixed at creation
    if (!st.ok()) return st;
    std::lock_guard<std::mutex> lock(mu_);
    ++requests_;
    if (stop_) return Status(Code::unavailable, "pipeline is shutting down");
    if (int32_t(callbacks_.size()) >= options_.max_pending) {
      ++rejected_busy_;
      return Status(Code::busy, "max_pending (" + std::to_string(options_.max_pending) +
                                    ") requests in flight");
    }
    const uint64_t id = request.request_id;
    if (!callbacks_.emplace(id, std::move(on_event)).second)
      return Status(Code::invalid_argument, "request id " + std::to_string(id) + " is already in flight");
    inbox_.push_back(std::move(request));
    cv_.notify_all();
    return Status::Ok();
  }

  std::vector<msg::Stats> stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    msg::Stats s = snapshot_;
    s.counters.insert(s.counters.begin(), {{"requests", requests_},
                                           {"rejected_busy", rejected_busy_},
                                           {"tokens", tokens_},
                                           {"finished", finished_},
                                           {"failures", failed_}});
    return {s};
  }
  int32_t alive(const std::string& kind) override { return kind == "mono" ? 1 : 0; }
  Status kill_decode_actor(int32_t index) override {
    return Status(Code::not_found, "mono has no decode actor " + std::to_string(index));
  }
  Status send_raw_for_test(const std::string&, int32_t, const std::vector<char>&) override {
    return Status(Code::unsupported, "mono has no actors");
  }
  const PipelineOptions& options() const override { return options_; }

 private:
  void emit(const msg::StreamEvent& e) {
    EventCallback cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = callbacks_.find(e.request_id);
      if (it == callbacks_.end()) return;
      if (e.kind == msg::StreamEvent::Kind::token) {
        ++tokens_;
        cb = it->second;
      } else {
        ++(e.kind == msg::StreamEvent::Kind::finished ? finished_ : failed_);
        cb = std::move(it->second);
        callbacks_.erase(it);
      }
    }
    cb(e);
  }

  void loop() {
    std::vector<SchedulerEvent> events;
    for (;;) {
      std::deque<GenerateRequest> incoming;
      {
        std::unique_lock<std::mutex> lock(mu_);
        const bool busy = core_->has_work();
        cv_.wait(lock, [&] { return stop_ || busy || !inbox_.empty(); });
        if (stop_) return;
        incoming.swap(inbox_);
      }
      for (GenerateRequest& r : incoming) {
        const uint64_t id = r.request_id;
        Status st = core_->submit(std::move(r));
        if (!st.ok()) {
          SchedulerEvent failed;
          failed.kind = SchedulerEvent::Kind::failed;
          failed.request_id = id;
          failed.error = st;
          events.push_back(std::move(failed));
        }
      }
      (void)core_->step(events);  // an engine error fails the running requests as events
      for (const SchedulerEvent& e : events) emit(to_stream_event(e, "mono"));
      events.clear();
      msg::Stats snapshot = core_->stats();
      std::lock_guard<std::mutex> lock(mu_);
      snapshot_ = std::move(snapshot);
    }
  }

  PipelineOptions options_;
  std::unique_ptr<StageCore> core_;  // touched by the thread only (after construction)
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenerateRequest> inbox_;
  std::unordered_map<uint64_t, EventCallback> callbacks_;
  bool stop_ = false;
  msg::Stats snapshot_;
  uint64_t requests_ = 0, rejected_busy_ = 0, tokens_ = 0, finished_ = 0, failed_ = 0;
  std::thread thread_;
};

// The actor topologies have no vision stage yet: a request with images is
// refused at submit rather than run without them.
class TextOnlyPipeline final : public Pipeline {
 public:
  explicit TextOnlyPipeline(std::unique_ptr<Pipeline> inner) : inner_(std::move(inner)) {}
  Status submit(GenerateRequest request, EventCallback on_event) override {
    if (!request.images.empty())
      return Status(Code::unsupported,
                    std::string("pipeline: request ") + std::to_string(request.request_id) +
                        " has images; the " + topology_name(inner_->options().topology) +
                        " topology has no vision actors yet (use mono)");
    return inner_->submit(std::move(request), std::move(on_event));
  }
  std::vector<msg::Stats> stats() override { return inner_->stats(); }
  int32_t alive(const std::string& kind) override { return inner_->alive(kind); }
  Status kill_decode_actor(int32_t index) override { return inner_->kill_decode_actor(index); }
  Status send_raw_for_test(const std::string& kind, int32_t index,
                           const std::vector<char>& bytes) override {
    return inner_->send_raw_for_test(kind, index, bytes);
  }
  const PipelineOptions& options() const override { return inner_->options(); }

 private:
  std::unique_ptr<Pipeline> inner_;
};

Status check_options(const PipelineOptions& o) {
  auto bad = [](const std::string& what, int64_t v) {
    return Status(Code::invalid_argument, what + " must be between 1 and 64, got " + std::to_string(v));
  };
  if (o.topology == Topology::pd) {
    if (o.prefill_actors < 1 || o.prefill_actors > 64) return bad("prefill_actors", o.prefill_actors);
    if (o.decode_actors < 1 || o.decode_actors > 64) return bad("decode_actors", o.decode_actors);
  }
  if (o.topology == Topology::colocated && (o.colocated_actors < 1 || o.colocated_actors > 64))
    return bad("colocated_actors", o.colocated_actors);
  if (o.max_pending < 1)
    return Status(Code::invalid_argument, "max_pending must be at least 1, got " +
                                              std::to_string(o.max_pending));
  Status st = validate_scheduler_options(o.scheduler);
  if (!st.ok()) return st;
  if (!(o.request_timeout_s > 0))
    return Status(Code::invalid_argument, "request_timeout_s must be positive");
  if (o.actor_threads < 0)
    return Status(Code::invalid_argument, "actor_threads must not be negative, got " +
                                              std::to_string(o.actor_threads));
  return validate_kv_stream_options(o.kv_stream.chunk_bytes, o.kv_stream.window);
}

}  // namespace

Result<std::unique_ptr<Pipeline>> Pipeline::create(std::shared_ptr<const GgufFile> file,
                                                   std::shared_ptr<const Tokenizer> tokenizer,
                                                   const PipelineOptions& options) {
  if (!file) return Status(Code::invalid_argument, "pipeline: no model file");
  Status st = check_options(options);
  if (!st.ok()) return st;
  if (options.topology != Topology::mono) {
    auto actors = make_actor_pipeline(std::move(file), std::move(tokenizer), options);
    if (!actors.ok()) return actors.status();
    return std::unique_ptr<Pipeline>(new TextOnlyPipeline(std::move(actors.value())));
  }
  SchedulerOptions so = options.scheduler;
  so.prefill_only = false;
  auto core = StageCore::create(std::move(file), std::move(tokenizer), options.engine, so, "mono");
  if (!core.ok()) return core.status();
  return std::unique_ptr<Pipeline>(new MonoPipeline(options, std::move(core.value())));
}

Result<std::vector<Completion>> Pipeline::run(std::vector<GenerateRequest> requests) {
  using Clock = std::chrono::steady_clock;
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    size_t done = 0;
  };
  auto shared = std::make_shared<Shared>();
  std::vector<Completion> out(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto start = Clock::now();
    auto on_event = [shared, &out, i, start](const msg::StreamEvent& e) {
      Completion& c = out[i];
      const double t = std::chrono::duration<double>(Clock::now() - start).count();
      switch (e.kind) {
        case msg::StreamEvent::Kind::token:
          if (c.tokens.empty()) c.ttft_seconds = t;
          c.tokens.push_back(e.token);
          c.text += e.text;
          return;
        case msg::StreamEvent::Kind::finished:
          c.text += e.text;
          c.finish_reason = e.finish_reason;
          c.logits = e.logits;
          break;
        case msg::StreamEvent::Kind::failed:
          c.error = e.error.ok() ? Status(Code::aborted, "failed without a reason") : e.error;
          break;
      }
      c.total_seconds = t;
      std::lock_guard<std::mutex> lock(shared->mu);
      ++shared->done;
      shared->cv.notify_all();
    };
    for (;;) {
      size_t done_before;
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        done_before = shared->done;
      }
      Status st = submit(requests[i], on_event);
      if (st.code() == Code::busy) {  // wait for one to finish, then retry
        std::unique_lock<std::mutex> lock(shared->mu);
        shared->cv.wait_for(lock, std::chrono::milliseconds(50),
                            [&] { return shared->done != done_before; });
        continue;
      }
      if (!st.ok()) {
        out[i].error = st;
        std::lock_guard<std::mutex> lock(shared->mu);
        ++shared->done;
      }
      break;
    }
  }
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done == requests.size(); });
  return out;
}

}  // namespace cleave
