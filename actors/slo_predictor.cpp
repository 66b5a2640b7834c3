#include "actors/slo_predictor.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace cleave {
namespace {

std::string ms(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f ms", seconds * 1e3);
  return buf;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

double placement_limit_s(const GenerateRequest& r, bool entry, double elapsed_ms, int64_t generated) {
  double limit_ms = entry ? r.ttft_target_ms : r.tpot_target_ms;
  if (r.deadline_ms <= 0) return limit_ms > 0 ? limit_ms / 1e3 : 0;
  const double steps = entry ? 1.0 : double(std::max<int64_t>(1, int64_t(r.sampling.max_tokens) - generated));
  const double share_ms = std::max(r.deadline_ms - elapsed_ms, 0.0) / steps;
  limit_ms = limit_ms > 0 ? std::min(limit_ms, share_ms) : share_ms;
  return limit_ms > 0 ? limit_ms / 1e3 : 1e-9;
}

SloPredictor::SloPredictor(double decay) : decay_(std::clamp(decay, 0.0, 1.0)) {}

SloPredictor::Entry& SloPredictor::entry(int32_t stage) { return entries_[stage]; }

// Busy seconds: the time the stage had at least one prompt outstanding.
void SloPredictor::count_busy(Entry& e, double t) {
  if (e.queued > 0 && t > e.since) e.pending_busy += t - e.since;
  e.since = t;
}

void SloPredictor::placed(int32_t stage, uint64_t id, int64_t prompt_tokens, double t) {
  leave(id, t, false);
  Entry& e = entry(stage);
  count_busy(e, t);
  e.queued_tokens += prompt_tokens;
  ++e.queued;
  queued_[id] = Queued{stage, prompt_tokens};
}

void SloPredictor::leave(uint64_t id, double t, bool sample) {
  auto it = queued_.find(id);
  if (it == queued_.end()) return;
  Entry& e = entry(it->second.stage);
  count_busy(e, t);
  e.queued_tokens -= it->second.tokens;
  --e.queued;
  if (sample) {
    // A batched prefill answers its requests in one step, but their first
    // tokens reach the router as separate messages microseconds apart. Those
    // join the step's sample undecayed: decaying the step's busy time once
    // per message would inflate the rate with the batch's size, and a stage
    // given more requests (bigger batches) would look ever faster.
    const bool same_step =
        e.last_busy > 0 && e.pending_busy <= std::min(kSameStepS, kSameStepFraction * e.last_busy);
    if (same_step) {
      e.tokens += double(it->second.tokens);
      e.busy += e.pending_busy;
    } else {
      e.tokens = e.tokens * decay_ + double(it->second.tokens);
      e.busy = e.busy * decay_ + e.pending_busy;
      e.last_busy = e.pending_busy;
    }
    e.pending_busy = 0;
  }
  queued_.erase(it);
}

void SloPredictor::first_token(uint64_t id, double t) { leave(id, t, true); }

void SloPredictor::forget_request(uint64_t id, double t) { leave(id, t, false); }

void SloPredictor::token_gap(int32_t stage, double gap) {
  if (!(gap >= 0)) return;
  auto [it, fresh] = tpot_.emplace(stage, gap);
  if (!fresh) it->second = it->second * decay_ + gap * (1 - decay_);
}

void SloPredictor::forget_stage(int32_t stage, double) {
  entries_.erase(stage);
  tpot_.erase(stage);
  for (auto it = queued_.begin(); it != queued_.end();)
    it = it->second.stage == stage ? queued_.erase(it) : std::next(it);
}

std::optional<double> SloPredictor::prefill_rate(int32_t stage) const {
  auto it = entries_.find(stage);
  if (it == entries_.end() || it->second.busy <= 0 || it->second.tokens <= 0) return std::nullopt;
  return it->second.tokens / it->second.busy;
}

int64_t SloPredictor::queued_tokens(int32_t stage) const {
  auto it = entries_.find(stage);
  return it == entries_.end() ? 0 : it->second.queued_tokens;
}

std::optional<double> SloPredictor::ttft(int32_t stage, int64_t prompt_tokens) const {
  const auto rate = prefill_rate(stage);
  if (!rate) return std::nullopt;
  return double(queued_tokens(stage) + prompt_tokens) / *rate;
}

std::optional<double> SloPredictor::tpot(int32_t stage) const {
  auto it = tpot_.find(stage);
  if (it == tpot_.end()) return std::nullopt;
  return it->second;
}

// `measure` of `stage`, or while it has none the mean over those `peers` that have one.
template <class Measure>
std::optional<double> own_or_mean(int32_t stage, const std::vector<int32_t>& peers, Measure measure) {
  if (auto v = measure(stage)) return v;
  double sum = 0;
  int n = 0;
  for (int32_t p : peers)
    if (auto v = measure(p)) sum += *v, ++n;
  if (n == 0) return std::nullopt;
  return sum / n;
}

std::optional<double> SloPredictor::estimate_prefill_rate(int32_t stage, const std::vector<int32_t>& peers) const {
  return own_or_mean(stage, peers, [this](int32_t s) { return prefill_rate(s); });
}

std::optional<double> SloPredictor::estimate_ttft(int32_t stage, int64_t prompt_tokens,
                                                  const std::vector<int32_t>& peers) const {
  const auto rate = estimate_prefill_rate(stage, peers);
  if (!rate) return std::nullopt;
  return double(queued_tokens(stage) + prompt_tokens) / *rate;
}

std::optional<double> SloPredictor::estimate_tpot(int32_t stage, const std::vector<int32_t>& peers) const {
  return own_or_mean(stage, peers, [this](int32_t s) { return tpot(s); });
}

Status SloPredictor::check(const GenerateRequest& r, const std::vector<int32_t>& entry,
                           const std::vector<int32_t>& continuing) const {
  if (r.ttft_target_ms <= 0 && r.tpot_target_ms <= 0 && r.deadline_ms <= 0) return Status::Ok();
  const int64_t prompt = int64_t(r.prompt.size());
  std::optional<double> best_ttft, best_tpot;
  int32_t best_stage = -1;
  for (int32_t s : entry)
    if (auto t = ttft(s, prompt); t && (!best_ttft || *t < *best_ttft)) {
      best_ttft = t;
      best_stage = s;
    }
  for (int32_t s : continuing)
    if (auto t = tpot(s); t && (!best_tpot || *t < *best_tpot)) best_tpot = t;
  const std::string who = "request " + std::to_string(r.request_id) + " cannot meet its ";
  auto ttft_why = [&] {
    return " (" + std::to_string(queued_tokens(best_stage)) + " prompt tokens queued ahead of its " +
           std::to_string(prompt) + " on the fastest stage, measured at " +
           num(*prefill_rate(best_stage)) + " tokens/s)";
  };
  if (r.ttft_target_ms > 0 && best_ttft && *best_ttft * 1e3 > r.ttft_target_ms)
    return Status(Code::rejected, who + "ttft_target_ms " + num(r.ttft_target_ms) + ": predicted TTFT " +
                                      ms(*best_ttft) + ttft_why());
  if (r.tpot_target_ms > 0 && best_tpot && *best_tpot * 1e3 > r.tpot_target_ms)
    return Status(Code::rejected, who + "tpot_target_ms " + num(r.tpot_target_ms) +
                                      ": the fastest decoding stage measures " + ms(*best_tpot) +
                                      " per token");
  if (r.deadline_ms > 0 && (best_ttft || best_tpot)) {
    const double steps = double(std::max(0, r.sampling.max_tokens - 1));
    const double total = best_ttft.value_or(0) + steps * best_tpot.value_or(0);
    if (total * 1e3 > r.deadline_ms)
      return Status(Code::rejected, who + "deadline_ms " + num(r.deadline_ms) + ": predicted " + ms(total) +
                                        " = TTFT " + ms(best_ttft.value_or(0)) + " + " + num(steps) +
                                        " x TPOT " + ms(best_tpot.value_or(0)));
  }
  return Status::Ok();
}

}  // namespace cleave
