// `cleave plan`: how many prefill and decode stages (and on what) a load
// needs, found by a discrete-event simulation of the cluster (DistServe's
// placement search) over measured per-step costs, reported as the Pareto
// front of goodput, latency and cost rather than one answer. Plain C++ (no
// CAF, no engine): tests/planner/ checks the simulation against queueing
// results that are known in closed form.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace cleave::planner {

// What one stage's steps cost, in milliseconds (a fit of measured steps).
struct StepProfile {
  double prefill_ms = 0, prefill_ms_per_token = 0;      // a prefill step of T prompt tokens: a + b T
  double decode_ms = 0, decode_ms_per_row = 0;           // a decode step of R rows: c + d R ...
  double decode_ms_per_context_token = 0;                // ... + e x the rows' context tokens
  double handoff_ms = 0, handoff_ms_per_token = 0;       // prefill -> decode: f + g x prompt tokens
  int32_t max_batch_tokens = 256;                        // a prefill step's token budget (a served stage's)
  int32_t max_seqs = 8;                                  // a decoder's rows
  // Steps that slow down with the load their machine serves (the front's
  // HTTP and SSE work and the other stages sharing its cores): at L
  // requests/s per stage of a role, that role's step costs above are x
  // (1 + slowdown_per_rps x (L - load_rate)), at least x 0.25. All 0: the
  // costs hold at any load. From calibrate_over_loads.
  double load_rate = 0;
  double prefill_slowdown_per_rps = 0, decode_slowdown_per_rps = 0;
  // Steps that do not all take their cost: each simulated step takes the
  // cost the fields above give x a log-normal factor of mean 1 and this
  // coefficient of variation (standard deviation over mean). 0: every step
  // exactly its cost. From calibrate (the served steps' spread around the
  // fit).
  double prefill_step_cv = 0, decode_step_cv = 0;
};
// invalid_argument naming the field: costs finite and >= 0, a step's fixed
// or per-unit cost above 0, budgets >= 1, slowdowns 0 to 1 per request/s
// and a load_rate above 0 when one is not 0, step_cv 0 to 5.
Status validate_profile(const StepProfile& p);
// JSON (the fields above by name) <-> StepProfile; parse errors name the field.
Result<StepProfile> parse_profile(const std::string& json);
std::string profile_json(const StepProfile& p);

// One request of a recorded trace.
struct TraceRequest {
  double arrival_ms = 0;  // after the trace's start
  int32_t prompt = 1, output = 1;
};

struct Workload {
  double rate = 1.0;                           // Poisson arrivals per second
  int32_t requests = 2000;                     // how many the simulation runs
  int32_t prompt_min = 128, prompt_max = 128;  // uniform, tokens
  int32_t output_min = 64, output_max = 64;    // uniform, tokens generated
  uint64_t seed = 1;
  // A recorded trace instead (non-empty): its arrivals and lengths replace
  // rate, requests, the lengths and the seed, and its rate is (n - 1) over
  // the span from first to last arrival (trace_rate).
  std::vector<TraceRequest> trace;
};
Status validate_workload(const Workload& w);

// JSON Lines, one request a line: {"arrival_s": 0.25, "prompt_tokens": 128,
// "output_tokens": 64} (arrivals from the trace's start, in any order: the
// result is sorted by them). invalid_argument naming the line and field:
// not an object, unknown field, arrival finite in [0, 1e7] s, tokens 1 to
// 16777216, at least 2 and at most 10,000,000 requests.
Result<std::vector<TraceRequest>> parse_trace(const std::string& jsonl);
// Requests per second of a trace of at least 2: (n - 1) / (last - first arrival).
double trace_rate(const std::vector<TraceRequest>& trace);

// What one role's stages did while serving, from their counters (the
// stages' steps, step_us, prefill_tokens, decode_rows; Prometheus text of
// `cleave serve --metrics` / `cleave node --http-port --metrics`), and the
// second moments of their steps (step_us_sq, step_tokens_sq,
// step_us_tokens, step_rows_sq, step_us_rows; all 0 from a server
// without them: no spread is measured then).
struct ServedSteps {
  double steps = 0, step_ms = 0, prefill_tokens = 0, decode_rows = 0;
  // Sums over the steps of x^2, t^2, x t, r^2 and x r: x a step's ms, t its
  // prompt tokens, r its decode rows.
  double step_ms_sq = 0, tokens_sq = 0, step_ms_tokens = 0, rows_sq = 0, step_ms_rows = 0;
};
struct ServedRun {
  ServedSteps prefill, decode;  // summed over the prefill stages, the decode stages
  int32_t prefill_stages = 0, decode_stages = 0;  // distinct actors of each role
};
// Sums cleave_actor_stat{actor="[NODE/]prefill/N" | "[NODE/]decode/N"} of
// steps, step_us, prefill_tokens and decode_rows. invalid_argument when no
// prefill or no decode stage is in the text (a colocated stage's steps mix
// both phases: they cannot calibrate either).
Result<ServedRun> parse_served_metrics(const std::string& prometheus_text);
// What `after` adds to `before` (two snapshots of the same server's
// counters around a load): invalid_argument when a counter went down (a
// restarted server, or the files swapped).
Result<ServedRun> served_between(const ServedRun& before, const ServedRun& after);

// How much slower each role's steps ran while serving than the profile
// says for the same steps: measured step time over a + b x tokens (prefill)
// and c + d x rows (decode) summed over those steps. And how far the steps
// spread around that: the root mean square of (x - factor m) over the
// root mean square of factor m (m a step's cost in the profile), from the
// served second moments; 0 when the metrics have none.
struct Calibration {
  double prefill_factor = 1, decode_factor = 1;
  double prefill_cv = 0, decode_cv = 0;
};
// invalid_argument when a role has fewer than min_steps steps (too few to
// say) or a factor falls outside [0.1, 10] (the profile is of another model
// or machine).
Result<Calibration> calibrate(const StepProfile& profile, const ServedRun& run, double min_steps = 20);
// The profile with each role's step costs scaled by its factor and its
// step_cv set to the calibration's (the hand-off as it was).
StepProfile calibrated(const StepProfile& profile, const Calibration& c);

// A served load at a known rate (requests/s over the whole server).
struct LoadRun {
  ServedRun run;
  double rate = 0;
};
// Each role's factor (calibrate) at two or more loads, fitted by least
// squares as a line in the load per stage (rate / that role's stages): the
// profile's costs scaled to the line at the mean load (load_rate), and the
// line's slope over that value as the role's slowdown_per_rps. A slope
// below 0 (steps no slower at more load) counts as 0. invalid_argument when
// fewer than two loads, a rate not above 0, all loads the same per stage,
// or calibrate() refuses one (its message, naming the load's rate). Each
// role's step_cv pools the loads' (the root of their squares' mean,
// weighted by the role's steps). per_load, when given, gets each load's
// own calibration, in the loads' order.
Result<StepProfile> calibrate_over_loads(const StepProfile& profile, const std::vector<LoadRun>& loads,
                                         double min_steps = 20, std::vector<Calibration>* per_load = nullptr);
// The profile as it runs at `rate` requests/s over the placement's stages:
// each role's costs x its slowdown at rate / its stages (slowdowns then 0;
// the spread as it was).
StepProfile at_load(const StepProfile& profile, double rate, int32_t prefill_stages, int32_t decode_stages);

struct Slo {
  double ttft_ms = 0, tpot_ms = 0;  // 0 = none
};

// One configuration: prefill and decode stages and their nodes' cost.
struct Placement {
  int32_t prefill = 1, decode = 1;
  double prefill_cost = 1.0, decode_cost = 1.0;  // per stage
  double cost() const { return prefill * prefill_cost + decode * decode_cost; }
};

struct Outcome {
  Placement placement;
  double attainment = 0;     // fraction of requests meeting both goals
  double goodput = 0;        // requests per second meeting both goals (rate x attainment)
  double ttft_mean_ms = 0, ttft_p50_ms = 0, ttft_p90_ms = 0;
  double tpot_mean_ms = 0, tpot_p50_ms = 0, tpot_p90_ms = 0;
  double prefill_busy = 0, decode_busy = 0;  // mean fraction of time a stage stepped
};

// Simulates the workload on the placement: prefill stages take queued
// prompts first come, first served, batched up to max_batch_tokens (a
// prompt longer than that in chunks of it); the first token comes at the
// end of its prompt's last step; the hand-off then takes its time and the
// request joins the decoder with the fewest rows and queued requests,
// whose continuous batch (up to max_seqs rows) gives each row a token per
// step. Each step takes its cost x its role's log-normal spread (step_cv).
// Deterministic for a seed (the workload's: it also draws the spread of a
// trace's steps).
Outcome simulate(const StepProfile& profile, const Workload& workload, const Slo& slo, const Placement& placement);

// Every placement with 1 <= prefill, 1 <= decode, prefill + decode <=
// max_stages, simulated.
std::vector<Outcome> search(const StepProfile& profile, const Workload& workload, const Slo& slo,
                            int32_t max_stages, double prefill_cost = 1.0, double decode_cost = 1.0);

// The outcomes no other one beats at once on goodput (higher), p90 TTFT and
// p90 TPOT (lower) and cost (lower), figures within 1 % counting as equal;
// by goodput (highest first), then cost.
std::vector<Outcome> pareto_front(std::vector<Outcome> all);

}  // namespace cleave::planner
