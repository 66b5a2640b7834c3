// Private to the router's files (it includes CAF): the router's state, and
// the functions one of them defines and another calls. router_actor.cpp
// holds the behaviour and a request's way from admission to its end,
// router_placement.cpp which stages serve and putting a request on one,
// router_control.cpp the P:D role switches, autoscale and drain.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "actors/actor_types.h"
#include "actors/cost_budget.h"
#include "actors/slo_predictor.h"

namespace cleave::actors::router_detail {

struct RouterState {
  struct Stage {
    stage_actor handle;
    caf::actor_addr addr;
    ActorKind kind = ActorKind::colocated;
    bool entry = false, cont = false;  // takes new requests / handoffs
    bool alive = true;
    bool draining = false;  // drained (or switching roles): alive, takes nothing new
    bool parked = false;    // autoscale: alive, takes nothing new until unparked
    int32_t in_flight = 0;
    int64_t load_blocks = 0;  // PlacementRequest::load_blocks of those in flight
    kv_store_actor store;     // its node's store (stage_store), in a KV pool
    double cost = 1.0;        // its node's (cost_aware placement)
    caf::actor_addr kv_sender;  // the kv_sender its hand-offs name (decoders pull from it)
  };
  struct Encoder {
    vision_encoder_actor handle;
    caf::actor_addr addr;
    bool alive = true;
    bool parked = false;  // autoscale of the encoders: alive, takes nothing new until unparked
    int32_t in_flight = 0;
    uint64_t last_given = 0;  // encoder_turn when it was last given images; 0 = never
  };
  uint64_t encoder_turn = 0;
  struct Pending {
    GenerateRequest request;  // kept to re-place it
    std::vector<int32_t> generated;
    int32_t stage = -1;
    int64_t load_blocks = 0;  // what it adds to its stage's load
    int32_t encoder = -1;     // the vision encoder it waits for
    bool continuing = false;  // handed off (or re-placed with tokens)
    bool resumed = false;     // Frontend::resume: continues after `generated` once encoded
    bool arrival_counted = false;  // the P:D controller saw its prompt arrive (once, re-placed or not)
    Clock::time_point admitted_at;  // deadline_ms counts from here
    Clock::time_point language_from;  // admitted, or its embeddings came: the stages' TTFT counts from here
    Clock::time_point encode_started;
    Clock::time_point last_progress;
    Clock::time_point last_token;  // for the TPOT the predictor measures
    int32_t last_token_stage = -1;
    std::string encode_origin;  // reported with the first token
    double encode_seconds = 0;
    double cost_spent = 0;  // max_cost: its prefill's predicted cost, placed in P/D
  };
  RouterConfig config;
  std::shared_ptr<EventSinks> sinks;
  kv_store_actor kv;
  bool kv_alive = true;
  bool closed = false;
  std::vector<Stage> stages;
  std::vector<Encoder> encoders;
  std::unordered_map<uint64_t, Pending> pending;
  // stage_store messages that came before their stage's attach.
  std::unordered_map<caf::actor_addr, kv_store_actor> early_stores;
  // One policy for new requests (prefill / colocated), one for hand-offs
  // (decode / colocated): each learns from its own placements.
  std::unique_ptr<PlacementPolicy> entry_policy, continue_policy;
  bool predict_placement = false;  // cost_aware: candidates carry predictions
  SloPredictor slo;
  std::unique_ptr<PdController> pd;  // the adaptive P:D ratio, when configured
  Clock::time_point next_pd_decision;
  bool switching = false;            // a role switch is under way
  int32_t switch_stage = -1;         // the stage finishing its requests before it switches
  Clock::time_point switch_deadline;  // then whatever it still holds moves to stages of its role
  std::unique_ptr<ScaleController> scaler;  // autoscale of the entry stages, when configured
  std::unique_ptr<ScaleController> encoder_scaler;  // and of the vision encoders (encode_ms)
  Clock::time_point next_scale_decision;
  double scaled_until = 0;       // stage_seconds counts up to here (seconds_since_start)
  double stage_seconds = 0;      // active entry stages integrated over time
  double encoder_seconds = 0;    // active encoders integrated over time (encoder autoscale)
  uint64_t scale_ups = 0, scale_downs = 0, encoder_ups = 0, encoder_downs_scaled = 0;
  Clock::time_point epoch = Clock::now();
  uint64_t requests = 0, admitted = 0, rejected_busy = 0, rejected_unavailable = 0, rejected_slo = 0;
  uint64_t rejected_cost = 0;  // over their max_cost (cost_budget.h)
  uint64_t cancelled = 0;
  uint64_t resumes = 0;
  uint64_t finished = 0, failed = 0, tokens = 0, handoffs = 0, direct_handoffs = 0, replacements = 0;
  uint64_t stage_downs = 0, timeouts = 0, stray_events = 0, bad_messages = 0;
  uint64_t encodes = 0, encoder_downs = 0, encode_replacements = 0;
  uint64_t preloads = 0, preload_blocks = 0;
  uint64_t drained_stages = 0, migrated = 0;
  uint64_t role_switches = 0, role_switch_failures = 0, to_prefill = 0, to_decode = 0;
  uint64_t pd_decisions = 0;
  uint64_t pd_arrivals = 0;  // prompts the P:D controller counted as arriving
  uint64_t handoffs_rebalanced = 0;  // waiting hand-offs moved to a stage that just switched to decode
  static inline const char* name = "cleave.router";
};
using router_pointer = router_actor::stateful_pointer<RouterState>;

// router_actor.cpp
double seconds_since_start(const RouterState& s);
// A request whose stage is gone or drained goes on elsewhere.
void replace(router_pointer self, uint64_t id);

// router_placement.cpp
std::vector<int32_t> live_stages(const RouterState& s, bool entry);
// Stage i, or the live stages of the role, with their nodes' costs and
// loads (cost_budget.h).
CostStage cost_stage(const RouterState& s, int32_t i);
std::vector<CostStage> cost_stages(const RouterState& s, bool entry);
bool any_alive(const RouterState& s, bool entry);
// Places the pending request on a live stage of the role; -1 when none.
int32_t place_on_stage(router_pointer self, RouterState::Pending& p, bool entry);
void leave_stage(RouterState& s, RouterState::Pending& p);

// router_control.cpp
void finish_switch(router_pointer self);
void control_pd(router_pointer self);
void control_autoscale(router_pointer self);
Clock::duration next_tick(const RouterState& s);
caf::result<uint64_t> drain(router_pointer self, const std::vector<stage_actor>& stages);

}  // namespace cleave::actors::router_detail
