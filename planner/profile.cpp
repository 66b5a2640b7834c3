// StepProfile and Workload checks and the profile's JSON form.
#include <cmath>
#include <nlohmann/json.hpp>

#include "planner/plan.h"

namespace cleave::planner {
namespace {

Status bad(const std::string& what) { return Status(Code::invalid_argument, "plan: " + what); }

}  // namespace

Status validate_profile(const StepProfile& p) {
  for (auto [name, v] : {std::pair<const char*, double>{"prefill_ms", p.prefill_ms},
                         {"prefill_ms_per_token", p.prefill_ms_per_token},
                         {"decode_ms", p.decode_ms},
                         {"decode_ms_per_row", p.decode_ms_per_row},
                         {"decode_ms_per_context_token", p.decode_ms_per_context_token},
                         {"handoff_ms", p.handoff_ms},
                         {"handoff_ms_per_token", p.handoff_ms_per_token}})
    if (!std::isfinite(v) || v < 0 || v > 1e7)
      return bad(std::string("profile ") + name + " must be from 0 to 1e7 ms, got " + std::to_string(v));
  if (p.prefill_ms + p.prefill_ms_per_token <= 0) return bad("profile: a prefill step must take some time");
  if (p.decode_ms + p.decode_ms_per_row <= 0) return bad("profile: a decode step must take some time");
  if (p.max_batch_tokens < 1 || p.max_batch_tokens > (1 << 20))
    return bad("profile max_batch_tokens must be 1 to 1048576, got " + std::to_string(p.max_batch_tokens));
  if (p.max_seqs < 1 || p.max_seqs > 4096)
    return bad("profile max_seqs must be 1 to 4096, got " + std::to_string(p.max_seqs));
  for (auto [name, v] : {std::pair<const char*, double>{"prefill_slowdown_per_rps", p.prefill_slowdown_per_rps},
                         {"decode_slowdown_per_rps", p.decode_slowdown_per_rps}})
    if (!std::isfinite(v) || v < 0 || v > 1)
      return bad(std::string("profile ") + name + " must be 0 to 1 per request/s, got " + std::to_string(v));
  if (!std::isfinite(p.load_rate) || p.load_rate < 0 || p.load_rate > 1e6)
    return bad("profile load_rate must be 0 to 1e6 requests/s, got " + std::to_string(p.load_rate));
  for (auto [name, v] : {std::pair<const char*, double>{"prefill_step_cv", p.prefill_step_cv},
                         {"decode_step_cv", p.decode_step_cv}})
    if (!std::isfinite(v) || v < 0 || v > 5)
      return bad(std::string("profile ") + name + " must be 0 to 5, got " + std::to_string(v));
  if ((p.prefill_slowdown_per_rps > 0 || p.decode_slowdown_per_rps > 0) && p.load_rate <= 0)
    return bad("profile: a slowdown per request/s needs the load_rate it is measured from (above 0)");
  return Status::Ok();
}

Status validate_workload(const Workload& w) {
  if (!w.trace.empty()) {
    for (const TraceRequest& r : w.trace)
      if (!std::isfinite(r.arrival_ms) || r.arrival_ms < 0 || r.prompt < 1 || r.output < 1 || r.prompt > (1 << 24) ||
          r.output > (1 << 24))
        return bad("a trace request needs an arrival >= 0 and 1 to 16777216 prompt and output tokens");
    for (size_t i = 1; i < w.trace.size(); ++i)
      if (w.trace[i].arrival_ms < w.trace[i - 1].arrival_ms) return bad("a trace's arrivals must be in order");
    if (w.trace.size() < 2 || !(trace_rate(w.trace) > 0)) return bad("a trace needs at least 2 requests spread in time");
    return Status::Ok();
  }
  if (!std::isfinite(w.rate) || w.rate <= 0 || w.rate > 1e6)
    return bad("rate must be above 0 and at most 1e6 requests/s, got " + std::to_string(w.rate));
  if (w.requests < 1 || w.requests > 10'000'000)
    return bad("requests must be 1 to 10000000, got " + std::to_string(w.requests));
  if (w.prompt_min < 1 || w.prompt_max < w.prompt_min || w.prompt_max > (1 << 24))
    return bad("prompt tokens: need 1 <= min <= max <= 16777216, got " + std::to_string(w.prompt_min) + ".." +
               std::to_string(w.prompt_max));
  if (w.output_min < 1 || w.output_max < w.output_min || w.output_max > (1 << 24))
    return bad("output tokens: need 1 <= min <= max <= 16777216, got " + std::to_string(w.output_min) + ".." +
               std::to_string(w.output_max));
  return Status::Ok();
}

Result<StepProfile> parse_profile(const std::string& text) {
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("profile: not a JSON object");
  StepProfile p;
  const std::pair<const char*, double*> reals[] = {{"prefill_ms", &p.prefill_ms},
                                                   {"prefill_ms_per_token", &p.prefill_ms_per_token},
                                                   {"decode_ms", &p.decode_ms},
                                                   {"decode_ms_per_row", &p.decode_ms_per_row},
                                                   {"decode_ms_per_context_token", &p.decode_ms_per_context_token},
                                                   {"handoff_ms", &p.handoff_ms},
                                                   {"handoff_ms_per_token", &p.handoff_ms_per_token},
                                                   {"load_rate", &p.load_rate},
                                                   {"prefill_slowdown_per_rps", &p.prefill_slowdown_per_rps},
                                                   {"decode_slowdown_per_rps", &p.decode_slowdown_per_rps},
                                                   {"prefill_step_cv", &p.prefill_step_cv},
                                                   {"decode_step_cv", &p.decode_step_cv}};
  const std::pair<const char*, int32_t*> ints[] = {{"max_batch_tokens", &p.max_batch_tokens},
                                                   {"max_seqs", &p.max_seqs}};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (auto [k, out] : reals)
      if (it.key() == k) {
        if (!it->is_number()) return bad(std::string("profile ") + k + " must be a number");
        *out = it->get<double>();
        known = true;
      }
    for (auto [k, out] : ints)
      if (it.key() == k) {
        if (!it->is_number_integer()) return bad(std::string("profile ") + k + " must be an integer");
        const int64_t v = it->get<int64_t>();
        if (v < 0 || v > (1 << 24)) return bad(std::string("profile ") + k + " is out of range");
        *out = int32_t(v);
        known = true;
      }
    if (!known) return bad("profile: unknown field '" + it.key().substr(0, 64) + "'");
  }
  CLEAVE_RETURN_IF_ERROR(validate_profile(p));
  return p;
}

std::string profile_json(const StepProfile& p) {
  nlohmann::json j = {{"prefill_ms", p.prefill_ms},
                      {"prefill_ms_per_token", p.prefill_ms_per_token},
                      {"decode_ms", p.decode_ms},
                      {"decode_ms_per_row", p.decode_ms_per_row},
                      {"decode_ms_per_context_token", p.decode_ms_per_context_token},
                      {"handoff_ms", p.handoff_ms},
                      {"handoff_ms_per_token", p.handoff_ms_per_token},
                      {"max_batch_tokens", p.max_batch_tokens},
                      {"max_seqs", p.max_seqs},
                      {"load_rate", p.load_rate},
                      {"prefill_slowdown_per_rps", p.prefill_slowdown_per_rps},
                      {"decode_slowdown_per_rps", p.decode_slowdown_per_rps},
                      {"prefill_step_cv", p.prefill_step_cv},
                      {"decode_step_cv", p.decode_step_cv}};
  return j.dump(1);
}

}  // namespace cleave::planner
