// The placement policies on tables (no actors): each row is a request and
// the candidates' state; the expected stage follows from the policy's rule.
#include <doctest/doctest.h>

#include <vector>

#include "actors/placement.h"

using namespace cleave;

namespace {

std::unique_ptr<PlacementPolicy> policy(const std::string& name, double pw = 1, double dw = 1) {
  PlacementConfig c;
  c.policy = name;
  c.prefill_weight = pw;
  c.decode_weight = dw;
  auto p = make_placement_policy(c);
  REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  REQUIRE((*p)->name() == name);
  return std::move(p.value());
}

GenerateRequest prompt(std::vector<int32_t> ids, int32_t max_tokens = 8) {
  GenerateRequest r;
  r.prompt = std::move(ids);
  r.sampling.max_tokens = max_tokens;
  return r;
}

std::vector<int32_t> run(int32_t first, int32_t n) {
  std::vector<int32_t> v;
  for (int32_t i = 0; i < n; ++i) v.push_back(first + i);
  return v;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("placement_request: chain hashes of full blocks, load in blocks, images in the key") {
  const auto r = placement_request(prompt(run(1, 40), 9), 16);
  CHECK(r.blocks.size() == 2);  // 40 tokens: two full blocks
  CHECK(r.load_blocks == 4);    // ceil((40 + 9) / 16)
  // A shared first block gives the same first hash; the chain makes the
  // second differ once anything before it differs.
  auto other = prompt(run(1, 40));
  other.prompt[20] = 999;
  const auto o = placement_request(other, 16);
  CHECK(o.blocks[0] == r.blocks[0]);
  CHECK(o.blocks[1] != r.blocks[1]);
  auto changed_first = prompt(run(1, 40));
  changed_first.prompt[0] = 999;
  CHECK(placement_request(changed_first, 16).blocks[1] != r.blocks[1]);
  // The same placeholder ids with another image are other blocks.
  auto a = prompt(std::vector<int32_t>(32, 0)), b = a;
  a.images.push_back({});
  a.images[0].position = 0;
  a.images[0].n_tokens = 32;
  a.images[0].hash = {1, 2};
  b.images = a.images;
  b.images[0].hash = {3, 4};
  CHECK(placement_request(a, 16).blocks != placement_request(b, 16).blocks);
  CHECK(placement_request(prompt(run(1, 15)), 16).blocks.empty());
}

TEST_CASE("least_loaded: fewest in flight, ties to the lowest stage") {
  auto p = policy("least_loaded");
  const auto r = placement_request(prompt(run(1, 20)), 16);
  struct Row {
    std::vector<Candidate> cs;
    int32_t want;
  };
  for (const Row& row : {Row{{{0, 2, 0}, {1, 1, 0}, {2, 1, 0}}, 1},
                         Row{{{3, 0, 0}, {1, 0, 0}}, 1},
                         Row{{{5, 7, 0}}, 5},
                         Row{{}, -1}}) {
    CHECK(p->pick(r, row.cs) == row.want);
  }
}

TEST_CASE("round_robin: alternates over the live stages and skips the dead") {
  auto p = policy("round_robin");
  const auto r = placement_request(prompt(run(1, 20)), 16);
  const std::vector<Candidate> three = {{0, 5, 0}, {1, 0, 0}, {2, 9, 0}};
  std::vector<int32_t> got;
  for (int i = 0; i < 7; ++i) got.push_back(p->pick(r, three));
  CHECK(got == std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0});  // load does not matter
  const std::vector<Candidate> without_1 = {{0, 0, 0}, {2, 0, 0}};
  CHECK(p->pick(r, without_1) == 2);
  CHECK(p->pick(r, without_1) == 0);
  CHECK(p->pick(r, {}) == -1);
}

TEST_CASE("least_loaded_prefix: the first block's stage while within 4 of the least") {
  auto p = policy("least_loaded_prefix");
  const auto a = placement_request(prompt(run(1, 40)), 16);
  p->placed(a, 2);
  const auto again = placement_request(prompt(concat(run(1, 16), run(500, 30))), 16);  // same first block
  CHECK(p->pick(again, {{0, 0, 0}, {2, 4, 0}}) == 2);  // 4 more: still the affinity stage
  CHECK(p->pick(again, {{0, 0, 0}, {2, 5, 0}}) == 0);  // 5 more: the least loaded
  CHECK(p->pick(again, {{0, 1, 0}, {1, 0, 0}}) == 1);  // stage 2 is not a candidate
  const auto other = placement_request(prompt(run(100, 40)), 16);
  CHECK(p->pick(other, {{0, 1, 0}, {2, 0, 0}}) == 2);  // no affinity: least loaded
  p->forget(2);
  CHECK(p->pick(again, {{0, 0, 0}, {2, 1, 0}}) == 0);
}

TEST_CASE("kv_aware: prefill_weight x blocks to compute + decode_weight x load, from what it placed") {
  auto p = policy("kv_aware");
  const std::vector<int32_t> system_prompt = run(1, 128);  // 8 blocks
  const auto first = placement_request(prompt(concat(system_prompt, run(900, 5))), 16);
  CHECK(first.blocks.size() == 8);
  // Nothing known: equal cost, ties to fewer in flight, then the lowest stage.
  CHECK(p->pick(first, {{0, 0, 0}, {1, 0, 0}}) == 0);
  CHECK(p->pick(first, {{0, 1, 0}, {1, 0, 0}}) == 1);
  p->placed(first, 1);
  const auto second = placement_request(prompt(concat(system_prompt, run(700, 20))), 16);
  CHECK(second.blocks.size() == 9);
  // Stage 1 holds 8 leading blocks: cost 1 + load vs 9 + load.
  CHECK(p->pick(second, {{0, 0, 0}, {1, 0, 0}}) == 1);
  CHECK(p->pick(second, {{0, 0, 0}, {1, 3, 7}}) == 1);   // 1 + 7 < 9
  CHECK(p->pick(second, {{0, 0, 0}, {1, 3, 9}}) == 0);   // 1 + 9 > 9: load wins
  // Only a leading run counts: a request that shares blocks 2..8 but not
  // block 0 gains nothing.
  auto shifted = concat({77}, system_prompt);
  CHECK(p->pick(placement_request(prompt(shifted), 16), {{0, 0, 0}, {1, 0, 1}}) == 0);
  // Weights from the script: load matters more than recompute.
  auto heavy_load = policy("kv_aware", 1, 4);
  heavy_load->placed(first, 1);
  CHECK(heavy_load->pick(second, {{0, 0, 0}, {1, 1, 3}}) == 0);  // 1 + 12 > 9
  auto heavy_prefill = policy("kv_aware", 4, 1);
  heavy_prefill->placed(first, 1);
  CHECK(heavy_prefill->pick(second, {{0, 0, 0}, {1, 1, 20}}) == 1);  // 4 + 20 < 36
  // A dead stage's blocks are forgotten.
  p->forget(1);
  CHECK(p->pick(second, {{0, 0, 0}, {1, 0, 0}}) == 0);
}

TEST_CASE("kv_aware in a KV pool: blocks on the stage's store cost 0, elsewhere fetch_weight, else prefill_weight") {
  auto p = policy("kv_aware");  // fetch_weight 0.05
  const auto r = placement_request(prompt(run(1, 128)), 16);  // 8 blocks
  REQUIRE(r.blocks.size() == 8);
  auto c = [](int32_t stage, int32_t in_flight, int64_t load, int32_t local, int32_t any) {
    Candidate x{stage, in_flight, load};
    x.pool_local = local;
    x.pool_any = any;
    return x;
  };
  // Stage 0 holds all 8 blocks but serves load 2 (cost 2); stage 1 holds none
  // and would fetch 8 (8 x 0.05 = 0.4): the KV moves to where the request lands.
  CHECK(p->pick(r, {c(0, 1, 2, 8, 8), c(1, 0, 0, 0, 8)}) == 1);
  // With no load difference the holder wins (0 < 0.4).
  CHECK(p->pick(r, {c(0, 0, 0, 0, 8), c(1, 0, 0, 8, 8)}) == 1);
  // Held nowhere: the load decides (8 to compute either way).
  CHECK(p->pick(r, {c(0, 0, 3, 0, 0), c(1, 0, 1, 0, 0)}) == 1);
  // A heavier fetch weight keeps requests on the holder despite its load:
  // 8 x 1 = 8 to fetch against a load of 2.
  PlacementConfig heavy;
  heavy.policy = "kv_aware";
  heavy.fetch_weight = 1;
  auto h = std::move(make_placement_policy(heavy).value());
  CHECK(h->pick(r, {c(0, 1, 2, 8, 8), c(1, 0, 0, 0, 8)}) == 0);
  // Partial runs: stage 0 holds 4 locally, the pool 6: 2 x 0.05 + 2 to compute
  // = 2.1 against stage 1's 6 x 0.05 + 2 = 2.3.
  CHECK(p->pick(r, {c(0, 0, 0, 4, 6), c(1, 0, 0, 0, 6)}) == 0);
}

TEST_CASE("kv_aware: the block table is bounded (LRU)") {
  PlacementConfig c;
  c.policy = "kv_aware";
  c.max_blocks = 4;
  auto p = std::move(make_placement_policy(c).value());
  const auto a = placement_request(prompt(run(1, 64)), 16);     // 4 blocks on stage 1
  const auto b = placement_request(prompt(run(1000, 64)), 16);  // 4 others on stage 2: a's go
  p->placed(a, 1);
  p->placed(b, 2);
  CHECK(p->pick(a, {{0, 0, 0}, {1, 0, 0}}) == 0);  // nothing of a is known any more
  CHECK(p->pick(b, {{0, 0, 0}, {2, 0, 0}}) == 2);
}

namespace {

// A cost_aware candidate: its node's cost, the request's predicted seconds
// there and, with a budget, its predicted cost (< 0: none).
Candidate priced(int32_t stage, int32_t in_flight, double cost, double predicted, double predicted_cost = -1) {
  Candidate x{stage, in_flight, 0};
  x.cost = cost;
  x.predicted_s = predicted;
  x.predicted_cost = predicted_cost;
  return x;
}

PlacementRequest limited(double limit_s, double max_cost = 0) {
  PlacementRequest r;
  r.limit_s = limit_s;
  r.max_cost = max_cost;
  return r;
}

struct PickRow {
  PlacementRequest r;
  std::vector<Candidate> cs;
  int32_t want;
};

}  // namespace

TEST_CASE("cost_aware: the best predicted seconds x cost among those within the limit") {
  auto p = policy("cost_aware");
  auto c = [](int32_t stage, int32_t in_flight, double cost, double predicted) {
    return priced(stage, in_flight, cost, predicted);
  };
  using Row = PickRow;
  const PlacementRequest any;
  for (const Row& row : {
           // Equal speed: the cheaper node.
           Row{any, {c(0, 0, 1.5, 0.1), c(1, 0, 1.0, 0.1)}, 1},
           // Twice as fast at 1.5x the cost: 0.05 x 1.5 < 0.1 x 1.
           Row{any, {c(0, 0, 1.5, 0.05), c(1, 0, 1.0, 0.1)}, 0},
           // A queue on the cheap node: 0.2 x 1 > 0.1 x 1.5.
           Row{any, {c(0, 3, 1.5, 0.1), c(1, 9, 1.0, 0.2)}, 0},
           // The limit: the cheap one (0.3 s) misses 0.25 s, the dear one meets it.
           Row{limited(0.25), {c(0, 0, 4.0, 0.2), c(1, 0, 1.0, 0.3)}, 0},
           // Both meet it: the score decides (0.3 x 1 < 0.2 x 4).
           Row{limited(0.5), {c(0, 0, 4.0, 0.2), c(1, 0, 1.0, 0.3)}, 1},
           // None meets it: the fastest, whatever it costs.
           Row{limited(0.1), {c(0, 0, 9.0, 0.2), c(1, 0, 1.0, 0.3), c(2, 0, 1.0, 0.25)}, 0},
           // Equal scores: fewer in flight, then the lowest index.
           Row{any, {c(0, 2, 2.0, 0.1), c(1, 1, 1.0, 0.2)}, 1},
           Row{any, {c(4, 1, 2.0, 0.1), c(3, 1, 1.0, 0.2)}, 3},
           // A candidate with nothing to predict from is skipped while others have a prediction.
           Row{any, {c(0, 0, 0.1, -1), c(1, 5, 1.0, 0.4)}, 1},
           // Nothing predicted anywhere: (in flight + 1) x cost.
           Row{any, {c(0, 0, 3.0, -1), c(1, 1, 1.0, -1)}, 1},   // 3 vs 2
           Row{any, {c(0, 0, 3.0, -1), c(1, 2, 1.0, -1)}, 0},   // 3 vs 3: fewer in flight
           Row{any, {c(0, 1, 3.0, -1), c(1, 4, 1.0, -1)}, 1},   // 6 vs 5
           Row{any, {}, -1},
       }) {
    CHECK(p->pick(row.r, row.cs) == row.want);
  }
  // Weights belong to kv_aware only.
  PlacementConfig weighted;
  weighted.policy = "cost_aware";
  weighted.decode_weight = 2;
  CHECK_FALSE(make_placement_policy(weighted).ok());
}

TEST_CASE("cost_aware with a budget: within it first, by the same rule, and when none is within, the cheapest") {
  auto p = policy("cost_aware");
  auto c = [](int32_t stage, double cost, double predicted, double predicted_cost) {
    return priced(stage, 0, cost, predicted, predicted_cost);
  };
  auto req = [](double max_cost, double limit = 0) { return limited(limit, max_cost); };
  using Row = PickRow;
  for (const Row& row : {
           // Without a budget the score decides: 0.05 x 3 < 0.2 x 1.
           Row{req(0), {c(0, 3.0, 0.05, 0.9), c(1, 1.0, 0.2, 0.4)}, 0},
           // A budget of 0.5 leaves only stage 1 (0.4), though its score is worse.
           Row{req(0.5), {c(0, 3.0, 0.05, 0.9), c(1, 1.0, 0.2, 0.4)}, 1},
           // Both within: the score again.
           Row{req(1.0), {c(0, 3.0, 0.05, 0.9), c(1, 1.0, 0.2, 0.4)}, 0},
           // Within the budget beats within the limit: stage 0 meets the
           // 0.1 s limit but not the budget, stage 1 the budget only.
           Row{req(0.5, 0.1), {c(0, 3.0, 0.05, 0.9), c(1, 1.0, 0.2, 0.4)}, 1},
           // Among those within: within the limit, then the score.
           Row{req(0.5, 0.25), {c(0, 1.0, 0.3, 0.3), c(1, 2.0, 0.2, 0.45), c(2, 9.0, 0.01, 5)}, 1},
           // None within: the cheapest, not the fastest.
           Row{req(0.1), {c(0, 3.0, 0.05, 0.9), c(1, 1.0, 0.2, 0.4), c(2, 2.0, 0.3, 0.6)}, 1},
           // A cost that cannot be predicted counts as within.
           Row{req(0.1), {c(0, 3.0, 0.05, -1), c(1, 1.0, 0.2, 0.4)}, 0},
           // Cold (nothing predicted): the budget does not reorder (in flight + 1) x cost.
           Row{req(0.1), {c(0, 3.0, -1, -1), c(1, 1.0, -1, -1)}, 1},
       }) {
    CHECK(p->pick(row.r, row.cs) == row.want);
  }
}

TEST_CASE("make_placement_policy refuses unknown names and misplaced or bad weights") {
  struct Bad {
    PlacementConfig c;
    const char* message;
  };
  PlacementConfig unknown;
  unknown.policy = "fastest";
  PlacementConfig weighted_rr;
  weighted_rr.policy = "round_robin";
  weighted_rr.prefill_weight = 2;
  PlacementConfig negative;
  negative.policy = "kv_aware";
  negative.decode_weight = -1;
  PlacementConfig fetch_rr;
  fetch_rr.policy = "least_loaded";
  fetch_rr.fetch_weight = 1;
  for (const Bad& b : {Bad{unknown, "unknown router policy 'fastest' (expected one of least_loaded_prefix, "
                                    "least_loaded, round_robin, kv_aware, cost_aware)"},
                       Bad{weighted_rr, "takes no prefill_weight"}, Bad{negative, ">= 0"},
                       Bad{fetch_rr, "fetch_weight (only kv_aware does)"}}) {
    auto p = make_placement_policy(b.c);
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().code() == Code::invalid_argument);
    CHECK_MESSAGE(p.status().message().find(b.message) != std::string::npos, p.status().message());
  }
}
