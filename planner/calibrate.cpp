// Step costs measured while serving against the profile's (plan.h:
// parse_served_metrics, calibrate, calibrated).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>
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
  std::set<std::string> prefill_actors, decode_actors;
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
    (role == "prefill" ? prefill_actors : decode_actors).insert(actor);
    if (name == "steps") s.steps += v;
    else if (name == "step_us") s.step_ms += v / 1e3;
    else if (name == "prefill_tokens") s.prefill_tokens += v;
    else if (name == "decode_rows") s.decode_rows += v;
    else if (name == "step_us_sq") s.step_ms_sq += v / 1e6;
    else if (name == "step_tokens_sq") s.tokens_sq += v;
    else if (name == "step_us_tokens") s.step_ms_tokens += v / 1e3;
    else if (name == "step_rows_sq") s.rows_sq += v;
    else if (name == "step_us_rows") s.step_ms_rows += v / 1e3;
  }
  const bool prefill = !prefill_actors.empty(), decode = !decode_actors.empty();
  run.prefill_stages = int32_t(prefill_actors.size());
  run.decode_stages = int32_t(decode_actors.size());
  if (!prefill || !decode)
    return Status(Code::invalid_argument,
                  std::string("plan: the metrics name no ") + (prefill ? "decode" : "prefill") +
                      " stage (cleave_actor_stat of prefill/N and decode/N: a P/D server's /metrics with "
                      "--metrics; colocated stages mix both phases and cannot calibrate either)");
  return run;
}

Result<ServedRun> served_between(const ServedRun& before, const ServedRun& after) {
  ServedRun d;
  d.prefill_stages = after.prefill_stages;
  d.decode_stages = after.decode_stages;
  for (auto [b, a, out, role] : {std::tuple<const ServedSteps*, const ServedSteps*, ServedSteps*, const char*>{
                                     &before.prefill, &after.prefill, &d.prefill, "prefill"},
                                 {&before.decode, &after.decode, &d.decode, "decode"}}) {
    bool down = false;
    for (double ServedSteps::*f : {&ServedSteps::steps, &ServedSteps::step_ms, &ServedSteps::prefill_tokens,
                                   &ServedSteps::decode_rows, &ServedSteps::step_ms_sq, &ServedSteps::tokens_sq,
                                   &ServedSteps::step_ms_tokens, &ServedSteps::rows_sq, &ServedSteps::step_ms_rows}) {
      out->*f = a->*f - b->*f;
      down = down || out->*f < 0;
    }
    if (down)
      return Status(Code::invalid_argument, std::string("plan: the ") + role +
                                                " counters went down between the two snapshots (a restarted "
                                                "server, or before and after swapped)");
  }
  return d;
}

namespace {

// The spread of n steps x_i around f m_i, m_i = a + b u_i, relative to f
// m_i: sqrt(sum (x - f m)^2 / sum (f m)^2), expanded into the served sums
// (x2 = sum x^2, xu = sum x u, u2 = sum u^2; x1, u1 the plain sums).
// 0 without second moments; at most 5 (validate_profile's bound: a
// counter that saturated is no measurement).
double step_cv(double a, double b, double f, double n, double x1, double u1, double x2, double xu, double u2) {
  if (x2 <= 0) return 0;
  const double m2 = n * a * a + 2 * a * b * u1 + b * b * u2;
  const double xm = a * x1 + b * xu;
  const double rss = x2 - 2 * f * xm + f * f * m2;
  if (!(m2 > 0) || !std::isfinite(rss)) return 0;
  return std::min(5.0, std::sqrt(std::max(0.0, rss) / (f * f * m2)));
}

}  // namespace

Result<Calibration> calibrate(const StepProfile& p, const ServedRun& run, double min_steps) {
  Calibration c;
  struct Role {
    const char* name;
    const ServedSteps& s;
    double a, b, units, units_sq, ms_units;
    double* factor;
    double* cv;
  };
  for (const Role& r : {Role{"prefill", run.prefill, p.prefill_ms, p.prefill_ms_per_token, run.prefill.prefill_tokens,
                             run.prefill.tokens_sq, run.prefill.step_ms_tokens, &c.prefill_factor, &c.prefill_cv},
                        Role{"decode", run.decode, p.decode_ms, p.decode_ms_per_row, run.decode.decode_rows,
                             run.decode.rows_sq, run.decode.step_ms_rows, &c.decode_factor, &c.decode_cv}}) {
    const double predicted = r.a * r.s.steps + r.b * r.units;
    if (r.s.steps < min_steps)
      return Status(Code::invalid_argument, std::string("plan: the served run has ") + std::to_string(int64_t(r.s.steps)) +
                                                " " + r.name + " steps, too few to calibrate (at least " +
                                                std::to_string(int64_t(min_steps)) + ")");
    const double f = r.s.step_ms / predicted;
    if (!std::isfinite(f) || f < 0.1 || f > 10)
      return Status(Code::invalid_argument,
                    std::string("plan: ") + r.name + " steps took " + std::to_string(f) +
                        " times what the profile says: is it a profile of this model on this machine?");
    *r.factor = f;
    *r.cv = step_cv(r.a, r.b, f, r.s.steps, r.s.step_ms, r.units, r.s.step_ms_sq, r.ms_units, r.units_sq);
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
  out.prefill_step_cv = c.prefill_cv;
  out.decode_step_cv = c.decode_cv;
  return out;
}

Result<StepProfile> calibrate_over_loads(const StepProfile& p, const std::vector<LoadRun>& loads, double min_steps,
                                         std::vector<Calibration>* per_load) {
  if (loads.size() < 2)
    return Status(Code::invalid_argument, "plan: a slowdown with load needs two or more calibrating loads");
  // Per role: (load per stage, factor) of each run.
  std::vector<double> xp, fp, xd, fd;
  std::vector<Calibration> factors;
  double prefill_cv2 = 0, prefill_steps = 0, decode_cv2 = 0, decode_steps = 0;  // the spread, pooled
  for (const LoadRun& l : loads) {
    const std::string at = "the load at " + std::to_string(l.rate) + " requests/s: ";
    if (!std::isfinite(l.rate) || l.rate <= 0)
      return Status(Code::invalid_argument, "plan: a calibrating load's rate must be above 0 requests/s");
    if (l.run.prefill_stages < 1 || l.run.decode_stages < 1)
      return Status(Code::invalid_argument, "plan: " + at + "no prefill or no decode stage in its metrics");
    auto c = calibrate(p, l.run, min_steps);
    if (!c.ok()) return Status(c.status().code(), "plan: " + at + c.status().message());
    xp.push_back(l.rate / l.run.prefill_stages);
    fp.push_back(c->prefill_factor);
    xd.push_back(l.rate / l.run.decode_stages);
    fd.push_back(c->decode_factor);
    factors.push_back(*c);
    prefill_cv2 += c->prefill_cv * c->prefill_cv * l.run.prefill.steps;
    prefill_steps += l.run.prefill.steps;
    decode_cv2 += c->decode_cv * c->decode_cv * l.run.decode.steps;
    decode_steps += l.run.decode.steps;
  }
  // Least squares f = a + b x; the line's value at the mean x and b over it.
  struct Line {
    double at_mean, mean, slope;
  };
  auto fit = [](const std::vector<double>& x, const std::vector<double>& f) -> Result<Line> {
    const double n = double(x.size());
    double mx = 0, mf = 0;
    for (size_t i = 0; i < x.size(); ++i) mx += x[i] / n, mf += f[i] / n;
    double sxx = 0, sxf = 0;
    for (size_t i = 0; i < x.size(); ++i) sxx += (x[i] - mx) * (x[i] - mx), sxf += (x[i] - mx) * (f[i] - mf);
    if (!(sxx > 1e-12 * std::max(1.0, mx * mx)))
      return Status(Code::invalid_argument,
                    "plan: the calibrating loads must differ in requests/s per stage (all at " + std::to_string(mx) +
                        ")");
    return Line{mf, mx, std::max(0.0, sxf / sxx)};
  };
  auto lp = fit(xp, fp);
  if (!lp.ok()) return lp.status();
  auto ld = fit(xd, fd);
  if (!ld.ok()) return ld.status();
  // One reference load for both roles: the prefill line's mean; the decode
  // line is moved there along its slope.
  const double ref = lp->mean;
  const double dref = std::max(0.1, ld->at_mean + ld->slope * (ref - ld->mean));
  auto pooled = [](double cv2, double steps) { return steps > 0 ? std::sqrt(cv2 / steps) : 0.0; };
  StepProfile out =
      calibrated(p, Calibration{lp->at_mean, dref, pooled(prefill_cv2, prefill_steps), pooled(decode_cv2, decode_steps)});
  out.load_rate = ref;
  out.prefill_slowdown_per_rps = std::min(1.0, lp->slope / lp->at_mean);
  out.decode_slowdown_per_rps = std::min(1.0, ld->slope / dref);
  if (per_load) *per_load = std::move(factors);
  return out;
}

StepProfile at_load(const StepProfile& p, double rate, int32_t prefill_stages, int32_t decode_stages) {
  auto factor = [&](double slowdown, int32_t stages) {
    if (slowdown == 0) return 1.0;
    return std::max(0.25, 1 + slowdown * (rate / std::max(1, stages) - p.load_rate));
  };
  StepProfile out = calibrated(p, Calibration{factor(p.prefill_slowdown_per_rps, prefill_stages),
                                              factor(p.decode_slowdown_per_rps, decode_stages), p.prefill_step_cv,
                                              p.decode_step_cv});
  out.load_rate = 0;
  out.prefill_slowdown_per_rps = out.decode_slowdown_per_rps = 0;
  return out;
}

}  // namespace cleave::planner
