// The router's early-rejection predictor on tables (no actors): times are
// given, so each expected rate and prediction follows by hand.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "actors/slo_predictor.h"

using namespace cleave;

namespace {

GenerateRequest goals(int64_t prompt, double ttft_ms, double tpot_ms = 0, double deadline_ms = 0,
                      int32_t max_tokens = 1) {
  GenerateRequest r;
  r.request_id = 99;
  r.prompt.assign(size_t(prompt), 1);
  r.sampling.max_tokens = max_tokens;
  r.ttft_target_ms = ttft_ms;
  r.tpot_target_ms = tpot_ms;
  r.deadline_ms = deadline_ms;
  return r;
}

}  // namespace

TEST_CASE("slo predictor: the prefill rate is prompt tokens over busy seconds") {
  SloPredictor p(1.0);  // no decay: plain sums
  CHECK_FALSE(p.prefill_rate(0));
  CHECK_FALSE(p.ttft(0, 100));
  // 1,000 tokens answered 0.5 s after placement: 2,000 tokens/s.
  p.placed(0, 1, 1000, 10.0);
  CHECK(p.queued_tokens(0) == 1000);
  p.first_token(1, 10.5);
  REQUIRE(p.prefill_rate(0));
  CHECK(*p.prefill_rate(0) == doctest::Approx(2000));
  CHECK(p.queued_tokens(0) == 0);
  // Idle time (10.5 .. 20) is not busy time: 1,000 more in 0.25 s gives
  // 2,000 tokens in 0.75 s.
  p.placed(0, 2, 1000, 20.0);
  p.first_token(2, 20.25);
  CHECK(*p.prefill_rate(0) == doctest::Approx(2000.0 / 0.75));
  // A prediction counts the tokens queued ahead.
  p.placed(0, 3, 500, 30.0);
  CHECK(*p.ttft(0, 300) == doctest::Approx(800 / (2000.0 / 0.75)));
  // Another stage has its own measurement: none yet.
  CHECK_FALSE(p.ttft(1, 300));
}

TEST_CASE("slo predictor: a batched prefill's requests share their busy time") {
  SloPredictor p(1.0);
  // Four 250-token prompts placed together, all answered 1 s later (one
  // batch): 1,000 tokens in 1 s, not 250 tokens/s per request.
  for (uint64_t id = 1; id <= 4; ++id) p.placed(0, id, 250, 0.0);
  for (uint64_t id = 1; id <= 4; ++id) p.first_token(id, 1.0);
  CHECK(*p.prefill_rate(0) == doctest::Approx(1000));
}

TEST_CASE("slo predictor: a batch's answers arriving microseconds apart are one sample, not one per message") {
  // With decay, counting each message as a sample would discount the step's
  // busy time three times over while its tokens all count: ~2x the rate.
  SloPredictor p(0.8);
  for (uint64_t id = 1; id <= 4; ++id) p.placed(0, id, 250, 0.0);
  for (uint64_t id = 1; id <= 4; ++id) p.first_token(id, 1.0 + 2e-5 * double(id - 1));
  CHECK(*p.prefill_rate(0) == doctest::Approx(1000 / (1.0 + 6e-5)));
  // The next step, 0.5 s later, is a sample of its own: the first decays.
  for (uint64_t id = 5; id <= 6; ++id) p.placed(0, id, 250, 1.0);
  p.first_token(5, 1.5);
  p.first_token(6, 1.5 + 1e-5);
  CHECK(*p.prefill_rate(0) == doctest::Approx((0.8 * 1000 + 500) / (0.8 * (1.0 + 6e-5) + 0.5 + 1e-5)));
  // An answer 1 ms after a 2 ms step is past the same-step window (0.2 ms).
  SloPredictor q(0.5);
  q.placed(0, 1, 100, 0.0);
  q.placed(0, 2, 100, 0.0);
  q.first_token(1, 0.002);
  q.first_token(2, 0.003);
  CHECK(*q.prefill_rate(0) == doctest::Approx((0.5 * 100 + 100) / (0.5 * 0.002 + 0.001)));
}

TEST_CASE("slo predictor: decay follows the load, re-placement moves the queue, a down stage forgets") {
  SloPredictor p(0.5);
  p.placed(0, 1, 100, 0.0);
  p.first_token(1, 1.0);  // 100 tokens/s
  p.placed(0, 2, 100, 2.0);
  p.first_token(2, 2.1);  // 1,000 tokens/s now: (0.5 x 100 + 100) / (0.5 x 1 + 0.1)
  CHECK(*p.prefill_rate(0) == doctest::Approx(150 / 0.6));
  // Re-placed on stage 1 (stage 0 went down): the tokens move with it.
  p.placed(0, 3, 40, 3.0);
  p.placed(1, 3, 40, 3.5);
  CHECK(p.queued_tokens(0) == 0);
  CHECK(p.queued_tokens(1) == 40);
  // A request that leaves before its first token is no sample.
  p.forget_request(3, 4.0);
  CHECK(p.queued_tokens(1) == 0);
  CHECK_FALSE(p.prefill_rate(1));
  p.forget_stage(0, 5.0);
  CHECK_FALSE(p.prefill_rate(0));
}

TEST_CASE("slo predictor: TPOT is an EWMA of the gaps on each continuing stage") {
  SloPredictor p(0.5);
  CHECK_FALSE(p.tpot(2));
  p.token_gap(2, 0.010);
  CHECK(*p.tpot(2) == doctest::Approx(0.010));
  p.token_gap(2, 0.030);
  CHECK(*p.tpot(2) == doctest::Approx(0.020));
  p.token_gap(2, -1);  // not a gap
  CHECK(*p.tpot(2) == doctest::Approx(0.020));
}

TEST_CASE("slo predictor: check rejects only what no live stage can meet") {
  SloPredictor p(1.0);
  p.placed(0, 1, 1000, 0.0);
  p.first_token(1, 1.0);  // stage 0: 1,000 tokens/s
  p.placed(1, 2, 1000, 0.0);
  p.first_token(2, 0.1);  // stage 1: 10,000 tokens/s
  p.placed(1, 3, 4000, 0.2);  // 4,000 queued on stage 1
  p.token_gap(5, 0.020);
  p.token_gap(6, 0.050);
  const std::vector<int32_t> entry{0, 1}, cont{5, 6};
  struct Row {
    GenerateRequest r;
    std::vector<int32_t> entry, cont;
    bool admitted;
    const char* says;  // in the message when rejected
  };
  // 500 prompt tokens: stage 0 predicts 0.5 s, stage 1 (4,500 / 10,000) 0.45 s.
  const Row rows[] = {
      {goals(500, 0), entry, cont, true, ""},                  // no goals
      {goals(500, 450.5), entry, cont, true, ""},              // stage 1 makes it
      {goals(500, 449), entry, cont, false, "ttft_target_ms 449: predicted TTFT 450.000 ms"},
      {goals(500, 490), {0}, cont, false, "predicted TTFT 500.000 ms"},  // stage 1 is down
      {goals(500, 449), {2}, cont, true, ""},                  // unmeasured: not checked
      {goals(500, 0, 20.5), entry, cont, true, ""},            // stage 5 decodes at 20 ms
      {goals(500, 0, 19), entry, cont, false, "tpot_target_ms 19"},
      {goals(500, 0, 19), entry, {7}, true, ""},               // no TPOT measured
      // 0.45 s + 9 x 0.02 s = 0.63 s.
      {goals(500, 0, 0, 640, 10), entry, cont, true, ""},
      {goals(500, 0, 0, 620, 10), entry, cont, false, "deadline_ms 620: predicted 630.000 ms"},
      // Without a TPOT the deadline counts the TTFT only.
      {goals(500, 0, 0, 460, 10), entry, {7}, true, ""},
      {goals(500, 0, 0, 440, 10), entry, {7}, false, "deadline_ms 440"},
  };
  for (size_t i = 0; i < std::size(rows); ++i) {
    CAPTURE(i);
    const Status st = p.check(rows[i].r, rows[i].entry, rows[i].cont);
    CHECK(st.ok() == rows[i].admitted);
    if (!rows[i].admitted) {
      CHECK(st.code() == Code::rejected);
      CHECK_MESSAGE(st.message().find(rows[i].says) != std::string::npos, st.message());
      CHECK(st.message().find("request 99") != std::string::npos);
    }
  }
}

TEST_CASE("slo predictor: placement estimates an unmeasured stage at its peers' mean rate") {
  SloPredictor p(1.0);
  const std::vector<int32_t> entry = {0, 1, 2};
  CHECK_FALSE(p.estimate_ttft(2, 100, entry));  // nothing measured anywhere
  // Stage 0: 1,000 tokens/s; stage 1: 3,000 tokens/s; stage 2 unmeasured.
  p.placed(0, 1, 1000, 0.0);
  p.first_token(1, 1.0);
  p.placed(1, 2, 3000, 0.0);
  p.first_token(2, 1.0);
  CHECK(*p.estimate_ttft(0, 500, entry) == doctest::Approx(0.5));     // its own rate
  CHECK(*p.estimate_ttft(2, 500, entry) == doctest::Approx(0.25));    // 500 / 2,000
  p.placed(2, 3, 1500, 2.0);                                          // queued there, still unmeasured
  CHECK(*p.estimate_ttft(2, 500, entry) == doctest::Approx(1.0));     // (1,500 + 500) / 2,000
  CHECK_FALSE(p.estimate_ttft(2, 500, {2}));                          // no measured peer
  // TPOT: its own EWMA, else the peers' mean.
  const std::vector<int32_t> cont = {5, 6, 7};
  CHECK_FALSE(p.estimate_tpot(7, cont));
  p.token_gap(5, 0.010);
  p.token_gap(6, 0.030);
  CHECK(*p.estimate_tpot(5, cont) == doctest::Approx(0.010));
  CHECK(*p.estimate_tpot(7, cont) == doctest::Approx(0.020));
}

TEST_CASE("placement_limit_s: the role's goal, capped by the deadline's share of what is left") {
  struct Row {
    double ttft_ms, tpot_ms, deadline_ms;
    int32_t max_tokens;
    bool entry;
    double elapsed_ms;
    int64_t generated;
    double want_s;
  };
  for (const Row& row : {
           Row{0, 0, 0, 8, true, 0, 0, 0},             // no goal
           Row{200, 0, 0, 8, true, 50, 0, 0.2},        // the TTFT goal
           Row{200, 0, 0, 8, false, 50, 1, 0},         // a continuing stage has no TTFT goal
           Row{0, 30, 0, 8, false, 50, 1, 0.03},       // the TPOT goal
           Row{0, 0, 1000, 8, true, 100, 0, 0.9},      // first token: all that is left
           Row{500, 0, 1000, 8, true, 100, 0, 0.5},    // the TTFT goal is tighter
           Row{0, 0, 1000, 11, false, 200, 1, 0.08},   // 800 ms over the 10 tokens to come
           Row{0, 50, 1000, 11, false, 200, 1, 0.05},  // the TPOT goal is tighter
           Row{0, 0, 1000, 8, true, 1500, 0, 1e-9},    // past its deadline: nothing meets it
       }) {
    GenerateRequest r;
    r.sampling.max_tokens = row.max_tokens;
    r.ttft_target_ms = row.ttft_ms;
    r.tpot_target_ms = row.tpot_ms;
    r.deadline_ms = row.deadline_ms;
    CHECK(placement_limit_s(r, row.entry, row.elapsed_ms, row.generated) == doctest::Approx(row.want_s));
  }
}
