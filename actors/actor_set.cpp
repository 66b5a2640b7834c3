#include "actors/actor_set.h"

#include "actors/expert_dispatch.h"
#include "schema/codec.h"

namespace cleave::actors {

// ---- Status <-> caf::error ----

const caf::atom_value kCleaveCategory = caf::atom("cleave");

caf::error to_error(const Status& st) {
  return caf::error(static_cast<uint8_t>(st.code()), kCleaveCategory, caf::make_message(st.message()));
}

Status from_error(const caf::error& e) {
  if (!e) return Status::Ok();
  if (e.category() == kCleaveCategory) {
    std::string what;
    if (e.context().match_elements<std::string>()) what = e.context().get_as<std::string>(0);
    return Status(static_cast<Code>(e.code()), what);
  }
  if (e.category() == caf::atom("system")) {
    auto sec = static_cast<caf::sec>(e.code());
    if (sec == caf::sec::request_timeout) return Status(Code::timed_out, "actor request timed out");
    return Status(Code::unavailable, "actor system: " + caf::to_string(sec));
  }
  return Status(Code::unavailable, "actor error " + std::to_string(e.code()) + " in category " +
                                       caf::to_string(e.category()));
}

bool is_receiver_down(const caf::error& e) {
  return e.category() == caf::atom("system") &&
         static_cast<caf::sec>(e.code()) == caf::sec::request_receiver_down;
}

Bytes encode_stats(std::string actor, std::vector<std::pair<std::string, uint64_t>> counters) {
  msg::Stats s;
  s.actor = std::move(actor);
  s.counters = std::move(counters);
  return codec::encode(s);
}

void configure_workers(caf::actor_system_config& config, int32_t threads) {
  if (threads > 0) config.set("scheduler.max-threads", size_t(threads));
  // Idle CAF workers poll (by default 100 busy polls, then 500 polls 50 us
  // apart) before they sleep on a condition variable that a new job wakes
  // at once. On a machine whose cores run the engines' threads, that
  // polling steals the cores every parallel step waits on; poll briefly
  // and sleep instead (no added latency: enqueue wakes the sleeper).
  config.set("work-stealing.aggressive-poll-attempts", size_t(10));
  config.set("work-stealing.moderate-poll-attempts", size_t(0));
}

// ---- the wiring path ----

Attach attach_to_router(caf::actor_system& system, const router_actor& router) {
  auto call = [&system, router](auto&&... args) {
    caf::scoped_actor self{system};
    Status st;
    self->request(router, kClientTimeout, attach_atom::value, args...)
        .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
    return st;
  };
  Attach a;
  // One process is one node: every stage costs the same.
  a.stage = [call](const std::string& kind, const stage_actor& h) { return call(kind, h, 1.0); };
  a.encoder = [call](const vision_encoder_actor& h) { return call(std::string("vision_encoder"), h); };
  return a;
}

Status ActorSet::spawn(HostedActors hosted, const std::string& name_prefix, const router_actor& router,
                       const kv_store_actor& kv, const KvStreamOptions& stream, const Attach& attach) {
  // Expert actors first: the stages' executors need their handles.
  if (!hosted.experts.empty() && !hosted.expert_socket_host.empty()) {
    std::vector<std::shared_ptr<ExpertHost>> hosts;
    for (const auto& e : hosted.experts) hosts.push_back(e.second);
    auto server = ExpertSocketServer::listen(hosted.expert_socket_host, std::move(hosts));
    if (!server.ok()) return server.status();
    expert_socket_ = std::move(server.value());
  }
  for (size_t i = 0; i < hosted.experts.size(); ++i) {
    auto& [set, host] = hosted.experts[i];
    auto handle = spawn_expert(system_, std::move(host), name_prefix + "expert/" + std::to_string(i));
    experts_.push_back(Expert{handle, set});
    directory_->add(ExpertRef{handle, set, ""});  // this process's stages: messages
    if (attach.expert) {
      Status st = attach.expert(handle, set, expert_socket_ ? expert_socket_->endpoint(i) : "");
      if (!st.ok()) return Status(st.code(), "attaching expert: " + st.message());
    }
  }
  for (size_t i = 0; i < hosted.expert_fallbacks.size(); ++i)
    hosted.stages[i].second->engine().set_expert_executor(
        make_actor_expert_executor(system_, directory_, std::move(hosted.expert_fallbacks[i]),
                                   hosted.expert_replication ? std::optional<ReplicationPolicy>(ReplicationPolicy{})
                                                             : std::nullopt));
  for (size_t i = 0; i < hosted.remote_stages.size(); ++i) {
    auto refs = spawn_pipeline({hosted.remote_stages[i]}, name_prefix);
    if (!refs.ok()) return refs.status();
    if (attach.pipeline_stage) {
      Status st = attach.pipeline_stage(refs->front().handle, refs->front().layers);
      if (!st.ok()) return Status(st.code(), "attaching stage: " + st.message());
    }
  }
  for (size_t i = 0; i < hosted.stages.size(); ++i) {
    auto& [kind, core] = hosted.stages[i];
    std::vector<caf::actor> pipeline;
    Engine& own = core->engine();
    const bool local = i < hosted.pipeline_stages.size() && !hosted.pipeline_stages[i].empty();
    if (local || (!own.stage_link() && own.own_layers().last + 1 < own.config().n_layers)) {
      auto refs = local ? spawn_pipeline(std::move(hosted.pipeline_stages[i]), name_prefix)
                        : find_pipeline(attach, own);
      if (!refs.ok()) return refs.status();
      for (const PipelineStageRef& r : *refs) pipeline.push_back(caf::actor_cast<caf::actor>(r.handle));
      Engine& engine = core->engine();
      caf::actor watcher;
      auto link = make_actor_stage_link(system_, std::move(refs.value()), engine.config(),
                                        engine.model_fingerprint(), &watcher);
      if (!link.ok()) return link.status();
      if (!local && attach.pipeline_watch) CLEAVE_RETURN_IF_ERROR(attach.pipeline_watch(watcher));
      CLEAVE_RETURN_IF_ERROR(engine.set_stage_link(std::move(link.value())));
    }
    auto handle = spawn_stage(system_, std::move(core), kind, router, kv, stream, std::move(pipeline));
    stages_.push_back(Stage{kind, handle});
    Status st = attach.stage(actor_kind_name(kind), handle);
    if (!st.ok())
      return Status(st.code(), std::string("attaching ") + actor_kind_name(kind) + ": " + st.message());
  }
  for (size_t i = 0; i < hosted.encoders.size(); ++i) {
    auto handle = spawn_vision_encoder(system_, std::move(hosted.encoders[i]),
                                       name_prefix + "vision_encoder/" + std::to_string(i));
    encoders_.push_back(Encoder{handle});
    Status st = attach.encoder(handle);
    if (!st.ok()) return Status(st.code(), "attaching vision_encoder: " + st.message());
  }
  return Status::Ok();
}

Result<std::vector<PipelineStageRef>> ActorSet::find_pipeline(const Attach& attach,
                                                              const Engine& engine) {
  const LlamaConfig& c = engine.config();
  if (!attach.pipeline_chain)
    return Status(Code::invalid_argument, "a stage holding layers [0, " +
                                              std::to_string(engine.own_layers().last) +
                                              "] of " + std::to_string(c.n_layers) +
                                              " has no later stages to hand its rows to");
  auto chain = attach.pipeline_chain(engine.own_layers().last + 1, c.n_layers);
  if (!chain.ok()) return chain.status();
  const size_t layer_bytes = engine.kv_layout().layer_bytes();
  std::vector<PipelineStageRef> refs;
  caf::scoped_actor self{system_};
  for (size_t k = 0; k < chain->size(); ++k) {
    auto& [handle, layers] = (*chain)[k];
    refs.push_back(PipelineStageRef{handle, layers, size_t(layers.count()) * layer_bytes});
    // Each stage hands its rows to the next (set by the first stage's node).
    caf::actor next = k + 1 < chain->size() ? caf::actor_cast<caf::actor>((*chain)[k + 1].first)
                                            : caf::actor{};
    Status st;
    self->request(handle, kClientTimeout, next_atom::value, next)
        .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
    if (!st.ok())
      return Status(st.code(), "wiring the stage holding " + layers.to_string() + ": " + st.message());
  }
  return refs;
}

Result<std::vector<PipelineStageRef>> ActorSet::spawn_pipeline(
    std::vector<std::shared_ptr<LayerStage>> later, const std::string& name_prefix) {
  std::vector<PipelineStageRef> refs(later.size());
  caf::scoped_actor self{system_};
  for (size_t k = later.size(); k-- > 0;) {
    refs[k].layers = later[k]->layers();
    refs[k].slice_bytes = later[k]->slice_bytes();
    PipelineStage ps{{}, false, later[k], std::make_shared<PipelineStageCounters>(),
                     name_prefix + "stage/" + std::to_string(pipeline_stages_.size())};
    ps.handle = spawn_pipeline_stage(system_, std::move(later[k]), ps.label, ps.counters);
    refs[k].handle = ps.handle;
    pipeline_stages_.push_back(std::move(ps));
    if (k + 1 < refs.size()) {
      Status st;
      self->request(refs[k].handle, kClientTimeout, next_atom::value,
                    caf::actor_cast<caf::actor>(refs[k + 1].handle))
          .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
      if (!st.ok()) return st;
    }
  }
  return refs;
}

void collect_stats(caf::scoped_actor& self, const caf::actor& handle, std::vector<msg::Stats>& out,
                   caf::duration timeout) {
  self->request(handle, timeout, stats_atom::value)
      .receive(
          [&](const Bytes& b) {
            auto s = codec::decode_as<msg::Stats>(b);
            if (s.ok()) out.push_back(std::move(s.value()));
          },
          [](caf::error&) {});
}

void collect_stats(caf::scoped_actor& self, const std::vector<caf::actor>& handles, std::vector<msg::Stats>& out,
                   caf::duration timeout) {
  using Pending = decltype(self->request(caf::actor{}, timeout, stats_atom::value));
  std::vector<Pending> pending;
  pending.reserve(handles.size());
  for (const caf::actor& h : handles) pending.push_back(self->request(h, timeout, stats_atom::value));
  for (Pending& p : pending)
    p.receive(
        [&](const Bytes& b) {
          auto s = codec::decode_as<msg::Stats>(b);
          if (s.ok()) out.push_back(std::move(s.value()));
        },
        [](caf::error&) {});
}

void ActorSet::collect_stats(std::vector<msg::Stats>& out) {
  caf::scoped_actor self{system_};
  for (auto& s : stages_) actors::collect_stats(self, s.handle, out);
  for (auto& e : encoders_) actors::collect_stats(self, e.handle, out);
  for (auto& e : experts_) actors::collect_stats(self, e.handle, out);
  // Read here, not asked: a pipeline stage taken down with its first stage
  // (a node losing its head) still reports what it did.
  for (auto& p : pipeline_stages_) {
    if (p.killed) continue;  // a deliberate kill (fault tests) reports nothing, as a dead actor did
    auto st = codec::decode_as<msg::Stats>(pipeline_stage_stats(p.label, *p.stage, *p.counters));
    if (st.ok()) out.push_back(std::move(st.value()));
  }
}

Status ActorSet::kill(const std::string& kind, int32_t index) {
  auto down = [](auto& entry) {
    if (entry.killed) return false;
    entry.killed = true;
    caf::anon_send_exit(entry.handle, caf::exit_reason::kill);
    return true;
  };
  if (kind == "vision_encoder") {
    if (index >= 0 && index < int32_t(encoders_.size()) && down(encoders_[size_t(index)]))
      return Status::Ok();
  } else if (kind == "expert") {
    if (index >= 0 && index < int32_t(experts_.size()) && down(experts_[size_t(index)]))
      return Status::Ok();
  } else if (kind == "stage") {
    if (index >= 0 && index < int32_t(pipeline_stages_.size()) &&
        down(pipeline_stages_[size_t(index)]))
      return Status::Ok();
  } else {
    int32_t n = 0;
    for (auto& s : stages_)
      if (actor_kind_name(s.kind) == kind && n++ == index && down(s)) return Status::Ok();
  }
  return Status(Code::not_found, "no live " + kind + " actor " + std::to_string(index));
}

Status ActorSet::send_raw(const std::string& kind, int32_t index, const Bytes& bytes) {
  caf::scoped_actor self{system_};
  Status st;
  auto on_error = [&](caf::error& e) { st = from_error(e); };
  if (kind == "vision_encoder") {
    if (index < 0 || index >= int32_t(encoders_.size()))
      return Status(Code::not_found, "no vision_encoder actor " + std::to_string(index));
    self->request(encoders_[size_t(index)].handle, kClientTimeout, encode_atom::value, bytes)
        .receive([](const Bytes&) {}, on_error);
    return st;
  }
  int32_t n = 0;
  for (auto& s : stages_) {
    if (actor_kind_name(s.kind) != kind || n++ != index) continue;
    self->request(s.handle, kClientTimeout, submit_atom::value, bytes).receive([](bool) {}, on_error);
    return st;
  }
  return Status(Code::not_found, "no " + kind + " actor " + std::to_string(index));
}

void ActorSet::stop() {
  if (stages_.empty() && encoders_.empty() && experts_.empty() && pipeline_stages_.empty() &&
      services_.empty() && !expert_socket_)
    return;
  {
    caf::scoped_actor self{system_};
    for (auto& s : stages_) self->send_exit(s.handle, caf::exit_reason::user_shutdown);
    for (auto& e : encoders_) self->send_exit(e.handle, caf::exit_reason::user_shutdown);
    // After the stages: one in its last step may still dispatch to them
    // (it then finds them gone and computes the rest itself).
    for (auto& e : experts_) self->send_exit(e.handle, caf::exit_reason::user_shutdown);
    for (auto& p : pipeline_stages_) self->send_exit(p.handle, caf::exit_reason::user_shutdown);
    for (auto& a : services_) self->send_exit(a, caf::exit_reason::user_shutdown);
  }
  stages_.clear();
  encoders_.clear();
  experts_.clear();
  pipeline_stages_.clear();
  services_.clear();
  expert_socket_.reset();  // closes its connections: other processes' stages drop these hosts
}

Status submit_to_router(caf::actor_system& system, const router_actor& router, EventSinks& sinks,
                        GenerateRequest request, EventCallback on_event,
                        std::vector<int32_t> generated) {
  const uint64_t id = request.request_id;
  if (!sinks.add(id, std::move(on_event)))
    return Status(Code::invalid_argument, "request id " + std::to_string(id) + " is already in flight");
  Status st;
  caf::scoped_actor self{system};
  auto on_error = [&](caf::error& e) { st = from_error(e); };
  if (generated.empty()) {
    self->request(router, kClientTimeout, submit_atom::value, codec::encode(request))
        .receive([](bool) {}, on_error);
  } else {
    msg::Handoff h;
    h.request = std::move(request);
    h.generated = std::move(generated);
    self->request(router, kClientTimeout, resume_atom::value, codec::encode(h))
        .receive([](bool) {}, on_error);
  }
  if (!st.ok()) sinks.remove(id);
  return st;
}

Status cancel_at_router(const router_actor& router, EventSinks& sinks, uint64_t request_id) {
  if (!sinks.has(request_id))
    return Status(Code::not_found, "request " + std::to_string(request_id) + " is not in flight");
  caf::anon_send(router, cancel_atom::value, request_id);
  return Status::Ok();
}

std::vector<msg::Stats> collect_all_stats(caf::actor_system& system, const router_actor& router,
                                          const kv_store_actor& kv, ActorSet& actors) {
  std::vector<msg::Stats> out;
  {
    caf::scoped_actor self{system};
    collect_stats(self, router, out);
    collect_stats(self, kv, out);
  }
  actors.collect_stats(out);
  return out;
}

void shutdown_router(caf::actor_system& system, const router_actor& router) {
  caf::scoped_actor self{system};
  self->request(router, kClientTimeout, shutdown_atom::value).receive([](bool) {}, [](caf::error&) {});
}

}  // namespace cleave::actors
