// Step costs measured while serving against the profile's (plan.h:
// parse_served_metrics, calibrate, calibrated).
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <tuple>

#include "planner/plan.h"

namespace cleave::planner {

namespace {

// `key="VALUE"` at `at` in line: VALUE, and `at` moved past the closing quote.
bool quoted(const std::string& line, size_t& at, const char* key, std::string* value) {
  const std::string open = std::string(key) + "=\"";
  if (line.compare(at, open.size(), open) != 0) return false;
  const size_t close = line.find('"', at + open.size());
  if (close == std::string::npos) return false;
  *value = line.substr(at + open.size(), close - at - open.size());
  at = close + 1;
  return true;
}

// "[NODE/]prefill/N" -> "prefill" (or decode); "" for any other actor.
std::string role_of(const std::string& actor) {
  const size_t last = actor.rfind('/');
  if (last == std::string::npos || last + 1 == actor.size()) return "";
  for (size_t i = last + 1; i < actor.size(); ++i)
    if (actor[i] < '0' || actor[i] > '9') return "";
  const size_t before = actor.rfind('/', last - 1);
  const std::string role = actor.substr(before == std::string::npos ? 0 : before + 1,
                                        last - (before == std::string::npos ? 0 : before + 1));
  return role == "prefill" || role == "decode" ? role : "";
}

}  // namespace

// cleave_actor_stat{actor="d0/decode/0",name="step_us"} 12345
Result<ServedRun> parse_served_metrics(const std::string& text) {
  static const std::string kPrefix = "cleave_actor_stat{";
  ServedRun run;
  bool prefill = false, decode = false;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() > 512 || line.compare(0, kPrefix.size(), kPrefix) != 0) continue;
    size_t at = kPrefix.size();
    std::string actor, name;
    if (!quoted(line, at, "actor", &actor) || line.compare(at, 1, ",") != 0) continue;
    ++at;
    if (!quoted(line, at, "name", &name) || line.compare(at, 2, "} ") != 0) continue;
    const std::string role = role_of(actor);
    if (role.empty()) continue;
    char* end = nullptr;
    const double v = std::strtod(line.c_str() + at + 2, &end);
    if (end == line.c_str() + at + 2 || !std::isfinite(v) || v < 0) continue;
    ServedSteps& s = role == "prefill" ? run.prefill : run.decode;
    (role == "prefill" ? prefill : decode) = true;
    if (name == "steps") s.steps += v;
    else if (name == "step_us") s.step_ms += v / 1e3;
    else if (name == "prefill_tokens") s.prefill_tokens += v;
    else if (name == "decode_rows") s.decode_rows += v;
  }
  if (!prefill || !decode)
    return Status(Code::invalid_argument,
                  std::string("plan: the metrics name no ") + (prefill ? "decode" : "prefill") +
                      " stage (cleave_actor_stat of prefill/N and decode/N: a P/D server's /metrics with "
                      "--metrics; colocated stages mix both phases and cannot calibrate either)");
  return run;
}

Result<ServedRun> served_between(const ServedRun& before, const ServedRun& after) {
  ServedRun d;
  for (auto [b, a, out, role] : {std::tuple<const ServedSteps*, const ServedSteps*, ServedSteps*, const char*>{
                                     &before.prefill, &after.prefill, &d.prefill, "prefill"},
                                 {&before.decode, &after.decode, &d.decode, "decode"}}) {
    out->steps = a->steps - b->steps;
    out->step_ms = a->step_ms - b->step_ms;
    out->prefill_tokens = a->prefill_tokens - b->prefill_tokens;
    out->decode_rows = a->decode_rows - b->decode_rows;
    if (out->steps < 0 || out->step_ms < 0 || out->prefill_tokens < 0 || out->decode_rows < 0)
      return Status(Code::invalid_argument, std::string("plan: the ") + role +
                                                " counters went down between the two snapshots (a restarted "
                                                "server, or before and after swapped)");
  }
  return d;
}

Result<Calibration> calibrate(const StepProfile& p, const ServedRun& run, double min_steps) {
  Calibration c;
  struct Role {
    const char* name;
    const ServedSteps& s;
    double predicted;
    double* factor;
  };
  for (const Role& r :
       {Role{"prefill", run.prefill, p.prefill_ms * run.prefill.steps + p.prefill_ms_per_token * run.prefill.prefill_tokens,
             &c.prefill_factor},
        Role{"decode", run.decode, p.decode_ms * run.decode.steps + p.decode_ms_per_row * run.decode.decode_rows,
             &c.decode_factor}}) {
    if (r.s.steps < min_steps)
      return Status(Code::invalid_argument, std::string("plan: the served run has ") + std::to_string(int64_t(r.s.steps)) +
                                                " " + r.name + " steps, too few to calibrate (at least " +
                                                std::to_string(int64_t(min_steps)) + ")");
    const double f = r.s.step_ms / r.predicted;
    if (!std::isfinite(f) || f < 0.1 || f > 10)
      return Status(Code::invalid_argument,
                    std::string("plan: ") + r.name + " steps took " + std::to_string(f) +
                        " times what the profile says: is it a profile of this model on this machine?");
    *r.factor = f;
  }
  return c;
}

StepProfile calibrated(const StepProfile& p, const Calibration& c) {
  StepProfile out = p;
  out.prefill_ms *= c.prefill_factor;
  out.prefill_ms_per_token *= c.prefill_factor;
  out.decode_ms *= c.decode_factor;
  out.decode_ms_per_row *= c.decode_factor;
  out.decode_ms_per_context_token *= c.decode_factor;
  return out;
}

}  // namespace cleave::planner
