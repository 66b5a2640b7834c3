// The router's placement (router_actor.cpp): which stages serve a role,
// what the policy sees of them (KV pool holdings, cost_aware predictions),
// and putting a request on the one it picks.
#include "actors/router_state.h"

#include <algorithm>
#include <vector>

#include "actors/stage_core.h"
#include "schema/codec.h"

namespace cleave::actors {
namespace {

using namespace router_detail;

// A stage that takes work of the role: alive, not drained.
bool serves(const RouterState::Stage& st, bool entry) {
  return st.alive && !st.draining && !st.parked && (entry ? st.entry : st.cont);
}

// The prompt's block keys, as the stages' engines name them (KV pool only).
std::vector<BlockKey> pool_keys(const RouterState& s, const GenerateRequest& r) {
  if (!s.config.kv_index) return {};
  return resume_kv_keys(r.prompt, {}, s.config.model_fingerprint, s.config.kv_layout, image_key_spans(r));
}

// The live stages of the role, as the policy sees them: with a KV pool,
// what each one's store holds of `keys` and what the pool holds anywhere.
std::vector<Candidate> candidates(const RouterState& s, bool entry, const std::vector<BlockKey>& keys) {
  std::vector<Candidate> out;
  int32_t any = 0;
  if (!keys.empty()) {
    auto runs = s.config.kv_index->leading_runs(keys);
    if (!runs.empty()) any = runs.front().second;
  }
  for (int32_t i = 0; i < int32_t(s.stages.size()); ++i) {
    const auto& st = s.stages[size_t(i)];
    if (!serves(st, entry)) continue;
    Candidate c{i, st.in_flight, st.load_blocks};
    c.cost = st.cost;
    if (any > 0 && st.store) {
      c.pool_local = s.config.kv_index->leading_run(pool_holder_name(st.store.address()), keys);
      c.pool_any = any;
    }
    out.push_back(c);
  }
  return out;
}

// A request with a cost budget (cost_budget.h): what the rest of it is
// predicted to cost on each candidate, and what is left of the budget. An
// entry candidate is priced with the decode that follows it (itself when
// colocated, the cheapest decoder in P/D); a hand-off with what its
// prefill was predicted to cost already spent.
void predict_cost(const RouterState& s, const RouterState::Pending& p, bool entry,
                  const std::vector<int32_t>& peers, PlacementRequest& r, std::vector<Candidate>& cs) {
  const GenerateRequest& q = p.request;
  const int64_t tokens = decode_tokens(q, int64_t(p.generated.size()));
  std::optional<double> follow;  // P/D entry: the cheapest decoder that would follow
  if (entry && s.config.disaggregated)
    if (auto d = cheapest_decode(s.slo, cost_stages(s, false), tokens)) follow = d->first;
  for (Candidate& c : cs) {
    const CostStage cs_i = cost_stage(s, c.stage);
    std::optional<double> cost;
    if (entry) {
      const auto pre = prefill_cost(s.slo, cs_i, int64_t(q.prompt.size()), peers);
      const auto dec = s.config.disaggregated ? follow : decode_cost(s.slo, cs_i, tokens, peers);
      if (pre && dec) cost = *pre + *dec;
    } else {
      cost = decode_cost(s.slo, cs_i, tokens, peers);
    }
    c.predicted_cost = cost.value_or(-1);
  }
  // Over budget already: every candidate is over what is left, so the cheapest is taken.
  r.max_cost = entry ? q.max_cost : std::max(q.max_cost - p.cost_spent, 1e-12);
}

// cost_aware: the request's predicted seconds on each candidate (TTFT on an
// entry stage, TPOT on a continuing one) and the most it may take there.
void predict(const RouterState& s, const RouterState::Pending& p, bool entry, PlacementRequest& r,
             std::vector<Candidate>& cs) {
  const std::vector<int32_t> peers = live_stages(s, entry);
  const GenerateRequest& q = p.request;
  for (Candidate& c : cs) {
    const auto t = entry ? s.slo.estimate_ttft(c.stage, int64_t(q.prompt.size()), peers)
                         : s.slo.estimate_tpot(c.stage, peers);
    c.predicted_s = t.value_or(-1);
  }
  const double elapsed_ms = std::chrono::duration<double, std::milli>(Clock::now() - p.admitted_at).count();
  r.limit_s = placement_limit_s(q, entry, elapsed_ms, int64_t(p.generated.size()));
  if (q.max_cost > 0) predict_cost(s, p, entry, peers, r, cs);
}

// The chosen stage's store starts fetching the prompt blocks other stores
// hold before the stage asks for them (it may be busy with a step).
void preload(router_pointer self, const RouterState::Stage& st, const std::vector<BlockKey>& keys) {
  auto& s = self->state;
  if (keys.empty() || !st.store || !s.config.kv_preload) return;
  const int32_t local = s.config.kv_index->leading_run(pool_holder_name(st.store.address()), keys);
  auto runs = s.config.kv_index->leading_runs(keys);
  if (runs.empty() || runs.front().second <= local) return;
  msg::KvGet get;
  get.keys.assign(keys.begin() + local, keys.begin() + runs.front().second);
  ++s.preloads;
  s.preload_blocks += get.keys.size();
  self->send(st.store, kv_preload_atom::value, codec::encode(get));
}

}  // namespace

namespace router_detail {

// The live stages of the role, by index.
std::vector<int32_t> live_stages(const RouterState& s, bool entry) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < int32_t(s.stages.size()); ++i)
    if (serves(s.stages[size_t(i)], entry)) out.push_back(i);
  return out;
}

CostStage cost_stage(const RouterState& s, int32_t i) {
  const auto& st = s.stages[size_t(i)];
  return CostStage{i, st.cost, st.in_flight};
}

std::vector<CostStage> cost_stages(const RouterState& s, bool entry) {
  std::vector<CostStage> out;
  for (int32_t i : live_stages(s, entry)) out.push_back(cost_stage(s, i));
  return out;
}

bool any_alive(const RouterState& s, bool entry) {
  for (const auto& st : s.stages)
    if (serves(st, entry)) return true;
  return false;
}

// Places the pending request on a live stage of the role; -1 when none.
int32_t place_on_stage(router_pointer self, RouterState::Pending& p, bool entry) {
  auto& s = self->state;
  PlacementPolicy& policy = entry ? *s.entry_policy : *s.continue_policy;
  PlacementRequest r = placement_request(p.request, s.config.block_size);
  // Hand-offs stream their KV from the prefill: only new requests use the pool.
  const std::vector<BlockKey> keys = entry ? pool_keys(s, p.request) : std::vector<BlockKey>{};
  std::vector<Candidate> cs = candidates(s, entry, keys);
  if (s.predict_placement) predict(s, p, entry, r, cs);
  if (entry && s.pd) {
    // What this arrival sees of the prefill side (pd_controller.h).
    int32_t prefills = 0, busy = 0;
    for (const auto& st : s.stages)
      if (st.alive && !st.draining && st.kind == ActorKind::prefill) {
        ++prefills;
        busy += st.in_flight > 0;
      }
    if (prefills > 0) s.pd->observe_prefill_busy(double(busy) / double(prefills));
    // A first placement only: a re-placed request arrived once already.
    if (!p.arrival_counted) {
      s.pd->observe_arrival(int64_t(p.request.prompt.size()));
      ++s.pd_arrivals;
      p.arrival_counted = true;
    }
  }
  const int32_t i = policy.pick(r, cs);
  if (i < 0) return i;
  if (entry && p.request.max_cost > 0 && s.config.disaggregated)
    p.cost_spent =
        prefill_cost(s.slo, cost_stage(s, i), int64_t(p.request.prompt.size()), live_stages(s, true)).value_or(0);
  policy.placed(r, i);
  p.stage = i;
  p.load_blocks = r.load_blocks;
  ++s.stages[size_t(i)].in_flight;
  s.stages[size_t(i)].load_blocks += r.load_blocks;
  preload(self, s.stages[size_t(i)], keys);
  return i;
}

void leave_stage(RouterState& s, RouterState::Pending& p) {
  if (p.stage < 0) return;
  auto& st = s.stages[size_t(p.stage)];
  if (st.in_flight > 0) --st.in_flight;
  st.load_blocks = std::max<int64_t>(0, st.load_blocks - p.load_blocks);
  p.load_blocks = 0;
}

}  // namespace router_detail
}  // namespace cleave::actors
