// The router's control (router_actor.cpp calls it): the P:D controller's
// role switches, autoscale of the entry stages and vision encoders, and
// drain. What a draining or switching stage holds is placed again elsewhere.
#include "actors/router_state.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace cleave::actors {
namespace {

using namespace router_detail;

// Each request on the (draining) stages is dropped there and placed again
// elsewhere, as if the stage had gone down. How many moved.
uint64_t move_off(router_pointer self, const std::vector<int32_t>& which) {
  auto& s = self->state;
  std::vector<uint64_t> affected;
  for (int32_t i : which) {
    s.entry_policy->forget(i);
    s.continue_policy->forget(i);
    s.slo.forget_stage(i, seconds_since_start(s));
    for (auto& [id, p] : s.pending)
      if (p.stage == i) affected.push_back(id);
  }
  std::sort(affected.begin(), affected.end());
  for (uint64_t id : affected) {
    auto& p = s.pending.at(id);
    self->send(s.stages[size_t(p.stage)].handle, cancel_atom::value, id);
    leave_stage(s, p);
    ++s.migrated;
    replace(self, id);
  }
  return uint64_t(affected.size());
}

// Stage `to` has just become a decoder: hand-offs that wait on another
// decoder for a row (no token from it yet, longer than the TPOT goal since
// their last token) move to a stage with room, oldest first, while their
// decoder holds more than `to` does. The queue that called for the move is
// served by the stage it added, rather than after the rows it waits for.
// Each is cancelled there and placed again with its tokens, as a drain
// does; a token its old decoder still sends is stray.
uint64_t take_waiting_handoffs(router_pointer self, int32_t to) {
  auto& s = self->state;
  const auto now = Clock::now();
  const double goal_s = s.pd->config().tpot_ms * 1e-3;
  std::vector<std::pair<Clock::time_point, uint64_t>> waiting;
  for (const auto& [id, p] : s.pending) {
    if (!p.continuing || p.stage < 0 || p.stage == to || p.last_token_stage == p.stage) continue;
    const auto& st = s.stages[size_t(p.stage)];
    if (st.alive && st.kind == ActorKind::decode &&
        std::chrono::duration<double>(now - p.last_token).count() > goal_s)
      waiting.emplace_back(p.last_token, id);
  }
  std::sort(waiting.begin(), waiting.end());
  uint64_t moved = 0;
  for (const auto& [since, id] : waiting) {
    auto& p = s.pending.at(id);
    auto& from = s.stages[size_t(p.stage)];
    if (s.stages[size_t(to)].in_flight + 1 >= from.in_flight) continue;
    self->send(from.handle, cancel_atom::value, id);
    leave_stage(s, p);
    ++moved;
    replace(self, id);
  }
  return moved;
}

// The P:D controller moved stage i to the other role: it takes nothing new
// and finishes what it holds (switch_grace_s at most: what is left then
// moves to stages of its role), then it switches and serves the other phase
// (a refusal, say KV still arriving, leaves it as it was).
void switch_role(router_pointer self, int32_t i) {
  auto& s = self->state;
  s.stages[size_t(i)].draining = true;
  s.switching = true;
  s.switch_stage = i;
  s.switch_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(s.pd->config().switch_grace_s));
  finish_switch(self);
}

}  // namespace

namespace router_detail {

// The switching stage's last request is done, or its grace is over.
void finish_switch(router_pointer self) {
  auto& s = self->state;
  if (s.switch_stage < 0) return;
  const int32_t i = s.switch_stage;
  auto& st = s.stages[size_t(i)];
  if (st.alive && st.in_flight > 0 && Clock::now() < s.switch_deadline) return;
  s.switch_stage = -1;
  if (!st.alive) {  // went down meanwhile: its requests were re-placed
    s.switching = false;
    return;
  }
  const bool to_prefill = st.kind == ActorKind::decode;
  move_off(self, {i});
  self->request(st.handle, kStageTimeout, role_atom::value, std::string(to_prefill ? "prefill" : "decode"))
      .then(
          [=](bool) {
            auto& s = self->state;
            auto& st = s.stages[size_t(i)];
            s.switching = false;
            st.draining = false;
            st.kind = to_prefill ? ActorKind::prefill : ActorKind::decode;
            st.entry = actor_kind_info(st.kind).entry;
            st.cont = actor_kind_info(st.kind).continues;
            ++s.role_switches;
            ++(to_prefill ? s.to_prefill : s.to_decode);
            if (!to_prefill) s.handoffs_rebalanced += take_waiting_handoffs(self, i);
          },
          [=](caf::error&) {
            auto& s = self->state;
            s.switching = false;
            s.stages[size_t(i)].draining = false;
            ++s.role_switch_failures;
          });
}

// Every interval: the controller's verdict, and the least loaded stage of
// the role that gives one up.
void control_pd(router_pointer self) {
  auto& s = self->state;
  if (!s.pd || Clock::now() < s.next_pd_decision) return;
  s.next_pd_decision = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(s.pd->config().interval_s));
  int32_t prefills = 0, decoders = 0;
  for (const auto& st : s.stages) {
    if (!st.alive || st.draining) continue;
    prefills += st.kind == ActorKind::prefill;
    decoders += st.kind == ActorKind::decode;
  }
  const auto now = Clock::now();
  for (const auto& [id, p] : s.pending) {
    if (p.generated.empty()) s.pd->observe_waiting(std::chrono::duration<double>(now - p.admitted_at).count());
    else if (p.last_token_stage >= 0) s.pd->observe_stalled(std::chrono::duration<double>(now - p.last_token).count());
  }
  // What the live prefill stages prefill per second together, as measured;
  // one not measured yet (say, just switched) counts at the others' mean.
  double rate = 0;
  int32_t measured = 0, unmeasured = 0;
  for (int32_t i = 0; i < int32_t(s.stages.size()); ++i) {
    const auto& st = s.stages[size_t(i)];
    if (!st.alive || st.draining || st.kind != ActorKind::prefill) continue;
    if (auto r = s.slo.prefill_rate(i)) {
      rate += *r;
      ++measured;
    } else {
      ++unmeasured;
    }
  }
  s.pd->observe_prefill_capacity(measured > 0 ? rate + rate / measured * unmeasured : 0);
  const RoleMove m = s.pd->decide(seconds_since_start(s), prefills, decoders);
  ++s.pd_decisions;
  if (m == RoleMove::none || s.switching) return;
  const ActorKind from = m == RoleMove::to_prefill ? ActorKind::decode : ActorKind::prefill;
  int32_t pick = -1;
  for (int32_t i = 0; i < int32_t(s.stages.size()); ++i) {
    const auto& st = s.stages[size_t(i)];
    if (st.alive && !st.draining && st.kind == from &&
        (pick < 0 || st.in_flight < s.stages[size_t(pick)].in_flight))
      pick = i;
  }
  if (pick < 0) return;
  s.pd->moved(seconds_since_start(s));
  switch_role(self, pick);
}

// The tick's period, or less when a controller's next decision comes
// sooner: an interval_s under the period is kept, not rounded up to it.
Clock::duration next_tick(const RouterState& s) {
  Clock::duration d = kTickInterval;
  const auto now = Clock::now();
  if (s.pd) d = std::min(d, s.next_pd_decision - now);
  if (s.scaler) d = std::min(d, s.next_scale_decision - now);
  return std::max<Clock::duration>(d, std::chrono::milliseconds(1));
}

// Autoscale: every interval the controllers say how many entry stages (and,
// with encode_ms, vision encoders) take new work, within the shared budget
// (max_active); the rest are parked (what they hold finishes there).
// Between decisions only the floors are kept up (one went down). Unparks
// the cheapest first (then the oldest), parks the least loaded.
void control_autoscale(router_pointer self) {
  auto& s = self->state;
  if (!s.scaler) return;
  const double now = seconds_since_start(s);
  std::vector<int32_t> stage_at, encoder_at;
  std::vector<ScaleUnit> stages, encoders;
  for (int32_t i = 0; i < int32_t(s.stages.size()); ++i) {
    const auto& st = s.stages[size_t(i)];
    if (!st.alive || st.draining || !st.entry) continue;
    stage_at.push_back(i);
    stages.push_back({st.parked, st.in_flight, st.cost});
  }
  for (int32_t i = 0; s.encoder_scaler && i < int32_t(s.encoders.size()); ++i) {
    const auto& e = s.encoders[size_t(i)];
    if (!e.alive) continue;
    encoder_at.push_back(i);
    encoders.push_back({e.parked, e.in_flight, 1.0});
  }
  auto side = [](const std::vector<ScaleUnit>& units, int32_t min) {
    int32_t active = 0;
    for (const ScaleUnit& u : units) active += !u.parked;
    const int32_t floor = std::min(min, int32_t(units.size()));
    return std::pair<int32_t, ScaleSide>{active, ScaleSide{std::max(active, floor), floor, 0}};
  };
  auto [n_stages, stage_side] = side(stages, s.scaler->config().min_stages);
  auto [n_encoders, encoder_side] = side(encoders, s.scaler->config().min_encoders);
  const double dt = std::max(0.0, now - s.scaled_until);
  s.stage_seconds += double(n_stages) * dt;
  s.encoder_seconds += double(n_encoders) * dt;
  s.scaled_until = now;
  if (Clock::now() >= s.next_scale_decision) {
    s.next_scale_decision = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(s.scaler->config().interval_s));
    stage_side.target = s.scaler->decide(now, n_stages, int32_t(stages.size()));
    stage_side.pressure = s.scaler->pressure();
    if (s.encoder_scaler) {
      encoder_side.target = s.encoder_scaler->decide(now, n_encoders, int32_t(encoders.size()));
      encoder_side.pressure = s.encoder_scaler->pressure();
      fit_budget(stage_side, encoder_side, s.scaler->config().max_active);
    }
  }
  const ScaleSteps stage_steps = apply_scale_target(stages, stage_side.target);
  s.scale_ups += uint64_t(stage_steps.ups);
  s.scale_downs += uint64_t(stage_steps.downs);
  for (size_t k = 0; k < stages.size(); ++k) s.stages[size_t(stage_at[k])].parked = stages[k].parked;
  if (!s.encoder_scaler) return;
  const ScaleSteps encoder_steps = apply_scale_target(encoders, encoder_side.target);
  s.encoder_ups += uint64_t(encoder_steps.ups);
  s.encoder_downs_scaled += uint64_t(encoder_steps.downs);
  for (size_t k = 0; k < encoders.size(); ++k) s.encoders[size_t(encoder_at[k])].parked = encoders[k].parked;
}

// Drained stages take nothing new; each request on one is dropped there and
// placed again elsewhere, as if the stage had gone down (same tokens: the
// new stage continues after those the router has; KV from the store).
caf::result<uint64_t> drain(router_pointer self, const std::vector<stage_actor>& stages) {
  auto& s = self->state;
  std::vector<int32_t> which;
  for (const stage_actor& h : stages)
    for (int32_t i = 0; i < int32_t(s.stages.size()); ++i)
      if (s.stages[size_t(i)].addr == h.address() && s.stages[size_t(i)].alive && !s.stages[size_t(i)].draining)
        which.push_back(i);
  for (int32_t i : which) s.stages[size_t(i)].draining = true;
  control_autoscale(self);  // parked stages take the drained ones' places
  for (bool entry : {true, false}) {
    bool had = false;
    for (int32_t i : which) had |= entry ? s.stages[size_t(i)].entry : s.stages[size_t(i)].cont;
    if (!had || any_alive(s, entry)) continue;
    for (int32_t i : which) s.stages[size_t(i)].draining = false;
    return to_error(Status(Code::unavailable,
                           std::string("draining would leave no live ") +
                               (entry ? (s.config.disaggregated ? "prefill" : "stage") : (s.config.disaggregated ? "decode" : "stage")) +
                               " actor to serve requests"));
  }
  s.drained_stages += which.size();
  return move_off(self, which);
}

}  // namespace router_detail
}  // namespace cleave::actors
