// The planner's simulation against results known in closed form: one
// prefill stage serving one prompt per step under Poisson arrivals is an
// M/D/1 queue (mean wait rho S / 2 (1 - rho)); an idle cluster gives each
// request exactly its step costs; more stages never lower goodput on a
// load that saturates fewer; the Pareto front keeps exactly the
// undominated rows; profiles and workloads are checked by name.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "planner/plan.h"

using namespace cleave;
using namespace cleave::planner;

namespace {

StepProfile linear(double prefill_ms_per_token, double decode_ms, double decode_ms_per_row) {
  StepProfile p;
  p.prefill_ms_per_token = prefill_ms_per_token;
  p.decode_ms = decode_ms;
  p.decode_ms_per_row = decode_ms_per_row;
  return p;
}

Workload fixed(double rate, int32_t prompt, int32_t output, int32_t n) {
  Workload w;
  w.rate = rate;
  w.requests = n;
  w.prompt_min = w.prompt_max = prompt;
  w.output_min = w.output_max = output;
  return w;
}

}  // namespace

TEST_CASE("planner: one prefill stage, one prompt a step, is M/D/1") {
  StepProfile p = linear(0.1, 1, 0);  // 100 tokens: S = 10 ms
  p.max_batch_tokens = 100;           // one prompt per step
  for (double rho : {0.3, 0.5, 0.8}) {
    CAPTURE(rho);
    const double service_ms = 10, rate = rho / (service_ms / 1e3);
    const Outcome o = simulate(p, fixed(rate, 100, 1, 40000), {}, {1, 1});
    const double wait_ms = rho * service_ms / (2 * (1 - rho));
    CHECK(o.ttft_mean_ms == doctest::Approx(wait_ms + service_ms).epsilon(0.05));
    CHECK(o.prefill_busy == doctest::Approx(rho).epsilon(0.05));
  }
}

TEST_CASE("planner: an idle cluster gives each request exactly its step costs") {
  StepProfile p = linear(0.05, 2, 1);  // prefill 200 tokens: 10 ms; a one-row decode step: 3 ms
  p.prefill_ms = 1;
  p.handoff_ms = 5;
  p.handoff_ms_per_token = 0.01;  // 2 ms for 200 tokens
  const Outcome o = simulate(p, fixed(0.01, 200, 11, 50), {}, {1, 1});  // 100 s apart
  CHECK(o.ttft_p50_ms == doctest::Approx(11));
  CHECK(o.ttft_p90_ms == doctest::Approx(11));
  // 10 decode steps of 3 ms after a 7 ms hand-off, over 10 gaps.
  CHECK(o.tpot_mean_ms == doctest::Approx((7 + 30) / 10.0));
  CHECK(o.attainment == 1.0);
  // Goals: TTFT 10 ms misses every request, 11 ms meets it.
  CHECK(simulate(p, fixed(0.01, 200, 11, 50), {10, 0}, {1, 1}).attainment == 0.0);
  CHECK(simulate(p, fixed(0.01, 200, 11, 50), {11, 0}, {1, 1}).goodput == doctest::Approx(0.01));
  CHECK(simulate(p, fixed(0.01, 200, 11, 50), {0, 3.8}, {1, 1}).attainment == 1.0);
  CHECK(simulate(p, fixed(0.01, 200, 11, 50), {0, 3.8}, {1, 2}).attainment == 1.0);
  CHECK(simulate(p, fixed(0.01, 200, 11, 50), {0, 3.6}, {1, 1}).attainment == 0.0);
}

TEST_CASE("planner: a decoder's batch shares its steps, a long prompt runs in chunks") {
  // Four requests at once on one decoder of 4 rows: each step costs 2 + 4 x 1.
  StepProfile p = linear(0.001, 2, 1);
  p.max_seqs = 4;
  Workload w = fixed(1e5, 10, 6, 4);  // 4 requests 10 us apart: one prefill step each
  const Outcome o = simulate(p, w, {}, {4, 1});
  // 5 steps of 6 ms, the first gap up to one 1-row step (3 ms) longer.
  CHECK(o.tpot_p90_ms >= 6.0);
  CHECK(o.tpot_p90_ms <= 6.0 + 3.0 / 5);
  p.max_seqs = 1;  // one row: the later ones wait for the earlier ones
  CHECK(simulate(p, w, {}, {4, 1}).tpot_p90_ms > 10);
  // A 1,000-token prompt with a 256-token budget: 4 steps of 1 + 0.01 x chunk.
  StepProfile c = linear(0.01, 1, 0);
  c.prefill_ms = 1;
  c.max_batch_tokens = 256;
  CHECK(simulate(c, fixed(0.01, 1000, 1, 5), {}, {1, 1}).ttft_p50_ms == doctest::Approx(4 + 10));
}

TEST_CASE("planner: search covers every split, more decoders help a decode-bound load, the front is undominated") {
  StepProfile p = linear(0.01, 5, 2);
  p.max_seqs = 4;
  const Workload w = fixed(40, 64, 64, 2000);
  const Slo slo{200, 20};
  const auto all = search(p, w, slo, 6);
  CHECK(all.size() == 15);  // p + d <= 6, both >= 1
  auto find = [&](int32_t pf, int32_t d) {
    for (const auto& o : all)
      if (o.placement.prefill == pf && o.placement.decode == d) return o;
    FAIL("missing");
    return Outcome{};
  };
  CHECK(find(1, 5).goodput >= find(1, 2).goodput);
  CHECK(find(1, 5).tpot_p90_ms < find(1, 1).tpot_p90_ms);
  const auto front = pareto_front(all);
  REQUIRE_FALSE(front.empty());
  for (const auto& f : front)
    for (const auto& o : all) {
      // (strictly, beyond the front's 1 % tolerance)
      const bool dominates = o.goodput >= f.goodput * 1.01 && o.ttft_p90_ms * 1.01 <= f.ttft_p90_ms &&
                             o.tpot_p90_ms * 1.01 <= f.tpot_p90_ms && o.placement.cost() < f.placement.cost();
      CHECK_FALSE(dominates);
    }
  // The cheapest configuration is always on the front (nothing is cheaper).
  bool cheapest = false;
  for (const auto& f : front) cheapest |= f.placement.cost() == 2;
  CHECK(cheapest);
  // Deterministic for a seed.
  CHECK(simulate(p, w, slo, {2, 3}).ttft_p90_ms == simulate(p, w, slo, {2, 3}).ttft_p90_ms);
}

TEST_CASE("planner: a hand-made front on a table") {
  auto row = [](int32_t pf, int32_t d, double goodput, double ttft, double tpot) {
    Outcome o;
    o.placement = {pf, d};
    o.goodput = goodput;
    o.ttft_p90_ms = ttft;
    o.tpot_p90_ms = tpot;
    return o;
  };
  const auto front = pareto_front({row(1, 1, 5, 100, 10),    // cheapest: kept
                                   row(1, 2, 8, 100, 8),     // better, dearer: kept
                                   row(2, 1, 8, 120, 9),     // same cost as (1,2), worse everywhere: dropped
                                   row(2, 2, 8, 90, 8),      // lower TTFT, dearer: kept
                                   row(3, 3, 8, 90, 8),      // dearer, no better: dropped
                                   row(1, 3, 8.02, 99.5, 8)}); // dearer than (1,2), better by < 1 %: dropped
  REQUIRE(front.size() == 3);
  CHECK(front[0].placement.decode == 2);  // goodput 8, cost 3 first
  CHECK(front[0].placement.prefill == 1);
  CHECK(front[1].placement.prefill == 2);
  CHECK(front[2].goodput == 5);
}

TEST_CASE("planner: profiles and workloads are checked by name") {
  CHECK(validate_profile(linear(0.1, 1, 1)).ok());
  CHECK(validate_profile(linear(-1, 1, 1)).message().find("prefill_ms_per_token") != std::string::npos);
  CHECK(validate_profile(linear(0, 1, 1)).message().find("a prefill step must take some time") != std::string::npos);
  auto parsed = parse_profile(profile_json(linear(0.25, 3, 0.5)));
  REQUIRE(parsed.ok());
  CHECK(parsed->prefill_ms_per_token == 0.25);
  CHECK(parsed->decode_ms_per_row == 0.5);
  for (auto [text, needle] : {std::pair<const char*, const char*>{"[1]", "not a JSON object"},
                              {"{\"prefill_ms\": \"x\"}", "prefill_ms must be a number"},
                              {"{\"speed\": 1}", "unknown field 'speed'"},
                              {"{\"max_seqs\": 1.5}", "max_seqs must be an integer"},
                              {"{\"prefill_ms_per_token\": 1, \"decode_ms\": 1, \"max_seqs\": 0}", "max_seqs must be 1"}}) {
    auto r = parse_profile(text);
    REQUIRE_FALSE(r.ok());
    CHECK_MESSAGE(r.status().message().find(needle) != std::string::npos, r.status().message());
  }
  Workload w;
  CHECK(validate_workload(w).ok());
  w.rate = 0;
  CHECK(validate_workload(w).message().find("rate") != std::string::npos);
  w = Workload{};
  w.prompt_max = 1;
  CHECK(validate_workload(w).message().find("prompt tokens") != std::string::npos);
}

TEST_CASE("planner: a trace replaces the Poisson arrivals, and the same arrivals give the same outcome") {
  const StepProfile p = linear(0.01, 1, 0.5);  // prefill 0.01 ms/token, decode 1 + 0.5 rows
  // Far apart: each request alone, its step costs exactly (as an idle cluster).
  Workload w;
  w.trace = {{0, 100, 5}, {1000, 200, 3}, {2000, 100, 9}};
  const Outcome o = simulate(p, w, Slo{}, Placement{});
  CHECK(o.ttft_p90_ms == doctest::Approx(2.0));   // the 200-token prompt
  CHECK(o.tpot_p90_ms == doctest::Approx(1.5));   // one row a step
  CHECK(o.goodput == doctest::Approx(1.0));       // 2 gaps over 2 s, everything meets no goal
  CHECK(trace_rate(w.trace) == doctest::Approx(1.0));
  // A trace written from a generated workload's arrivals gives its outcome.
  Workload gen = fixed(40, 64, 16, 300);
  gen.seed = 7;
  Workload replay;
  {
    std::mt19937_64 rng(gen.seed);  // as the simulation draws them
    std::exponential_distribution<double> gap(gen.rate);
    std::uniform_int_distribution<int32_t> prompt(64, 64), output(16, 16);
    double t = 0;
    for (int i = 0; i < gen.requests; ++i) {
      t += gap(rng) * 1e3;
      const int32_t pr = prompt(rng), out = output(rng);
      replay.trace.push_back({t, pr, out});
    }
  }
  const Slo slo{8, 3};
  const Outcome a = simulate(p, gen, slo, Placement{1, 2}), b = simulate(p, replay, slo, Placement{1, 2});
  CHECK(a.attainment == b.attainment);
  CHECK(a.ttft_p90_ms == b.ttft_p90_ms);
  CHECK(a.tpot_p90_ms == b.tpot_p90_ms);
  CHECK(b.goodput == doctest::Approx(trace_rate(replay.trace) * b.attainment));
}

TEST_CASE("planner: traces are parsed and checked by line and field") {
  auto t = parse_trace("{\"arrival_s\": 0.5, \"prompt_tokens\": 10, \"output_tokens\": 2}\n\n"
                       "{\"output_tokens\": 3, \"arrival_s\": 0.25, \"prompt_tokens\": 20}\n");
  REQUIRE(t.ok());
  REQUIRE(t->size() == 2);
  CHECK((*t)[0].arrival_ms == 250);  // sorted by arrival
  CHECK((*t)[0].prompt == 20);
  CHECK((*t)[1].output == 2);
  CHECK(trace_rate(*t) == doctest::Approx(4.0));
  const std::string ok = "{\"arrival_s\": 0, \"prompt_tokens\": 1, \"output_tokens\": 1}\n";
  for (auto [text, needle] : std::vector<std::pair<std::string, const char*>>{
           {ok, "at least 2 requests"},
           {ok + ok, "arrives at once"},
           {ok + "[1]\n", "line 2: not a JSON object"},
           {ok + "{\"arrival_s\": -1, \"prompt_tokens\": 1, \"output_tokens\": 1}", "line 2: arrival_s must be"},
           {ok + "{\"arrival_s\": 1, \"prompt_tokens\": 0, \"output_tokens\": 1}", "prompt_tokens must be an integer"},
           {ok + "{\"arrival_s\": 1, \"prompt_tokens\": 1, \"output_tokens\": 1.5}", "output_tokens must be"},
           {ok + "{\"arrival_s\": 1, \"prompt_tokens\": 1}", "missing output_tokens"},
           {ok + "{\"arrival_s\": 1, \"prompt_tokens\": 1, \"output_tokens\": 1, \"model\": \"x\"}",
            "unknown field 'model'"}}) {
    auto r = parse_trace(text);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == Code::invalid_argument);
    CHECK_MESSAGE(r.status().message().find(needle) != std::string::npos, r.status().message());
  }
  Workload w;
  w.trace = {{5, 1, 1}, {1, 1, 1}};
  CHECK(validate_workload(w).message().find("in order") != std::string::npos);
}

TEST_CASE("planner: calibration scales each role by its served steps over the profile's prediction") {
  const std::string metrics =
      "# TYPE cleave_actor_stat gauge\n"
      "cleave_actor_stat{actor=\"prefill/0\",name=\"steps\"} 100\n"
      "cleave_actor_stat{actor=\"prefill/0\",name=\"step_us\"} 300000\n"
      "cleave_actor_stat{actor=\"prefill/0\",name=\"prefill_tokens\"} 12800\n"
      "cleave_actor_stat{actor=\"p1/prefill/0\",name=\"steps\"} 100\n"  // a node's, summed in
      "cleave_actor_stat{actor=\"p1/prefill/0\",name=\"step_us\"} 300000\n"
      "cleave_actor_stat{actor=\"p1/prefill/0\",name=\"prefill_tokens\"} 12800\n"
      "cleave_actor_stat{actor=\"decode/0\",name=\"steps\"} 1000\n"
      "cleave_actor_stat{actor=\"decode/0\",name=\"step_us\"} 5000000\n"
      "cleave_actor_stat{actor=\"decode/0\",name=\"decode_rows\"} 4000\n"
      "cleave_actor_stat{actor=\"colocated/0\",name=\"steps\"} 77\n"  // mixes both phases: not counted
      "cleave_actor_stat{actor=\"router\",name=\"steps\"} 5\n"
      "cleave_stage_steps_total{stage=\"decode/0\"} 1000\n";
  auto run = parse_served_metrics(metrics);
  REQUIRE(run.ok());
  CHECK(run->prefill.steps == 200);
  CHECK(run->prefill.step_ms == 600);
  CHECK(run->prefill.prefill_tokens == 25600);
  CHECK(run->decode.steps == 1000);
  CHECK(run->decode.step_ms == 5000);
  CHECK(run->decode.decode_rows == 4000);
  // Profile: prefill 1 + 0.0125 x 128 = 2.6 ms a step against 3 served;
  // decode 1 + 0.5 x 4 = 3 ms against 5.
  StepProfile p = linear(0.0125, 1, 0.5);
  p.prefill_ms = 1;
  p.handoff_ms = 2;
  auto c = calibrate(p, *run);
  REQUIRE(c.ok());
  CHECK(c->prefill_factor == doctest::Approx(3.0 / 2.6));
  CHECK(c->decode_factor == doctest::Approx(5.0 / 3.0));
  const StepProfile q = calibrated(p, *c);
  CHECK(q.prefill_ms_per_token == doctest::Approx(0.0125 * 3.0 / 2.6));
  CHECK(q.decode_ms == doctest::Approx(5.0 / 3.0));
  CHECK(q.decode_ms_per_row == doctest::Approx(0.5 * 5.0 / 3.0));
  CHECK(q.handoff_ms == 2);
  // Between two snapshots only what the load added counts.
  ServedRun before = *run;
  before.decode.steps = 500;
  before.decode.step_ms = 1000;
  before.decode.decode_rows = 1000;
  auto d = served_between(before, *run);
  REQUIRE(d.ok());
  CHECK(d->decode.steps == 500);
  CHECK(d->decode.step_ms == 4000);
  CHECK(d->prefill.steps == 0);
  CHECK(served_between(*run, before).status().message().find("went down") != std::string::npos);
  // Refusals.
  CHECK(calibrate(p, *d).status().message().find("0 prefill steps, too few") != std::string::npos);
  StepProfile other = p;
  other.decode_ms = 100;  // another machine's or model's
  CHECK(calibrate(other, *run).status().message().find("decode steps took") != std::string::npos);
  CHECK(parse_served_metrics("cleave_actor_stat{actor=\"colocated/0\",name=\"steps\"} 5\n")
            .status()
            .message()
            .find("no prefill stage") != std::string::npos);
}

namespace {

// A served run whose steps took `fp` (prefill) and `fd` (decode) times what
// linear(0.0125, 1, 0.5) with prefill_ms 1 says: 100 prefill steps of 128
// tokens (2.6 ms each), 1000 decode steps of 4 rows (3 ms each).
LoadRun load_at(double rate, double fp, double fd, int32_t decode_stages = 1) {
  LoadRun l;
  l.rate = rate;
  l.run.prefill = ServedSteps{100, 260 * fp, 12800, 0};
  l.run.decode = ServedSteps{1000, 3000 * fd, 0, 4000};
  l.run.prefill_stages = 1;
  l.run.decode_stages = decode_stages;
  return l;
}

}  // namespace

TEST_CASE("planner: calibration over loads fits each role's slowdown per request/s a stage") {
  StepProfile p = linear(0.0125, 1, 0.5);
  p.prefill_ms = 1;
  // Prefill x1.2 at 10/s and x1.6 at 30/s; decode x1.1 and x1.3: lines
  // 1.4 + 0.02 (L - 20) and 1.2 + 0.01 (L - 20).
  auto q = calibrate_over_loads(p, {load_at(10, 1.2, 1.1), load_at(30, 1.6, 1.3)});
  REQUIRE(q.ok());
  CHECK(q->load_rate == doctest::Approx(20));
  CHECK(q->prefill_ms == doctest::Approx(1.4));
  CHECK(q->prefill_ms_per_token == doctest::Approx(0.0125 * 1.4));
  CHECK(q->decode_ms_per_row == doctest::Approx(0.5 * 1.2));
  CHECK(q->prefill_slowdown_per_rps == doctest::Approx(0.02 / 1.4));
  CHECK(q->decode_slowdown_per_rps == doctest::Approx(0.01 / 1.2));
  // Back on the line at each load, per stage of each role.
  const StepProfile at30 = at_load(*q, 30, 1, 1);
  CHECK(at30.prefill_ms == doctest::Approx(1.6));
  CHECK(at30.decode_ms_per_row == doctest::Approx(0.5 * 1.3));
  CHECK(at30.prefill_slowdown_per_rps == 0);
  const StepProfile spread = at_load(*q, 60, 2, 3);  // 30/s a prefill stage, 20/s a decoder
  CHECK(spread.prefill_ms == doctest::Approx(1.6));
  CHECK(spread.decode_ms == doctest::Approx(1.2));
  CHECK(at_load(*q, 0.001, 1, 1).prefill_ms == doctest::Approx(1.4 * (1 - 0.02 / 1.4 * (20 - 0.001))));
  CHECK(at_load(p, 500, 1, 1).prefill_ms == 1);  // no slowdown: any load
  // A load run by two decoders counts at half its rate for decode.
  auto two = calibrate_over_loads(p, {load_at(10, 1.2, 1.1), load_at(60, 1.6, 1.3, 2)});
  REQUIRE(two.ok());
  CHECK(two->decode_slowdown_per_rps == doctest::Approx((0.2 / 20) / (1.1 + 0.01 * (35 - 10))));
  // Three loads: least squares; a slowdown that falls with load counts as none.
  std::vector<Calibration> factors;
  auto three = calibrate_over_loads(p, {load_at(10, 1.2, 1.3), load_at(20, 1.5, 1.2), load_at(30, 1.6, 1.1)}, 20,
                                    &factors);
  REQUIRE(three.ok());
  REQUIRE(factors.size() == 3);  // each load's own factors, in order
  CHECK(factors[1].prefill_factor == doctest::Approx(1.5));
  CHECK(factors[2].decode_factor == doctest::Approx(1.1));
  CHECK(three->prefill_slowdown_per_rps == doctest::Approx(0.02 / (4.3 / 3)));
  CHECK(three->decode_slowdown_per_rps == 0);
  CHECK(three->decode_ms == doctest::Approx(1.2));
  // Refusals.
  for (auto [loads, needle] :
       {std::pair<std::vector<LoadRun>, const char*>{{load_at(10, 1, 1)}, "two or more calibrating loads"},
        {{load_at(10, 1, 1), load_at(10, 1.2, 1)}, "must differ in requests/s per stage"},
        {{load_at(10, 1, 1), load_at(0, 1.2, 1)}, "rate must be above 0"},
        {{load_at(10, 1, 1), load_at(30, 20, 1)}, "the load at 30.000000 requests/s: plan: prefill steps took"}}) {
    auto r = calibrate_over_loads(p, loads);
    REQUIRE_FALSE(r.ok());
    CHECK_MESSAGE(r.status().message().find(needle) != std::string::npos, r.status().message());
  }
}

TEST_CASE("planner: a profile's slowdown with load slows the simulated steps at the load simulated") {
  StepProfile p = linear(0.0125, 1, 0.5);
  p.prefill_ms = 1;
  auto q = calibrate_over_loads(p, {load_at(10, 1.2, 1.1), load_at(30, 1.6, 1.3)});
  REQUIRE(q.ok());
  // Two one-token requests far enough apart to meet no queue: TTFT is one
  // 128-token prefill step at the trace's rate (30/s: x1.6, 10/s: x1.2).
  for (auto [gap_ms, factor] : {std::pair<double, double>{1000.0 / 30, 1.6}, {100.0, 1.2}}) {
    Workload w;
    w.trace = {TraceRequest{0, 128, 1}, TraceRequest{gap_ms, 128, 1}};
    const Outcome o = simulate(*q, w, Slo{}, Placement{});
    CHECK(o.ttft_p90_ms == doctest::Approx(2.6 * factor));
  }
  // Saved and read back with its slowdowns; checked by name.
  auto back = parse_profile(profile_json(*q));
  REQUIRE(back.ok());
  CHECK(back->load_rate == doctest::Approx(20));
  CHECK(back->prefill_slowdown_per_rps == doctest::Approx(q->prefill_slowdown_per_rps));
  StepProfile bad = *q;
  bad.decode_slowdown_per_rps = 2;
  CHECK(validate_profile(bad).message().find("decode_slowdown_per_rps must be 0 to 1") != std::string::npos);
  bad = *q;
  bad.load_rate = 0;
  CHECK(validate_profile(bad).message().find("needs the load_rate") != std::string::npos);
  // The stage counts come from the distinct actors of each role.
  auto run = parse_served_metrics(
      "cleave_actor_stat{actor=\"prefill/0\",name=\"steps\"} 1\n"
      "cleave_actor_stat{actor=\"n1/decode/0\",name=\"steps\"} 1\n"
      "cleave_actor_stat{actor=\"n1/decode/0\",name=\"decode_rows\"} 1\n"
      "cleave_actor_stat{actor=\"n2/decode/0\",name=\"steps\"} 1\n");
  REQUIRE(run.ok());
  CHECK(run->prefill_stages == 1);
  CHECK(run->decode_stages == 2);
}

namespace {

// The served sums of steps (x ms, u units: a prefill step's tokens or a
// decode step's rows) into one role of a ServedSteps.
ServedSteps served(const std::vector<std::pair<double, double>>& steps, bool prefill) {
  ServedSteps s;
  for (auto [x, u] : steps) {
    s.steps += 1;
    s.step_ms += x;
    s.step_ms_sq += x * x;
    (prefill ? s.prefill_tokens : s.decode_rows) += u;
    (prefill ? s.tokens_sq : s.rows_sq) += u * u;
    (prefill ? s.step_ms_tokens : s.step_ms_rows) += x * u;
  }
  return s;
}

// n steps of f (a + b u) x a log-normal factor of mean 1 and coefficient
// of variation cv, u uniform in [lo, hi].
std::vector<std::pair<double, double>> noisy_steps(int n, double a, double b, double f, double cv, int lo, int hi,
                                                   uint64_t seed) {
  std::mt19937_64 rng(seed);
  const double sigma = std::sqrt(std::log1p(cv * cv));
  std::normal_distribution<double> z(-sigma * sigma / 2, sigma);
  std::uniform_int_distribution<int> u(lo, hi);
  std::vector<std::pair<double, double>> out;
  for (int i = 0; i < n; ++i) {
    const double units = u(rng);
    out.push_back({f * (a + b * units) * (cv > 0 ? std::exp(z(rng)) : 1.0), units});
  }
  return out;
}

}  // namespace

TEST_CASE("planner: steps that spread make one prefill stage M/G/1, and each step's factor is log-normal") {
  StepProfile p = linear(0.1, 1, 0);  // 100 tokens: S = 10 ms
  p.max_batch_tokens = 100;
  for (double cv : {0.5, 1.0}) {
    p.prefill_step_cv = cv;
    // Pollaczek-Khinchine: mean wait = rho S (1 + cv^2) / 2 (1 - rho); the
    // steps' mean stays S (busy = rho).
    for (double rho : {0.3, 0.7}) {
      CAPTURE(cv);
      CAPTURE(rho);
      const double service_ms = 10, rate = rho / (service_ms / 1e3);
      const Outcome o = simulate(p, fixed(rate, 100, 1, 100000), {}, {1, 1});
      const double wait_ms = rho * service_ms * (1 + cv * cv) / (2 * (1 - rho));
      CHECK(o.ttft_mean_ms == doctest::Approx(wait_ms + service_ms).epsilon(0.06));
      CHECK(o.prefill_busy == doctest::Approx(rho).epsilon(0.03));
    }
    // Alone (no queue), TTFT is one step: its p50 and p90 are the
    // log-normal's, exp(mu + z sigma) x S.
    const double sigma = std::sqrt(std::log1p(cv * cv)), mu = -sigma * sigma / 2;
    const Outcome alone = simulate(p, fixed(0.01, 100, 1, 20000), {}, {1, 1});
    CHECK(alone.ttft_mean_ms == doctest::Approx(10).epsilon(0.03));
    CHECK(alone.ttft_p50_ms == doctest::Approx(10 * std::exp(mu)).epsilon(0.03));
    CHECK(alone.ttft_p90_ms == doctest::Approx(10 * std::exp(mu + 1.2816 * sigma)).epsilon(0.03));
  }
  // Decode steps too: a lone request's TPOT is the mean of its steps.
  StepProfile d = linear(0.1, 2, 0);
  d.decode_step_cv = 0.8;
  const Outcome o = simulate(d, fixed(0.01, 10, 2, 20000), {}, {1, 1});
  const double sigma = std::sqrt(std::log1p(0.64));
  CHECK(o.tpot_p90_ms == doctest::Approx(2 * std::exp(-sigma * sigma / 2 + 1.2816 * sigma)).epsilon(0.03));
  // The same seed draws the same steps; no spread is exactly the old simulation.
  CHECK(simulate(d, fixed(50, 10, 20, 500), {}, {1, 1}).tpot_p90_ms ==
        simulate(d, fixed(50, 10, 20, 500), {}, {1, 1}).tpot_p90_ms);
  d.decode_step_cv = 0;
  CHECK(simulate(d, fixed(0.01, 10, 2, 100), {}, {1, 1}).tpot_p90_ms == 2);
}

TEST_CASE("planner: calibration measures the steps' spread from the served second moments") {
  StepProfile p = linear(0.0125, 1, 0.5);
  p.prefill_ms = 1;
  for (double cv : {0.0, 0.15, 0.6}) {
    CAPTURE(cv);
    ServedRun run;
    run.prefill = served(noisy_steps(4000, 1, 0.0125, 1.3, cv, 16, 256, 7), true);
    run.decode = served(noisy_steps(4000, 1, 0.5, 0.9, cv / 2, 1, 8, 8), false);
    run.prefill_stages = run.decode_stages = 1;
    auto c = calibrate(p, run);
    REQUIRE(c.ok());
    CHECK(c->prefill_factor == doctest::Approx(1.3).epsilon(0.03));
    CHECK(c->decode_factor == doctest::Approx(0.9).epsilon(0.03));
    CHECK(c->prefill_cv == doctest::Approx(cv).epsilon(0.08));
    CHECK(c->decode_cv == doctest::Approx(cv / 2).epsilon(0.08));
    if (cv == 0) CHECK(c->prefill_cv < 1e-6);
    const StepProfile q = calibrated(p, *c);
    CHECK(q.prefill_step_cv == c->prefill_cv);
    CHECK(q.decode_step_cv == c->decode_cv);
  }
  // Steps whose shape the profile gets wrong spread around it too: the
  // served steps cost 4 + 0 x tokens where the profile says 1 + 0.0125 t.
  ServedRun shape;
  shape.prefill = served({{4, 16}, {4, 256}, {4, 16}, {4, 256}}, true);
  shape.decode = served({{1.5, 1}, {4, 6}, {1.5, 1}, {4, 6}}, false);  // exactly x1: no spread
  shape.prefill_stages = shape.decode_stages = 1;
  auto c = calibrate(p, shape, 1);
  REQUIRE(c.ok());
  CHECK(c->prefill_cv > 0.3);
  CHECK(c->decode_cv < 1e-6);
  // No second moments (a server without them): no spread, not a refusal.
  ServedRun plain = shape;
  plain.prefill.step_ms_sq = plain.decode.step_ms_sq = 0;
  auto none = calibrate(p, plain, 1);
  REQUIRE(none.ok());
  CHECK(none->prefill_cv == 0);
  // Parsed from a stage's counters (us, us^2 and us x units) and
  // subtracted between snapshots.
  auto parsed = parse_served_metrics(
      "cleave_actor_stat{actor=\"prefill/0\",name=\"steps\"} 2\n"
      "cleave_actor_stat{actor=\"prefill/0\",name=\"step_us\"} 5000\n"
      "cleave_actor_stat{actor=\"prefill/0\",name=\"step_us_sq\"} 13000000\n"
      "cleave_actor_stat{actor=\"prefill/0\",name=\"step_tokens_sq\"} 20000\n"
      "cleave_actor_stat{actor=\"prefill/0\",name=\"step_us_tokens\"} 500000\n"
      "cleave_actor_stat{actor=\"decode/0\",name=\"steps\"} 1\n"
      "cleave_actor_stat{actor=\"decode/0\",name=\"step_rows_sq\"} 9\n"
      "cleave_actor_stat{actor=\"decode/0\",name=\"step_us_rows\"} 6000\n");
  REQUIRE(parsed.ok());
  CHECK(parsed->prefill.step_ms_sq == doctest::Approx(13));
  CHECK(parsed->prefill.tokens_sq == 20000);
  CHECK(parsed->prefill.step_ms_tokens == doctest::Approx(500));
  CHECK(parsed->decode.rows_sq == 9);
  CHECK(parsed->decode.step_ms_rows == doctest::Approx(6));
  ServedRun later = *parsed;
  later.prefill.step_ms_sq += 4;
  auto between = served_between(*parsed, later);
  REQUIRE(between.ok());
  CHECK(between->prefill.step_ms_sq == doctest::Approx(4));
  CHECK(served_between(later, *parsed).status().message().find("prefill counters went down") != std::string::npos);
}

TEST_CASE("planner: calibration over loads pools the loads' spread, and a saved profile keeps it") {
  StepProfile p = linear(0.0125, 1, 0.5);
  p.prefill_ms = 1;
  auto load = [&](double rate, double cv, int steps, uint64_t seed) {
    LoadRun l;
    l.rate = rate;
    l.run.prefill = served(noisy_steps(steps, 1, 0.0125, 1.2, cv, 128, 128, seed), true);
    l.run.decode = served(noisy_steps(steps, 1, 0.5, 1.1, 0, 4, 4, seed + 1), false);
    l.run.prefill_stages = l.run.decode_stages = 1;
    return l;
  };
  std::vector<Calibration> per;
  auto q = calibrate_over_loads(p, {load(10, 0.2, 1000, 1), load(30, 0.4, 3000, 2)}, 20, &per);
  REQUIRE(q.ok());
  REQUIRE(per.size() == 2);
  // sqrt((0.2^2 x 1000 + 0.4^2 x 3000) / 4000), from each load's measured cv.
  const double pooled = std::sqrt((per[0].prefill_cv * per[0].prefill_cv * 1000 +
                                   per[1].prefill_cv * per[1].prefill_cv * 3000) / 4000);
  CHECK(q->prefill_step_cv == doctest::Approx(pooled));
  CHECK(pooled == doctest::Approx(std::sqrt(0.13)).epsilon(0.08));
  CHECK(q->decode_step_cv < 1e-6);
  // at_load scales the costs and keeps the spread.
  CHECK(at_load(*q, 50, 1, 1).prefill_step_cv == q->prefill_step_cv);
  auto back = parse_profile(profile_json(*q));
  REQUIRE(back.ok());
  CHECK(back->prefill_step_cv == doctest::Approx(q->prefill_step_cv));
  StepProfile bad = p;
  bad.decode_step_cv = 6;
  CHECK(validate_profile(bad).message().find("decode_step_cv must be 0 to 5") != std::string::npos);
  CHECK(parse_profile("{\"prefill_ms\": 1, \"decode_ms\": 1, \"prefill_step_cv\": -0.5}")
            .status()
            .message()
            .find("prefill_step_cv must be 0 to 5") != std::string::npos);
}

TEST_CASE("planner: a saturated or empty moment gives a spread within the profile's bounds") {
  StepProfile p = linear(0.0125, 1, 0.5);
  p.prefill_ms = 1;
  ServedRun run;
  run.prefill = served(noisy_steps(100, 1, 0.0125, 1, 0, 128, 128, 3), true);
  run.decode = served(noisy_steps(100, 1, 0.5, 1, 0, 4, 4, 4), false);
  run.prefill.step_ms_sq = 1.8e13;  // a counter stuck at UINT64_MAX us^2
  run.prefill_stages = run.decode_stages = 1;
  auto c = calibrate(p, run);
  REQUIRE(c.ok());
  CHECK(c->prefill_cv == 5);
  CHECK(validate_profile(calibrated(p, *c)).ok());
  // Loads calibrated with no steps required (min_steps 0) and none served: spread 0, not NaN.
  LoadRun a, b;
  a.rate = 1;
  b.rate = 2;
  a.run.prefill_stages = a.run.decode_stages = b.run.prefill_stages = b.run.decode_stages = 1;
  a.run.prefill = b.run.prefill = served({{2.6, 128}}, true);
  a.run.decode = b.run.decode = served({{3, 4}}, false);
  a.run.prefill.steps = a.run.decode.steps = b.run.prefill.steps = b.run.decode.steps = 0;
  auto q = calibrate_over_loads(p, {a, b}, 0);
  REQUIRE(q.ok());
  CHECK(q->prefill_step_cv == 0);
  CHECK(q->decode_step_cv == 0);
}
