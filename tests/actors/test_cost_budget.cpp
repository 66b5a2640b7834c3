// A request's cost budget on tables (no actors): the predictor is fed given
// times, so each expected cost follows by hand.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "actors/cost_budget.h"

using namespace cleave;

namespace {

GenerateRequest budgeted(int64_t prompt, int32_t max_tokens, double max_cost) {
  GenerateRequest r;
  r.request_id = 7;
  r.prompt.assign(size_t(prompt), 1);
  r.sampling.max_tokens = max_tokens;
  r.max_cost = max_cost;
  return r;
}

// Stage 0 prefills 1,000 tokens/s and decodes a token every 10 ms; stage 1
// 2,000 tokens/s and 20 ms. Nothing else is measured.
SloPredictor measured() {
  SloPredictor p(1.0);
  p.placed(0, 1, 100, 0.0);
  p.first_token(1, 0.1);
  p.placed(1, 2, 100, 0.0);
  p.first_token(2, 0.05);
  p.token_gap(0, 0.01);
  p.token_gap(1, 0.02);
  return p;
}

}  // namespace

TEST_CASE("cost budget: the tokens decoded after the first") {
  CHECK(decode_tokens(budgeted(1, 11, 1), 0) == 10);  // the first comes from prefill
  CHECK(decode_tokens(budgeted(1, 11, 1), 1) == 10);
  CHECK(decode_tokens(budgeted(1, 11, 1), 4) == 7);
  CHECK(decode_tokens(budgeted(1, 1, 1), 0) == 0);
  CHECK(decode_tokens(budgeted(1, 0, 1), 0) == 0);
  CHECK(decode_tokens(budgeted(1, 3, 1), 9) == 0);
}

TEST_CASE("cost budget: prefill and decode priced from the measured rates, costs and rows") {
  const SloPredictor p = measured();
  const CostStage a{0, 1.0, 0}, b{1, 3.0, 1};
  // 200 tokens at 1,000/s on cost 1: 0.2; at 2,000/s on cost 3: 0.3.
  CHECK(*prefill_cost(p, a, 200, {0, 1}) == doctest::Approx(0.2));
  CHECK(*prefill_cost(p, b, 200, {0, 1}) == doctest::Approx(0.3));
  // 10 tokens x 10 ms alone on cost 1: 0.1; x 20 ms shared by 2 rows on cost 3: 0.3.
  CHECK(*decode_cost(p, a, 10, {0, 1}) == doctest::Approx(0.1));
  CHECK(*decode_cost(p, b, 10, {0, 1}) == doctest::Approx(0.3));
  // More rows in the step: a smaller share of it.
  CHECK(*decode_cost(p, CostStage{0, 1.0, 4}, 10, {0, 1}) == doctest::Approx(0.02));
  CHECK(*decode_cost(p, a, 0, {}) == 0.0);  // nothing to decode costs nothing, measured or not
  // A stage not measured yet: its peers' mean (1,500 tokens/s, 15 ms).
  const CostStage fresh{5, 2.0, 0};
  CHECK(*prefill_cost(p, fresh, 300, {0, 1, 5}) == doctest::Approx(300 / 1500.0 * 2));
  CHECK(*decode_cost(p, fresh, 10, {0, 1, 5}) == doctest::Approx(10 * 0.015 * 2));
  // Nothing measured among the peers: no prediction.
  CHECK_FALSE(prefill_cost(p, fresh, 300, {5}));
  CHECK_FALSE(decode_cost(p, fresh, 10, {5}));
}

TEST_CASE("cost budget: the cheapest way to serve, colocated and disaggregated") {
  const SloPredictor p = measured();
  const GenerateRequest r = budgeted(200, 11, 1);
  const std::vector<CostStage> both = {{0, 1.0, 0}, {1, 3.0, 1}};
  // Colocated: each stage does both; 0.2 + 0.1 on stage 0 against 0.3 + 0.3.
  auto q = cheapest_cost(p, r, both, both, false);
  REQUIRE(q);
  CHECK(q->total == doctest::Approx(0.3));
  CHECK(q->entry.stage == 0);
  CHECK(q->decoder.stage == 0);
  // Disaggregated: the cheapest prefill (stage 0, 0.2) with the cheapest
  // decoder, which is the busier stage 0 (10 x 10 ms / 5 rows = 0.02)
  // rather than stage 1 (0.3).
  const std::vector<CostStage> decoders = {{1, 3.0, 1}, {0, 1.0, 4}};
  q = cheapest_cost(p, r, both, decoders, true);
  REQUIRE(q);
  CHECK(q->total == doctest::Approx(0.22));
  CHECK(q->prefill == doctest::Approx(0.2));
  CHECK(q->decode == doctest::Approx(0.02));
  CHECK(q->decoder.in_flight == 4);
  // Colocated, the stage cheapest to decode on is not chosen for its decode
  // alone: stage 1 with 9 rows decodes for 10 x 20 ms / 10 x 3 = 0.06, but
  // its prefill (0.3) makes it dearer than stage 0's 0.3 in all.
  q = cheapest_cost(p, r, {{0, 1.0, 0}, {1, 3.0, 9}}, {}, false);
  REQUIRE(q);
  CHECK(q->entry.stage == 0);
  // Nothing measured: no quote.
  CHECK_FALSE(cheapest_cost(SloPredictor(), r, both, both, false));
  CHECK_FALSE(cheapest_cost(p, r, both, {{5, 1.0, 0}}, true));
}

TEST_CASE("cost budget: check refuses only what the cheapest prediction exceeds, naming it") {
  const SloPredictor p = measured();
  const std::vector<CostStage> both = {{0, 1.0, 0}, {1, 3.0, 1}};
  CHECK(check_cost(p, budgeted(200, 11, 0), both, both, false).ok());     // no budget
  CHECK(check_cost(p, budgeted(200, 11, 0.31), both, both, false).ok());  // just over the cheapest (0.3)
  CHECK(check_cost(p, budgeted(200, 11, 5), both, both, false).ok());
  const Status s = check_cost(p, budgeted(200, 11, 0.25), both, both, false);
  CHECK(s.code() == Code::rejected);
  CHECK(s.message().find("request 7 cannot meet its max_cost 0.25") != std::string::npos);
  CHECK(s.message().find("the cheapest prediction is 0.3 cost-seconds") != std::string::npos);
  CHECK(s.message().find("prefill 0.2 (stage 0, cost 1) + decode of 10 tokens 0.1 (stage 0, cost 1)") !=
        std::string::npos);
  // A cold router admits: nothing to predict from.
  CHECK(check_cost(SloPredictor(), budgeted(200, 11, 1e-9), both, both, false).ok());
}

TEST_CASE("cost budget: only the cost_aware router takes one") {
  CHECK(check_cost_policy(budgeted(1, 1, 0), "round_robin").ok());
  CHECK(check_cost_policy(budgeted(1, 1, 0), "").ok());
  CHECK(check_cost_policy(budgeted(1, 1, 2), "cost_aware").ok());
  const Status other = check_cost_policy(budgeted(1, 1, 2), "least_loaded_prefix");
  CHECK(other.code() == Code::invalid_argument);
  CHECK(other.message() ==
        "max_cost: a cost budget needs router policy 'cost_aware' (this router's is 'least_loaded_prefix')");
  const Status mono = check_cost_policy(budgeted(1, 1, 2), "");
  CHECK(mono.code() == Code::invalid_argument);
  CHECK(mono.message().find("this topology has no router") != std::string::npos);
}
