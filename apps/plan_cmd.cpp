// cleave plan (--profile FILE | -m MODEL) [--calibrate-metrics FILE [--calibrate-baseline FILE]
//             [--calibrate-rate R]]... [--save-profile OUT]
//             (--rate R [--requests N] [--prompt-tokens LO[:HI]] [--output-tokens LO[:HI]] | --trace FILE)
//             [--slo-ttft-ms X] [--slo-tpot-ms Y] --max-stages N
//             [--prefill-cost C] [--decode-cost C] [--seed S]
// Searches prefill:decode splits with planner/'s simulation over measured
// step costs (a saved profile, or a short profiling run on this machine)
// and prints the Pareto front of goodput, latency and cost.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "actors/pipeline.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "planner/plan.h"

namespace cleave {
namespace {

struct PlanArgs {
  std::string profile, model, save_profile, prompt = "128", output = "64", profile_topology = "pd";
  std::string trace;
  std::vector<std::string> calibrate_metrics, calibrate_baseline;
  std::vector<double> calibrate_rate;
  planner::Workload workload;
  planner::Slo slo;
  int32_t max_stages = 8, threads = 1, max_seqs = 8, top = 0;
  // What a served stage's scheduler takes in one step (SchedulerOptions).
  int32_t max_batch_tokens = SchedulerOptions{}.max_batch_tokens;
  double prefill_cost = 1.0, decode_cost = 1.0, handoff_ms = 0;
};
PlanArgs g_plan;
CLI::App* g_plan_cmd = nullptr;

[[noreturn]] void fail(const Status& st) { throw std::runtime_error(st.to_string()); }

// "LO" or "LO:HI".
std::pair<int32_t, int32_t> range_of(const std::string& flag, const std::string& v) {
  const size_t colon = v.find(':');
  try {
    size_t used = 0;
    const long lo = std::stol(v.substr(0, colon), &used);
    if (used != (colon == std::string::npos ? v.size() : colon)) throw std::invalid_argument(v);
    long hi = lo;
    if (colon != std::string::npos) {
      hi = std::stol(v.substr(colon + 1), &used);
      if (used != v.size() - colon - 1) throw std::invalid_argument(v);
    }
    if (lo < 1 || hi < lo || hi > (1 << 24)) throw std::out_of_range(v);
    return {int32_t(lo), int32_t(hi)};
  } catch (const std::exception&) {
    throw CLI::ValidationError(flag, "expected N or LO:HI tokens with 1 <= LO <= HI, got '" + v + "'");
  }
}

// Wall milliseconds until every request finished (mono, one engine).
double run_ms(Pipeline& p, const std::vector<GenerateRequest>& requests) {
  std::mutex mu;
  std::condition_variable cv;
  size_t done = 0;
  Status failure;
  const auto t0 = std::chrono::steady_clock::now();
  for (const GenerateRequest& r : requests) {
    Status st = p.submit(r, [&](const msg::StreamEvent& e) {
      if (e.kind == msg::StreamEvent::Kind::token) return;
      std::lock_guard<std::mutex> lock(mu);
      if (e.kind == msg::StreamEvent::Kind::failed) failure = e.error;
      ++done;
      cv.notify_all();
    });
    if (!st.ok()) fail(st);
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done == requests.size(); });
  if (!failure.ok()) fail(failure);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

GenerateRequest request(uint64_t id, int32_t prompt, int32_t tokens) {
  GenerateRequest r;
  r.request_id = id;
  for (int32_t i = 0; i < prompt; ++i) r.prompt.push_back(3 + (int32_t(id) * 131 + i * 17) % 200);
  r.sampling.max_tokens = tokens;
  r.sampling.temperature = 0;
  r.ignore_eos = true;
  return r;
}

// A short profiling run on this machine: prefill steps of two sizes and
// decode steps of one row and of max_seqs rows (the best of 3 each), fitted
// to a + b x tokens and c + d x rows. Through a P/D pipeline (one prefill
// and one decode actor, the default) the figures carry what serving adds
// to a step (messages, the store's copy of new blocks, the hand-off, which
// lands in the decode fit); mono measures the bare engine. The context term
// is not measured (0); --handoff-ms adds a fixed hand-off.
planner::StepProfile measure(const PlanArgs& a) {
  auto file = GgufFile::open(a.model);
  if (!file.ok()) fail(file.status());
  std::shared_ptr<const Tokenizer> tok;
  if (auto t = Tokenizer::from_gguf(**file); t.ok()) tok = std::move(*t);
  PipelineOptions o;
  o.topology = a.profile_topology == "mono" ? Topology::mono : Topology::pd;
  o.engine.threads = a.threads;
  o.engine.max_seqs = a.max_seqs;
  o.scheduler.max_batch_tokens = a.max_batch_tokens;
  auto lm = LlamaModel::load(*file);
  if (!lm.ok()) fail(lm.status());
  const int32_t context = (*lm)->config().context;
  constexpr int32_t kSteps = 32, kPrompt = 16;
  if (context < kPrompt + kSteps + 2 || context < 64)
    fail(Status(Code::invalid_argument, "plan -m: the model's context (" + std::to_string(context) +
                                            " tokens) is too short to profile (at least 64)"));
  auto p = Pipeline::create(*file, tok, o);
  if (!p.ok()) fail(p.status());
  uint64_t id = 1;
  auto best = [&](auto make) {
    double ms = 1e300;
    for (int rep = 0; rep < 3; ++rep) ms = std::min(ms, run_ms(**p, make()));
    return ms;
  };
  // Prompts that fit the context (the first token needs one position more).
  const int32_t large = std::min({a.max_batch_tokens, 256, context - 1}), small = std::max(8, large / 8);
  const double t_small = best([&] { return std::vector<GenerateRequest>{request(id++, small, 1)}; });
  const double t_large = best([&] { return std::vector<GenerateRequest>{request(id++, large, 1)}; });
  planner::StepProfile s;
  s.prefill_ms_per_token = std::max(0.0, (t_large - t_small) / double(large - small));
  s.prefill_ms = std::max(0.0, t_small - s.prefill_ms_per_token * small);
  auto decode_step = [&](int32_t rows) {
    const double total = best([&] {
      std::vector<GenerateRequest> rs;
      for (int32_t r = 0; r < rows; ++r) rs.push_back(request(id++, kPrompt, kSteps + 1));
      return rs;
    });
    const double prefill = s.prefill_ms + s.prefill_ms_per_token * double(rows * kPrompt);
    return std::max(1e-3, (total - prefill) / kSteps);
  };
  const double one = decode_step(1), many = decode_step(a.max_seqs);
  s.decode_ms_per_row = a.max_seqs > 1 ? std::max(0.0, (many - one) / double(a.max_seqs - 1)) : 0;
  s.decode_ms = std::max(0.0, one - s.decode_ms_per_row);
  s.max_seqs = a.max_seqs;
  s.max_batch_tokens = a.max_batch_tokens;
  s.handoff_ms = a.handoff_ms;
  return s;
}

}  // namespace
}  // namespace cleave

CLI::App* add_plan_command(CLI::App& app) {
  using cleave::g_plan;
  auto* cmd = app.add_subcommand("plan", "search prefill:decode splits by simulation and print the Pareto front "
                                         "of goodput, latency and cost");
  auto* profile = cmd->add_option("--profile", g_plan.profile, "saved step profile (JSON, from --save-profile)")
                      ->check(CLI::ExistingFile);
  auto* model = cmd->add_option("-m,--model", g_plan.model, "profile this GGUF model on this machine first")
                    ->check(CLI::ExistingFile);
  profile->excludes(model);
  cmd->add_option("--calibrate-metrics", g_plan.calibrate_metrics,
                  "Prometheus text of a P/D server that served a real load (curl URL/metrics): scale each role's "
                  "step costs by how much slower its steps ran there than the profile says; given once per load, "
                  "two or more loads with --calibrate-rate fit how the slowdown grows with the load")
      ->check(CLI::ExistingFile);
  cmd->add_option("--calibrate-baseline", g_plan.calibrate_baseline,
                  "the same server's metrics from before that load: only what the load added counts (none, or "
                  "one per --calibrate-metrics)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--calibrate-rate", g_plan.calibrate_rate,
                  "requests/s of the load behind each --calibrate-metrics (one per load, two or more loads)")
      ->check(CLI::Range(1e-6, 1e6));
  cmd->add_option("--save-profile", g_plan.save_profile, "write the profile (measured with -m, calibrated) here");
  cmd->add_option("--trace", g_plan.trace,
                  "simulate a recorded trace instead of Poisson arrivals: JSON lines of arrival_s, prompt_tokens, "
                  "output_tokens")
      ->check(CLI::ExistingFile);
  cmd->add_option("-t,--threads", g_plan.threads, "with -m: threads of the profiled engine")->check(CLI::Range(1, 1024))->needs(model);
  cmd->add_option("--max-seqs", g_plan.max_seqs, "with -m: a decoder's rows")->check(CLI::Range(1, 4096))->needs(model);
  cmd->add_option("--max-batch-tokens", g_plan.max_batch_tokens, "with -m: a prefill step's tokens (default: a served stage's, 256)")
      ->check(CLI::Range(64, 1 << 20))->needs(model);
  cmd->add_option("--profile-topology", g_plan.profile_topology,
                  "with -m: profile through a P/D pipeline (pd, what serving adds included) or the bare engine (mono)")
      ->check(CLI::IsMember({"pd", "mono"}))
      ->needs(model);
  cmd->add_option("--handoff-ms", g_plan.handoff_ms, "with -m: the prefill -> decode hand-off (not profiled)")
      ->check(CLI::Range(0.0, 1e6))->needs(model);
  cmd->add_option("--rate", g_plan.workload.rate, "requests per second (Poisson; required without --trace)")
      ->check(CLI::Range(1e-6, 1e6));
  cmd->add_option("--requests", g_plan.workload.requests, "requests simulated per split")->check(CLI::Range(1, 10000000));
  cmd->add_option("--prompt-tokens", g_plan.prompt, "prompt tokens: N or LO:HI (uniform)");
  cmd->add_option("--output-tokens", g_plan.output, "generated tokens: N or LO:HI (uniform)");
  cmd->add_option("--slo-ttft-ms", g_plan.slo.ttft_ms, "TTFT goal (0: none)")->check(CLI::Range(0.0, 1e9));
  cmd->add_option("--slo-tpot-ms", g_plan.slo.tpot_ms, "TPOT goal (0: none)")->check(CLI::Range(0.0, 1e9));
  cmd->add_option("--max-stages", g_plan.max_stages, "prefill + decode stages at most")->check(CLI::Range(2, 4096));
  cmd->add_option("--prefill-cost", g_plan.prefill_cost, "cost of a prefill stage's node")->check(CLI::Range(1e-6, 1e6));
  cmd->add_option("--decode-cost", g_plan.decode_cost, "cost of a decode stage's node")->check(CLI::Range(1e-6, 1e6));
  cmd->add_option("--top", g_plan.top, "print the N rows of the front with the highest goodput (then lowest cost); "
                                       "0: all")
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--seed", g_plan.workload.seed, "arrivals and lengths");
  cleave::g_plan_cmd = cmd;
  return cmd;
}

int run_plan_command() {
  using namespace cleave;
  PlanArgs& a = g_plan;
  if (a.profile.empty() == a.model.empty())
    throw CLI::ValidationError("--profile", "give a saved --profile or a -m model to profile");
  auto read_file = [](const std::string& path) {
    std::ifstream f(path);
    std::stringstream text;
    text << f.rdbuf();
    if (!f) fail(Status(Code::io_error, "cannot read " + path));
    return text.str();
  };
  const CLI::App& cmd = *g_plan_cmd;
  if (!a.trace.empty()) {
    // The trace says when each request comes and how long it is.
    for (const char* flag : {"--rate", "--requests", "--prompt-tokens", "--output-tokens", "--seed"})
      if (cmd.get_option(flag)->count() > 0)
        throw CLI::ValidationError(flag, "does not go with --trace (the trace gives arrivals and lengths)");
    auto t = planner::parse_trace(read_file(a.trace));
    if (!t.ok()) fail(Status(t.status().code(), a.trace + ": " + t.status().message()));
    a.workload.trace = std::move(*t);
    a.workload.rate = planner::trace_rate(a.workload.trace);
    a.workload.requests = int32_t(a.workload.trace.size());
  } else {
    if (cmd.get_option("--rate")->count() == 0) throw CLI::RequiredError("--rate (or --trace)");
    std::tie(a.workload.prompt_min, a.workload.prompt_max) = range_of("--prompt-tokens", a.prompt);
    std::tie(a.workload.output_min, a.workload.output_max) = range_of("--output-tokens", a.output);
  }
  if (Status st = planner::validate_workload(a.workload); !st.ok()) fail(st);
  planner::StepProfile profile;
  if (!a.profile.empty()) {
    std::ifstream f(a.profile);
    std::stringstream text;
    text << f.rdbuf();
    auto p = planner::parse_profile(text.str());
    if (!p.ok()) fail(Status(p.status().code(), a.profile + ": " + p.status().message()));
    profile = *p;
  } else {
    profile = measure(a);
  }
  const size_t loads = a.calibrate_metrics.size();
  if (!a.calibrate_baseline.empty() && a.calibrate_baseline.size() != loads)
    throw CLI::ValidationError("--calibrate-baseline", "give one per --calibrate-metrics (" + std::to_string(loads) +
                                                           "), or none");
  if (!a.calibrate_rate.empty() && a.calibrate_rate.size() != loads)
    throw CLI::ValidationError("--calibrate-rate", "give one per --calibrate-metrics (" + std::to_string(loads) + ")");
  if (loads > 1 && a.calibrate_rate.empty())
    throw CLI::ValidationError("--calibrate-metrics", "two or more loads need their --calibrate-rate each");
  if (loads == 1 && !a.calibrate_rate.empty())
    throw CLI::ValidationError("--calibrate-rate", "needs two or more --calibrate-metrics (one load gives no slowdown "
                                                   "with load)");
  if (loads > 0 && (profile.prefill_slowdown_per_rps > 0 || profile.decode_slowdown_per_rps > 0))
    throw CLI::ValidationError("--calibrate-metrics", "the profile is calibrated already (it has a slowdown per "
                                                      "request/s): calibrate the profile it came from");
  std::vector<planner::LoadRun> runs;
  for (size_t i = 0; i < loads; ++i) {
    const std::string& path = a.calibrate_metrics[i];
    auto run = planner::parse_served_metrics(read_file(path));
    if (!run.ok()) fail(Status(run.status().code(), path + ": " + run.status().message()));
    if (!a.calibrate_baseline.empty()) {
      const std::string& base = a.calibrate_baseline[i];
      auto before = planner::parse_served_metrics(read_file(base));
      if (!before.ok()) fail(Status(before.status().code(), base + ": " + before.status().message()));
      run = planner::served_between(*before, *run);
      if (!run.ok()) fail(Status(run.status().code(), path + ": " + run.status().message()));
    }
    if (loads == 1) {
      auto c = planner::calibrate(profile, *run);
      if (!c.ok()) fail(Status(c.status().code(), path + ": " + c.status().message()));
      std::printf("calibrated from %s: prefill steps x%.3f (%.0f steps, spread %.3f), decode steps x%.3f (%.0f "
                  "steps, spread %.3f)\n",
                  path.c_str(), c->prefill_factor, run->prefill.steps, c->prefill_cv, c->decode_factor,
                  run->decode.steps, c->decode_cv);
      profile = planner::calibrated(profile, *c);
    }
    runs.push_back(planner::LoadRun{*run, loads > 1 ? a.calibrate_rate[i] : 0});
  }
  if (loads > 1) {
    std::vector<planner::Calibration> factors;
    auto p = planner::calibrate_over_loads(profile, runs, 20, &factors);
    if (!p.ok()) fail(p.status());
    for (size_t i = 0; i < runs.size(); ++i)
      std::printf("load %.4g requests/s: prefill steps x%.3f (%.0f steps, spread %.3f), decode steps x%.3f (%.0f "
                  "steps, spread %.3f)\n",
                  runs[i].rate, factors[i].prefill_factor, runs[i].run.prefill.steps, factors[i].prefill_cv,
                  factors[i].decode_factor, runs[i].run.decode.steps, factors[i].decode_cv);
    profile = *p;
    std::printf("calibrated from %zu loads: at %.4g requests/s a stage, then +%.2f %% (prefill) and +%.2f %% "
                "(decode) a step per request/s a stage\n",
                loads, profile.load_rate, profile.prefill_slowdown_per_rps * 100,
                profile.decode_slowdown_per_rps * 100);
  }
  if (!a.save_profile.empty()) {
    if (a.model.empty() && loads == 0)
      throw CLI::ValidationError("--save-profile", "needs -m or --calibrate-metrics (else it would copy --profile)");
    std::ofstream out(a.save_profile);
    out << planner::profile_json(profile) << "\n";
    if (!out) fail(Status(Code::io_error, "cannot write " + a.save_profile));
  }
  std::printf("profile: prefill %.4g + %.4g ms/token (batch %d tokens), decode %.4g + %.4g ms/row (%d rows), "
              "hand-off %.4g + %.4g ms/token\n",
              profile.prefill_ms, profile.prefill_ms_per_token, profile.max_batch_tokens, profile.decode_ms,
              profile.decode_ms_per_row, profile.max_seqs, profile.handoff_ms, profile.handoff_ms_per_token);
  if (profile.prefill_slowdown_per_rps > 0 || profile.decode_slowdown_per_rps > 0)
    std::printf("profile: those costs at %.4g requests/s a stage, +%.2f %% (prefill) and +%.2f %% (decode) a step "
                "per request/s a stage more\n",
                profile.load_rate, profile.prefill_slowdown_per_rps * 100, profile.decode_slowdown_per_rps * 100);
  if (profile.prefill_step_cv > 0 || profile.decode_step_cv > 0)
    std::printf("profile: steps spread log-normally around those costs, coefficient of variation %.3f (prefill) "
                "and %.3f (decode)\n",
                profile.prefill_step_cv, profile.decode_step_cv);
  if (!a.workload.trace.empty())
    std::printf("load: trace %s, %d requests at %.4g requests/s; goals TTFT %g ms, TPOT %g ms\n", a.trace.c_str(),
                a.workload.requests, a.workload.rate, a.slo.ttft_ms, a.slo.tpot_ms);
  else
    std::printf("load: %g requests/s, prompt %d..%d, output %d..%d tokens, %d requests; goals TTFT %g ms, TPOT %g ms\n",
                a.workload.rate, a.workload.prompt_min, a.workload.prompt_max, a.workload.output_min,
                a.workload.output_max, a.workload.requests, a.slo.ttft_ms, a.slo.tpot_ms);
  const auto all = planner::search(profile, a.workload, a.slo, a.max_stages, a.prefill_cost, a.decode_cost);
  const auto front = planner::pareto_front(all);
  // The front is ordered by goodput, then cost: --top keeps its head.
  const size_t shown = a.top > 0 ? std::min(front.size(), size_t(a.top)) : front.size();
  std::printf("%zu split%s simulated; Pareto front (goodput, p90 TTFT, p90 TPOT, cost): %zu row%s", all.size(),
              all.size() == 1 ? "" : "s", front.size(), front.size() == 1 ? "" : "s");
  if (shown < front.size()) std::printf(", the %zu of highest goodput shown (--top)", shown);
  std::printf("\n");
  std::printf("%8s %8s %8s %10s %8s %11s %11s %11s %11s %8s %8s\n", "prefill", "decode", "cost", "goodput/s",
              "attain", "ttft_p50ms", "ttft_p90ms", "tpot_p50ms", "tpot_p90ms", "p_busy", "d_busy");
  for (size_t i = 0; i < shown; ++i) {
    const planner::Outcome& o = front[i];
    std::printf("%8d %8d %8.3g %10.4g %8.3f %11.4g %11.4g %11.4g %11.4g %8.2f %8.2f\n", o.placement.prefill,
                o.placement.decode, o.placement.cost(), o.goodput, o.attainment, o.ttft_p50_ms, o.ttft_p90_ms,
                o.tpot_p50_ms, o.tpot_p90_ms, o.prefill_busy, o.decode_busy);
  }
  return 0;
}
