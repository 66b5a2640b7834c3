// Attention/FFN disaggregation in one process: stages that send each layer's
// FFN rows to expert actors (any placement, replicas, layer ranges, P/D) give
// the monolithic run's tokens and logits bit for bit; a killed expert actor's
// experts go to a replica, then to the stage itself, and no request fails;
// sets that leave an expert without a host are refused, naming it.
#include <doctest/doctest.h>

#include <chrono>

#include "actors/pipeline.h"
#include "model/experts.h"
#include "tests/actors/pipeline_load.h"
#include "tests/actors/pipeline_util.h"

using namespace cleave;
using namespace cleave::testing;

namespace {

ModelSpec moe8() {
  ModelSpec s = small_dense();
  s.n_layers = 3;
  s.n_experts = 8;
  s.n_experts_used = 2;
  s.ffn = 64;
  s.name = "actors-moe8";
  return s;
}

PipelineOptions with_experts(PipelineOptions o, std::vector<ExpertSet> sets, int32_t micro_batches = 1) {
  o.experts = std::move(sets);
  o.engine.expert_micro_batches = micro_batches;
  return o;
}

// The stage counters the expert dispatch adds, summed over the stages.
uint64_t stage_sum(const std::vector<msg::Stats>& all, const std::string& name) {
  uint64_t n = 0;
  for (const auto& s : all)
    if (s.actor.find("expert/") == std::string::npos && s.actor != "router" && s.actor != "kv_store")
      n += s.get(name);
  return n;
}

}  // namespace

TEST_CASE("experts: attention stages over expert actors give mono's tokens and logits, any placement") {
  const Model& m = model(moe8());
  const auto requests = mixed_requests(m, 120, 40000);
  const auto ref = mono_reference(m, requests);
  struct Case {
    const char* what;
    PipelineOptions options;
    int32_t expert_actors;
  };
  const std::vector<Case> cases = {
      {"mono, 2 hosts in process",
       with_experts(base_options(Topology::mono), {expert_set({0, 1, 2, 3}), expert_set({4, 5, 6, 7})}), 0},
      {"colocated 2 + 1 expert actor", with_experts(base_options(Topology::colocated, 0, 0, 2), {ExpertSet{}}), 1},
      {"colocated 1 + 2 expert actors",
       with_experts(base_options(Topology::colocated), {expert_set({0, 1, 2, 3}), expert_set({4, 5, 6, 7})}), 2},
      {"pd 1+2 + 4 expert actors",
       with_experts(base_options(Topology::pd, 1, 2),
                    {expert_set({0, 4}), expert_set({1, 5}), expert_set({2, 6}), expert_set({3, 7})}),
       4},
      {"colocated 2 + replicas",
       with_experts(base_options(Topology::colocated, 0, 0, 2), {ExpertSet{}, ExpertSet{}, expert_set({0, 1})}), 3},
      {"colocated 1 + layer ranges",
       with_experts(base_options(Topology::colocated), {expert_set({}, 0, 0), expert_set({}, 1, 2)}), 2},
      // Micro-batch ping-pong: several groups' layers in flight at once.
      {"mono, 2 hosts in process, 4 micro-batches",
       with_experts(base_options(Topology::mono), {expert_set({0, 1, 2, 3}), expert_set({4, 5, 6, 7})}, 4), 0},
      {"colocated 2 + 2 expert actors, 2 micro-batches",
       with_experts(base_options(Topology::colocated, 0, 0, 2), {expert_set({0, 1, 2, 3}), expert_set({4, 5, 6, 7})}, 2),
       2},
      {"pd 1+2 + replicas, 3 micro-batches",
       with_experts(base_options(Topology::pd, 1, 2), {ExpertSet{}, ExpertSet{}}, 3), 2},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    auto p = make_pipeline(m, c.options);
    check_identical(ref, run_all(*p, requests), c.what);
    const auto stats = p->stats();
    CHECK(stage_sum(stats, "expert_rows") > 0);
    CHECK(stage_sum(stats, "expert_fallback_rows") == 0);
    CHECK(stage_sum(stats, "expert_host_failures") == 0);
    for (int32_t i = 0; i < c.expert_actors; ++i) {
      const msg::Stats* e = find_stats(stats, "expert/" + std::to_string(i));
      REQUIRE_MESSAGE(e, "expert/" << i);
      CHECK(e->get("rows") > 0);  // every host took work
      CHECK(e->get("refused") == 0);
      // Its busy time per (layer, expert), within its total (each rounded down).
      uint64_t per_expert = 0, entries = 0;
      for (const auto& [name, v] : e->counters)
        if (name.rfind("busy_us_", 0) == 0) per_expert += v, ++entries;
      CHECK(entries > 0);
      CHECK(per_expert <= e->get("busy_us"));
      CHECK(per_expert + entries >= e->get("busy_us") * 9 / 10);
    }
    if (c.expert_actors > 0) CHECK(sum_counter(stats, "expert/", "rows") == stage_sum(stats, "expert_rows"));
  }
}

TEST_CASE("experts: a dense model's FFN as the one expert, split by layer over expert actors") {
  const Model& m = model(small_dense());
  const auto requests = mixed_requests(m, 60, 41000);
  const auto ref = mono_reference(m, requests);
  auto p = make_pipeline(m, with_experts(base_options(Topology::pd, 1, 1), {expert_set({0}, 0, 0), expert_set({}, 1, 1)}));
  check_identical(ref, run_all(*p, requests), "pd + dense FFN on 2 expert actors");
  const auto stats = p->stats();
  // Every row passes both layers: each expert actor saw the same rows.
  const msg::Stats* e0 = find_stats(stats, "expert/0");
  const msg::Stats* e1 = find_stats(stats, "expert/1");
  REQUIRE(e0);
  REQUIRE(e1);
  CHECK(e0->get("rows") > 0);
  CHECK(e0->get("rows") == e1->get("rows"));
}

TEST_CASE("experts: killed expert actors: replicas take over, then the stages compute, nothing fails") {
  const Model& m = model(moe8());
  const auto requests = long_requests(m, 40, 42000);
  const auto ref = mono_reference(m, requests);
  for (int32_t micro : {1, 2}) {  // with 2, a layer of each group is in flight when the actor dies
    CAPTURE(micro);
    auto p = make_pipeline(m, with_experts(base_options(Topology::colocated, 0, 0, 2), {ExpertSet{}, ExpertSet{}}, micro));
    Collector col;
    for (const GenerateRequest& r : requests) REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
    REQUIRE(col.wait_tokens(200, std::chrono::seconds(60)));
    REQUIRE(hooks(*p).kill_actor("expert", 0).ok());
    REQUIRE(col.wait_tokens(500, std::chrono::seconds(60)));
    const uint64_t fallback_before = stage_sum(p->stats(), "expert_fallback_rows");
    REQUIRE(hooks(*p).kill_actor("expert", 1).ok());
    REQUIRE(col.wait_done(requests.size(), std::chrono::seconds(120)));
    std::vector<Completion> got;
    for (const GenerateRequest& r : requests) got.push_back(col.done[r.request_id]);
    check_identical(ref, got, "colocated 2, both expert actors killed under load");
    const auto stats = p->stats();
    CHECK(stage_sum(stats, "expert_host_failures") >= 2);  // each stage found both gone
    CHECK(fallback_before == 0);                           // the replica took expert/0's share
    CHECK(stage_sum(stats, "expert_fallback_rows") > 0);   // then the stages computed
    CHECK(stage_sum(stats, "expert_hosts_alive") == 0);
    CHECK(find_stats(stats, "router")->get("failures") == 0);
  }
}

TEST_CASE("experts: hot-expert replication across expert actors evens their rows and never changes a token") {
  ModelSpec skewed = moe8();
  skewed.router_skew = 4;  // low-numbered experts win the top-2 more often
  skewed.name = "actors-moe8-skew";
  const Model& m = model(skewed);
  const auto requests = long_requests(m, 32, 43000);
  const auto ref = mono_reference(m, requests);
  const std::vector<ExpertSet> four = {expert_set({0, 1}), expert_set({2, 3}), expert_set({4, 5}),
                                       expert_set({6, 7})};
  double spread[2] = {0, 0};
  for (bool replicate : {false, true}) {
    CAPTURE(replicate);
    PipelineOptions o = with_experts(base_options(Topology::colocated), four);
    o.expert_replication = replicate;
    auto p = make_pipeline(m, o);
    check_identical(ref, run_all(*p, requests), replicate ? "replication on" : "replication off");
    const auto stats = p->stats();
    std::vector<uint64_t> rows;
    for (int i = 0; i < 4; ++i) rows.push_back(find_stats(stats, "expert/" + std::to_string(i))->get("rows"));
    spread[replicate] = load_spread(rows);
    const uint64_t added = stage_sum(stats, "expert_replicas_added");
    CHECK(sum_counter(stats, "expert/", "replicas_added") == added);  // each one the actor accepted
    if (replicate) CHECK(added > 0);
    else CHECK(added == 0);
    // The per-(layer, expert) routing counts add up to the rows dispatched.
    uint64_t routed = 0;
    for (const auto& st : stats)
      if (st.actor.find("colocated/") != std::string::npos)
        for (const auto& [name, v] : st.counters)
          if (name.rfind("expert_routed_rows_", 0) == 0) routed += v;
    CHECK(routed == stage_sum(stats, "expert_rows"));
    CHECK(stage_sum(stats, "expert_fallback_rows") == 0);
  }
  MESSAGE("expert actor rows spread: " << spread[0] << " without replication, " << spread[1] << " with");
  CHECK(spread[0] > 0.25);  // the skew shows
  CHECK(spread[1] < spread[0] / 2);
}

TEST_CASE("experts: expert_replication needs experts") {
  const Model& m = model(moe8());
  PipelineOptions o = base_options(Topology::colocated);
  o.expert_replication = true;
  auto p = Pipeline::create(m.file, m.tokenizer, o);
  CHECK(p.status().code() == Code::invalid_argument);
  CHECK(p.status().message().find("expert_replication needs experts") != std::string::npos);
}

TEST_CASE("experts: sets that leave an expert without a host, or name one the model lacks, are refused") {
  const Model& m = model(moe8());
  for (Topology t : {Topology::mono, Topology::colocated, Topology::pd}) {
    CAPTURE(topology_name(t));
    auto missing = Pipeline::create(m.file, m.tokenizer,
                                    with_experts(base_options(t), {expert_set({0, 1, 2, 3}), expert_set({4, 5, 6}, 0, 1),
                                                                   expert_set({4, 5, 6, 7}, 2, 2)}));
    CHECK(missing.status().code() == Code::not_found);
    CHECK(missing.status().message() == "expert 7 of layer 0 has no host");
    auto bad = Pipeline::create(m.file, m.tokenizer, with_experts(base_options(t), {expert_set({0, 8})}));
    CHECK(bad.status().code() == Code::invalid_argument);
    CHECK(bad.status().message().find("expert 8 is not one of the model's 8 experts") != std::string::npos);
    auto layers = Pipeline::create(m.file, m.tokenizer, with_experts(base_options(t), {expert_set({}, 0, 3)}));
    CHECK(layers.status().code() == Code::invalid_argument);
  }
}
