#include "actors/scale_controller.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace cleave {

Status validate_autoscale(const AutoscaleConfig& c) {
  auto bad = [](const std::string& what) { return Status(Code::invalid_argument, "autoscale: " + what); };
  auto num = [](double v) { return std::to_string(v); };
  if (!std::isfinite(c.ttft_ms) || !(c.ttft_ms > 0) || c.ttft_ms > 1e9)
    return bad("ttft_ms must be above 0 and at most 1e9 ms, got " + num(c.ttft_ms));
  if (c.min_stages < 1 || c.min_stages > 4096)
    return bad("min_stages must be 1 to 4096, got " + std::to_string(c.min_stages));
  if (!(c.interval_s > 0) || !(c.interval_s <= 3600))
    return bad("interval_s must be above 0 and at most 3600, got " + num(c.interval_s));
  if (c.confirm < 1 || c.confirm > 1000) return bad("confirm must be 1 to 1000, got " + std::to_string(c.confirm));
  if (!(c.cooldown_s >= 0) || !(c.cooldown_s <= 86400))
    return bad("cooldown_s must be 0 to 86400, got " + num(c.cooldown_s));
  if (!(c.low >= 0) || !(c.low < 1)) return bad("low must be at least 0 and below 1, got " + num(c.low));
  if (c.forecast != "none" && c.forecast != "holt")
    return bad("forecast must be \"none\" or \"holt\", got \"" + c.forecast.substr(0, 64) + "\"");
  const AutoscaleConfig d;
  if (c.encoder_rps != d.encoder_rps) {
    if (!c.encoders() || !c.holt())
      return bad("encoder_rps needs encode_ms and forecast = \"holt\" (it is the encoders' forecast)");
    if (!(c.encoder_rps > 0) || !(c.encoder_rps <= 1e6))
      return bad("encoder_rps (image requests/s one encoder serves) must be above 0 and at most 1e6, got " +
                 num(c.encoder_rps));
  }
  if (!c.encoders()) {
    if (c.encode_ms != 0) return bad("encode_ms must be above 0 and at most 1e9 ms, got " + num(c.encode_ms));
    if (c.min_encoders != d.min_encoders) return bad("min_encoders needs encode_ms (the encoders' goal)");
    if (c.max_active != d.max_active) return bad("max_active needs encode_ms (the encoders' goal)");
  } else {
    if (!std::isfinite(c.encode_ms) || c.encode_ms > 1e9)
      return bad("encode_ms must be above 0 and at most 1e9 ms, got " + num(c.encode_ms));
    if (c.min_encoders < 1 || c.min_encoders > 4096)
      return bad("min_encoders must be 1 to 4096, got " + std::to_string(c.min_encoders));
    if (c.max_active != 0 && (c.max_active < c.min_stages + c.min_encoders || c.max_active > 8192))
      return bad("max_active must be 0 (no budget) or from min_stages + min_encoders (" +
                 std::to_string(c.min_stages + c.min_encoders) + ") to 8192, got " + std::to_string(c.max_active));
  }
  if (!c.holt()) {
    for (auto [name, v, dv] : {std::tuple<const char*, double, double>{"stage_rps", c.stage_rps, d.stage_rps},
                               {"horizon_s", c.horizon_s, d.horizon_s},
                               {"alpha", c.alpha, d.alpha},
                               {"beta", c.beta, d.beta}})
      if (v != dv) return bad(std::string(name) + " needs forecast = \"holt\"");
    return Status::Ok();
  }
  if (!(c.stage_rps > 0) || !(c.stage_rps <= 1e6))
    return bad("forecast \"holt\" needs stage_rps (requests/s one stage serves) above 0 and at most 1e6, got " +
               num(c.stage_rps));
  if (!(c.horizon_s >= 0) || !(c.horizon_s <= 86400))
    return bad("horizon_s must be 0 to 86400, got " + num(c.horizon_s));
  for (auto [name, v] : {std::pair<const char*, double>{"alpha", c.alpha}, {"beta", c.beta}})
    if (!(v > 0) || !(v <= 1)) return bad(std::string(name) + " must be above 0 and at most 1, got " + num(v));
  return Status::Ok();
}

AutoscaleConfig AutoscaleConfig::encoder_config() const {
  AutoscaleConfig e;
  e.ttft_ms = encode_ms;
  e.min_stages = min_encoders;
  e.interval_s = interval_s;
  e.confirm = confirm;
  e.cooldown_s = cooldown_s;
  e.low = low;
  if (encoder_rps > 0) {
    e.forecast = "holt";
    e.stage_rps = encoder_rps;
    e.horizon_s = horizon_s;
    e.alpha = alpha;
    e.beta = beta;
  }
  return e;
}

void fit_budget(ScaleSide& stages, ScaleSide& encoders, int32_t budget) {
  if (budget <= 0) return;
  while (stages.target + encoders.target > budget) {
    const bool stages_can = stages.target > stages.floor, encoders_can = encoders.target > encoders.floor;
    if (!stages_can && !encoders_can) return;
    const bool cut_stages = stages_can && (!encoders_can || stages.pressure <= encoders.pressure);
    --(cut_stages ? stages : encoders).target;
  }
}

ScaleSteps apply_scale_target(std::vector<ScaleUnit>& units, int32_t target) {
  ScaleSteps steps;
  int32_t active = 0;
  for (const ScaleUnit& u : units) active += !u.parked;
  while (active < target) {
    ScaleUnit* best = nullptr;
    for (ScaleUnit& u : units)
      if (u.parked && (!best || u.cost < best->cost)) best = &u;
    if (!best) break;
    best->parked = false;
    ++active;
    ++steps.ups;
  }
  while (active > target) {
    ScaleUnit* idle = nullptr;
    for (ScaleUnit& u : units)
      if (!u.parked && (!idle || u.in_flight < idle->in_flight)) idle = &u;
    if (!idle) break;
    idle->parked = true;
    --active;
    ++steps.downs;
  }
  return steps;
}

void HoltForecast::update(double x) {
  if (!started_) {
    level_ = x;
    trend_ = 0;
    started_ = true;
    return;
  }
  const double prev = level_;
  level_ = alpha_ * x + (1 - alpha_) * (level_ + trend_);
  trend_ = beta_ * (level_ - prev) + (1 - beta_) * trend_;
}

double HoltForecast::forecast(double steps) const { return std::max(0.0, level_ + steps * trend_); }

ScaleController::ScaleController(AutoscaleConfig config)
    : config_(std::move(config)), holt_(config_.alpha, config_.beta) {}

void ScaleController::observe_ttft(double s) {
  if (!(s >= 0)) return;
  ttft_sum_ += s;
  ++ttft_n_;
}

int32_t ScaleController::decide(double now, int32_t active, int32_t available) {
  // The interval is the time since the last decision (the first: interval_s).
  const double dt = decided_ ? std::max(now - last_now_, 1e-6) : config_.interval_s;
  last_now_ = now;
  decided_ = true;
  rate_ = double(arrivals_) / dt;
  pressure_ = ttft_n_ > 0 ? ttft_sum_ / double(ttft_n_) * 1e3 / config_.ttft_ms : 0;
  const bool quiet = ttft_n_ == 0 && arrivals_ == 0;
  arrivals_ = 0;
  ttft_sum_ = 0;
  ttft_n_ = 0;

  forecast_ = rate_;
  needed_ = 0;
  if (config_.holt()) {
    holt_.update(rate_);
    forecast_ = std::max(holt_.level(), holt_.forecast(config_.horizon_s / dt));
    needed_ = int32_t(std::min(4096.0, std::ceil(forecast_ / config_.stage_rps - 1e-9)));
  }

  up_streak_ = pressure_ > 1 ? up_streak_ + 1 : 0;
  down_streak_ = (quiet || pressure_ < config_.low) ? down_streak_ + 1 : 0;

  const int32_t floor = std::min(config_.min_stages, available);
  int32_t target = std::clamp(active, floor, available);
  if (up_streak_ >= config_.confirm) {
    target = std::min(available, std::max(target, active + 1));
    up_streak_ = 0;
  }
  if (config_.holt() && needed_ > target) target = std::min(available, needed_);
  if (target == active && down_streak_ >= config_.confirm && now >= no_down_until_ &&
      (!config_.holt() || needed_ < active))
    target = std::max(floor, active - 1);
  if (target < active) down_streak_ = 0;
  if (target != active) no_down_until_ = now + config_.cooldown_s;
  return target;
}

}  // namespace cleave
