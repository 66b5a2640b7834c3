// Nodes (actors/node.h): the same actors spread over processes. The head
// publishes a join actor through CAF's middleman; workers join it with the
// cluster secret and attach their stages and encoders to the head's router.
// Both build their actors with make_hosted_actors and wire them with an
// ActorSet, as the in-process Pipeline does.
#include "actors/node.h"

#include <caf/io/all.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>
#include <type_traits>

#include "actors/actor_set.h"
#include "actors/node_join.h"
#include "kernels/backend.h"
#include "model/llama.h"

namespace cleave {

bool secrets_equal(std::string_view a, std::string_view b) {
  // Every byte of the longer string is looked at, whatever differs first.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

Result<std::optional<std::string>> read_cluster_secret(const ClusterSpec& spec) {
  if (!spec.secret_file.empty()) {
    std::ifstream f(spec.secret_file, std::ios::binary);
    if (!f) return Status(Code::io_error, "cannot read the cluster secret file '" + spec.secret_file + "'");
    std::string secret((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
    if (secret.empty())
      return Status(Code::invalid_argument, "the cluster secret file '" + spec.secret_file + "' is empty");
    return std::optional<std::string>(std::move(secret));
  }
  const char* env = spec.secret_env.empty() ? nullptr : std::getenv(spec.secret_env.c_str());
  if (!env || !*env) return std::optional<std::string>();
  return std::optional<std::string>(std::string(env));
}

namespace {

using namespace actors;

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}
// Middleman, heartbeats and the handle types that cross the wire: the same
// Middleman, heartbeats and the handle types that cross the wire: the same
// on every node.
void configure_node_impl(caf::actor_system_config& config, const ClusterSpec& spec, int32_t threads) {
  config.load<caf::io::middleman>();
  config.add_message_type<router_actor>("cleave.router_actor");
  config.add_message_type<kv_store_actor>("cleave.kv_store_actor");
  config.add_message_type<stage_actor>("cleave.stage_actor");
  config.add_message_type<kv_sender_actor>("cleave.kv_sender_actor");
  config.add_message_type<kv_receiver_actor>("cleave.kv_receiver_actor");
  config.add_message_type<vision_encoder_actor>("cleave.vision_encoder_actor");
  config.add_message_type<expert_actor>("cleave.expert_actor");
  config.add_message_type<expert_directory_actor>("cleave.expert_directory_actor");
  config.add_message_type<pipeline_stage_actor>("cleave.pipeline_stage_actor");
  auto span = [](double s) { return caf::timespan(std::chrono::nanoseconds(int64_t(s * 1e9))); };
  config.set("middleman.heartbeat-interval", span(spec.heartbeat_interval_s));
  config.set("middleman.connection-timeout", span(spec.connection_timeout_s));
  configure_workers(config, threads);
}

// A node's device: "cpu", or "cuda:N" when the build and the machine have
// that GPU (its stages' engines, pipeline stages, expert hosts, vision
// encoders and the kv_store's tiers run there). Refused at start with the
// reason otherwise, never ignored.
Status check_device(const ClusterSpec& spec, const NodeSpec& node) {
  if (node.device == "cpu") return Status::Ok();
  const std::string what = "node '" + node.name + "': device " + node.device + ": ";
  auto device = parse_device(node.device);
  if (!device.ok()) return Status(Code::invalid_argument, what + device.status().message());
  if (spec.compute != Compute::exact)
    return Status(Code::unsupported, what + "compute = \"int8\" runs on the CPU backend only");
  auto backend = make_cuda_backend(device->index);
  if (!backend.ok()) return Status(Code::unavailable, what + backend.status().message());
  return Status::Ok();
}

// The node's stages and encoders, built before any actor.
Result<HostedActors> make_node_actors(const NodeOptions& o, const NodeSpec& node) {
  HostedSpec hs;
  for (const ActorGroupSpec& g : node.actors) {
    const auto kind = parse_actor_kind(g.kind);
    if (!kind) return Status(Code::invalid_argument, "node '" + node.name + "': unknown actor kind '" + g.kind + "'");
    if (*kind == ActorKind::vision_encoder && !o.mmproj)
      return Status(Code::invalid_argument, "node '" + node.name + "' hosts vision_encoder actors (line " +
                                                std::to_string(g.line) + "): give it --mmproj");
    hs.groups.push_back({*kind, g.count});
    if (*kind == ActorKind::expert) hs.experts.assign(size_t(g.count), node.experts);
    if (*kind == ActorKind::stage) hs.stage_layers.assign(size_t(g.count), node.stage.layers);
  }
  // With expert actors anywhere in the cluster, every stage is an attention
  // actor: it sends each layer's FFN to them.
  hs.attention = o.spec.count("expert") > 0;
  hs.expert_replication = o.expert_replication;
  hs.name_prefix = node.name + "/";
  hs.file = o.file;
  hs.tokenizer = o.tokenizer;
  hs.engine = o.engine;
  hs.engine.device = node.device;  // check_device() let it through
  if (node.threads > 0) hs.engine.threads = node.threads;
  // A pipeline's first stage: its one stage actor's engine holds the
  // script's range; the later stages attach to the head from their nodes.
  if (node.stage.set && node.count("stage") == 0) hs.engine.last_layer = node.stage.layers.last;
  hs.scheduler = o.scheduler;
  hs.scheduler.policy = o.spec.scheduling_policy;
  hs.mmproj = o.mmproj;
  hs.vision = o.vision;
  if (node.threads > 0) hs.vision.threads = node.threads;
  return make_hosted_actors(hs);
}

// Attaches through the head's join actor, with the secret.
Attach attach_through(caf::actor_system& system, const join_actor& join, const std::string& secret,
                      const std::string& node, const std::string& pipeline, double timeout_s) {
  auto call_expert = [&system, join, secret, node](const expert_actor& h, const ExpertSet& set,
                                                  const std::string& endpoint) {
    caf::scoped_actor self{system};
    Status st;
    self->request(join, kJoinTimeout, attach_atom::value, secret, node, h, set.spec(), endpoint)
        .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
    if (!st.ok()) return Status(st.code(), "the head: " + st.message());
    return st;
  };
  auto call = [&system, join, secret, node](const std::string& kind, auto&& handle) {
    caf::scoped_actor self{system};
    Status st;
    self->request(join, kJoinTimeout, attach_atom::value, secret, node, kind, handle)
        .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
    if (!st.ok()) return Status(st.code(), "the head: " + st.message());
    return st;
  };
  Attach a;
  a.stage = [call](const std::string& kind, const stage_actor& h) { return call(kind, h); };
  a.encoder = [call](const vision_encoder_actor& h) { return call("vision_encoder", h); };
  a.expert = call_expert;
  a.pipeline_stage = [&system, join, secret, node, pipeline](const pipeline_stage_actor& h,
                                                           LayerRange layers) {
    caf::scoped_actor self{system};
    Status st;
    self->request(join, kJoinTimeout, attach_atom::value, secret, node, pipeline, layers.first,
                  layers.last, h)
        .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
    if (!st.ok()) return Status(st.code(), "the head: " + st.message());
    return st;
  };
  a.pipeline_watch = [&system, join, secret, pipeline](const caf::actor& watcher) {
    caf::scoped_actor self{system};
    Status st;
    self->request(join, kJoinTimeout, stage_watch_atom::value, secret, pipeline, watcher)
        .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
    if (!st.ok()) return Status(st.code(), "the head: " + st.message());
    return st;
  };
  // Later stages start in any order: ask the head until each has attached.
  a.pipeline_chain = [&system, join, secret, pipeline, timeout_s](int32_t from, int32_t n_layers)
      -> Result<std::vector<std::pair<pipeline_stage_actor, LayerRange>>> {
    std::vector<std::pair<pipeline_stage_actor, LayerRange>> chain;
    const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1e3));
    caf::scoped_actor self{system};
    while (from < n_layers) {
      Status st;
      self->request(join, kJoinTimeout, stage_find_atom::value, secret, pipeline, from)
          .receive(
              [&](pipeline_stage_actor& h, int32_t last) {
                chain.emplace_back(std::move(h), LayerRange{from, last});
              },
              [&](caf::error& e) { st = from_error(e); });
      if (st.ok()) {
        from = chain.back().second.last + 1;
        continue;
      }
      if (st.code() != Code::not_found || Clock::now() >= deadline)
        return Status(st.code(), "pipeline '" + pipeline + "': " + st.message() + " within " +
                                     seconds_text(timeout_s));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return chain;
  };
  return a;
}

// A node whose stages are attention actors learns of the cluster's expert
// actors through the head (they attach in any order, and again after a
// restart).
Status watch_experts(caf::actor_system& system, const join_actor& join, const std::string& secret,
                     ActorSet& actors) {
  auto directory = spawn_expert_directory(system, actors.expert_directory());
  actors.add_service(caf::actor_cast<caf::actor>(directory));
  caf::scoped_actor self{system};
  Status st;
  self->request(join, kJoinTimeout, expert_watch_atom::value, secret, directory)
      .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
  if (!st.ok()) return Status(st.code(), "watching the expert actors at the head: " + st.message());
  return st;
}

// Every node checks the expert placement against its model at start.
Status check_node_experts(const NodeOptions& o) {
  const bool pipelines = std::any_of(o.spec.nodes.begin(), o.spec.nodes.end(),
                                     [](const NodeSpec& n) { return n.stage.set; });
  if (o.spec.count("expert") == 0 && !pipelines) return Status::Ok();
  auto model = LlamaModel::load(o.file);
  if (!model.ok()) return model.status();
  CLEAVE_RETURN_IF_ERROR(check_topology_pipelines(o.spec, &(*model)->config()));
  return check_topology_experts(o.spec, (*model)->config());
}

// A node's TieredStore from its kv{} tiers. Its fingerprint and layout, and
// request validation, come from an engine: a local stage's, or one made for
// that when there is none.
struct NodeStore {
  Result<std::shared_ptr<TieredStore>> store = Status(Code::unavailable, "no store made yet");
  int32_t context = 0, n_vocab = 0, n_embd = 0;
  uint64_t model_fingerprint = 0;
  KvLayout layout;
};
NodeStore make_node_store(const NodeOptions& o, const NodeSpec& me, HostedActors* hosted,
                          const std::shared_ptr<const GgufFile>& file, const std::string& kv_dir) {
  NodeStore out;
  std::unique_ptr<Engine> probe;
  Engine* engine = nullptr;
  if (hosted && !hosted->stages.empty()) {
    engine = &hosted->stages.front().second->engine();
  } else {
    EngineOptions eo = o.engine;
    eo.max_seqs = 1;
    auto e = Engine::create(file, eo);
    if (!e.ok()) {
      out.store = e.status();
      return out;
    }
    probe = std::move(e.value());
    engine = probe.get();
  }
  out.context = engine->context();
  out.n_vocab = engine->config().n_vocab;
  out.n_embd = engine->config().dim;
  out.model_fingerprint = engine->model_fingerprint();
  out.layout = engine->kv_layout();
  // On a GPU node the store's tiers are GPU and page-locked host memory.
  auto device = kv_store_backend(me.kv_durable ? "cpu" : me.device);
  if (!device.ok()) {
    out.store = device.status();
    return out;
  }
  out.store = make_kv_store(size_t(me.kv_tier0_bytes), size_t(me.kv_tier1_bytes), kv_dir,
                            out.model_fingerprint, out.layout, me.kv_durable, 0, *device);
  return out;
}

// One model's front end on the head: its router (with its own event sinks)
// and store. The head's own model is models_[0]; every other model's
// actors report as "model:PATH/router" and "model:PATH/kv_store", so two
// models' counters never share a name (stats lines, /metrics).
class ModelFront final : public Frontend {
 public:
  static constexpr auto kStageStatsTimeout = std::chrono::seconds(2);

  ModelFront(caf::actor_system& system, std::string path, bool head_model)
      : system_(system), path_(std::move(path)), prefix_(head_model ? "" : "model:" + path_ + "/") {}

  Status submit(GenerateRequest request, EventCallback on_event) override {
    Status st = validate_request(request, context, n_vocab, n_embd);
    if (!st.ok()) return st;
    return submit_to_router(system_, route.router, *sinks, std::move(request), std::move(on_event));
  }
  Status resume(GenerateRequest request, std::vector<int32_t> generated, EventCallback on_event) override {
    Status st = validate_request(request, context, n_vocab, n_embd);
    if (!st.ok()) return st;
    return submit_to_router(system_, route.router, *sinks, std::move(request), std::move(on_event),
                            std::move(generated));
  }
  Status cancel(uint64_t request_id) override { return cancel_at_router(route.router, *sinks, request_id); }
  // The router's and the store's, then those of every stage and vision
  // encoder attached to the router, on any node (they name themselves by
  // node), asked all at once. One that does not answer within
  // kStageStatsTimeout is left out: a scrape does not hang on a stopped or
  // partitioned node.
  std::vector<msg::Stats> stats() override {
    std::vector<msg::Stats> out;
    caf::scoped_actor self{system_};
    collect_stats(self, route.router, out);
    collect_stats(self, route.kv, out);
    for (msg::Stats& st : out) st.actor = prefix_ + st.actor;
    std::vector<caf::actor> attached;
    self->request(route.router, kClientTimeout, stage_list_atom::value)
        .receive(
            [&](const std::vector<stage_actor>& s, const std::vector<vision_encoder_actor>& e) {
              for (const auto& h : s) attached.push_back(caf::actor_cast<caf::actor>(h));
              for (const auto& h : e) attached.push_back(caf::actor_cast<caf::actor>(h));
            },
            [](caf::error&) {});
    collect_stats(self, attached, out, caf::duration(kStageStatsTimeout));
    return out;
  }
  // The router's counters alone (no stage is asked).
  msg::Stats router_stats() {
    std::vector<msg::Stats> out;
    caf::scoped_actor self{system_};
    collect_stats(self, route.router, out);
    return out.empty() ? msg::Stats{} : std::move(out.front());
  }
  const std::string& path() const { return path_; }

  ModelRoute route;
  std::shared_ptr<EventSinks> sinks = std::make_shared<EventSinks>();
  int32_t context = 0, n_vocab = 0, n_embd = 0;

 private:
  caf::actor_system& system_;
  std::string path_;
  std::string prefix_;
};

class HeadNode final : public Node {
 public:
  explicit HeadNode(const NodeOptions& o, const NodeSpec& me) : options_(o), me_(me) {
    configure_node(config_, o.spec, 0);
    system_ = std::make_unique<caf::actor_system>(config_);
    actors_ = std::make_unique<ActorSet>(*system_);
  }

  ~HeadNode() override {
    for (auto& m : models_) shutdown_router(*system_, m->route.router);
    if (port_ > 0) system_->middleman().unpublish(join_, port_);
    actors_.reset();
    join_ = join_actor{};
    models_.clear();
    system_.reset();
  }

  Status start() {
    CLEAVE_RETURN_IF_ERROR(check_device(options_.spec, me_));
    auto hosted = make_node_actors(options_, me_);
    if (!hosted.ok()) return hosted.status();
    // A router and a store for every model the cluster serves; the head's
    // own stages serve the first.
    const std::vector<std::string> paths = cluster_models(options_.spec);
    std::shared_ptr<KvPoolIndex> index;
    for (size_t i = 0; i < paths.size(); ++i) {
      const std::string& path = paths[i];
      std::shared_ptr<const GgufFile> file = options_.file;
      if (i > 0) {
        auto f = options_.model_files.find(path);
        if (f == options_.model_files.end() || !f->second)
          return Status(Code::invalid_argument, "the head needs the file of model '" + path +
                                                    "' (NodeOptions::model_files)");
        file = f->second;
      }
      // Another model's RocksDB lives beside the head's, in a directory of
      // its own: one store per model fingerprint.
      std::string kv_dir = me_.kv_dir;
      if (i > 0 && !kv_dir.empty()) kv_dir += "/model-" + std::to_string(i);
      NodeStore store = make_node_store(options_, me_, i == 0 ? &hosted.value() : nullptr, file, kv_dir);
      if (!store.store.ok()) return store.store.status();
      auto front = std::make_unique<ModelFront>(*system_, path, i == 0);
      front->context = store.context;
      front->n_vocab = store.n_vocab;
      front->n_embd = store.n_embd;
      KvStoreRole role;
      if (options_.spec.kv_pool) {  // a pool per model: its workers' stores join this directory
        index = std::make_shared<KvPoolIndex>();
        role.index = index;
        role.replicate_reads = options_.spec.kv_replicate_reads;
        role.fault_corrupt_served = options_.kv_fault_corrupt_served;
        role.fault_stale_index = options_.kv_fault_stale_index;
        role.data_host = me_.host;
      }
      front->route.kv = spawn_kv_store(*system_, std::move(store.store.value()), role);
      RouterConfig rc;
      rc.disaggregated = options_.spec.count("prefill", path) > 0;
      rc.max_pending = options_.spec.max_pending;
      rc.block_size = options_.engine.block_size;
      rc.request_timeout_s = options_.spec.request_timeout_s;
      rc.placement = options_.spec.placement;
      rc.scheduling_policy = options_.spec.scheduling_policy;
      rc.pd_controller = options_.spec.pd_controller;
      rc.autoscale = options_.spec.autoscale;
      rc.kv_index = index;
      rc.kv_preload = options_.spec.kv_preload;
      rc.model_fingerprint = store.model_fingerprint;
      rc.kv_layout = store.layout;
      front->route.router = spawn_router(*system_, rc, front->sinks, front->route.kv);
      models_.push_back(std::move(front));
    }
    JoinConfig jc;
    jc.secret = options_.secret;
    for (const auto& m : models_) jc.models.push_back(m->route);
    for (const NodeSpec& n : options_.spec.nodes) {
      jc.costs[n.name] = n.cost;
      jc.node_model[n.name] = size_t(std::find(paths.begin(), paths.end(), n.model) - paths.begin());
    }
    jc.head = me_.name;
    jc.experts_alive = experts_alive_;
    jc.fault_stall_attach = options_.fault_stall_attach;
    jc.topology = {options_.spec.source_name, options_.spec.source};
    for (const auto& [key, value] : options_.spec.source_args) {
      jc.topology.push_back(key);
      jc.topology.push_back(value);
    }
    join_ = spawn_join(*system_, std::move(jc));
    // Stopped after the stages: join, routers, stores.
    actors_->add_service(caf::actor_cast<caf::actor>(join_));
    for (const auto& m : models_) {
      actors_->add_service(caf::actor_cast<caf::actor>(m->route.router));
      actors_->add_service(caf::actor_cast<caf::actor>(m->route.kv));
    }
    // reuse: a restarted head binds its port again while the dead one's
    // connections still wait in TIME_WAIT (its workers rejoin there).
    auto port = system_->middleman().publish(join_, uint16_t(me_.port), me_.host.c_str(), /*reuse=*/true);
    if (!port)
      return Status(Code::unavailable, "cannot listen on " + me_.host + ":" + std::to_string(me_.port) +
                                           ": " + system_->render(port.error()));
    port_ = *port;
    KvStreamOptions stream = options_.kv_stream;
    stream.node_address = address();
    stream.pool = options_.spec.kv_pool;
    // The head's own actors attach through the join actor too, so it logs
    // which node lost what.
    const bool attention = !hosted->expert_fallbacks.empty();
    hosted->expert_socket_host = me_.host;
    CLEAVE_RETURN_IF_ERROR(actors_->spawn(std::move(hosted.value()), me_.name + "/", own().route.router,
                                          own().route.kv, stream,
                                          attach_through(*system_, join_, options_.secret.value_or(""), me_.name,
                                                         me_.stage.pipeline, options_.join_timeout_s)));
    if (attention) CLEAVE_RETURN_IF_ERROR(watch_experts(*system_, join_, options_.secret.value_or(""), *actors_));
    return Status::Ok();
  }

  bool is_head() const override { return true; }
  std::string address() const override { return me_.host + ":" + std::to_string(port_); }
  bool lost_head() const override { return false; }
  Result<uint64_t> drain() override {
    return Status(Code::unsupported, "the head hosts the router: it cannot drain (stop the cluster instead)");
  }
  bool drained() const override { return false; }

  int32_t stages() override {
    int32_t n = experts_alive_->load();
    for (const auto& m : models_) {
      const msg::Stats s = m->router_stats();
      n += int32_t(s.get("alive_prefill") + s.get("alive_decode") + s.get("alive_colocated") +
                   s.get("alive_vision_encoder") - s.get("stores_pending"));
    }
    return n;
  }

  std::vector<std::pair<std::string, Frontend*>> model_frontends() override {
    std::vector<std::pair<std::string, Frontend*>> out;
    for (const auto& m : models_) out.emplace_back(m->path(), m.get());
    return out;
  }

  Status submit(GenerateRequest request, EventCallback on_event) override {
    return own().submit(std::move(request), std::move(on_event));
  }
  Status resume(GenerateRequest request, std::vector<int32_t> generated, EventCallback on_event) override {
    return own().resume(std::move(request), std::move(generated), std::move(on_event));
  }
  Status cancel(uint64_t request_id) override { return own().cancel(request_id); }

  // The head's model's router and store, then the head's own stages and
  // encoders (other models' counters come from model_frontends()).
  std::vector<msg::Stats> stats() override {
    return collect_all_stats(*system_, own().route.router, own().route.kv, *actors_);
  }

 private:
  ModelFront& own() { return *models_.front(); }

  NodeOptions options_;
  NodeSpec me_;
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
  std::vector<std::unique_ptr<ModelFront>> models_;
  join_actor join_;
  std::unique_ptr<ActorSet> actors_;
  uint16_t port_ = 0;
  std::shared_ptr<std::atomic<int32_t>> experts_alive_ = std::make_shared<std::atomic<int32_t>>(0);
};

class WorkerNode final : public Node {
 public:
  WorkerNode(const NodeOptions& o, const NodeSpec& me, const NodeSpec& head)
      : options_(o), me_(me), head_(head) {
    configure_node(config_, o.spec, 0);
    system_ = std::make_unique<caf::actor_system>(config_);
    head_lost_ = std::make_shared<std::atomic<bool>>(false);
    actors_ = std::make_unique<ActorSet>(*system_);
  }

  ~WorkerNode() override {
    actors_.reset();
    join_ = join_actor{};
    router_ = router_actor{};
    kv_ = kv_store_actor{};
    system_.reset();
  }

  Status start() {
    CLEAVE_RETURN_IF_ERROR(check_device(options_.spec, me_));
    auto hosted = make_node_actors(options_, me_);
    if (!hosted.ok()) return hosted.status();
    // Where decoders on other nodes connect for worker-to-worker KV streams
    // (named in this node's hand-offs; the topology's host, 127.0.0.1 by
    // default, port 0: any free one).
    auto listening = system_->middleman().open(uint16_t(me_.port), me_.host.c_str());
    if (!listening)
      return Status(Code::unavailable, "worker " + me_.name + " cannot listen on " + me_.host + ":" +
                                           std::to_string(me_.port) + ": " +
                                           system_->render(listening.error()));
    KvStreamOptions stream = options_.kv_stream;
    stream.node_address = me_.host + ":" + std::to_string(*listening);
    // Nodes start in any order: keep trying until the deadline.
    const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(options_.join_timeout_s * 1e3));
    caf::error last;
    for (;;) {
      auto j = system_->middleman().remote_actor<join_actor>(head_.host, uint16_t(head_.port));
      if (j) {
        join_ = *j;
        break;
      }
      last = j.error();
      if (Clock::now() >= deadline)
        return Status(Code::unavailable, "cannot reach the head '" + head_.name + "' at " + address() +
                                             " within " + seconds_text(options_.join_timeout_s) + ": " +
                                             system_->render(last));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const std::string secret = options_.secret.value_or("");
    Status st;
    {
      caf::scoped_actor self{*system_};
      self->request(join_, kJoinTimeout, join_atom::value, secret, me_.name)
          .receive(
              [&](router_actor& r, kv_store_actor& k) {
                router_ = std::move(r);
                kv_ = std::move(k);
              },
              [&](caf::error& e) { st = from_error(e); });
    }
    if (!st.ok())
      return Status(st.code(), "the head at " + address() + " refused node " + me_.name + ": " + st.message());
    // Arguments go through spawn, not captures: CAF 0.17 dereferences a null
    // shared_ptr<tuple<>> for a function actor spawned without any (UBSan).
    auto watcher = system_->spawn(
        [](caf::event_based_actor* w, router_actor router, std::shared_ptr<std::atomic<bool>> lost) {
          w->monitor(router);
          w->set_down_handler([=](caf::down_msg&) {
            lost->store(true);
            w->quit();
          });
          return caf::behavior{[](int32_t) {}};
        },
        router_, head_lost_);
    actors_->add_service(watcher);
    // From here a failure while the head is gone is the head's loss (its
    // requests time out), not this node's error: say so, so a supervised
    // run starts again to rejoin rather than fail.
    auto unless_lost = [this](Status s) {
      if (s.ok() || !head_lost_->load()) return s;
      return lost_head_while_starting_status(address(), s);
    };
    // A kv_store here joins the head's pool; this node's stages use it.
    stream.pool = options_.spec.kv_pool;
    if (me_.count("kv_store") > 0) {
      NodeStore store = make_node_store(options_, me_, &hosted.value(), options_.file, me_.kv_dir);
      if (!store.store.ok()) return store.store.status();
      KvStoreRole role;
      role.directory = kv_;
      role.replicate_reads = options_.spec.kv_replicate_reads;
      role.fault_corrupt_served = options_.kv_fault_corrupt_served;
      role.fault_stale_index = options_.kv_fault_stale_index;
      role.data_host = me_.host;
      kv_ = spawn_kv_store(*system_, std::move(store.store.value()), role);
      actors_->add_service(caf::actor_cast<caf::actor>(kv_));
      local_store_ = true;
    }
    const bool attention = !hosted->expert_fallbacks.empty();
    hosted->expert_socket_host = me_.host;
    CLEAVE_RETURN_IF_ERROR(unless_lost(actors_->spawn(std::move(hosted.value()), me_.name + "/", router_, kv_,
                                                      stream,
                                                      attach_through(*system_, join_, secret, me_.name,
                                                                     me_.stage.pipeline, options_.join_timeout_s))));
    if (attention) CLEAVE_RETURN_IF_ERROR(unless_lost(watch_experts(*system_, join_, secret, *actors_)));
    // Hears from the head when this node is drained.
    auto drain_watcher = system_->spawn(
        [](caf::event_based_actor*, std::shared_ptr<std::atomic<bool>> drained) {
          return caf::behavior{[=](drain_atom) { drained->store(true); }};
        },
        drained_);
    actors_->add_service(drain_watcher);
    {
      caf::scoped_actor self{*system_};
      self->request(join_, kJoinTimeout, drain_watch_atom::value, secret, me_.name, drain_watcher)
          .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
    }
    if (!st.ok())
      return unless_lost(Status(st.code(), "the head at " + address() + " did not take node " + me_.name +
                                               "'s drain watcher: " + st.message()));
    return Status::Ok();
  }

  Result<uint64_t> drain() override {
    caf::scoped_actor self{*system_};
    Result<uint64_t> out = Status(Code::unavailable, "no answer");
    self->request(join_, kClientTimeout, drain_atom::value, options_.secret.value_or(""), me_.name)
        .receive([&](uint64_t moved) { out = moved; }, [&](caf::error& e) { out = from_error(e); });
    return out;
  }
  bool drained() const override { return drained_->load(); }

  bool is_head() const override { return false; }
  std::string address() const override { return head_.host + ":" + std::to_string(head_.port); }
  bool lost_head() const override { return head_lost_->load(); }
  int32_t stages() override { return actors_->size(); }
  std::vector<std::pair<std::string, Frontend*>> model_frontends() override { return {}; }

  Status submit(GenerateRequest, EventCallback) override {
    return Status(Code::unsupported, "requests go to the head, not to worker node " + me_.name);
  }
  Status cancel(uint64_t) override {
    return Status(Code::unsupported, "requests go to the head, not to worker node " + me_.name);
  }
  Status resume(GenerateRequest, std::vector<int32_t>, EventCallback) override {
    return Status(Code::unsupported, "requests go to the head, not to worker node " + me_.name);
  }

  std::vector<msg::Stats> stats() override {
    std::vector<msg::Stats> out;
    if (local_store_) {
      caf::scoped_actor self{*system_};
      self->request(kv_, kClientTimeout, stats_atom::value)
          .receive(
              [&](const Bytes& b) {
                auto st = codec::decode_as<msg::Stats>(b);
                if (st.ok()) out.push_back(std::move(st.value()));
              },
              [](caf::error&) {});
    }
    actors_->collect_stats(out);
    return out;
  }

 private:
  NodeOptions options_;
  NodeSpec me_, head_;
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
  std::shared_ptr<std::atomic<bool>> head_lost_;
  std::shared_ptr<std::atomic<bool>> drained_ = std::make_shared<std::atomic<bool>>(false);
  join_actor join_;
  router_actor router_;
  kv_store_actor kv_;  // this node's own store, else the head's
  bool local_store_ = false;
  std::unique_ptr<ActorSet> actors_;
};

}  // namespace

Result<uint64_t> drain_node(const ClusterSpec& spec, const std::string& name, double timeout_s) {
  auto secret = read_cluster_secret(spec);
  if (!secret.ok()) return secret.status();
  const NodeSpec& head = spec.head();
  if (head.port <= 0 || head.port > 65535)
    return Status(Code::invalid_argument, "the head '" + head.name + "' has port " + std::to_string(head.port) +
                                              " in the topology: drain needs its real port (e.g. --set " +
                                              head.name + "_port=N)");
  caf::actor_system_config config;
  configure_node_impl(config, spec, 1);
  caf::actor_system system{config};
  auto join = system.middleman().remote_actor<join_actor>(head.host, uint16_t(head.port));
  if (!join)
    return Status(Code::unavailable, "cannot reach the head '" + head.name + "' at " + head.host + ":" +
                                         std::to_string(head.port) + ": " + system.render(join.error()));
  caf::scoped_actor self{system};
  Result<uint64_t> out = Status(Code::unavailable, "no answer");
  const auto limit = std::chrono::duration_cast<caf::timespan>(std::chrono::duration<double>(timeout_s));
  self->request(*join, limit, drain_atom::value, secret->value_or(""), name)
      .receive([&](uint64_t moved) { out = moved; }, [&](caf::error& e) { out = from_error(e); });
  return out;
}

Result<ClusterSpec> fetch_topology(const std::string& host, int32_t port, const std::optional<std::string>& secret,
                                   double timeout_s) {
  const std::string where = host + ":" + std::to_string(port);
  if (port <= 0 || port > 65535) return Status(Code::invalid_argument, "--join: bad port in '" + where + "'");
  caf::actor_system_config config;
  configure_node_impl(config, ClusterSpec{}, 1);
  caf::actor_system system{config};
  // The head may not be up yet: keep trying until the deadline, as a worker does.
  const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1e3));
  join_actor join;
  for (;;) {
    auto j = system.middleman().remote_actor<join_actor>(host, uint16_t(port));
    if (j) {
      join = *j;
      break;
    }
    if (Clock::now() >= deadline)
      return Status(Code::unavailable, "cannot reach the head at " + where + " within " + seconds_text(timeout_s) +
                                           ": " + system.render(j.error()));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  caf::scoped_actor self{system};
  Status st;
  std::vector<std::string> got;
  self->request(join, kJoinTimeout, topology_atom::value, secret.value_or(""))
      .receive([&](std::vector<std::string>& v) { got = std::move(v); }, [&](caf::error& e) { st = from_error(e); });
  if (!st.ok()) return Status(st.code(), "the head at " + where + " refused the topology: " + st.message());
  if (got.size() < 2 || got.size() % 2 != 0 || got.size() > 2 + 2 * 4096)
    return Status(Code::corruption, "the head at " + where + " sent a malformed topology (" +
                                        std::to_string(got.size()) + " strings)");
  std::map<std::string, std::string> args;
  for (size_t i = 2; i < got.size(); i += 2) args[got[i]] = got[i + 1];
  return load_joined_topology(got[1], got[0], args, host, port);
}

namespace actors {
void configure_node(caf::actor_system_config& config, const ClusterSpec& spec, int32_t threads) {
  configure_node_impl(config, spec, threads);
}
}  // namespace actors

Status lost_head_while_starting_status(const std::string& head, const Status& cause) {
  return Status(Code::aborted, std::string(kLostHeadWhileStarting) + " at " + head + ": " + cause.message());
}

bool lost_head_while_starting(const Status& st) {
  return st.code() == Code::aborted && st.message().rfind(kLostHeadWhileStarting, 0) == 0;
}

Result<std::unique_ptr<Node>> Node::start(const NodeOptions& options) {
  if (!options.file) return Status(Code::invalid_argument, "node: no model file");
  CLEAVE_RETURN_IF_ERROR(validate_kv_stream_options(options.kv_stream.chunk_bytes, options.kv_stream.window));
  const NodeSpec* me = options.spec.find(options.name);
  if (!me) {
    std::string names;
    for (const NodeSpec& n : options.spec.nodes) names += (names.empty() ? "" : ", ") + n.name;
    return Status(Code::invalid_argument, "no node '" + options.name + "' in the topology (nodes: " + names + ")");
  }
  if (auto policy = make_placement_policy(options.spec.placement); !policy.ok()) return policy.status();
  CLEAVE_RETURN_IF_ERROR(check_node_experts(options));
  if (me->head) {
    auto node = std::make_unique<HeadNode>(options, *me);
    Status st = node->start();
    if (!st.ok()) return st;
    return std::unique_ptr<Node>(std::move(node));
  }
  const NodeSpec& head = options.spec.head();
  if (head.port <= 0 || head.port > 65535)
    return Status(Code::invalid_argument,
                  "the head '" + head.name + "' has port " + std::to_string(head.port) +
                      " in the topology: a worker needs its real port (e.g. --set " + head.name + "_port=N)");
  auto node = std::make_unique<WorkerNode>(options, *me, head);
  Status st = node->start();
  if (!st.ok()) return st;
  return std::unique_ptr<Node>(std::move(node));
}

}  // namespace cleave
