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
  int32_t max_batch_tokens = 512;                        // a prefill step's token budget
  int32_t max_seqs = 8;                                  // a decoder's rows
};
// invalid_argument naming the field: costs finite and >= 0, a step's fixed
// or per-unit cost above 0, budgets >= 1.
Status validate_profile(const StepProfile& p);
// JSON (the fields above by name) <-> StepProfile; parse errors name the field.
Result<StepProfile> parse_profile(const std::string& json);
std::string profile_json(const StepProfile& p);

struct Workload {
  double rate = 1.0;                           // Poisson arrivals per second
  int32_t requests = 2000;                     // how many the simulation runs
  int32_t prompt_min = 128, prompt_max = 128;  // uniform, tokens
  int32_t output_min = 64, output_max = 64;    // uniform, tokens generated
  uint64_t seed = 1;
};
Status validate_workload(const Workload& w);

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
// step. Deterministic for a seed.
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
