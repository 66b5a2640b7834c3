// The colocated and pd topologies in one process (actors/actor_pipeline.h):
// the kv_store, the router and the stages, wired by an ActorSet.
#include "actors/actor_pipeline.h"

#include "actors/actor_set.h"
#include "actors/pipeline_testing.h"

namespace cleave {
namespace {

using namespace actors;

class ActorPipeline final : public Pipeline, private PipelineTestHooks {
 public:
  ActorPipeline(const PipelineOptions& options, int32_t context, int32_t n_vocab, int32_t n_embd)
      : options_(options), context_(context), n_vocab_(n_vocab), n_embd_(n_embd) {
    configure_workers(config_, options.actor_threads);
    system_ = std::make_unique<caf::actor_system>(config_);
    sinks_ = std::make_shared<EventSinks>();
    actors_ = std::make_unique<ActorSet>(*system_);
  }

  ~ActorPipeline() override {
    // Every admitted request gets its one final event (aborted) before the
    // actors go.
    shutdown_router(*system_, router_);
    actors_.reset();
    router_ = router_actor{};
    kv_ = kv_store_actor{};
    system_.reset();  // waits for every actor (a stage ends its current step first)
  }

  Status start(HostedActors hosted, std::shared_ptr<TieredStore> store) {
    kv_ = spawn_kv_store(*system_, std::move(store));
    RouterConfig rc;
    rc.disaggregated = options_.topology == Topology::pd;
    rc.max_pending = options_.max_pending;
    rc.block_size = options_.engine.block_size;
    rc.request_timeout_s = options_.request_timeout_s;
    rc.placement = options_.placement;
    rc.scheduling_policy = options_.scheduler.policy;
    rc.pd_controller = options_.pd_controller;
    rc.autoscale = options_.autoscale;
    router_ = spawn_router(*system_, rc, sinks_, kv_);
    actors_->add_service(caf::actor_cast<caf::actor>(router_));
    actors_->add_service(caf::actor_cast<caf::actor>(kv_));
    return actors_->spawn(std::move(hosted), "", router_, kv_, options_.kv_stream,
                          attach_to_router(*system_, router_));
  }

  Status submit(GenerateRequest request, EventCallback on_event) override {
    return resume(std::move(request), {}, std::move(on_event));
  }

  Status resume(GenerateRequest request, std::vector<int32_t> generated, EventCallback on_event) override {
    Status st = validate_request(request, context_, n_vocab_, n_embd_);
    if (!st.ok()) return st;
    if (!options_.mmproj && !check_images_encoded(request).ok())
      return Status(Code::invalid_argument,
                    "request " + std::to_string(request.request_id) +
                        " has images without embeddings and this pipeline has no vision encoder "
                        "(no mmproj)");
    return submit_to_router(*system_, router_, *sinks_, std::move(request), std::move(on_event),
                            std::move(generated));
  }

  Status cancel(uint64_t request_id) override { return cancel_at_router(router_, *sinks_, request_id); }

  std::vector<msg::Stats> stats() override { return collect_all_stats(*system_, router_, kv_, *actors_); }

  int32_t alive(const std::string& kind) override {
    for (const msg::Stats& s : stats())
      if (s.actor == "router") return int32_t(s.get("alive_" + kind));
    return 0;
  }

  const PipelineOptions& options() const override { return options_; }

 private:
  PipelineTestHooks* hooks() override { return this; }

  Status kill_actor(const std::string& kind, int32_t index) override { return actors_->kill(kind, index); }

  Status send_raw(const std::string& kind, int32_t index, const std::vector<char>& bytes) override {
    caf::scoped_actor self{*system_};
    Status st;
    auto on_error = [&](caf::error& e) { st = from_error(e); };
    if (kind == "router") {
      self->request(router_, kClientTimeout, submit_atom::value, bytes).receive([](bool) {}, on_error);
      return st;
    }
    if (kind == "kv_store") {
      self->request(kv_, kClientTimeout, kv_put_atom::value, bytes).receive([](const Bytes&) {}, on_error);
      return st;
    }
    return actors_->send_raw(kind, index, bytes);
  }

  PipelineOptions options_;
  int32_t context_, n_vocab_, n_embd_;
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
  std::shared_ptr<EventSinks> sinks_;
  kv_store_actor kv_;
  router_actor router_;
  std::unique_ptr<ActorSet> actors_;
};

}  // namespace

Result<std::unique_ptr<Pipeline>> make_actor_pipeline(std::shared_ptr<const GgufFile> file,
                                                       std::shared_ptr<const Tokenizer> tokenizer,
                                                       const PipelineOptions& options) {
  // Engines, encoders and the store first, so their errors come back before any actor.
  HostedSpec hs;
  if (options.topology == Topology::pd) {
    hs.groups = {{ActorKind::prefill, options.prefill_actors}, {ActorKind::decode, options.decode_actors}};
  } else {
    hs.groups = {{ActorKind::colocated, options.colocated_actors}};
  }
  if (options.mmproj) hs.groups.push_back({ActorKind::vision_encoder, options.vision_actors});
  if (!options.experts.empty()) {
    hs.groups.push_back({ActorKind::expert, int32_t(options.experts.size())});
    hs.experts = options.experts;
    hs.attention = true;
    hs.expert_replication = options.expert_replication;
  }
  if (!options.prefill_pipeline.empty()) hs.pipelines[ActorKind::prefill] = options.prefill_pipeline;
  if (!options.decode_pipeline.empty()) hs.pipelines[ActorKind::decode] = options.decode_pipeline;
  if (!options.colocated_pipeline.empty())
    hs.pipelines[ActorKind::colocated] = options.colocated_pipeline;
  hs.file = file;
  hs.tokenizer = tokenizer;
  hs.engine = options.engine;
  hs.scheduler = options.scheduler;
  hs.mmproj = options.mmproj;
  hs.vision = options.vision;
  auto hosted = make_hosted_actors(hs);
  if (!hosted.ok()) return hosted.status();
  Engine& engine = hosted->stages.front().second->engine();
  if (!options.experts.empty()) {
    Status covered = check_expert_coverage(engine.config(), options.experts);
    if (!covered.ok()) return covered;
  }
  auto device = kv_store_backend(options.kv_durable ? "cpu" : options.engine.device);
  if (!device.ok()) return device.status();
  auto store = make_kv_store(options.kv_tier0_bytes, options.kv_tier1_bytes, options.kv_dir,
                             engine.model_fingerprint(), engine.kv_layout(), options.kv_durable,
                             options.kv_disk_bytes, *device);
  if (!store.ok()) return store.status();
  auto pipeline = std::make_unique<ActorPipeline>(options, engine.context(), engine.config().n_vocab,
                                                  engine.config().dim);
  Status st = pipeline->start(std::move(hosted.value()), std::move(store.value()));
  if (!st.ok()) return st;
  return std::unique_ptr<Pipeline>(std::move(pipeline));
}

}  // namespace cleave
