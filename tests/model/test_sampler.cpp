// Sampling: counter-based RNG, greedy / top-k / top-p / min-p, repetition
// penalty, determinism, and stop strings.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <limits>
#include <random>
#include <vector>

#include "model/sampler.h"

using namespace cleave;

namespace {

SamplingParams plain(float temperature) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.repeat_penalty = 1.0f;
  p.seed = 1234;
  return p;
}

std::vector<double> softmax(const std::vector<float>& l, double t) {
  double m = *std::max_element(l.begin(), l.end());
  std::vector<double> p(l.size());
  double s = 0;
  for (size_t i = 0; i < l.size(); ++i) s += p[i] = std::exp((l[i] - m) / t);
  for (double& x : p) x /= s;
  return p;
}

// Draws n tokens at positions 0..n-1 and returns the counts per token.
std::vector<int> histogram(const std::vector<float>& logits, const SamplingParams& p, int n,
                           uint64_t request = 0) {
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) {
    const int32_t t = sample_token(logits.data(), static_cast<int32_t>(logits.size()), p, {},
                                   request, static_cast<uint64_t>(i));
    REQUIRE(t >= 0);
    REQUIRE(t < static_cast<int32_t>(logits.size()));
    ++counts[t];
  }
  return counts;
}

// Pearson chi-square of counts against probabilities (cells with p > 0).
double chi_square(const std::vector<int>& counts, const std::vector<double>& probs, int n) {
  double chi = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (probs[i] <= 0) continue;
    const double e = probs[i] * n;
    chi += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi;
}

const std::vector<float> kLogits = {1.0f, 2.0f, 0.5f, 3.0f, -1.0f, 2.5f, 0.0f, 1.5f};

}  // namespace

TEST_CASE("counter_rng: Philox4x32-10 known answers (Random123 kat_vectors)") {
  // counter = (position lo, position hi, request lo, request hi), key = (seed lo, seed hi),
  // result = word1:word0.
  CHECK(counter_rng_u64(0, 0, 0) == 0xE169C58D6627E8D5ull);
  CHECK(counter_rng_u64(~0ull, ~0ull, ~0ull) == 0x41C83B0E408F276Dull);
  CHECK(counter_rng_u64(0x299F31D0A4093822ull, 0x0370734413198A2Eull, 0x85A308D3243F6A88ull) ==
        0x94FDCCEBD16CFE09ull);
}

TEST_CASE("counter_rng: uniform draws in 0..1 are deterministic and keyed by all three inputs") {
  CHECK(counter_rng_uniform(1, 2, 3) == counter_rng_uniform(1, 2, 3));
  CHECK(counter_rng_uniform(1, 2, 3) ==
        static_cast<double>(counter_rng_u64(1, 2, 3) >> 11) * std::ldexp(1.0, -53));
  std::set<uint64_t> seen;
  for (uint64_t s = 0; s < 4; ++s)
    for (uint64_t r = 0; r < 4; ++r)
      for (uint64_t p = 0; p < 4; ++p) seen.insert(counter_rng_u64(s, r, p));
  CHECK(seen.size() == 64);
  double sum = 0, sum2 = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double u = counter_rng_uniform(42, 7, static_cast<uint64_t>(i));
    REQUIRE(u >= 0.0);
    REQUIRE(u < 1.0);
    sum += u;
    sum2 += u * u;
  }
  CHECK(std::abs(sum / n - 0.5) < 0.005);
  CHECK(std::abs(sum2 / n - 1.0 / 3.0) < 0.005);
}

TEST_CASE("sample_token: greedy picks the argmax and ties go to the lowest id") {
  SamplingParams p = plain(0.0f);
  CHECK(sample_token(kLogits.data(), 8, p, {}, 0, 0) == 3);
  const std::vector<float> tie = {0.0f, 5.0f, 1.0f, 5.0f, 5.0f};
  CHECK(sample_token(tie.data(), 5, p, {}, 0, 0) == 1);
  p.temperature = -1.0f;
  CHECK(sample_token(tie.data(), 5, p, {}, 9, 9) == 1);
  const std::vector<float> with_nan = {NAN, 1.0f, 2.0f};
  CHECK(sample_token(with_nan.data(), 3, p, {}, 0, 0) == 2);
}

TEST_CASE("sample_token: greedy straight on the row equals greedy through the candidates") {
  // A penalty with an empty history changes no logit but takes the path
  // that copies the row into candidates; rows with ties, NaN and infinities,
  // of lengths within one block of the fast path's 64, across several and
  // with a tail, and a vocabulary's.
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> pick(0, 9);
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = trial % 3 == 0 ? 64 : trial % 97 == 1 ? 32000 : 10 + (trial * 37) % 290;
    std::vector<float> row(static_cast<size_t>(n));
    for (float& x : row) {
      const int k = pick(rng);
      x = k == 0 ? NAN : k == 1 ? -INFINITY : k == 2 ? INFINITY : k == 3 ? -0.0f
          : float(pick(rng) % 4) * (k % 2 ? 1.0f : -1.0f) / 3.0f;
    }
    if (trial % 7 == 0) std::fill(row.begin(), row.end(), NAN);
    if (trial % 5 == 2) {  // one maximum anywhere, and its twin after it
      std::fill(row.begin(), row.end(), -1.0f);
      const size_t at = size_t(rng()) % row.size();
      row[at] = 2.0f;
      row[at + (row.size() - at) / 2] = 2.0f;
    }
    if (trial % 11 == 0)  // -0 before +0 as the only maxima: equal floats, the lower id wins
      for (size_t i = 0; i < row.size(); ++i) row[i] = i == 3 ? -0.0f : i == 9 ? 0.0f : -1.0f;
    SamplingParams fast = plain(0.0f), slow = plain(0.0f);
    slow.repeat_penalty = 1.5f;
    CAPTURE(n);
    REQUIRE(sample_token(row.data(), n, fast, {}, 0, 0) == sample_token(row.data(), n, slow, {}, 0, 0));
  }
}

TEST_CASE("sample_token: top_k = 1 equals greedy at any temperature") {
  for (float temp : {0.1f, 0.8f, 1.0f, 5.0f, 100.0f}) {
    SamplingParams p = plain(temp);
    p.top_k = 1;
    for (uint64_t pos = 0; pos < 200; ++pos) {
      REQUIRE(sample_token(kLogits.data(), 8, p, {}, 3, pos) == 3);
    }
  }
  const std::vector<float> tie = {0.0f, 5.0f, 1.0f, 5.0f};
  SamplingParams p = plain(2.0f);
  p.top_k = 1;
  for (uint64_t pos = 0; pos < 100; ++pos) REQUIRE(sample_token(tie.data(), 4, p, {}, 0, pos) == 1);
}

TEST_CASE("sample_token: empirical distribution matches softmax(logits / T)") {
  const int n = 20000;
  for (float temp : {0.5f, 1.0f, 2.0f}) {
    CAPTURE(temp);
    const SamplingParams p = plain(temp);
    const auto counts = histogram(kLogits, p, n);
    const auto probs = softmax(kLogits, temp);
    // 7 degrees of freedom: P(chi2 > 30) ~ 1e-4.
    const double chi = chi_square(counts, probs, n);
    MESSAGE("T=" << temp << " chi2=" << chi);
    CHECK(chi < 30.0);
  }
}

TEST_CASE("sample_token: top_k and top_p and min_p exclude exactly the right tokens") {
  const int n = 20000;
  // Sorted by logit: 3 (3.0), 5 (2.5), 1 (2.0), 7 (1.5), 0 (1.0), 2 (0.5), 6 (0.0), 4 (-1.0)
  const auto full = softmax(kLogits, 1.0);

  auto check_kept = [&](const SamplingParams& p, const std::set<int>& kept) {
    const auto counts = histogram(kLogits, p, n);
    double mass = 0;
    for (int t : kept) mass += full[t];
    std::vector<double> expect(kLogits.size(), 0.0);
    for (int t : kept) expect[t] = full[t] / mass;
    for (int t = 0; t < 8; ++t) {
      CAPTURE(t);
      if (kept.count(t)) {
        CHECK(counts[t] > 0);
      } else {
        CHECK(counts[t] == 0);
      }
    }
    const double chi = chi_square(counts, expect, n);
    MESSAGE("kept " << kept.size() << " chi2=" << chi);
    CHECK(chi < 30.0);
  };

  SUBCASE("top_k = 3") {
    SamplingParams p = plain(1.0f);
    p.top_k = 3;
    check_kept(p, {3, 5, 1});
  }
  SUBCASE("top_p") {
    // p: 3 .4027, 5 .2443, 1 .1482, 7 .0899, 0 .0545, 2 .0331, 6 .0200, 4 .0074
    // cumulative: .4027, .6470, .7952, .8851, .9396, ...
    SamplingParams p = plain(1.0f);
    p.top_p = 0.7f;  // needs 3 tokens to reach 0.7
    check_kept(p, {3, 5, 1});
    p.top_p = 0.8f;  // 4 tokens
    check_kept(p, {3, 5, 1, 7});
    p.top_p = 0.1f;  // the first already reaches it
    check_kept(p, {3});
  }
  SUBCASE("min_p") {
    // p / p_max = exp(l - 3): 5 -> .607, 1 -> .368, 7 -> .223, 0 -> .135, 2 -> .082
    SamplingParams p = plain(1.0f);
    p.min_p = 0.3f;
    check_kept(p, {3, 5, 1});
    p.min_p = 0.1f;
    check_kept(p, {3, 5, 1, 7, 0});
  }
  SUBCASE("top_k then top_p then min_p") {
    SamplingParams p = plain(1.0f);
    p.top_k = 5;  // {3, 5, 1, 7, 0}; renormalised .4287 .2600 .1577 .0956 .0580
    // cumulative over the 5: .4287 .6887 .8464 .9420 1.0
    p.top_p = 0.95f;  // all 5 kept (over all 8 tokens .95 would need 6)
    p.min_p = 0.2f;   // p / p_max >= 0.2: 7 (.223) kept, 0 (.135) dropped
    check_kept(p, {3, 5, 1, 7});
    p.min_p = 0.0f;
    check_kept(p, {3, 5, 1, 7, 0});
    p.top_p = 0.9f;  // .9420 >= .9 at the 4th (over all 8 tokens: .9396 at the 5th)
    check_kept(p, {3, 5, 1, 7});
  }
}

TEST_CASE("sample_token: deterministic per seed/request/position and independent across requests") {
  SamplingParams p = plain(1.0f);
  for (uint64_t pos = 0; pos < 100; ++pos) {
    const int32_t a = sample_token(kLogits.data(), 8, p, {}, 5, pos);
    const int32_t b = sample_token(kLogits.data(), 8, p, {}, 5, pos);
    REQUIRE(a == b);
  }
  // Different requests draw different sequences; and the pair distribution
  // of (request 1, request 2) at the same position is the product of the
  // marginals (independence), checked on 4 x 4 cells with equal logits.
  const std::vector<float> flat = {0.f, 0.f, 0.f, 0.f};
  std::vector<int> joint(16, 0);
  int same_as_other_request = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const int32_t x = sample_token(flat.data(), 4, p, {}, 1, static_cast<uint64_t>(i));
    const int32_t y = sample_token(flat.data(), 4, p, {}, 2, static_cast<uint64_t>(i));
    ++joint[x * 4 + y];
    same_as_other_request += (x == y);
  }
  const std::vector<double> uniform16(16, 1.0 / 16);
  const double chi = chi_square(joint, uniform16, n);
  MESSAGE("joint chi2=" << chi);
  CHECK(chi < 45.0);  // 15 dof: P(chi2 > 45) ~ 1e-4
  CHECK(same_as_other_request < n / 4 + 400);
  // A different seed gives a different sequence.
  SamplingParams q = p;
  q.seed = p.seed + 1;
  int differ = 0;
  for (uint64_t pos = 0; pos < 200; ++pos) {
    differ += sample_token(kLogits.data(), 8, p, {}, 0, pos) !=
              sample_token(kLogits.data(), 8, q, {}, 0, pos);
  }
  CHECK(differ > 50);
}

TEST_CASE("sample_token: repetition penalty") {
  SamplingParams p = plain(0.0f);
  p.repeat_penalty = 2.0f;
  p.repeat_last_n = 64;
  // 3 (3.0) / 2 = 1.5 -> 5 (2.5) wins.
  CHECK(sample_token(kLogits.data(), 8, p, {3}, 0, 0) == 5);
  // Repeats in the window are applied once: 3 -> 1.5, not 0.75; 5 -> 1.25; 1 (2.0) wins.
  CHECK(sample_token(kLogits.data(), 8, p, {3, 3, 3, 5, 5}, 0, 0) == 1);
  // Only the last repeat_last_n tokens count.
  p.repeat_last_n = 2;
  CHECK(sample_token(kLogits.data(), 8, p, {3, 0, 0}, 0, 0) == 3);
  // Negative logits get more negative: token 1: -0.5 * 2 = -1.0.
  const std::vector<float> neg = {-1.0f, -0.5f, -0.8f};
  p.repeat_last_n = 64;
  CHECK(sample_token(neg.data(), 3, p, {1}, 0, 0) == 2);  // -0.5 -> -1.0; -0.8 wins
  // Out-of-range history ids are ignored.
  CHECK(sample_token(kLogits.data(), 8, p, {-1, 99}, 0, 0) == 3);
  // Penalty 1 is off.
  p.repeat_penalty = 1.0f;
  CHECK(sample_token(kLogits.data(), 8, p, {3}, 0, 0) == 3);
}

TEST_CASE("sample_token: large vocabulary with small top_k is fast") {
  const int32_t V = 152064;
  std::vector<float> logits(V);
  uint64_t x = 88172645463325252ull;
  for (auto& l : logits) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    l = static_cast<float>(x % 10000) / 1000.0f;
  }
  SamplingParams p;  // defaults: T 0.8, top_k 40, top_p .95, min_p .05
  std::vector<int32_t> hist(64, 17);
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t pos = 0; pos < 50; ++pos) {
    const int32_t t = sample_token(logits.data(), V, p, hist, 0, pos);
    REQUIRE(t >= 0);
    REQUIRE(t < V);
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 50;
  MESSAGE("sample_token V=" << V << " top_k=40: " << ms << " ms per token");
  CHECK(ms < 20);
}

TEST_CASE("StopMatcher: stop strings split across pushes") {
  SUBCASE("split stop string") {
    StopMatcher m({"</end>"});
    CHECK(m.push("Hello wor") == "Hello wor");
    CHECK(m.push("ld</e") == "ld");
    CHECK_FALSE(m.stopped());
    CHECK(m.push("nd> trailing") == "");
    CHECK(m.stopped());
    CHECK(m.push("more") == "");
    CHECK(m.flush() == "");
  }
  SUBCASE("text before the stop string in the same push is emitted") {
    StopMatcher m({"STOP"});
    CHECK(m.push("abc STOP def") == "abc ");
    CHECK(m.stopped());
  }
  SUBCASE("a false start is released") {
    StopMatcher m({"</end>"});
    CHECK(m.push("a</") == "a");
    CHECK(m.push("b") == "</b");
    CHECK(m.flush() == "");
    CHECK_FALSE(m.stopped());
  }
  SUBCASE("one character per push") {
    StopMatcher m({"\n\nUser:"});
    std::string out;
    for (char c : std::string("Sure.\n\nUser: hi")) out += m.push(std::string(1, c));
    CHECK(out == "Sure.");
    CHECK(m.stopped());
  }
  SUBCASE("several stop strings: the earliest wins") {
    StopMatcher m({"xyz", "b"});
    CHECK(m.push("axy") == "a");
    CHECK(m.push("zb") == "");
    CHECK(m.stopped());
    StopMatcher m2({"xyz", "yz"});
    CHECK(m2.push("axyz") == "a");
  }
  SUBCASE("held text comes out on flush") {
    StopMatcher m({"###"});
    CHECK(m.push("done ##") == "done ");
    CHECK(m.flush() == "##");
  }
  SUBCASE("no stop strings and empty ones are ignored") {
    StopMatcher m({});
    CHECK(m.push("anything") == "anything");
    StopMatcher m2({""});
    CHECK(m2.push("anything") == "anything");
    CHECK_FALSE(m2.stopped());
  }
  SUBCASE("multi-byte UTF-8 stop string") {
    StopMatcher m({"日本"});
    CHECK(m.push("abc\xE6\x97") == "abc");
    CHECK(m.push("\xA5\xE6\x9C\xAC!") == "");
    CHECK(m.stopped());
  }
}

TEST_CASE("sample_token: presence and frequency penalties count generated tokens only") {
  SamplingParams p = plain(0.0f);
  // kLogits: token 3 = 3.0 is the argmax, 5 = 2.5 next.
  p.presence_penalty = 0.4f;
  // 3 appears in the prompt only (n_prompt = 1): no penalty, 3 still wins.
  CHECK(sample_token(kLogits.data(), 8, p, {3}, 0, 0, 1) == 3);
  // Once generated: 3.0 - 0.4 = 2.6 > 2.5, still 3; twice: presence counts once.
  CHECK(sample_token(kLogits.data(), 8, p, {0, 3, 3}, 0, 0, 1) == 3);
  p.presence_penalty = 0.6f;  // 2.4 < 2.5: 5 wins
  CHECK(sample_token(kLogits.data(), 8, p, {0, 3}, 0, 0, 1) == 5);
  p.presence_penalty = 0.0f;
  p.frequency_penalty = 0.3f;  // once: 2.7 (3 wins); twice: 2.4 (5 wins)
  CHECK(sample_token(kLogits.data(), 8, p, {0, 3}, 0, 0, 1) == 3);
  CHECK(sample_token(kLogits.data(), 8, p, {0, 3, 3}, 0, 0, 1) == 5);
  // Negative values reward repeats: 5 generated with -1 -> 3.5 beats 3.
  p.frequency_penalty = -1.0f;
  CHECK(sample_token(kLogits.data(), 8, p, {0, 5}, 0, 0, 1) == 5);
}

TEST_CASE("token_logprobs: log-softmax of the raw row in double, top sorted, ties to the lowest id") {
  const std::vector<float> l = {1.0f, 3.0f, 3.0f, -2.0f, 0.5f};
  double m = 3.0, s = 0;
  for (float x : l) s += std::exp(double(x) - m);
  const double lse = m + std::log(s);
  const LogprobEntry e = token_logprobs(l.data(), 5, 4, 3);
  CHECK(e.chosen.token == 4);
  CHECK(e.chosen.logprob == float(0.5 - lse));
  REQUIRE(e.top.size() == 3);
  CHECK(e.top[0].token == 1);
  CHECK(e.top[1].token == 2);
  CHECK(e.top[2].token == 0);
  CHECK(e.top[0].logprob == float(3.0 - lse));
  CHECK(e.top[2].logprob == float(1.0 - lse));
  double total = 0;
  for (int i = 0; i < 5; ++i) total += std::exp(double(token_logprobs(l.data(), 5, i, 0).chosen.logprob));
  CHECK(total == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(token_logprobs(l.data(), 5, 0, 0).top.empty());
  CHECK(token_logprobs(l.data(), 5, 0, 99).top.size() == 5);  // capped at the vocabulary
  // A masked (-inf) token has logprob -inf.
  const std::vector<float> masked = {0.0f, -std::numeric_limits<float>::infinity()};
  CHECK(std::isinf(token_logprobs(masked.data(), 2, 1, 0).chosen.logprob));
  CHECK(token_logprobs(masked.data(), 2, 0, 0).chosen.logprob == 0.0f);
}
