// Autoscaling with real actors: the router parks the entry stages beyond
// min_stages and unparks them against the TTFT goal (actors/scale_controller.h);
// a parked stage takes nothing new, and no request's tokens, text, finish
// reason or final logits change against the monolithic run.
#include <doctest/doctest.h>

#include <chrono>
#include <thread>

#include "actors/pipeline.h"
#include "tests/actors/pipeline_load.h"
#include "tests/actors/pipeline_util.h"

using namespace cleave;
using namespace cleave::testing;

namespace {

AutoscaleConfig goal(double ttft_ms) {
  AutoscaleConfig c;
  c.ttft_ms = ttft_ms;
  c.interval_s = 0.2;
  c.confirm = 1;
  c.cooldown_s = 0.2;
  return c;
}

uint64_t submitted_to(const std::vector<msg::Stats>& stats, const std::string& stage) {
  const msg::Stats* st = find_stats(stats, stage);
  REQUIRE(st);
  return st->get("scheduler_submitted");
}

// Submitted in waves of 8, 300 ms apart: a stage unparked after the first
// waves takes later ones (requests placed already stay where they are).
std::vector<Completion> run_in_waves(Pipeline& p, const std::vector<GenerateRequest>& requests) {
  Collector col;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (i > 0 && i % 8 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    REQUIRE(p.submit(requests[i], col.callback(requests[i].request_id)).ok());
  }
  REQUIRE(col.wait_done(requests.size(), std::chrono::seconds(180)));
  return col.in_order(requests);
}

}  // namespace

TEST_CASE("autoscale with real actors: a missed TTFT goal unparks stages, a met one keeps them parked, tokens stay mono's") {
  const Model& m = model(small_dense());
  const auto requests = long_requests(m, 64, 9300);
  const auto ref = mono_reference(m, requests);
  struct Case {
    const char* what;
    Topology topology;
    double ttft_ms;
    bool grows;
  };
  // 1 us nothing meets: all three entry stages come up. 1e6 ms anything
  // meets: the two parked ones never take a request.
  for (const Case& k : {Case{"colocated, goal missed", Topology::colocated, 0.001, true},
                        Case{"colocated, goal met", Topology::colocated, 1e6, false},
                        Case{"pd, goal missed", Topology::pd, 0.001, true}}) {
    const std::string what = k.what;
    CAPTURE(what);
    PipelineOptions o = k.topology == Topology::pd ? base_options(Topology::pd, 3, 1)
                                                   : base_options(Topology::colocated, 0, 0, 3);
    o.autoscale = goal(k.ttft_ms);
    auto p = make_pipeline(m, o);
    auto got = run_in_waves(*p, requests);
    check_identical(ref, got, k.what);
    auto stats = p->stats();
    const msg::Stats* router = find_stats(stats, "router");
    REQUIRE(router);
    CHECK(router->get("failures") == 0);
    CHECK(router->get("finished") == requests.size());
    CHECK(router->get("autoscale_active") + router->get("autoscale_parked") == 3);
    CHECK(router->get("autoscale_active") >= 1);
    const std::string kind = k.topology == Topology::pd ? "prefill/" : "colocated/";
    if (k.grows) {
      CHECK(router->get("autoscale_ups") >= 2);
      for (int i = 0; i < 3; ++i) CHECK(submitted_to(stats, kind + std::to_string(i)) > 0);
    } else {
      CHECK(router->get("autoscale_ups") == 0);
      CHECK(router->get("autoscale_active") == 1);
      CHECK(submitted_to(stats, kind + "0") == requests.size());
      CHECK(submitted_to(stats, kind + "1") == 0);
      CHECK(submitted_to(stats, kind + "2") == 0);
    }
    // Active stage-time is counted, and never more than 3 stages' worth.
    CHECK(router->get("autoscale_stage_ms") > 0);
    MESSAGE(what << ": " << router->get("autoscale_ups") << " up, " << router->get("autoscale_downs")
                 << " down, " << router->get("autoscale_stage_ms") << " stage-ms");
  }
}

TEST_CASE("autoscale: refused for mono, with pd_controller, beyond the entry stages and with bad fields") {
  const Model& m = model(small_dense());
  auto refused = [&](const PipelineOptions& o, const char* needle) { check_refused(m, o, needle); };
  PipelineOptions mono = base_options(Topology::mono);
  mono.autoscale = goal(100);
  refused(mono, "not mono");
  PipelineOptions both = base_options(Topology::pd, 2, 2);
  both.autoscale = goal(100);
  both.pd_controller.ttft_ms = 100;
  refused(both, "pd_controller");
  PipelineOptions many = base_options(Topology::colocated, 0, 0, 2);
  many.autoscale = goal(100);
  many.autoscale.min_stages = 3;
  refused(many, "min_stages 3 is more than the 2 colocated");
  PipelineOptions bad = base_options(Topology::colocated, 0, 0, 2);
  bad.autoscale = goal(100);
  bad.autoscale.forecast = "holt";  // without stage_rps
  refused(bad, "stage_rps");
  PipelineOptions unset_goal = base_options(Topology::colocated, 0, 0, 2);
  unset_goal.autoscale.forecast = "holt";
  unset_goal.autoscale.stage_rps = 4;  // a table without ttft_ms is not ignored
  refused(unset_goal, "ttft_ms");
}
