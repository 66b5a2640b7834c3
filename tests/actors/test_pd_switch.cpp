// The adaptive P:D ratio with real actors: the router's controller
// (actors/pd_controller.h) moves stages between prefill and decode under
// load, each switching stage drains first (its requests move to stages of
// its role), and no request's tokens, text, finish reason or final logits
// change against the monolithic run.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "actors/pipeline.h"
#include "tests/actors/pipeline_load.h"
#include "tests/actors/pipeline_util.h"

using namespace cleave;
using namespace cleave::testing;

namespace {

PdControllerConfig eager(double ttft_ms, double tpot_ms) {
  PdControllerConfig c;
  c.ttft_ms = ttft_ms;
  c.tpot_ms = tpot_ms;
  c.interval_s = 0.2;
  c.confirm = 1;
  c.cooldown_s = 0.2;
  return c;
}

}  // namespace

TEST_CASE("pd controller with real actors: stages switch roles toward the goal that is missed, tokens stay mono's") {
  const Model& m = model(small_dense());
  const auto requests = long_requests(m, 96, 9100);
  const auto ref = mono_reference(m, requests);
  struct Case {
    const char* what;
    int32_t p, d;
    PdControllerConfig goals;
    const char* grows;  // the role that gains stages
  };
  // A TTFT goal nothing meets (1 us) against a TPOT goal anything meets: the
  // decoders go to prefill, down to one; and the reverse. A switching stage
  // finishes its requests first (a grace longer than any run: none moves)
  // or hands them over at once (grace 0: they move, recomputed or read from
  // the store, with the same tokens).
  auto graced = [](PdControllerConfig c, double grace) {
    c.switch_grace_s = grace;
    return c;
  };
  for (const Case& k : {Case{"TTFT missed, moved at once", 1, 3, graced(eager(0.001, 1e6), 0), "prefill"},
                        Case{"TPOT missed, moved at once", 3, 1, graced(eager(1e6, 0.001), 0), "decode"},
                        Case{"TTFT missed, finished first", 1, 3, graced(eager(0.001, 1e6), 600), "prefill"},
                        Case{"TPOT missed, finished first", 3, 1, graced(eager(1e6, 0.001), 600), "decode"}}) {
    const std::string what = k.what;
    CAPTURE(what);
    PipelineOptions o = base_options(Topology::pd, k.p, k.d);
    o.pd_controller = k.goals;
    auto p = make_pipeline(m, o);
    auto got = run_all(*p, requests);
    check_identical(ref, got, k.what);
    auto stats = p->stats();
    const msg::Stats* router = find_stats(stats, "router");
    REQUIRE(router);
    const bool to_prefill = std::string(k.grows) == "prefill";
    CHECK(router->get("failures") == 0);
    CHECK(router->get("finished") == requests.size());
    CHECK(router->get(to_prefill ? "role_switches_to_prefill" : "role_switches_to_decode") >= 1);
    CHECK(router->get(to_prefill ? "role_switches_to_decode" : "role_switches_to_prefill") == 0);
    CHECK(router->get("role_switch_failures") == 0);
    // Never below one stage of a role.
    CHECK(router->get("alive_prefill") >= 1);
    CHECK(router->get("alive_decode") >= 1);
    CHECK(router->get(to_prefill ? "alive_prefill" : "alive_decode") >= 2);
    if (k.goals.switch_grace_s > 0) CHECK(router->get("migrated") == 0);  // every request finished where it was
    MESSAGE(what << ": " << router->get("role_switches") << " switches, " << router->get("migrated")
                   << " requests moved; now P" << router->get("alive_prefill") << " D"
                   << router->get("alive_decode"));
  }
}

// A decode side with no free row does not step slower: its hand-offs
// wait. One decoder holding one sequence at a time, against a TPOT goal
// its steps meet many times over (50 ms): the waits between a request's
// first token (from prefill) and its next (once the decoder has a row) are
// what the client's TPOT misses, and the controller sees them (the
// hand-off's gaps, and requests stalled past the goal), so a prefill stage
// moves to decode. Counting only gaps between tokens of one stage, it saw
// the steps alone and never moved. While it runs, the router's stats carry
// each decision's pressures (pd_*_milli): the TPOT one must pass the goal
// (1000), the TTFT one stay near 0 (its goal is 1e6 ms).
TEST_CASE("pd controller with real actors: hand-offs waiting for a decode row move a prefill stage to decode") {
  const Model& m = model(small_dense());
  const auto requests = long_requests(m, 48, 9300);
  const auto ref = mono_reference(m, requests);
  PipelineOptions o = base_options(Topology::pd, 3, 1);
  o.engine.max_seqs = 1;
  o.pd_controller = eager(1e6, 50);
  o.pd_controller.switch_grace_s = 600;  // what a switching prefill stage holds finishes there
  auto p = make_pipeline(m, o);
  Collector col;
  for (const GenerateRequest& r : requests) REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
  uint64_t peak_tpot = 0, peak_ttft = 0, peak_busy = 0, polls = 0, with_busy = 0;
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!col.wait_done(requests.size(), std::chrono::seconds(0)) && std::chrono::steady_clock::now() < limit) {
    const auto live = p->stats();
    if (const msg::Stats* r = find_stats(live, "router")) {
      ++polls;
      peak_tpot = std::max(peak_tpot, r->get("pd_tpot_pressure_milli"));
      peak_ttft = std::max(peak_ttft, r->get("pd_ttft_pressure_milli"));
      for (const auto& [k, v] : r->counters)
        if (k == "pd_prefill_busy_milli") {
          ++with_busy;
          peak_busy = std::max(peak_busy, v);
        }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(col.wait_done(requests.size(), std::chrono::seconds(60)));
  check_identical(ref, col.in_order(requests), "hand-offs waiting");
  MESSAGE("pressures over " << polls << " polls: TPOT peak " << peak_tpot << ", TTFT peak " << peak_ttft
                            << " (thousandths); prefill busy in " << with_busy << ", peak " << peak_busy);
  CHECK(peak_tpot > 1000);
  CHECK(peak_ttft < 100);
  CHECK(peak_busy <= 1000);  // a fraction (present only after an interval with arrivals)
  auto stats = p->stats();
  const msg::Stats* router = find_stats(stats, "router");
  REQUIRE(router);
  CHECK(router->get("failures") == 0);
  CHECK(router->get("finished") == requests.size());
  CHECK(router->get("role_switches_to_decode") >= 1);
  CHECK(router->get("role_switches_to_prefill") == 0);
  CHECK(router->get("alive_decode") >= 2);
  // The queue on the old decoder moved to the new one when it switched.
  CHECK(router->get("handoffs_rebalanced") >= 1);
  MESSAGE("hand-offs waiting: now P" << router->get("alive_prefill") << " D" << router->get("alive_decode") << ", "
                                     << router->get("handoffs_rebalanced") << " waiting hand-offs moved");
}

// The controller's prefill load counts each prompt once as it arrives: a
// prefill stage that dies with prompts queued has them placed again on
// the other, and they are not new arrivals (counted twice, they would read
// as a shift to longer prompts and call for a move to prefill).
TEST_CASE("pd controller with real actors: prompts placed again after a prefill stage dies arrive once") {
  const Model& m = model(small_dense());
  const auto requests = long_requests(m, 48, 9500);
  const auto ref = mono_reference(m, requests);
  PipelineOptions o = base_options(Topology::pd, 2, 1);
  o.engine.max_seqs = 1;                  // the prompts queue on the prefill stages
  o.pd_controller = eager(1e6, 1e6);      // goals always met: it observes, never moves
  auto p = make_pipeline(m, o);
  Collector col;
  for (const GenerateRequest& r : requests) REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
  REQUIRE(hooks(*p).kill_actor("prefill", 0).ok());
  REQUIRE(col.wait_done(requests.size(), std::chrono::seconds(120)));
  check_identical(ref, col.in_order(requests), "after a prefill stage died");
  auto stats = p->stats();
  const msg::Stats* router = find_stats(stats, "router");
  REQUIRE(router);
  CHECK(router->get("stage_downs") == 1);
  CHECK(router->get("failures") == 0);
  CHECK(router->get("replacements") >= 1);  // it held prompts when it died...
  CHECK(router->get("pd_arrivals") == requests.size());  // ...which arrived once
  CHECK(router->get("role_switches") == 0);
  MESSAGE("prefill stage down: " << router->get("replacements") << " placed again, "
                                 << router->get("pd_arrivals") << " arrivals");
}

// interval_s under the router's 200 ms tick is kept, not rounded up to the
// tick: with 20 ms the controller decides about 50 times a second (at the
// tick's pace it would be 5).
TEST_CASE("pd controller with real actors: it decides every interval_s, also below the router's tick") {
  const Model& m = model(small_dense());
  const auto requests = long_requests(m, 24, 9400);
  PipelineOptions o = base_options(Topology::pd, 1, 1);
  o.pd_controller = eager(1e6, 1e6);  // goals always met: it decides, never moves
  o.pd_controller.interval_s = 0.02;
  const auto t0 = std::chrono::steady_clock::now();  // before the router starts: no decision before it
  auto p = make_pipeline(m, o);
  CHECK(run_all(*p, requests).size() == requests.size());
  // At least a second of run for the count to mean something.
  while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1200))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto stats = p->stats();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const msg::Stats* router = find_stats(stats, "router");
  REQUIRE(router);
  CHECK(router->get("finished") == requests.size());
  CHECK(router->get("role_switches") == 0);
  const double per_s = double(router->get("pd_decisions")) / seconds;
  MESSAGE("pd decisions: " << per_s << " a second");
  CHECK(per_s >= 15);   // 50 expected; the tick's pace gives 5
  CHECK(per_s <= 55);   // and not more often than asked
}

TEST_CASE("pd controller: refused outside pd, with pipeline stages, and with bad goals") {
  const Model& m = model(small_dense());
  auto refused = [&](const PipelineOptions& o, const char* needle) { check_refused(m, o, needle); };
  PipelineOptions colocated = base_options(Topology::colocated, 0, 0, 2);
  colocated.pd_controller = eager(100, 10);
  refused(colocated, "needs the pd topology");
  PipelineOptions bad = base_options(Topology::pd, 1, 1);
  bad.pd_controller = eager(100, 10);
  bad.pd_controller.confirm = 0;
  refused(bad, "confirm");
  PipelineOptions negative = base_options(Topology::pd, 1, 1);
  negative.pd_controller.ttft_ms = -5;
  refused(negative, "ttft_ms");
}
