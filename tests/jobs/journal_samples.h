// Sample journal values with every field set, and field-by-field checks.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "jobs/journal.h"

namespace jobs_test {

using namespace cleave;
using namespace cleave::jobs;

inline JobMeta sample_meta() {
  JobMeta m;
  m.input_fingerprint = "0123456789abcdef0123456789abcdef";
  m.input_path = "/data/batch input \xff\xfe.jsonl";  // not UTF-8: paths are any bytes
  m.output_path = "/data/sortie-\xc3\xa9t\xc3\xa9.jsonl";
  m.endpoint = "mixed";
  m.status = JobStatus::cancelling;
  m.error = "\xe5\xa4\xb1\xe8\xb4\xa5: \"quoted\"\n\ttab \xf0\x9f\x99\x82";
  m.created_at = -5;
  m.in_progress_at = 1700000001;
  m.finalizing_at = 1700000002;
  m.completed_at = 1700000003;
  m.failed_at = 1700000004;
  m.cancelling_at = 1700000005;
  m.cancelled_at = std::numeric_limits<int64_t>::max();
  m.total = 1000;
  m.completed = 998;
  m.failed = 2;
  m.output_bytes = (uint64_t(1) << 63) + 12345;
  m.runs = 3;
  m.generated_tokens = 123456789;
  m.resumed_tokens = 4567;
  m.resumed_requests = 89;
  m.imported_tokens = 4000;
  m.recomputed_tokens = 567;
  m.active_seconds = 1234.5678901234567;
  return m;
}

inline TokenLogprob lp(int32_t token, float logprob) {
  return {token, logprob};
}

inline RequestRecord sample_record(uint64_t seed = 0) {
  RequestRecord r;
  r.state = RequestState::running;
  r.output_end = (uint64_t(1) << 40) + seed;
  r.ok = false;
  ChoiceProgress a;
  a.tokens = {0, 1, int32_t(seed), std::numeric_limits<int32_t>::max(), 31999};
  a.text =
      "h\xc3\xa9llo \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x99\x82 \"q\" \\ \n" + std::to_string(seed);
  a.logprobs.push_back({lp(1, -0.1234567f), {lp(1, -0.1234567f), lp(7, -2.5f), lp(9, -1e-30f)}});
  a.logprobs.push_back({lp(2, -std::numeric_limits<float>::infinity()), {}});
  a.logprobs.push_back(
      {lp(3, std::nextafter(-3.0f, 0.0f)), {lp(4, std::numeric_limits<float>::quiet_NaN())}});
  a.finish_reason = "length";
  a.cached_tokens = 17;
  ChoiceProgress b;
  b.tokens = {42};
  b.text = "";
  b.finish_reason = "";
  b.cached_tokens = 0;
  r.choices = {a, b, ChoiceProgress{}};
  return r;
}

inline bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

inline void check_same(const JobMeta& a, const JobMeta& b) {
  CHECK(a.input_fingerprint == b.input_fingerprint);
  CHECK(a.input_path == b.input_path);
  CHECK(a.output_path == b.output_path);
  CHECK(a.endpoint == b.endpoint);
  CHECK(a.status == b.status);
  CHECK(a.error == b.error);
  CHECK(a.created_at == b.created_at);
  CHECK(a.in_progress_at == b.in_progress_at);
  CHECK(a.finalizing_at == b.finalizing_at);
  CHECK(a.completed_at == b.completed_at);
  CHECK(a.failed_at == b.failed_at);
  CHECK(a.cancelling_at == b.cancelling_at);
  CHECK(a.cancelled_at == b.cancelled_at);
  CHECK(a.total == b.total);
  CHECK(a.completed == b.completed);
  CHECK(a.failed == b.failed);
  CHECK(a.output_bytes == b.output_bytes);
  CHECK(a.runs == b.runs);
  CHECK(a.generated_tokens == b.generated_tokens);
  CHECK(a.resumed_tokens == b.resumed_tokens);
  CHECK(a.resumed_requests == b.resumed_requests);
  CHECK(a.imported_tokens == b.imported_tokens);
  CHECK(a.recomputed_tokens == b.recomputed_tokens);
  CHECK(a.active_seconds == b.active_seconds);
}

inline void check_same(const TokenLogprob& a, const TokenLogprob& b) {
  CHECK(a.token == b.token);
  CHECK_MESSAGE(same_float(a.logprob, b.logprob), a.logprob, " vs ", b.logprob);
}

inline void check_same(const RequestRecord& a, const RequestRecord& b) {
  CHECK(a.state == b.state);
  CHECK(a.output_end == b.output_end);
  CHECK(a.ok == b.ok);
  REQUIRE(a.choices.size() == b.choices.size());
  for (size_t i = 0; i < a.choices.size(); ++i) {
    const auto &x = a.choices[i], &y = b.choices[i];
    CHECK(x.tokens == y.tokens);
    CHECK(x.text == y.text);
    CHECK(x.finish_reason == y.finish_reason);
    CHECK(x.cached_tokens == y.cached_tokens);
    REQUIRE(x.logprobs.size() == y.logprobs.size());
    for (size_t k = 0; k < x.logprobs.size(); ++k) {
      check_same(x.logprobs[k].chosen, y.logprobs[k].chosen);
      REQUIRE(x.logprobs[k].top.size() == y.logprobs[k].top.size());
      for (size_t t = 0; t < x.logprobs[k].top.size(); ++t)
        check_same(x.logprobs[k].top[t], y.logprobs[k].top[t]);
    }
  }
}

}  // namespace jobs_test
