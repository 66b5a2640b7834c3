// The journal's value encoding: [u64 XXH3-64 of the payload, little-endian]
// [payload: JSON]. Strings that are not UTF-8 (a path is any bytes) are
// stored as {"hex": "..."}; non-finite numbers as "inf", "-inf", "nan".
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "jobs/journal.h"
#include "server/openai_request.h"
#include "storage/block.h"

namespace cleave::jobs {
namespace {

using nlohmann::json;

constexpr size_t kChecksumBytes = 8;
constexpr int kFormatVersion = 1;

constexpr const char* kStatusNames[] = {"validating", "in_progress", "finalizing", "completed",
                                        "failed",     "cancelling",  "cancelled"};
constexpr const char* kStateNames[] = {"pending", "running", "done"};

json string_value(const std::string& s) {
  if (server::is_valid_utf8(s)) return s;
  static const char* digits = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * s.size());
  for (unsigned char c : s) {
    hex.push_back(digits[c >> 4]);
    hex.push_back(digits[c & 15]);
  }
  return json{{"hex", hex}};
}

json number_value(double v) {
  if (std::isfinite(v)) return v;
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

std::string seal(const json& payload) {
  std::string text;
  try {
    text = payload.dump();
  } catch (const json::exception&) {  // not reached: every string is UTF-8 or hex
    text = payload.dump(-1, ' ', false, json::error_handler_t::replace);
  }
  const uint64_t sum = checksum_bytes(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  std::string value(kChecksumBytes, '\0');
  for (size_t i = 0; i < kChecksumBytes; ++i) value[i] = char(uint8_t(sum >> (8 * i)));
  return value + text;
}

// Reads fields of one JSON object; the first failure is kept and later reads
// are no-ops, so a decoder reads every field and then checks `error`.
class Fields {
 public:
  Fields(const json& object, std::string where) : j_(object), where_(std::move(where)) {
    if (!j_.is_object()) fail("is not a JSON object");
  }
  const std::string& error() const { return error_; }
  bool failed() const { return !error_.empty(); }

  const json* find(const char* key) {
    if (failed()) return nullptr;
    auto it = j_.find(key);
    if (it == j_.end()) {
      fail(std::string("field '") + key + "' is missing");
      return nullptr;
    }
    return &*it;
  }
  void wrong(const char* key, const char* expected) {
    fail(std::string("field '") + key + "' has the wrong type (expected " + expected + ")");
  }

  template <class T>
  void integer(const char* key, T& out) {
    const json* v = find(key);
    if (!v) return;
    if (std::is_unsigned_v<T> ? !v->is_number_unsigned() : !v->is_number_integer())
      return wrong(key, std::is_unsigned_v<T> ? "unsigned integer" : "integer");
    if constexpr (std::is_unsigned_v<T>) {
      const auto u = v->get<uint64_t>();
      if (u > std::numeric_limits<T>::max()) return wrong(key, "an integer in range");
      out = T(u);
    } else {
      if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
        return wrong(key, "an integer in range");
      const auto s = v->get<int64_t>();
      if (s < std::numeric_limits<T>::min() || s > std::numeric_limits<T>::max())
        return wrong(key, "an integer in range");
      out = T(s);
    }
  }
  void boolean(const char* key, bool& out) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_boolean()) return wrong(key, "boolean");
    out = v->get<bool>();
  }
  void text(const char* key, std::string& out) {
    const json* v = find(key);
    if (v && !text_of(*v, out)) wrong(key, "string");
  }
  void number(const char* key, double& out) {
    const json* v = find(key);
    if (v && !number_of(*v, out)) wrong(key, "number");
  }
  const json* array(const char* key) {
    const json* v = find(key);
    if (v && !v->is_array()) {
      wrong(key, "array");
      return nullptr;
    }
    return v;
  }

  static bool text_of(const json& v, std::string& out) {
    if (v.is_string()) {
      out = v.get<std::string>();
      return true;
    }
    if (!v.is_object() || v.size() != 1 || !v.contains("hex") || !v["hex"].is_string())
      return false;
    const auto& hex = v["hex"].get_ref<const std::string&>();
    if (hex.size() % 2) return false;
    out.clear();
    for (size_t i = 0; i < hex.size(); i += 2) {
      int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
      if (hi < 0 || lo < 0) return false;
      out.push_back(char(hi * 16 + lo));
    }
    return true;
  }
  static bool number_of(const json& v, double& out) {
    if (v.is_number()) {
      out = v.get<double>();
      return true;
    }
    if (!v.is_string()) return false;
    const auto& s = v.get_ref<const std::string&>();
    if (s == "inf")
      out = std::numeric_limits<double>::infinity();
    else if (s == "-inf")
      out = -std::numeric_limits<double>::infinity();
    else if (s == "nan")
      out = std::numeric_limits<double>::quiet_NaN();
    else
      return false;
    return true;
  }
  void fail(const std::string& what) { set_error(where_ + " " + what); }
  void set_error(const std::string& message) {
    if (error_.empty()) error_ = message;
  }

 private:
  static int nibble(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }
  const json& j_;
  std::string where_;
  std::string error_;
};

// Checksum, then JSON, then the format version.
Result<json> unseal(const std::string& value, const char* what) {
  const std::string who = std::string("journal: ") + what + ": ";
  if (value.size() < kChecksumBytes)
    return Status(Code::corruption, who + "value of " + std::to_string(value.size()) +
                                        " bytes is shorter than its 8-byte checksum");
  uint64_t stored = 0;
  for (size_t i = 0; i < kChecksumBytes; ++i) stored |= uint64_t(uint8_t(value[i])) << (8 * i);
  const auto* payload = reinterpret_cast<const uint8_t*>(value.data()) + kChecksumBytes;
  const size_t n = value.size() - kChecksumBytes;
  if (checksum_bytes(payload, n) != stored)
    return Status(Code::corruption,
                  who + "checksum mismatch over the " + std::to_string(n) + "-byte payload");
  json j;
  try {
    j = json::parse(value.begin() + kChecksumBytes, value.end());
  } catch (const json::exception& e) {
    return Status(Code::corruption, who + "bad JSON: " + e.what());
  }
  Fields f(j, who.substr(0, who.size() - 2) + ":");
  int version = 0;
  f.integer("version", version);
  if (!f.failed() && version != kFormatVersion)
    f.fail("has the unknown format version " + std::to_string(version));
  if (f.failed()) return Status(Code::corruption, f.error());
  return j;
}

json encode_logprob(const TokenLogprob& t) {
  return json::array({t.token, number_value(t.logprob)});
}

bool decode_logprob(const json& v, TokenLogprob& out) {
  double lp = 0;
  if (!v.is_array() || v.size() != 2 || !v[0].is_number_integer() || !Fields::number_of(v[1], lp))
    return false;
  const auto token = v[0].get<int64_t>();
  if (token < INT32_MIN || token > INT32_MAX) return false;
  out.token = int32_t(token);
  out.logprob = float(lp);
  return true;
}

json encode_choice(const ChoiceProgress& c) {
  json logprobs = json::array();
  for (const auto& e : c.logprobs) {
    json top = json::array();
    for (const auto& t : e.top) top.push_back(encode_logprob(t));
    logprobs.push_back(json::array({encode_logprob(e.chosen), std::move(top)}));
  }
  return json{{"tokens", c.tokens},
              {"text", string_value(c.text)},
              {"logprobs", std::move(logprobs)},
              {"finish_reason", string_value(c.finish_reason)},
              {"cached_tokens", c.cached_tokens}};
}

void decode_choice(const json& v, size_t i, ChoiceProgress& c, Fields& outer) {
  Fields f(v, "journal: request record: choice " + std::to_string(i));
  if (const json* tokens = f.array("tokens")) {
    for (const auto& t : *tokens) {
      if (!t.is_number_integer() || t.get<int64_t>() < INT32_MIN || t.get<int64_t>() > INT32_MAX) {
        f.wrong("tokens", "array of 32-bit integers");
        break;
      }
      c.tokens.push_back(int32_t(t.get<int64_t>()));
    }
  }
  f.text("text", c.text);
  if (const json* logprobs = f.array("logprobs")) {
    for (const auto& e : *logprobs) {
      LogprobEntry entry;
      bool good =
          e.is_array() && e.size() == 2 && decode_logprob(e[0], entry.chosen) && e[1].is_array();
      for (size_t k = 0; good && k < e[1].size(); ++k)
        good = decode_logprob(e[1][k], entry.top.emplace_back());
      if (!good) {
        f.wrong("logprobs", "array of [[token, logprob], [[token, logprob], ...]]");
        break;
      }
      c.logprobs.push_back(std::move(entry));
    }
  }
  f.text("finish_reason", c.finish_reason);
  f.integer("cached_tokens", c.cached_tokens);
  if (f.failed()) outer.set_error(f.error());
}

}  // namespace

const char* job_status_name(JobStatus s) {
  const auto i = size_t(s);
  return i < std::size(kStatusNames) ? kStatusNames[i] : "unknown";
}

std::optional<JobStatus> parse_job_status(const std::string& name) {
  for (size_t i = 0; i < std::size(kStatusNames); ++i)
    if (name == kStatusNames[i]) return JobStatus(i);
  return std::nullopt;
}

const char* request_state_name(RequestState s) {
  const auto i = size_t(s);
  return i < std::size(kStateNames) ? kStateNames[i] : "unknown";
}

std::string encode_meta(const JobMeta& m) {
  return seal(json{{"version", kFormatVersion},
                   {"input_fingerprint", string_value(m.input_fingerprint)},
                   {"input_path", string_value(m.input_path)},
                   {"output_path", string_value(m.output_path)},
                   {"settings", string_value(m.settings)},
                   {"endpoint", string_value(m.endpoint)},
                   {"status", job_status_name(m.status)},
                   {"error", string_value(m.error)},
                   {"created_at", m.created_at},
                   {"in_progress_at", m.in_progress_at},
                   {"finalizing_at", m.finalizing_at},
                   {"completed_at", m.completed_at},
                   {"failed_at", m.failed_at},
                   {"cancelling_at", m.cancelling_at},
                   {"cancelled_at", m.cancelled_at},
                   {"total", m.total},
                   {"completed", m.completed},
                   {"failed", m.failed},
                   {"output_bytes", m.output_bytes},
                   {"runs", m.runs},
                   {"generated_tokens", m.generated_tokens},
                   {"resumed_tokens", m.resumed_tokens},
                   {"resumed_requests", m.resumed_requests},
                   {"imported_tokens", m.imported_tokens},
                   {"recomputed_tokens", m.recomputed_tokens},
                   {"active_seconds", number_value(m.active_seconds)}});
}

Result<JobMeta> decode_meta(const std::string& value) {
  auto j = unseal(value, "job meta");
  if (!j.ok()) return j.status();
  Fields f(*j, "journal: job meta:");
  JobMeta m;
  f.text("input_fingerprint", m.input_fingerprint);
  f.text("input_path", m.input_path);
  f.text("output_path", m.output_path);
  f.text("settings", m.settings);  // absent in older journals
  f.text("endpoint", m.endpoint);
  std::string status;
  f.text("status", status);
  if (!f.failed()) {
    if (auto s = parse_job_status(status))
      m.status = *s;
    else
      f.fail("field 'status' has the unknown value '" + status + "'");
  }
  f.text("error", m.error);
  for (auto [key, field] : {std::pair{"created_at", &m.created_at},
                            {"in_progress_at", &m.in_progress_at},
                            {"finalizing_at", &m.finalizing_at},
                            {"completed_at", &m.completed_at},
                            {"failed_at", &m.failed_at},
                            {"cancelling_at", &m.cancelling_at},
                            {"cancelled_at", &m.cancelled_at}})
    f.integer(key, *field);
  for (auto [key, field] : {std::pair{"total", &m.total},
                            {"completed", &m.completed},
                            {"failed", &m.failed},
                            {"output_bytes", &m.output_bytes},
                            {"runs", &m.runs},
                            {"generated_tokens", &m.generated_tokens},
                            {"resumed_tokens", &m.resumed_tokens},
                            {"resumed_requests", &m.resumed_requests},
                            {"imported_tokens", &m.imported_tokens},
                            {"recomputed_tokens", &m.recomputed_tokens}})
    f.integer(key, *field);
  f.number("active_seconds", m.active_seconds);
  if (f.failed()) return Status(Code::corruption, f.error());
  return m;
}

std::string encode_record(const RequestRecord& r) {
  json choices = json::array();
  for (const auto& c : r.choices) choices.push_back(encode_choice(c));
  return seal(json{{"version", kFormatVersion},
                   {"state", request_state_name(r.state)},
                   {"choices", std::move(choices)},
                   {"output_end", r.output_end},
                   {"ok", r.ok}});
}

Result<RequestRecord> decode_record(const std::string& value) {
  auto j = unseal(value, "request record");
  if (!j.ok()) return j.status();
  Fields f(*j, "journal: request record:");
  RequestRecord r;
  std::string state;
  f.text("state", state);
  if (!f.failed()) {
    size_t i = 0;
    while (i < std::size(kStateNames) && state != kStateNames[i]) ++i;
    if (i < std::size(kStateNames))
      r.state = RequestState(i);
    else
      f.fail("field 'state' has the unknown value '" + state + "'");
  }
  if (const json* choices = f.array("choices"))
    for (size_t i = 0; i < choices->size() && !f.failed(); ++i)
      decode_choice((*choices)[i], i, r.choices.emplace_back(), f);
  f.integer("output_end", r.output_end);
  f.boolean("ok", r.ok);
  if (f.failed()) return Status(Code::corruption, f.error());
  return r;
}

}  // namespace cleave::jobs
