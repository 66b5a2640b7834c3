// Early rejection (Mooncake's): the router predicts a new request's TTFT
// and TPOT from what it measures and refuses, at admission, a request whose
// goals (GenerateRequest::ttft_target_ms, tpot_target_ms, deadline_ms)
// cannot be met, instead of serving it late. A plain class (no CAF),
// unit-tested on tables (tests/actors/test_slo_predictor.cpp).
//
// Per entry stage (prefill / colocated) it keeps the prompt tokens placed on
// it and not yet answered with a first token, and its measured prefill rate:
// prompt tokens answered over the seconds the stage had at least one such
// request outstanding (decayed sums, so the rate follows the load; the
// requests of one batched prefill, answered within kSameStepS of each other,
// are one sample and share its busy time). A request's TTFT on a stage is predicted
// as (queued prompt tokens + its own) / rate. Per continuing stage (decode /
// colocated) it keeps an EWMA of the gap between a request's consecutive
// tokens on that stage: the TPOT predicted for a request placed there.
//
// A goal is checked against the best live stage of each role (the
// request cannot meet it anywhere). A stage with nothing measured yet
// predicts nothing: while no stage of a role has a measurement, the goals
// that need it are not checked (a cold server admits). deadline_ms counts
// TTFT + (max_tokens - 1) x TPOT, the TPOT term only once one is measured.
// Encoding images is not predicted.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "model/request.h"

namespace cleave {

// The most seconds cost_aware placement lets the request take on one stage
// (PlacementRequest::limit_s): on an entry stage its TTFT goal, on a
// continuing one its TPOT goal, each capped by what is left of its deadline
// (elapsed_ms after admission) over the tokens still to come (`generated`
// so far of max_tokens; 1 for the first token). 0 = no goal; a deadline
// already past gives 1e-9 (no stage meets it: the fastest is chosen).
double placement_limit_s(const GenerateRequest& r, bool entry, double elapsed_ms, int64_t generated);

class SloPredictor {
 public:
  // decay: the weight an older sample keeps against a new one (0..1).
  explicit SloPredictor(double decay = 0.8);

  // Request `id` with `prompt_tokens` to prefill was placed on entry stage
  // `stage` at time `t` (seconds on any one clock). Placing it again (a
  // re-placement) moves it.
  void placed(int32_t stage, uint64_t id, int64_t prompt_tokens, double t);
  // Its first token arrived at `t`: one prefill-rate sample for its stage.
  void first_token(uint64_t id, double t);
  // It left before its first token (failed, cancelled): no sample.
  void forget_request(uint64_t id, double t);
  // A token of a request on continuing stage `stage`, `gap` seconds after
  // its previous token on that stage.
  void token_gap(int32_t stage, double gap);
  // The stage went down: what it measured and what was queued on it go.
  void forget_stage(int32_t stage, double t);

  // Predicted seconds to the first token of `prompt_tokens` placed on
  // `stage` now; none while the stage's rate is unmeasured.
  std::optional<double> ttft(int32_t stage, int64_t prompt_tokens) const;
  // Predicted seconds per output token on `stage`; none while unmeasured.
  std::optional<double> tpot(int32_t stage) const;
  // Prompt tokens queued on `stage` (placed, no first token yet).
  int64_t queued_tokens(int32_t stage) const;
  // Measured prefill tokens per second of `stage`; none while unmeasured.
  std::optional<double> prefill_rate(int32_t stage) const;
  // For placement (cost_aware): ttft / tpot on `stage`, or, while it is
  // unmeasured, at the mean prefill rate (mean TPOT) of the measured stages
  // among `peers` (its queue still counts); none while none is measured.
  std::optional<double> estimate_ttft(int32_t stage, int64_t prompt_tokens,
                                      const std::vector<int32_t>& peers) const;
  // The measured prefill rate of `stage`, or while it is unmeasured the
  // mean of the measured ones among `peers`; none while none is measured.
  std::optional<double> estimate_prefill_rate(int32_t stage, const std::vector<int32_t>& peers) const;
  std::optional<double> estimate_tpot(int32_t stage, const std::vector<int32_t>& peers) const;

  // ok when every goal of `r` can be met on some stage of `entry` (TTFT) and
  // of `continuing` (TPOT), or cannot be predicted; else Code::rejected
  // naming the goal, its value and the prediction.
  Status check(const GenerateRequest& r, const std::vector<int32_t>& entry,
               const std::vector<int32_t>& continuing) const;

 private:
  struct Entry {
    int64_t queued_tokens = 0;
    int32_t queued = 0;
    double since = 0;         // when the busy time was last counted
    double tokens = 0, busy = 0;  // decayed sums: answered prompt tokens, busy seconds
    double pending_busy = 0;  // busy seconds since the last sample
    double last_busy = 0;     // busy seconds of the last step's sample
  };
  // An answer within this long of the previous one (and within this share
  // of that step's busy time) belongs to the same batched step.
  static constexpr double kSameStepS = 5e-4;
  static constexpr double kSameStepFraction = 0.1;
  struct Queued {
    int32_t stage;
    int64_t tokens;
  };
  Entry& entry(int32_t stage);
  void count_busy(Entry& e, double t);
  void leave(uint64_t id, double t, bool sample);

  double decay_;
  std::unordered_map<int32_t, Entry> entries_;
  std::unordered_map<int32_t, double> tpot_;  // EWMA gap per continuing stage
  std::unordered_map<uint64_t, Queued> queued_;
};

}  // namespace cleave
