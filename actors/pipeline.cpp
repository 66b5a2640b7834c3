// Pipeline: the mono topology (a StageCore on a thread, no actors), run(),
// and the dispatch to the actor topologies (actors/actor_pipeline.cpp). No CAF here.
#include "actors/pipeline.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "actors/actor_pipeline.h"
#include "actors/cost_budget.h"
#include "actors/hosted.h"
#include "actors/slo_predictor.h"
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
  // encoder may be null (text only: requests come encoded); store too (no
  // kv_dir: nothing is persisted, resume() recomputes what the engine's
  // prefix cache lacks).
  MonoPipeline(const PipelineOptions& options, std::unique_ptr<StageCore> core,
               std::shared_ptr<VisionEncoder> encoder, std::shared_ptr<TieredStore> store)
      : options_(options), core_(std::move(core)), encoder_(std::move(encoder)), store_(std::move(store)) {
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
    return admit(std::move(request), {}, std::move(on_event));
  }

  Status resume(GenerateRequest request, std::vector<int32_t> generated, EventCallback on_event) override {
    return admit(std::move(request), std::move(generated), std::move(on_event));
  }

  // The loop drops it before its next step and sends the failed event.
  Status cancel(uint64_t request_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!callbacks_.count(request_id))
      return Status(Code::not_found, "request " + std::to_string(request_id) + " is not in flight");
    cancels_.push_back(request_id);
    cv_.notify_all();
    return Status::Ok();
  }

  std::vector<msg::Stats> stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    msg::Stats s = snapshot_;
    s.counters.insert(s.counters.begin(), {{"requests", requests_},
                                           {"rejected_busy", rejected_busy_},
                                           {"rejected_slo", rejected_slo_},
                                           {"tokens", tokens_},
                                           {"finished", finished_},
                                           {"failures", failed_},
                                           {"cancelled", cancelled_},
                                           {"resumes", resumes_},
                                           {"kv_blocks_put", kv_blocks_put_},
                                           {"kv_blocks_got", kv_blocks_got_},
                                           {"kv_errors", kv_errors_}});
    if (store_) {  // the store locks itself
      const StoreCounters c = store_->counters();
      s.counters.push_back({"kv_store_drops", c.drops});
      s.counters.push_back({"kv_store_corrupt", c.corrupt_detected});
      s.counters.push_back({"kv_store_bytes", store_->tier(store_->n_tiers() - 1).usage_bytes()});
    }
    return {s};
  }
  int32_t alive(const std::string& kind) override { return kind == "mono" ? 1 : 0; }
  const PipelineOptions& options() const override { return options_; }

 private:
  struct Incoming {
    GenerateRequest request;
    std::vector<int32_t> generated;  // resume(): replayed, not sampled
    bool resume = false;
  };

  Status admit(GenerateRequest request, std::vector<int32_t> generated, EventCallback on_event) {
    // Both only read sizes fixed at creation.
    Status st = encoder_ ? encoder_->check(request.images, request.request_id)
                         : core_->check_request(request);
    if (st.ok() && encoder_) {
      const Engine& e = core_->engine();
      st = validate_request(request, e.context(), e.config().n_vocab, e.config().dim);
    }
    if (!st.ok()) return st;
    if (Status cost = check_cost_policy(request, ""); !cost.ok()) return cost;  // no router here
    std::lock_guard<std::mutex> lock(mu_);
    ++requests_;
    if (stop_) return Status(Code::unavailable, "pipeline is shutting down");
    if (int32_t(callbacks_.size()) >= options_.max_pending) {
      ++rejected_busy_;
      return Status(Code::busy, "max_pending (" + std::to_string(options_.max_pending) +
                                    ") requests in flight");
    }
    const uint64_t id = request.request_id;
    if (callbacks_.count(id))
      return Status(Code::invalid_argument, "request id " + std::to_string(id) + " is already in flight");
    const bool resume = !generated.empty();
    if (!resume) {  // a resumed request's goals were checked when it started
      if (Status slo = slo_.check(request, {0}, {0}); !slo.ok()) {
        ++rejected_slo_;
        return slo;
      }
      slo_.placed(0, id, int64_t(request.prompt.size()), seconds());
    }
    callbacks_.emplace(id, std::move(on_event));
    resumes_ += resume;
    inbox_.push_back(Incoming{std::move(request), std::move(generated), resume});
    cv_.notify_all();
    return Status::Ok();
  }

  // A resumed request: the leading blocks the engine's prefix cache holds,
  // then the longest run after them that the store has; the scheduler
  // recomputes the rest.
  Status start_resume(Incoming& in) {
    std::vector<BlockKey> keys = core_->resume_keys(in.request, in.generated);
    const int32_t first = core_->engine().cached_leading_blocks(keys);
    std::vector<BlockRecord> blocks;
    for (size_t k = size_t(first); store_ && k < keys.size(); ++k) {
      auto rec = store_->get(keys[k]);
      if (!rec.ok()) break;
      blocks.push_back(std::move(rec.value()));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      kv_blocks_got_ += blocks.size();
    }
    return core_->resume(std::move(in.request), std::move(in.generated), std::move(blocks), first);
  }

  // The engine's newly filled blocks into the store (what resume() reads
  // after a restart).
  void persist_new_blocks() {
    if (!store_) return;
    uint64_t put = 0, errors = 0;
    for (const BlockRecord& r : core_->take_new_blocks()) {
      if (store_->put(r).ok()) ++put;
      else ++errors;
    }
    std::lock_guard<std::mutex> lock(mu_);
    kv_blocks_put_ += put;
    kv_errors_ += errors;
  }

  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_).count();
  }

  void emit(msg::StreamEvent e) {
    if (e.kind == msg::StreamEvent::Kind::token && e.index == 0) {
      if (auto it = encode_seconds_.find(e.request_id); it != encode_seconds_.end()) {
        e.encode_origin = "mono";
        e.encode_seconds = it->second;
      }
    }
    if (e.kind != msg::StreamEvent::Kind::token || e.index == 0) encode_seconds_.erase(e.request_id);
    EventCallback cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = callbacks_.find(e.request_id);
      if (it == callbacks_.end()) return;
      const auto now = std::chrono::steady_clock::now();
      if (e.kind == msg::StreamEvent::Kind::token) {
        ++tokens_;
        if (e.index == 0) slo_.first_token(e.request_id, seconds());
        else if (auto last = last_token_.find(e.request_id); last != last_token_.end())
          slo_.token_gap(0, std::chrono::duration<double>(now - last->second).count());
        last_token_[e.request_id] = now;
        cb = it->second;
      } else {
        slo_.forget_request(e.request_id, seconds());
        last_token_.erase(e.request_id);
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
      std::deque<Incoming> incoming;
      std::vector<uint64_t> cancels;
      {
        std::unique_lock<std::mutex> lock(mu_);
        const bool busy = core_->has_work();
        cv_.wait(lock, [&] { return stop_ || busy || !inbox_.empty() || !cancels_.empty(); });
        if (stop_) return;
        incoming.swap(inbox_);
        cancels.swap(cancels_);
      }
      for (uint64_t id : cancels) {
        std::erase_if(incoming, [&](const Incoming& r) { return r.request.request_id == id; });
        core_->cancel(id);
        SchedulerEvent failed;
        failed.kind = SchedulerEvent::Kind::failed;
        failed.request_id = id;
        failed.error = Status(Code::aborted, "request " + std::to_string(id) + " cancelled by its client");
        events.push_back(std::move(failed));
        std::lock_guard<std::mutex> lock(mu_);
        ++cancelled_;
      }
      if (encoder_) encode(incoming, events);
      // Resumes read their KV from the store first: a few per step, so that a
      // restart with many requests in flight gets its first tokens at once.
      constexpr int kResumesPerStep = 8;
      int resumes = 0;
      std::deque<Incoming> later;
      for (Incoming& r : incoming) {
        if (r.resume && resumes++ >= kResumesPerStep) {
          later.push_back(std::move(r));
          continue;
        }
        const uint64_t id = r.request.request_id;
        Status st = r.resume ? start_resume(r) : core_->submit(std::move(r.request));
        if (!st.ok()) {
          SchedulerEvent failed;
          failed.kind = SchedulerEvent::Kind::failed;
          failed.request_id = id;
          failed.error = st;
          events.push_back(std::move(failed));
        }
      }
      if (!later.empty()) {
        std::lock_guard<std::mutex> lock(mu_);
        inbox_.insert(inbox_.begin(), std::make_move_iterator(later.begin()), std::make_move_iterator(later.end()));
      }
      (void)core_->step(events);  // an engine error fails the running requests as events
      persist_new_blocks();
      for (const SchedulerEvent& e : events) emit(to_stream_event(e, "mono"));
      events.clear();
      msg::Stats snapshot = core_->stats();
      std::lock_guard<std::mutex> lock(mu_);
      snapshot_ = std::move(snapshot);
    }
  }

  // Encodes the images of the requests that just arrived, in one batch, on
  // this thread (the prefill path): a request that fails gets its failed
  // event and leaves `incoming`.
  void encode(std::deque<Incoming>& incoming, std::vector<SchedulerEvent>& events) {
    std::vector<std::vector<PromptImage>*> groups;
    std::vector<uint64_t> ids;
    for (Incoming& in : incoming) {
      GenerateRequest& r = in.request;
      if (check_images_encoded(r).ok()) continue;  // none, or encoded before it waited for a later step
      groups.push_back(&r.images);
      ids.push_back(r.request_id);
    }
    if (groups.empty()) return;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<Status> status = encoder_->encode(groups, ids);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::unordered_set<uint64_t> failed_ids;  // ids are unique among requests in flight
    for (size_t k = 0; k < status.size(); ++k) {
      if (status[k].ok()) {
        encode_seconds_[ids[k]] = seconds;
        for (PromptImage& im : *groups[k]) im.image.rgb = {};  // not needed once encoded
        continue;
      }
      failed_ids.insert(ids[k]);
      SchedulerEvent failed;
      failed.kind = SchedulerEvent::Kind::failed;
      failed.request_id = ids[k];
      failed.error = status[k];
      events.push_back(std::move(failed));
    }
    std::erase_if(incoming, [&](const Incoming& r) { return failed_ids.count(r.request.request_id) > 0; });
  }

  PipelineOptions options_;
  std::unique_ptr<StageCore> core_;  // touched by the thread only (after construction)
  std::shared_ptr<VisionEncoder> encoder_;  // likewise (check() is const and reads sizes only)
  std::shared_ptr<TieredStore> store_;       // the thread's; may be null
  std::unordered_map<uint64_t, double> encode_seconds_;  // the thread's: reported with token 0
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Incoming> inbox_;
  std::vector<uint64_t> cancels_;  // cancel() -> the loop
  std::unordered_map<uint64_t, EventCallback> callbacks_;
  // Early rejection as the router's, with the one core as its only stage.
  SloPredictor slo_;
  std::unordered_map<uint64_t, std::chrono::steady_clock::time_point> last_token_;
  const std::chrono::steady_clock::time_point epoch_ = std::chrono::steady_clock::now();
  bool stop_ = false;
  msg::Stats snapshot_;
  uint64_t requests_ = 0, rejected_busy_ = 0, rejected_slo_ = 0, tokens_ = 0, finished_ = 0, failed_ = 0, cancelled_ = 0;
  uint64_t resumes_ = 0, kv_blocks_put_ = 0, kv_blocks_got_ = 0, kv_errors_ = 0;
  std::thread thread_;
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
  if (o.mmproj && o.topology != Topology::mono && (o.vision_actors < 1 || o.vision_actors > 64))
    return bad("vision_actors", o.vision_actors);
  if (auto policy = make_placement_policy(o.placement); !policy.ok()) return policy.status();
  if (o.expert_replication && o.experts.empty())
    return Status(Code::invalid_argument, "expert_replication needs experts (expert hosts to replicate onto)");
  const bool pipelined = o.prefill_pipeline.size() > 1 || o.decode_pipeline.size() > 1 ||
                         o.colocated_pipeline.size() > 1 || o.pipeline_parallel_size > 1;
  if (o.pipeline_parallel_size < 1)
    return Status(Code::invalid_argument, "pipeline_parallel_size must be at least 1, got " +
                                              std::to_string(o.pipeline_parallel_size));
  if (pipelined && !o.experts.empty())
    return Status(Code::invalid_argument,
                  "pipeline stages and expert actors together are not supported: cut the model "
                  "into stages or send its FFN to experts, not both");
  if (o.topology == Topology::pd && !o.colocated_pipeline.empty())
    return Status(Code::invalid_argument,
                  "colocated_pipeline is for the mono and colocated topologies; pd cuts with "
                  "prefill_pipeline and decode_pipeline");
  if (o.topology != Topology::pd && (!o.prefill_pipeline.empty() || !o.decode_pipeline.empty()))
    return Status(Code::invalid_argument,
                  std::string("prefill_pipeline and decode_pipeline are for the pd topology; ") +
                      topology_name(o.topology) + " cuts with colocated_pipeline");
  if (o.pd_controller.ttft_ms != 0 || o.pd_controller.tpot_ms != 0) {
    if (o.topology != Topology::pd)
      return Status(Code::invalid_argument, std::string("pd_controller moves stages between prefill and decode: "
                                                        "it needs the pd topology, not ") +
                                                topology_name(o.topology));
    if (pipelined)
      return Status(Code::invalid_argument, "pd_controller and pipeline stages together are not supported");
    CLEAVE_RETURN_IF_ERROR(validate_pd_controller(o.pd_controller));
  }
  if (!(o.autoscale == AutoscaleConfig{})) {
    if (o.topology == Topology::mono)
      return Status(Code::invalid_argument, "autoscale parks and unparks stages behind the router: it needs the "
                                            "colocated or pd topology, not mono");
    if (pipelined)
      return Status(Code::invalid_argument, "autoscale and pipeline stages together are not supported");
    if (o.pd_controller.enabled())
      return Status(Code::invalid_argument, "autoscale and pd_controller together are not supported (both move entry stages)");
    CLEAVE_RETURN_IF_ERROR(validate_autoscale(o.autoscale));
    const int32_t entry = o.topology == Topology::pd ? o.prefill_actors : o.colocated_actors;
    if (o.autoscale.min_stages > entry)
      return Status(Code::invalid_argument, "autoscale: min_stages " + std::to_string(o.autoscale.min_stages) +
                                                " is more than the " + std::to_string(entry) +
                                                (o.topology == Topology::pd ? " prefill" : " colocated") + " actors");
    const int32_t encoders = o.mmproj ? o.vision_actors : 0;
    if (o.autoscale.encoders() && o.autoscale.min_encoders > encoders)
      return Status(Code::invalid_argument, "autoscale: min_encoders " + std::to_string(o.autoscale.min_encoders) +
                                                " is more than the " + std::to_string(encoders) +
                                                " vision_encoder actors");
  }
  if (o.actor_threads < 0)
    return Status(Code::invalid_argument, "actor_threads must not be negative, got " +
                                              std::to_string(o.actor_threads));
  return validate_kv_stream_options(o.kv_stream.chunk_bytes, o.kv_stream.window);
}

}  // namespace

Result<std::unique_ptr<Pipeline>> Pipeline::create(std::shared_ptr<const GgufFile> file,
                                                   std::shared_ptr<const Tokenizer> tokenizer,
                                                   const PipelineOptions& given) {
  if (!file) return Status(Code::invalid_argument, "pipeline: no model file");
  Status st = check_options(given);
  if (!st.ok()) return st;
  PipelineOptions options = given;
  if (options.pipeline_parallel_size > 1) {  // even cuts for the roles not cut by hand
    auto lm = LlamaModel::load(file);
    if (!lm.ok()) return lm.status();
    auto cut = even_cut((*lm)->config().n_layers, options.pipeline_parallel_size);
    if (!cut.ok()) return cut.status();
    const bool pd = options.topology == Topology::pd;
    for (std::vector<LayerRange>* c :
         {&options.prefill_pipeline, &options.decode_pipeline, &options.colocated_pipeline}) {
      const bool used = pd ? c != &options.colocated_pipeline : c == &options.colocated_pipeline;
      if (used && c->empty()) *c = *cut;
    }
  }
  if (options.topology != Topology::mono)
    return make_actor_pipeline(std::move(file), std::move(tokenizer), options);
  SchedulerOptions so = options.scheduler;
  so.prefill_only = false;
  std::shared_ptr<const GgufFile> file_for_experts = file;
  std::vector<std::shared_ptr<LayerStage>> later;
  auto core = make_pipelined_core(std::move(file), std::move(tokenizer), options.engine, so, "mono",
                                  options.colocated_pipeline, later);
  if (!core.ok()) return core.status();
  if (!later.empty()) {  // the later stages on threads of their own
    auto link = ThreadedStageLink::create(std::move(later));
    if (!link.ok()) return link.status();
    CLEAVE_RETURN_IF_ERROR((*core)->engine().set_stage_link(std::move(link.value())));
  }
  if (!options.experts.empty()) {
    // mono's expert hosts run in process, behind an ExpertPool.
    auto pool = ExpertPool::create(file_for_experts, options.experts, options.engine.threads,
                                   options.engine.compute, options.engine.device);
    if (!pool.ok()) return pool.status();
    if (options.expert_replication)
      (*pool)->set_replication(ReplicationPolicy{}, (*core)->engine().config().n_layers);
    (*core)->engine().set_expert_executor(std::shared_ptr<ExpertPool>(std::move(pool.value())));
  }
  auto encoders = make_vision_encoders(options, (*core)->engine().config().dim);
  if (!encoders.ok()) return encoders.status();
  std::shared_ptr<VisionEncoder> encoder = encoders->empty() ? nullptr : encoders->front();
  std::shared_ptr<TieredStore> store;
  if (!options.kv_dir.empty()) {
    const Engine& e = (*core)->engine();
    auto device = kv_store_backend(options.kv_durable ? "cpu" : options.engine.device);
    if (!device.ok()) return device.status();
    auto s = make_kv_store(options.kv_tier0_bytes, options.kv_tier1_bytes, options.kv_dir,
                           e.model_fingerprint(), e.kv_layout(), options.kv_durable,
                           options.kv_disk_bytes, *device);
    if (!s.ok()) return s.status();
    store = std::move(s.value());
  }
  return std::unique_ptr<Pipeline>(
      new MonoPipeline(options, std::move(core.value()), encoder, std::move(store)));
}

Result<std::vector<std::shared_ptr<VisionEncoder>>> make_vision_encoders(const PipelineOptions& options,
                                                                         int32_t n_embd) {
  std::vector<std::shared_ptr<VisionEncoder>> out;
  if (!options.mmproj) return out;
  VisionEncoderOptions vo = options.vision;
  vo.n_embd = n_embd;
  vo.device = options.engine.device;  // encoders run where the engines do
  const int32_t n = options.topology == Topology::mono ? 1 : options.vision_actors;
  for (int32_t i = 0; i < n; ++i) {
    auto e = VisionEncoder::create(options.mmproj, vo);
    if (!e.ok()) return e.status();
    out.push_back(std::move(e.value()));
  }
  return out;
}

Result<std::vector<Completion>> Pipeline::run(std::vector<GenerateRequest> requests) {
  return run_to_completion(*this, requests);
}

}  // namespace cleave
