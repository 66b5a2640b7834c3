// The router: admission (max_pending -> busy), placement through a
// PlacementPolicy (actors/placement.h; the script's `router` field) for
// new requests and for hand-offs, a vision encoder first for requests
// whose images lack embeddings (least loaded), supervision of every stage
// and encoder (a dead one's requests are re-placed: a Handoff with the
// tokens so far, KV restored from the store), a no-progress watchdog, and
// early rejection of requests whose goals cannot be met (actors/slo_predictor.h).
// Placement on the stages is in router_placement.cpp, the P:D role switches,
// autoscale and drain in router_control.cpp; router_state.h is what they share.
#include "actors/router_state.h"

#include <algorithm>
#include <cmath>

#include "actors/event_sinks.h"
#include "schema/codec.h"

namespace cleave::actors {
namespace {

using namespace router_detail;

void leave_encoder(RouterState& s, RouterState::Pending& p) {
  if (p.encoder >= 0 && s.encoders[size_t(p.encoder)].in_flight > 0)
    --s.encoders[size_t(p.encoder)].in_flight;
  p.encoder = -1;
}

bool needs_encoding(const GenerateRequest& r) {
  for (const PromptImage& im : r.images)
    if (im.embeddings.empty()) return true;
  return false;
}

bool any_encoder_alive(const RouterState& s) {
  for (const auto& e : s.encoders)
    if (e.alive) return true;
  return false;
}

void finish(router_pointer self, uint64_t id, const msg::StreamEvent& e) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end()) return;
  leave_stage(s, it->second);
  leave_encoder(s, it->second);
  s.slo.forget_request(id, seconds_since_start(s));
  s.pending.erase(it);
  if (e.kind == msg::StreamEvent::Kind::finished) ++s.finished;
  else ++s.failed;
  s.sinks->emit(e);
  finish_switch(self);
}

// Fails a pending request and tells its stage to drop it.
void fail(router_pointer self, uint64_t id, Status why) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end()) return;
  const int32_t stage = it->second.stage;
  if (stage >= 0 && s.stages[size_t(stage)].alive)
    self->send(s.stages[size_t(stage)].handle, cancel_atom::value, id);
  msg::StreamEvent e;
  e.kind = msg::StreamEvent::Kind::failed;
  e.request_id = id;
  e.error = std::move(why);
  e.origin = "router";
  finish(self, id, e);
}

// The answer of a stage to submit / handoff: a typed error fails the
// request; a stage that went down is handled by the down handler.
void on_stage_error(router_pointer self, uint64_t id, int32_t stage, const caf::error& err) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end() || it->second.stage != stage) return;
  if (!s.stages[size_t(stage)].alive) return;
  if (is_receiver_down(err)) return;  // the down message re-places it
  fail(self, id, from_error(err));
}

void place_entry(router_pointer self, uint64_t id) {
  auto& s = self->state;
  auto& p = s.pending.at(id);
  const int32_t i = place_on_stage(self, p, true);
  if (i < 0) {
    ++s.rejected_unavailable;
    return fail(self, id, Status(Code::unavailable, "no live prefill or colocated actor"));
  }
  p.continuing = false;
  s.slo.placed(i, id, int64_t(p.request.prompt.size()), seconds_since_start(s));
  self->request(s.stages[size_t(i)].handle, kStageTimeout, submit_atom::value,
                codec::encode(p.request))
      .then([](bool) {}, [=](caf::error& err) { on_stage_error(self, id, i, err); });
}

// With a source, the decoder pulls the KV from that prefill's kv_sender.
void place_continue(router_pointer self, uint64_t id, Bytes handoff,
                    const kv_sender_actor* source = nullptr) {
  auto& s = self->state;
  auto& p = s.pending.at(id);
  const int32_t i = place_on_stage(self, p, false);
  if (i < 0) {
    ++s.rejected_unavailable;
    return fail(self, id, Status(Code::unavailable, "no live decode actor"));
  }
  p.continuing = true;
  p.last_progress = Clock::now();
  auto on_error = [=](caf::error& err) { on_stage_error(self, id, i, err); };
  const stage_actor& stage = s.stages[size_t(i)].handle;
  if (source) {
    ++s.direct_handoffs;
    self->request(stage, kStageTimeout, handoff_atom::value, std::move(handoff), *source)
        .then([](bool) {}, on_error);
  } else {
    self->request(stage, kStageTimeout, handoff_atom::value, std::move(handoff))
        .then([](bool) {}, on_error);
  }
}

void on_embeddings(router_pointer self, uint64_t id, int32_t encoder, const Bytes& reply);

// A resumed request goes to a decode (or colocated) stage as a hand-off
// without KV: the stage reads what the store holds and recomputes the rest.
void place_resumed(router_pointer self, uint64_t id) {
  auto& p = self->state.pending.at(id);
  msg::Handoff h;
  h.request = p.request;
  h.generated = p.generated;
  place_continue(self, id, codec::encode(h));
}

// The request's images that lack embeddings go to the least loaded live
// encoder; its reply puts them into the request, which then goes on to a
// stage (place_entry).
void place_encode(router_pointer self, uint64_t id) {
  auto& s = self->state;
  auto& p = s.pending.at(id);
  // An active encoder; a parked one only when no active one is alive. Among
  // equally loaded ones the least recently given work: encoders faster than
  // the arrivals are all idle at each placement, and ties to the lowest
  // index would leave an encoder the autoscaler added without work.
  int32_t best = -1;
  auto better = [&](const RouterState::Encoder& e, const RouterState::Encoder& b) {
    return e.in_flight != b.in_flight ? e.in_flight < b.in_flight : e.last_given < b.last_given;
  };
  for (bool take_parked : {false, true}) {
    for (int32_t i = 0; i < int32_t(s.encoders.size()); ++i) {
      const auto& e = s.encoders[size_t(i)];
      if (e.alive && e.parked == take_parked && (best < 0 || better(e, s.encoders[size_t(best)]))) best = i;
    }
    if (best >= 0) break;
  }
  if (best < 0) {
    ++s.rejected_unavailable;
    return fail(self, id, Status(Code::unavailable, "no live vision_encoder actor"));
  }
  p.encoder = best;
  p.last_progress = p.encode_started = Clock::now();
  ++s.encoders[size_t(best)].in_flight;
  s.encoders[size_t(best)].last_given = ++s.encoder_turn;
  ++s.encodes;
  msg::EncodeRequest m;
  m.request_id = id;
  for (const PromptImage& im : p.request.images)
    if (im.embeddings.empty()) m.images.push_back(im);
  // The answer comes after the encoder's queue and its batch: bounded by
  // the request's own timeout, not a stage's admission timeout.
  const auto limit = std::chrono::duration_cast<caf::timespan>(
      std::chrono::duration<double>(s.config.request_timeout_s));
  self->request(s.encoders[size_t(best)].handle, limit, encode_atom::value, codec::encode(m))
      .then([=](const Bytes& reply) { on_embeddings(self, id, best, reply); },
            [=](caf::error& err) {
              auto& s = self->state;
              auto it = s.pending.find(id);
              if (it == s.pending.end() || it->second.encoder != best) return;
              if (!s.encoders[size_t(best)].alive) return;
              if (is_receiver_down(err)) return;  // the down message re-places it
              fail(self, id, from_error(err));
            });
}

void on_embeddings(router_pointer self, uint64_t id, int32_t encoder, const Bytes& reply) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end() || it->second.encoder != encoder) {
    ++s.stray_events;  // failed or re-placed meanwhile
    return;
  }
  auto& p = it->second;
  leave_encoder(s, p);
  auto m = codec::decode_as<msg::ImageEmbeddings>(reply);
  if (!m.ok()) {
    ++s.bad_messages;
    return fail(self, id, m.status());
  }
  size_t k = 0;
  for (const PromptImage& im : p.request.images) {
    if (!im.embeddings.empty()) continue;
    if (k >= m->images.size() || !(m->images[k].hash == im.hash) ||
        m->images[k].n_tokens != im.n_tokens)
      break;
    ++k;
  }
  if (k != m->images.size() || m->request_id != id)
    return fail(self, id, Status(Code::corruption, "the vision encoder's answer for request " +
                                                       std::to_string(id) +
                                                       " does not match its images"));
  k = 0;
  for (PromptImage& im : p.request.images) {
    if (!im.embeddings.empty()) continue;
    im.embeddings = std::move(m->images[k++].embeddings);
    im.image.rgb = {};  // encoded: the pixels are not needed any more
  }
  p.encode_origin = m->origin;
  p.encode_seconds = m->seconds;
  p.last_progress = p.language_from = Clock::now();
  if (s.encoder_scaler)
    s.encoder_scaler->observe_ttft(std::chrono::duration<double>(p.last_progress - p.encode_started).count());
  if (p.resumed) place_resumed(self, id);
  else place_entry(self, id);
}

void on_encoder_down(router_pointer self, int32_t index) {
  auto& s = self->state;
  s.encoders[size_t(index)].alive = false;
  s.encoders[size_t(index)].in_flight = 0;
  ++s.encoder_downs;
  control_autoscale(self);  // a parked encoder takes the dead one's place
  std::vector<uint64_t> affected;
  for (auto& [id, p] : s.pending)
    if (p.encoder == index) affected.push_back(id);
  std::sort(affected.begin(), affected.end());
  for (uint64_t id : affected) {
    s.pending.at(id).encoder = -1;
    ++s.encode_replacements;
    place_encode(self, id);  // on another encoder, or unavailable
  }
}

// The pending entry when the message comes from the stage the request is on.
RouterState::Pending* from_current_stage(router_pointer self, uint64_t id) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end() || it->second.stage < 0) return nullptr;
  auto sender = caf::actor_cast<caf::actor_addr>(self->current_sender());
  if (sender != s.stages[size_t(it->second.stage)].addr) return nullptr;
  return &it->second;
}

void on_stage_down(router_pointer self, int32_t index) {
  auto& s = self->state;
  auto& dead = s.stages[size_t(index)];
  dead.alive = false;
  dead.in_flight = 0;
  dead.load_blocks = 0;
  s.entry_policy->forget(index);
  s.continue_policy->forget(index);
  s.slo.forget_stage(index, seconds_since_start(s));
  ++s.stage_downs;
  // Decoders still pulling KV from its sender would wait for their pulls'
  // timeout where CAF tells them nothing (a node reached through the head,
  // a sender that died mid-handshake): they hear it from here.
  if (dead.kv_sender)
    for (const auto& st : s.stages)
      if (st.alive && st.cont)
        self->send(st.handle, kv_sender_down_atom::value, dead.kv_sender.node(), uint64_t(dead.kv_sender.id()));
  control_autoscale(self);  // a parked stage takes the dead one's place
  std::vector<uint64_t> affected;
  for (auto& [id, p] : s.pending)
    if (p.stage == index) affected.push_back(id);
  std::sort(affected.begin(), affected.end());
  // pd with no decoder left: nothing admitted can finish; fail it all now.
  if (dead.cont && !any_alive(s, false)) {
    std::vector<uint64_t> all;
    for (auto& [id, p] : s.pending) all.push_back(id);
    for (uint64_t id : all) fail(self, id, Status(Code::unavailable, "no live decode actor"));
    return;
  }
  for (uint64_t id : affected) {
    ++s.replacements;
    replace(self, id);
  }
}

// A prefill's hand-off: on to a decoder (which pulls the KV from source
// when there is one).
void on_handoff(router_pointer self, const Bytes& bytes, const kv_sender_actor* source) {
  auto& s = self->state;
  auto h = codec::decode_as<msg::Handoff>(bytes);
  if (!h.ok()) {
    ++s.bad_messages;
    return;
  }
  const uint64_t id = h->request.request_id;
  RouterState::Pending* p = from_current_stage(self, id);
  if (!p) {
    ++s.stray_events;
    return;
  }
  ++s.handoffs;
  if (source) s.stages[size_t(p->stage)].kv_sender = source->address();
  leave_stage(s, *p);
  p->stage = -1;
  place_continue(self, id, bytes, source);
  finish_switch(self);
}

// Admission of a submitted or resumed request (resume: `generated` tokens
// from an earlier run): busy, unavailable or a typed error at once, else it
// is pending and placed.
caf::result<bool> admit(router_pointer self, GenerateRequest request, std::vector<int32_t> generated) {
  auto& s = self->state;
  const uint64_t id = request.request_id;
  if (s.closed) return to_error(Status(Code::unavailable, "pipeline is shutting down"));
  const bool encode = needs_encoding(request);
  if (s.scaler && generated.empty()) s.scaler->observe_arrival();  // the demand, admitted or not
  if (s.encoder_scaler && encode) s.encoder_scaler->observe_arrival();
  if (int32_t(s.pending.size()) >= s.config.max_pending) {
    ++s.rejected_busy;
    return to_error(Status(Code::busy, "max_pending (" + std::to_string(s.config.max_pending) +
                                           ") requests in flight"));
  }
  if (Status st = check_priority_allowed(request, s.config.scheduling_policy); !st.ok())
    return to_error(st);
  if (Status st = check_cost_policy(request, s.config.placement.policy); !st.ok()) return to_error(st);
  if (s.pending.count(id))
    return to_error(Status(Code::invalid_argument,
                           "request id " + std::to_string(id) + " is already in flight"));
  if (!any_alive(s, true) || !any_alive(s, false)) {
    ++s.rejected_unavailable;
    return to_error(Status(Code::unavailable, s.config.disaggregated && any_alive(s, true)
                                                  ? "no live decode actor"
                                                  : "no live stage actor"));
  }
  if (encode && !any_encoder_alive(s)) {
    ++s.rejected_unavailable;
    return to_error(Status(Code::unavailable, "request " + std::to_string(id) +
                                                  " has images to encode and there is no "
                                                  "live vision_encoder actor"));
  }
  const bool resumed = !generated.empty();
  // A resumed request has started already: its goals were checked then.
  if (!resumed) {
    if (Status st = s.slo.check(request, live_stages(s, true), live_stages(s, false)); !st.ok()) {
      ++s.rejected_slo;
      return to_error(st);
    }
    if (Status st = check_cost(s.slo, request, cost_stages(s, true), cost_stages(s, false), s.config.disaggregated);
        !st.ok()) {
      ++s.rejected_cost;
      return to_error(st);
    }
  }
  RouterState::Pending p;
  p.request = std::move(request);
  p.generated = std::move(generated);
  p.resumed = resumed;
  p.last_progress = p.admitted_at = p.language_from = Clock::now();
  s.pending.emplace(id, std::move(p));
  ++s.admitted;
  if (encode) place_encode(self, id);
  else if (resumed) place_resumed(self, id);
  else place_entry(self, id);
  return true;
}

router_actor::behavior_type router_fn(router_pointer self, RouterConfig config,
                                      std::shared_ptr<EventSinks> sinks, kv_store_actor kv) {
  auto& s = self->state;
  s.config = config;
  auto entry = make_placement_policy(config.placement);
  auto cont = make_placement_policy(config.placement);
  CLEAVE_CHECK(entry.ok() && cont.ok());  // spawn_router's callers check the config
  s.entry_policy = std::move(entry.value());
  s.continue_policy = std::move(cont.value());
  s.predict_placement = s.config.placement.policy == "cost_aware";
  if (s.config.pd_controller.enabled()) s.pd = std::make_unique<PdController>(s.config.pd_controller);
  if (s.config.autoscale.enabled()) s.scaler = std::make_unique<ScaleController>(s.config.autoscale);
  if (s.config.autoscale.enabled() && s.config.autoscale.encoders())
    s.encoder_scaler = std::make_unique<ScaleController>(s.config.autoscale.encoder_config());
  s.sinks = std::move(sinks);
  s.kv = kv;
  self->monitor(kv);
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& s = self->state;
    if (dm.source == s.kv.address()) {
      s.kv_alive = false;
      return;
    }
    for (int32_t i = 0; i < int32_t(s.stages.size()); ++i)
      if (s.stages[size_t(i)].alive && s.stages[size_t(i)].addr == dm.source)
        return on_stage_down(self, i);
    for (int32_t i = 0; i < int32_t(s.encoders.size()); ++i)
      if (s.encoders[size_t(i)].alive && s.encoders[size_t(i)].addr == dm.source)
        return on_encoder_down(self, i);
  });
  self->send(caf::actor_cast<router_actor>(self), tick_atom::value);
  return {
      [=](submit_atom, const Bytes& bytes) -> caf::result<bool> {
        auto& s = self->state;
        ++s.requests;
        auto request = codec::decode_as<GenerateRequest>(bytes);
        if (!request.ok()) {
          ++s.bad_messages;
          return to_error(request.status());
        }
        return admit(self, std::move(request.value()), {});
      },
      [=](resume_atom, const Bytes& bytes) -> caf::result<bool> {
        auto& s = self->state;
        ++s.requests;
        auto h = codec::decode_as<msg::Handoff>(bytes);
        if (!h.ok()) {
          ++s.bad_messages;
          return to_error(h.status());
        }
        ++s.resumes;
        return admit(self, std::move(h->request), std::move(h->generated));
      },
      [=](event_atom, const Bytes& bytes) {
        auto& s = self->state;
        auto e = codec::decode_as<msg::StreamEvent>(bytes);
        if (!e.ok()) {
          ++s.bad_messages;
          return;
        }
        RouterState::Pending* p = from_current_stage(self, e->request_id);
        if (!p) {
          ++s.stray_events;
          return;
        }
        p->last_progress = Clock::now();
        if (e->kind == msg::StreamEvent::Kind::token) {
          if (e->index != int32_t(p->generated.size())) {  // a replayed token
            ++s.stray_events;
            return;
          }
          if (e->index == 0) {
            s.slo.first_token(e->request_id, seconds_since_start(s));
            const double ttft = std::chrono::duration<double>(p->last_progress - p->admitted_at).count();
            if (s.pd) s.pd->observe_ttft(ttft);
            // Parking stages cannot change the encoders' wait: the stages' goal counts from the embeddings.
            if (s.scaler)
              s.scaler->observe_ttft(std::chrono::duration<double>(p->last_progress - p->language_from).count());
          } else {
            const double gap = std::chrono::duration<double>(p->last_progress - p->last_token).count();
            // The predictor learns each stage's own step; the controller
            // sees every gap the client does, a hand-off's wait included
            // (from a token this router saw: a resumed request's first is
            // not a gap).
            if (p->last_token_stage == p->stage) s.slo.token_gap(p->stage, gap);
            if (s.pd && p->last_token_stage >= 0) s.pd->observe_tpot(gap);
          }
          p->last_token = p->last_progress;
          p->last_token_stage = p->stage;
          p->generated.push_back(e->token);
          ++s.tokens;
          if (e->index == 0 && !p->encode_origin.empty()) {
            e->encode_origin = p->encode_origin;
            e->encode_seconds = p->encode_seconds;
          }
          s.sinks->emit(*e);
          return;
        }
        finish(self, e->request_id, *e);
      },
      [=](cancel_atom, uint64_t id) {
        auto& s = self->state;
        if (!s.pending.count(id)) return;
        ++s.cancelled;
        fail(self, id, Status(Code::aborted, "request " + std::to_string(id) + " cancelled by its client"));
      },
      [=](handoff_atom, const Bytes& bytes) { on_handoff(self, bytes, nullptr); },
      [=](handoff_atom, const Bytes& bytes, kv_sender_actor source) {
        on_handoff(self, bytes, &source);
      },
      [=](attach_atom, const std::string& kind, stage_actor stage, double cost) -> caf::result<bool> {
        auto& s = self->state;
        const auto k = parse_actor_kind(kind);
        if (!k || !actor_kind_info(*k).stage)
          return to_error(Status(Code::invalid_argument, "cannot attach a '" + kind.substr(0, 64) +
                                                             "' actor as a stage"));
        RouterState::Stage st;
        st.addr = stage.address();
        st.handle = stage;
        st.kind = *k;
        st.entry = actor_kind_info(*k).entry;
        st.cont = actor_kind_info(*k).continues;
        st.cost = std::isfinite(cost) && cost > 0 ? cost : 1.0;
        if (auto e = s.early_stores.find(st.addr); e != s.early_stores.end()) {
          st.store = e->second;
          s.early_stores.erase(e);
        }
        if (s.scaler && st.entry) {
          // The first min_stages entry stages take requests; the rest start parked.
          int32_t active = 0;
          for (const auto& o : s.stages) active += o.alive && !o.draining && !o.parked && o.entry;
          st.parked = active >= s.scaler->config().min_stages;
        }
        self->monitor(stage);
        s.stages.push_back(std::move(st));
        return true;
      },
      [=](stage_store_atom, const stage_actor& stage, const kv_store_actor& store) {
        auto& s = self->state;
        for (auto& st : s.stages)
          if (st.addr == stage.address()) {
            st.store = store;
            return;
          }
        if (s.early_stores.size() < 4096) s.early_stores.emplace(stage.address(), store);
      },
      [=](attach_atom, const std::string&, vision_encoder_actor encoder) -> bool {
        auto& s = self->state;
        RouterState::Encoder e;
        e.addr = encoder.address();
        e.handle = encoder;
        if (s.encoder_scaler) {
          // The first min_encoders take requests; the rest start parked.
          int32_t active = 0;
          for (const auto& o : s.encoders) active += o.alive && !o.parked;
          e.parked = active >= s.encoder_scaler->config().min_stages;
        }
        self->monitor(encoder);
        s.encoders.push_back(std::move(e));
        return true;
      },
      [=](drain_atom, const std::vector<stage_actor>& stages) -> caf::result<uint64_t> {
        return drain(self, stages);
      },
      [=](tick_atom) {
        auto& s = self->state;
        const auto now = Clock::now();
        const auto limit = std::chrono::duration<double>(s.config.request_timeout_s);
        std::vector<uint64_t> stuck;
        for (auto& [id, p] : s.pending)
          if (now - p.last_progress > limit) stuck.push_back(id);
        for (uint64_t id : stuck) {
          ++s.timeouts;
          fail(self, id, Status(Code::timed_out, "request " + std::to_string(id) +
                                                     " made no progress for " +
                                                     std::to_string(s.config.request_timeout_s) + " s"));
        }
        finish_switch(self);
        control_pd(self);
        control_autoscale(self);
        self->delayed_send(caf::actor_cast<router_actor>(self), next_tick(s), tick_atom::value);
      },
      [=](shutdown_atom) -> bool {
        auto& s = self->state;
        s.closed = true;
        std::vector<uint64_t> all;
        for (auto& [id, p] : s.pending) all.push_back(id);
        for (uint64_t id : all) fail(self, id, Status(Code::aborted, "pipeline shut down"));
        return true;
      },
      [=](stage_list_atom) -> caf::result<std::vector<stage_actor>, std::vector<vision_encoder_actor>> {
        std::vector<stage_actor> stages;
        std::vector<vision_encoder_actor> encoders;
        for (const auto& st : self->state.stages)
          if (st.alive) stages.push_back(st.handle);
        for (const auto& e : self->state.encoders)
          if (e.alive) encoders.push_back(e.handle);
        return {std::move(stages), std::move(encoders)};
      },
      [=](stats_atom) -> Bytes {
        auto& s = self->state;
        uint64_t alive_prefill = 0, alive_decode = 0, alive_colocated = 0, alive_encoders = 0, parked_encoders = 0;
        for (const auto& e : s.encoders) {
          alive_encoders += e.alive;
          parked_encoders += e.alive && e.parked;
        }
        uint64_t active_entry = 0, parked_entry = 0, stores_pending = 0;
        for (const auto& st : s.stages) {
          if (!st.alive || st.draining) continue;
          // In a KV pool a stage sends its store apart from its attach; until
          // it comes, placement there neither counts nor preloads its blocks.
          stores_pending += s.config.kv_index && !st.store;
          if (st.entry) ++(st.parked ? parked_entry : active_entry);
          if (st.kind == ActorKind::prefill) ++alive_prefill;
          if (st.kind == ActorKind::decode) ++alive_decode;
          if (st.kind == ActorKind::colocated) ++alive_colocated;
        }
        std::vector<std::pair<std::string, uint64_t>> counters = {{"requests", s.requests},
                                                                   {"admitted", s.admitted},
                                                                   {"rejected_busy", s.rejected_busy},
                                                                   {"rejected_unavailable", s.rejected_unavailable},
                                                                   {"rejected_slo", s.rejected_slo},
                                                                   {"rejected_cost", s.rejected_cost},
                                                                   {"cancelled", s.cancelled},
                                                                   {"resumes", s.resumes},
                                                                   {"queue_depth", s.pending.size()},
                                                                   {"finished", s.finished},
                                                                   {"failures", s.failed},
                                                                   {"tokens", s.tokens},
                                                                   {"handoffs", s.handoffs},
                                                                   {"direct_handoffs", s.direct_handoffs},
                                                                   {"replacements", s.replacements},
                                                                   {"preloads", s.preloads},
                                                                   {"preload_blocks", s.preload_blocks},
                                                                   {"drained_stages", s.drained_stages},
                                                                   {"role_switches", s.role_switches},
                                                                   {"pd_decisions", s.pd_decisions},
                                                                   {"pd_arrivals", s.pd_arrivals},
                                                                   {"handoffs_rebalanced", s.handoffs_rebalanced},
                                                                   {"role_switches_to_prefill", s.to_prefill},
                                                                   {"role_switches_to_decode", s.to_decode},
                                                                   {"role_switch_failures", s.role_switch_failures},
                                                                   {"migrated", s.migrated},
                                                                   {"autoscale_active", active_entry},
                                                                   {"autoscale_parked", parked_entry},
                                                                   {"autoscale_ups", s.scale_ups},
                                                                   {"autoscale_downs", s.scale_downs},
                                                                   {"autoscale_stage_ms", uint64_t(std::llround(s.stage_seconds * 1e3))},
                                                                   {"autoscale_encoders_active", alive_encoders - parked_encoders},
                                                                   {"autoscale_encoders_parked", parked_encoders},
                                                                   {"autoscale_encoder_ups", s.encoder_ups},
                                                                   {"autoscale_encoder_downs", s.encoder_downs_scaled},
                                                                   {"autoscale_encoder_ms", uint64_t(std::llround(s.encoder_seconds * 1e3))},
                                                                   {"stage_downs", s.stage_downs},
                                                                   {"timeouts", s.timeouts},
                                                                   {"stray_events", s.stray_events},
                                                                   {"bad_messages", s.bad_messages},
                                                                   {"alive_prefill", alive_prefill},
                                                                   {"alive_decode", alive_decode},
                                                                   {"alive_colocated", alive_colocated},
                                                                   {"stores_pending", stores_pending},
                                                                   {"alive_vision_encoder", alive_encoders},
                                                                   {"encodes", s.encodes},
                                                                   {"encoder_downs", s.encoder_downs},
                                                                   {"encode_replacements", s.encode_replacements},
                                                                   {"alive_kv_store", s.kv_alive ? 1u : 0u}};
        // The P:D controller's last decision, in thousandths (a pressure is
        // measured / goal); busy and load only where that decision had them.
        if (s.pd) {
          auto milli = [](double v) { return uint64_t(std::llround(std::max(0.0, v) * 1e3)); };
          counters.emplace_back("pd_ttft_pressure_milli", milli(s.pd->ttft_pressure()));
          counters.emplace_back("pd_tpot_pressure_milli", milli(s.pd->tpot_pressure()));
          if (s.pd->prefill_busy() >= 0) counters.emplace_back("pd_prefill_busy_milli", milli(s.pd->prefill_busy()));
          if (s.pd->prefill_load() >= 0) counters.emplace_back("pd_prefill_load_milli", milli(s.pd->prefill_load()));
        }
        return encode_stats("router", std::move(counters));
      },
  };
}

}  // namespace

// What router_placement.cpp and router_control.cpp call back.
namespace router_detail {

double seconds_since_start(const RouterState& s) {
  return std::chrono::duration<double>(Clock::now() - s.epoch).count();
}

// A request whose stage is gone or drained goes on elsewhere: from its
// prompt when nothing came yet, else as a hand-off with the tokens so far.
void replace(router_pointer self, uint64_t id) {
  auto& p = self->state.pending.at(id);
  p.stage = -1;
  if (!p.continuing && p.generated.empty()) {
    place_entry(self, id);
  } else {
    msg::Handoff h;
    h.request = p.request;
    h.generated = p.generated;
    place_continue(self, id, codec::encode(h));
  }
}

}  // namespace router_detail

router_actor spawn_router(caf::actor_system& system, RouterConfig config,
                          std::shared_ptr<EventSinks> sinks, kv_store_actor kv) {
  return system.spawn(router_fn, std::move(config), std::move(sinks), std::move(kv));
}

}  // namespace cleave::actors
