// The adaptive prefill:decode ratio: a plain class (no CAF) the router asks
// every interval whether to move one stage between the roles, unit-tested
// on tables (tests/actors/test_pd_controller.cpp).
//
// It compares the TTFT and TPOT measured over the last interval (the means
// of what the router saw: admission to first token, gaps between a
// request's tokens) with their goals. Prefill is short when TTFT is over
// its goal and further over it than TPOT is over its own (by `margin`);
// decode when the reverse. The token gaps are every gap the client sees,
// the hand-off's too: a decode side whose rows are all taken shows as
// hand-offs that wait (the gap from the prefill's first token to the
// decoder's next), not as slower steps. A verdict must hold for `confirm` intervals in a
// row, no move comes within `cooldown_s` of the last one (hysteresis: the
// ratio does not flap), and neither role falls below one stage. An interval
// without samples of a kind counts that kind as on target. A prefill stage
// goes to decode only when the prefill side keeps room without it: the
// fraction of prefill stages busy as requests arrived (which, for arrivals
// at random, is the time-average), times P / (P - 1), at most
// kPrefillBusyAfterMove; otherwise a TPOT miss in a prompt-heavy load would
// be traded for a backlog of prompts.
//
// The prefill side's load: the prompt tokens that arrived over the interval
// per second, over what the live prefill stages measured they prefill per
// second (SloPredictor::prefill_rate, summed). It reads a shift to longer
// prompts from the arrivals themselves, before any request has waited: a
// load above 1 is a queue that grows, so it counts as TTFT pressure, and
// from kPrefillOverload on the move to prefill needs no confirming
// interval and is not held by the cooldown (a queue growing by a quarter of
// the side's rate is not noise, and no flap: the room check below left the
// side at most kPrefillBusyAfterMove loaded after a move to decode).
// The room check then also needs load x P / (P - 1) <= kPrefillBusyAfterMove.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace cleave {

struct PdControllerConfig {
  double ttft_ms = 0, tpot_ms = 0;  // the goals; 0 = none (the controller is off when both are)
  double interval_s = 1.0;          // how often the router asks
  int32_t confirm = 3;              // intervals a verdict must hold
  double cooldown_s = 5.0;          // after a move, none for this long
  double margin = 0.25;             // how much further over its goal one side must be
  // A switching stage first finishes what it holds, this long at most;
  // what is left then moves to stages of its role (recomputed or read from
  // the store there). 0: moves at once.
  double switch_grace_s = 2.0;

  bool enabled() const { return ttft_ms > 0 || tpot_ms > 0; }
};

// invalid_argument naming the field: goals finite and >= 0 (one > 0),
// interval_s in (0, 3600], confirm in 1..1000, cooldown_s in [0, 86400],
// margin in [0, 10], switch_grace_s in [0, 3600].
Status validate_pd_controller(const PdControllerConfig& c);

enum class RoleMove { none, to_prefill, to_decode };
const char* role_move_name(RoleMove m);

class PdController {
 public:
  explicit PdController(PdControllerConfig config) : config_(config) {}
  const PdControllerConfig& config() const { return config_; }

  // The busy fraction of the prefill side a request saw as it arrived
  // (prefill stages holding work / prefill stages).
  static constexpr double kPrefillBusyAfterMove = 0.9;
  // Prefill load from which a move to prefill is made without confirming.
  static constexpr double kPrefillOverload = 1.25;

  void observe_ttft(double seconds);
  void observe_tpot(double seconds);
  void observe_prefill_busy(double fraction);
  // A request still waiting for its first token, `seconds` after its
  // admission: its TTFT is at least that, so once past the goal it counts
  // as a TTFT sample now (a growing queue shows at once, not as it drains);
  // below the goal it says nothing yet and is dropped.
  void observe_waiting(double seconds);
  // A request that has its first token and has waited `seconds` since its
  // last one (its next may wait on a decode stage with no free row): once
  // past the TPOT goal that gap is at least that, so it counts as a TPOT
  // sample now, as observe_waiting does for TTFT; below the goal it is
  // dropped.
  void observe_stalled(double seconds);
  // A request with this many prompt tokens to prefill arrived.
  void observe_arrival(int64_t prompt_tokens);
  // Prompt tokens per second the live prefill stages prefill together, as
  // measured; 0 = not measured yet (no load is computed). Set before decide().
  void observe_prefill_capacity(double tokens_per_s);
  // At time `now` (seconds, any one clock), with this many live stages of
  // each role: the move to make now. Ends the interval (its samples go).
  // The caller reports a move it made with moved().
  RoleMove decide(double now, int32_t prefills, int32_t decoders);
  void moved(double now);

  // The last interval's pressures (measured / goal; 0 without samples) and
  // mean prefill busy fraction (-1 without samples).
  double ttft_pressure() const { return last_ttft_; }
  double tpot_pressure() const { return last_tpot_; }
  double prefill_busy() const { return last_busy_; }
  // The last interval's prefill load (-1 without a measured capacity).
  double prefill_load() const { return last_load_; }

 private:
  PdControllerConfig config_;
  double ttft_sum_ = 0, tpot_sum_ = 0, busy_sum_ = 0;
  int64_t ttft_n_ = 0, tpot_n_ = 0, busy_n_ = 0;
  double last_ttft_ = 0, last_tpot_ = 0, last_busy_ = -1, last_load_ = -1;
  double arrived_tokens_ = 0, capacity_ = 0, last_now_ = 0;
  bool decided_ = false;
  RoleMove streak_move_ = RoleMove::none;
  int32_t streak_ = 0;
  double cooldown_until_ = -1e300;
};

}  // namespace cleave
