// Pipeline parallelism in one process: prefill, decode and colocated actors
// that hold the first layers and hand each micro-batch to pipeline stage
// actors for the rest give the monolithic run's tokens and logits bit for
// bit, for any cut, any micro-batch count, and prefill and decode cut
// differently (the hand-off's KV covers every layer, gathered from the
// prefill's stages and scattered over the decoder's). A killed stage takes
// its pipeline down: the requests finish on another pipeline, identical,
// or, with none left, fail unavailable at once.
#include <doctest/doctest.h>

#include <chrono>
#include <thread>

#include "actors/pipeline.h"
#include "tests/actors/pipeline_load.h"
#include "tests/actors/pipeline_util.h"

using namespace cleave;
using namespace cleave::testing;

namespace {

ModelSpec four_layers(const char* name, int kv_heads, int experts = 0) {
  ModelSpec s = small_dense();
  s.n_layers = 4;
  s.n_kv_heads = kv_heads;
  if (experts) {
    s.n_experts = experts;
    s.n_experts_used = 2;
    s.ffn = 64;
  }
  s.name = name;
  return s;
}

using Cut = std::vector<LayerRange>;
const Cut kWhole = {};
const Cut kTwo = {{0, 1}, {2, 3}};
const Cut kTwoLate = {{0, 2}, {3, 3}};
const Cut kThree = {{0, 0}, {1, 2}, {3, 3}};
const Cut kFour = {{0, 0}, {1, 1}, {2, 2}, {3, 3}};

PipelineOptions cut(PipelineOptions o, Cut prefill, Cut decode, int32_t micro_batches) {
  if (o.topology == Topology::pd) {
    o.prefill_pipeline = std::move(prefill);
    o.decode_pipeline = std::move(decode);
  } else {
    o.colocated_pipeline = std::move(prefill);
  }
  o.engine.pipeline_micro_batches = micro_batches;
  return o;
}

struct Case {
  const char* what;
  PipelineOptions options;
  int32_t stage_actors;  // pipeline stage actors it runs
};

std::vector<Case> cases(bool all) {
  std::vector<Case> c = {
      {"mono, 2 stages on threads, 2 micro-batches", cut(base_options(Topology::mono), kTwo, {}, 2), 0},
      {"colocated 1, 3 stages, 3 micro-batches", cut(base_options(Topology::colocated), kThree, {}, 3), 2},
      {"pd: prefill over 2 stages -> decode on 1", cut(base_options(Topology::pd), kTwo, kWhole, 2), 1},
      {"pd: prefill on 1 -> decode over 2 stages", cut(base_options(Topology::pd), kWhole, kTwoLate, 2), 1},
  };
  if (!all) return c;
  c.push_back({"colocated 2, 4 stages each, 4 micro-batches",
               cut(base_options(Topology::colocated, 0, 0, 2), kFour, {}, 4), 6});
  c.push_back({"colocated 1, 2 stages, 1 micro-batch", cut(base_options(Topology::colocated), kTwoLate, {}, 1), 1});
  c.push_back({"pd 2+2: prefill over 3 stages -> decode over 2 cut elsewhere",
               cut(base_options(Topology::pd, 2, 2), kThree, kTwo, 3), 6});
  c.push_back({"pd: prefill over 4 -> decode over 3", cut(base_options(Topology::pd), kFour, kThree, 4), 5});
  return c;
}

}  // namespace

TEST_CASE("pipeline stages: any cut, micro-batch count and P/D cut give mono's tokens and logits") {
  struct M {
    ModelSpec spec;
    bool all;  // every case, or the first four
  };
  for (const M& mm : {M{four_layers("pp-gqa", 2), true}, M{four_layers("pp-dense", 4), false},
                      M{four_layers("pp-moe", 2, 4), false}}) {
    const Model& m = model(mm.spec);
    const auto requests = mixed_requests(m, 100, 60000);
    const auto ref = mono_reference(m, requests);
    for (const Case& c : cases(mm.all)) {
      CAPTURE(mm.spec.name);
      CAPTURE(c.what);
      auto p = make_pipeline(m, c.options);
      check_identical(ref, run_all(*p, requests), c.what);
      const auto stats = p->stats();
      for (int32_t i = 0; i < c.stage_actors; ++i) {
        const msg::Stats* s = find_stats(stats, "stage/" + std::to_string(i));
        REQUIRE_MESSAGE(s, "stage/" << i);
        CHECK(s->get("stage_batches") > 0);
        CHECK(s->get("failures") == 0);
        CHECK(s->get("stage_busy_us") > 0);
      }
      if (c.options.topology != Topology::mono) {
        CHECK(find_stats(stats, "stage/" + std::to_string(c.stage_actors)) == nullptr);
        uint64_t heads_mb = 0;
        for (const auto& s : stats) heads_mb += s.get("pipeline_micro_batches");
        CHECK(heads_mb > 0);
        const msg::Stats* router = find_stats(stats, "router");
        REQUIRE(router);
        CHECK(router->get("failures") == 0);
      }
    }
  }
}

TEST_CASE("pipeline stages: a killed stage fails its pipeline over to the other one, identical") {
  const Model& m = model(four_layers("pp-gqa", 2));
  const auto requests = long_requests(m, 30, 61000);
  const auto ref = mono_reference(m, requests);
  auto p = make_pipeline(m, cut(base_options(Topology::colocated, 0, 0, 2), kTwo, {}, 2));
  Collector col;
  for (const auto& r : requests) REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
  REQUIRE(col.wait_tokens(requests.size() * 4, std::chrono::seconds(60)));
  REQUIRE(hooks(*p).kill_actor("stage", 0).ok());
  REQUIRE(col.wait_done(requests.size(), std::chrono::seconds(120)));
  check_identical(ref, col.in_order(requests), "after a stage was killed");
  const auto stats = p->stats();
  const msg::Stats* router = find_stats(stats, "router");
  REQUIRE(router);
  CHECK(router->get("stage_downs") == 1);  // the pipeline's first stage went with it
  CHECK(router->get("replacements") > 0);
  CHECK(router->get("failures") == 0);
  CHECK(p->alive("colocated") == 1);
  CHECK(find_stats(stats, "stage/0") == nullptr);
  // Later requests run on the surviving pipeline.
  check_identical(ref, run_all(*p, requests), "on the surviving pipeline");
}

TEST_CASE("pipeline stages: later stages taken down with their first stage still report their counters") {
  // The first stage links its later stages: killing it takes them down. A
  // node that loses its head prints its stats after that can have happened
  // (the node of a pipeline's first stage exits first), so what they did
  // must not go with them.
  const Model& m = model(four_layers("pp-gqa", 2));
  const auto requests = mixed_requests(m, 20, 63000);
  auto p = make_pipeline(m, cut(base_options(Topology::colocated, 0, 0, 2), kTwo, {}, 2));
  run_all(*p, requests);
  uint64_t batches = 0;
  const auto before = p->stats();
  for (const char* name : {"stage/0", "stage/1"}) {
    const msg::Stats* s = find_stats(before, name);
    REQUIRE_MESSAGE(s, name);
    batches += s->get("stage_batches");
  }
  REQUIRE(batches > 0);
  REQUIRE(hooks(*p).kill_actor("colocated", 0).ok());
  REQUIRE(hooks(*p).kill_actor("colocated", 1).ok());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (p->alive("colocated") > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(p->alive("colocated") == 0);
  const auto stats = p->stats();
  uint64_t after = 0;
  for (const char* name : {"stage/0", "stage/1"}) {
    const msg::Stats* s = find_stats(stats, name);
    REQUIRE_MESSAGE(s, name << " after its first stage went");
    after += s->get("stage_batches");
    CHECK(s->get("failures") == 0);
  }
  CHECK(after == batches);
}

TEST_CASE("pipeline stages: a killed stage with no other pipeline ends every request unavailable at once") {
  const Model& m = model(four_layers("pp-gqa", 2));
  const auto requests = long_requests(m, 20, 62000);
  auto p = make_pipeline(m, cut(base_options(Topology::colocated), kThree, {}, 2));
  Collector col;
  for (const auto& r : requests) REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
  REQUIRE(col.wait_tokens(requests.size() * 2, std::chrono::seconds(60)));
  REQUIRE(hooks(*p).kill_actor("stage", 1).ok());  // the last stage
  const auto killed = std::chrono::steady_clock::now();
  REQUIRE(col.wait_done(requests.size(), std::chrono::seconds(5)));
  const auto [failed, worst] = unavailable_failures(col, killed);
  CHECK(failed > 0);
  CHECK(worst < 1.0);
  MESSAGE("failed " << failed << " requests, the last " << worst * 1000 << " ms after the kill");
  CHECK(p->alive("colocated") == 0);
}

TEST_CASE("pipeline stages: bad cuts and combinations are refused, naming the problem") {
  const Model& m = model(four_layers("pp-gqa", 2));
  auto refused = [&](const PipelineOptions& o) {
    auto p = Pipeline::create(m.file, m.tokenizer, o);
    REQUIRE(!p.ok());
    CHECK(p.status().code() == Code::invalid_argument);
    return p.status().message();
  };
  CHECK(refused(cut(base_options(Topology::colocated), {{0, 1}, {3, 3}}, {}, 1)) ==
        "pipeline cut: layers [2, 2] are held by no stage (a gap before [3, 3])");
  CHECK(refused(cut(base_options(Topology::pd), kTwo, {{0, 2}, {2, 3}}, 1)) ==
        "pipeline cut: layers [2, 3] overlap [2, 2] of the stage before");
  CHECK(refused(cut(base_options(Topology::mono), {{0, 1}, {2, 4}}, {}, 1)) ==
        "pipeline cut: layers [2, 4] go past the model's layers [0, 3]");
  PipelineOptions o = cut(base_options(Topology::colocated), kTwo, {}, 1);
  o.prefill_pipeline = kTwo;
  CHECK(refused(o).find("prefill_pipeline and decode_pipeline are for the pd topology") == 0);
  o = cut(base_options(Topology::colocated), kTwo, {}, 1);
  o.experts = {ExpertSet{}};
  CHECK(refused(o).find("pipeline stages and expert actors together are not supported") == 0);
  o = cut(base_options(Topology::colocated), kTwo, {}, 65);
  CHECK(refused(o).find("pipeline_micro_batches = 65") != std::string::npos);
}
