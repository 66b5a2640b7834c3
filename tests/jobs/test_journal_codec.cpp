// The journal's value encoding: every field round trips (non-UTF-8 paths,
// UTF-8 text, logprobs with top entries, -inf and NaN), any flipped byte is
// corruption, and bad JSON / missing / mistyped fields are corruption naming
// the field.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "jobs_test_util.h"
#include "journal_samples.h"
#include "storage/block.h"

using namespace jobs_test;

namespace {

// A value with a good checksum over `payload`.
std::string sealed(const std::string& payload) {
  const uint64_t sum =
      checksum_bytes(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
  std::string v(8, '\0');
  for (int i = 0; i < 8; ++i) v[i] = char(uint8_t(sum >> (8 * i)));
  return v + payload;
}

nlohmann::json payload_of(const std::string& value) {
  return nlohmann::json::parse(value.substr(8));
}

}  // namespace

TEST_CASE("journal codec: status and state names") {
  const char* names[] = {"validating", "in_progress", "finalizing", "completed",
                         "failed",     "cancelling",  "cancelled"};
  for (int i = 0; i < 7; ++i) {
    CHECK(std::string(job_status_name(JobStatus(i))) == names[i]);
    CHECK(parse_job_status(names[i]) == JobStatus(i));
  }
  CHECK(!parse_job_status("done").has_value());
  CHECK(!parse_job_status("").has_value());
  CHECK(std::string(request_state_name(RequestState::pending)) == "pending");
  CHECK(std::string(request_state_name(RequestState::running)) == "running");
  CHECK(std::string(request_state_name(RequestState::done)) == "done");
}

TEST_CASE("journal codec: every JobMeta field round trips") {
  const JobMeta m = sample_meta();
  const std::string v = encode_meta(m);
  auto got = decode_meta(v);
  REQUIRE_MESSAGE(got.ok(), got.status().to_string());
  check_same(*got, m);
  CHECK(payload_of(v)["status"] == "cancelling");  // the OpenAI name, not a number
  for (int s = 0; s < 7; ++s) {
    JobMeta x = m;
    x.status = JobStatus(s);
    auto y = decode_meta(encode_meta(x));
    REQUIRE(y.ok());
    CHECK(y->status == x.status);
  }
  auto d = decode_meta(encode_meta(JobMeta{}));
  REQUIRE(d.ok());
  check_same(*d, JobMeta{});
}

TEST_CASE("journal codec: every RequestRecord field round trips") {
  const RequestRecord r = sample_record(77);
  const std::string v = encode_record(r);
  auto got = decode_record(v);
  REQUIRE_MESSAGE(got.ok(), got.status().to_string());
  check_same(*got, r);
  CHECK(payload_of(v)["state"] == "running");
  for (auto s : {RequestState::pending, RequestState::running, RequestState::done}) {
    RequestRecord x = r;
    x.state = s;
    x.ok = true;
    auto y = decode_record(encode_record(x));
    REQUIRE(y.ok());
    CHECK(y->state == s);
    CHECK(y->ok);
  }
  auto d = decode_record(encode_record(RequestRecord{}));
  REQUIRE(d.ok());
  check_same(*d, RequestRecord{});
}

TEST_CASE("journal codec: a flipped byte anywhere in a value is corruption") {
  for (const std::string& v : {encode_record(sample_record(3)), encode_meta(sample_meta())}) {
    const bool is_meta = v == encode_meta(sample_meta());
    for (size_t i = 0; i < v.size(); ++i) {
      std::string bad = v;
      bad[i] ^= char(0xFF);
      const Status s = is_meta ? decode_meta(bad).status() : decode_record(bad).status();
      CAPTURE(i);
      REQUIRE(s.code() == Code::corruption);
      CHECK(mentions(s, "checksum mismatch"));
    }
  }
  CHECK(decode_record("").status().code() == Code::corruption);
  CHECK(mentions(decode_meta("abc").status(), "shorter than its 8-byte checksum"));
}

TEST_CASE("journal codec: bad JSON or missing or mistyped fields are corruption naming them") {
  auto fails = [](const std::string& value, const std::string& what, bool meta = false) {
    const Status s = meta ? decode_meta(value).status() : decode_record(value).status();
    CHECK(s.code() == Code::corruption);
    CHECK_MESSAGE(mentions(s, what), s.message(), " lacks ", what);
  };
  fails(sealed("{\"state\": "), "bad JSON");
  fails(sealed("[1, 2]"), "is not a JSON object");
  const auto record = payload_of(encode_record(sample_record()));
  const auto meta = payload_of(encode_meta(sample_meta()));
  for (const char* key : {"state", "choices", "output_end", "ok", "version"}) {
    auto j = record;
    j.erase(key);
    fails(sealed(j.dump()), std::string("field '") + key + "' is missing");
  }
  for (const char* key : {"input_fingerprint", "status", "cancelled_at", "total", "runs",
                          "recomputed_tokens", "active_seconds", "output_bytes"}) {
    auto j = meta;
    j.erase(key);
    fails(sealed(j.dump()), std::string("field '") + key + "' is missing", true);
  }
  auto j = record;
  j["ok"] = "yes";
  fails(sealed(j.dump()), "field 'ok' has the wrong type");
  j = record;
  j["output_end"] = -1;
  fails(sealed(j.dump()), "field 'output_end' has the wrong type");
  j = record;
  j["choices"][0]["tokens"][1] = "one";
  fails(sealed(j.dump()), "choice 0 field 'tokens' has the wrong type");
  j = record;
  j["choices"][1].erase("cached_tokens");
  fails(sealed(j.dump()), "choice 1 field 'cached_tokens' is missing");
  j = record;
  j["choices"][0]["logprobs"][0][1] = 5;
  fails(sealed(j.dump()), "field 'logprobs' has the wrong type");
  j = record;
  j["choices"][0]["cached_tokens"] = uint64_t(1) << 40;  // past int32
  fails(sealed(j.dump()), "field 'cached_tokens' has the wrong type");
  j = record;
  j["state"] = "sleeping";
  fails(sealed(j.dump()), "unknown value 'sleeping'");
  j = record;
  j["version"] = 2;
  fails(sealed(j.dump()), "unknown format version 2");
  auto m = meta;
  m["status"] = "done";
  fails(sealed(m.dump()), "field 'status' has the unknown value 'done'", true);
  m = meta;
  m["total"] = 1.5;
  fails(sealed(m.dump()), "field 'total' has the wrong type", true);
  m = meta;
  m["input_path"] = nlohmann::json{{"hex", "zz"}};
  fails(sealed(m.dump()), "field 'input_path' has the wrong type", true);
}
