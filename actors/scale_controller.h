// Autoscaling the entry stages (prefill in pd, colocated stages otherwise)
// against a TTFT goal: a plain class (no CAF) the router asks every
// interval how many of its entry stages should take new requests; the
// others are parked (alive, idle, what they hold finishing). Unit-tested on
// tables (tests/actors/test_scale_controller.cpp).
//
// Reactive: the interval's mean TTFT over the goal for `confirm` intervals
// in a row adds a stage; under `low` x goal (or no requests) for `confirm`
// intervals, outside `cooldown_s` of the last step, parks one. A reactive
// controller steps only once TTFT has gone bad, so on a ramp it is late.
// forecast = "holt" adds Holt's linear trend over the arrival rate (level
// and trend smoothed by alpha and beta): the stages the rate forecast
// `horizon_s` ahead needs, at `stage_rps` requests per second each, come up
// before TTFT rises; a step down also needs the forecast to allow it.
//
// Vision encoders scale the same way against their own goal (encode_ms: a
// request's wait for its embeddings, queue and batch included), with a
// second controller (reactive) over image requests. With max_active the
// two share one budget of actors taking work: when together they ask for
// more, the side further under its goal gives way (fit_budget), so
// capacity follows the mix of image and text requests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace cleave {

struct AutoscaleConfig {
  double ttft_ms = 0;        // the goal; 0 = autoscaling off
  int32_t min_stages = 1;    // active entry stages never fewer
  double interval_s = 1.0;   // how often the router asks
  int32_t confirm = 2;       // intervals a reactive verdict must hold
  double cooldown_s = 5.0;   // after a step, no step down for this long
  double low = 0.5;          // park one under low x goal
  std::string forecast = "none";  // "none" (reactive) or "holt"
  double stage_rps = 0;      // holt: requests/s one stage serves within the goal
  double horizon_s = 5.0;    // holt: how far ahead the rate is forecast
  double alpha = 0.5, beta = 0.3;  // holt: level and trend smoothing, in (0, 1]
  double encode_ms = 0;      // the vision encoders' goal; 0 = encoders not scaled
  int32_t min_encoders = 1;  // active encoders never fewer
  int32_t max_active = 0;    // entry stages + encoders taking work at once; 0 = no budget
  // holt with encode_ms: image requests/s one encoder serves within
  // encode_ms; the encoders' controller then forecasts the image arrival
  // rate the same way (0 = the encoders' controller stays reactive).
  double encoder_rps = 0;

  bool enabled() const { return ttft_ms > 0; }
  bool holt() const { return forecast == "holt"; }
  bool encoders() const { return encode_ms > 0; }
  // The encoders' controller: encode_ms as its goal, min_encoders as its
  // floor, the same interval, confirm, cooldown and low; with encoder_rps,
  // Holt's forecast at that rate per encoder (the same horizon, alpha and
  // beta), else reactive.
  AutoscaleConfig encoder_config() const;
  bool operator==(const AutoscaleConfig&) const = default;  // set at all: != AutoscaleConfig{}
};

// invalid_argument naming the field (prefixed "autoscale: "): ttft_ms in
// (0, 1e9], min_stages 1..4096, interval_s in (0, 3600], confirm 1..1000,
// cooldown_s in [0, 86400], low in [0, 1), forecast none|holt, and for
// holt stage_rps in (0, 1e6], horizon_s in [0, 86400], alpha and beta in
// (0, 1]; stage_rps, horizon_s, alpha and beta away from their defaults
// without holt are refused (they would change nothing); encode_ms in
// (0, 1e9] when set, min_encoders 1..4096 and max_active in
// [min_stages + min_encoders, 8192] (or 0), both only with encode_ms;
// encoder_rps in (0, 1e6] only with holt and encode_ms.
Status validate_autoscale(const AutoscaleConfig& c);

// One side of a shared budget: what its controller asks for, its floor and
// how far over its goal it is (mean latency / goal; 0 without samples).
struct ScaleSide {
  int32_t target = 0;
  int32_t floor = 0;
  double pressure = 0;
};
// Cuts the two targets until they sum to at most `budget`, one at a time
// from the side with the lower pressure (stages first on a tie), never
// below a floor: the side further over its goal keeps its capacity.
// budget <= 0: unchanged.
void fit_budget(ScaleSide& stages, ScaleSide& encoders, int32_t budget);

// One alive actor of a scaled kind, as the router sees it.
struct ScaleUnit {
  bool parked = false;
  int32_t in_flight = 0;
  double cost = 1.0;  // its node's (cost_aware); encoders 1
};
struct ScaleSteps {
  int32_t ups = 0, downs = 0;
};
// Parks or unparks units until `target` of them take work: unparks the
// cheapest parked one (the first among equals), parks the least loaded
// active one (the first among equals).
ScaleSteps apply_scale_target(std::vector<ScaleUnit>& units, int32_t target);

// Holt's linear (double exponential) smoothing of one series sampled at
// even steps: level l and trend b; the first sample sets l, b = 0.
class HoltForecast {
 public:
  HoltForecast(double alpha, double beta) : alpha_(alpha), beta_(beta) {}
  void update(double x);
  // The value `steps` samples ahead: l + steps * b (never below 0).
  double forecast(double steps) const;
  double level() const { return level_; }
  double trend() const { return trend_; }
  bool started() const { return started_; }

 private:
  double alpha_, beta_;
  double level_ = 0, trend_ = 0;
  bool started_ = false;
};

class ScaleController {
 public:
  explicit ScaleController(AutoscaleConfig config);
  const AutoscaleConfig& config() const { return config_; }

  void observe_arrival() { ++arrivals_; }
  void observe_ttft(double seconds);
  // At time `now` (seconds, one clock), with `active` entry stages taking
  // requests out of `available` alive ones: how many should. Ends the
  // interval (its samples go). Always within [min(min_stages, available),
  // available].
  int32_t decide(double now, int32_t active, int32_t available);

  // The last interval's readings.
  double rate() const { return rate_; }              // arrivals per second
  double forecast_rate() const { return forecast_; }  // holt: horizon_s ahead (else rate)
  double pressure() const { return pressure_; }      // mean TTFT / goal; 0 without samples
  int32_t needed() const { return needed_; }          // holt: stages the forecast needs (else 0)

 private:
  AutoscaleConfig config_;
  HoltForecast holt_;
  int64_t arrivals_ = 0;
  double ttft_sum_ = 0;
  int64_t ttft_n_ = 0;
  double last_now_ = 0;
  bool decided_ = false;
  double rate_ = 0, forecast_ = 0, pressure_ = 0;
  int32_t needed_ = 0;
  int32_t up_streak_ = 0, down_streak_ = 0;
  double no_down_until_ = -1e300;
};

}  // namespace cleave
