#include "actors/pd_controller.h"

#include <algorithm>
#include <cmath>

namespace cleave {

Status validate_pd_controller(const PdControllerConfig& c) {
  auto bad = [](const std::string& what) { return Status(Code::invalid_argument, "pd_controller: " + what); };
  for (auto [name, v] : {std::pair<const char*, double>{"ttft_ms", c.ttft_ms}, {"tpot_ms", c.tpot_ms}})
    if (!std::isfinite(v) || v < 0 || v > 1e9)
      return bad(std::string(name) + " must be from 0 to 1e9 ms, got " + std::to_string(v));
  if (!c.enabled()) return bad("needs a goal: ttft_ms or tpot_ms above 0");
  if (!(c.interval_s > 0) || !(c.interval_s <= 3600))
    return bad("interval_s must be above 0 and at most 3600, got " + std::to_string(c.interval_s));
  if (c.confirm < 1 || c.confirm > 1000) return bad("confirm must be 1 to 1000, got " + std::to_string(c.confirm));
  if (!(c.cooldown_s >= 0) || !(c.cooldown_s <= 86400))
    return bad("cooldown_s must be 0 to 86400, got " + std::to_string(c.cooldown_s));
  if (!(c.margin >= 0) || !(c.margin <= 10)) return bad("margin must be 0 to 10, got " + std::to_string(c.margin));
  if (!(c.switch_grace_s >= 0) || !(c.switch_grace_s <= 3600))
    return bad("switch_grace_s must be 0 to 3600, got " + std::to_string(c.switch_grace_s));
  return Status::Ok();
}

const char* role_move_name(RoleMove m) {
  switch (m) {
    case RoleMove::to_prefill: return "decode -> prefill";
    case RoleMove::to_decode: return "prefill -> decode";
    case RoleMove::none: break;
  }
  return "none";
}

void PdController::observe_ttft(double s) {
  if (!(s >= 0)) return;
  ttft_sum_ += s;
  ++ttft_n_;
}

void PdController::observe_tpot(double s) {
  if (!(s >= 0)) return;
  tpot_sum_ += s;
  ++tpot_n_;
}

void PdController::observe_waiting(double s) {
  if (config_.ttft_ms > 0 && s * 1e3 > config_.ttft_ms) observe_ttft(s);
}

void PdController::observe_stalled(double s) {
  if (config_.tpot_ms > 0 && s * 1e3 > config_.tpot_ms) observe_tpot(s);
}

void PdController::observe_prefill_busy(double fraction) {
  if (!(fraction >= 0) || !(fraction <= 1)) return;
  busy_sum_ += fraction;
  ++busy_n_;
}

void PdController::observe_arrival(int64_t prompt_tokens) {
  if (prompt_tokens > 0) arrived_tokens_ += double(prompt_tokens);
}

void PdController::observe_prefill_capacity(double tokens_per_s) {
  capacity_ = std::isfinite(tokens_per_s) && tokens_per_s > 0 ? tokens_per_s : 0;
}

RoleMove PdController::decide(double now, int32_t prefills, int32_t decoders) {
  // The interval is the time since the last decision (the first: interval_s).
  const double dt = decided_ ? std::max(now - last_now_, 1e-6) : config_.interval_s;
  last_now_ = now;
  decided_ = true;
  last_ttft_ = config_.ttft_ms > 0 && ttft_n_ > 0 ? ttft_sum_ / double(ttft_n_) * 1e3 / config_.ttft_ms : 0;
  last_tpot_ = config_.tpot_ms > 0 && tpot_n_ > 0 ? tpot_sum_ / double(tpot_n_) * 1e3 / config_.tpot_ms : 0;
  last_busy_ = busy_n_ > 0 ? busy_sum_ / double(busy_n_) : -1;
  last_load_ = capacity_ > 0 ? arrived_tokens_ / dt / capacity_ : -1;
  ttft_sum_ = tpot_sum_ = busy_sum_ = arrived_tokens_ = 0;
  ttft_n_ = tpot_n_ = busy_n_ = 0;
  RoleMove verdict = RoleMove::none;
  const double m = 1 + config_.margin;
  // An overloaded prefill side is TTFT pressure before any request waited.
  const double ttft = std::max(last_ttft_, last_load_);
  // The prefill side without one stage: its busy fraction and its load grow by P / (P - 1).
  const double grow = prefills > 1 ? double(prefills) / double(prefills - 1) : 0;
  const bool prefill_room = prefills > 1 && last_busy_ * grow <= kPrefillBusyAfterMove &&
                            (last_load_ < 0 || last_load_ * grow <= kPrefillBusyAfterMove);
  if (ttft > 1 && ttft > last_tpot_ * m && decoders > 1) verdict = RoleMove::to_prefill;
  else if (last_tpot_ > 1 && last_tpot_ > ttft * m && prefill_room) verdict = RoleMove::to_decode;
  if (verdict != streak_move_) {
    streak_move_ = verdict;
    streak_ = 0;
  }
  if (verdict == RoleMove::none) return verdict;
  ++streak_;
  // An overloaded prefill side is a shift in the arrivals, not noise: a move
  // to decode leaves that side at most kPrefillBusyAfterMove loaded (the room
  // check), so kPrefillOverload after it is new prompts. It moves at once,
  // neither confirmed nor held by the cooldown: a queue growing by a quarter
  // of the side's rate costs more each interval it waits.
  const bool overloaded = verdict == RoleMove::to_prefill && last_load_ >= kPrefillOverload;
  if (!overloaded && (streak_ < config_.confirm || now < cooldown_until_)) return RoleMove::none;
  return verdict;
}

void PdController::moved(double now) {
  cooldown_until_ = now + config_.cooldown_s;
  streak_move_ = RoleMove::none;
  streak_ = 0;
}

}  // namespace cleave
