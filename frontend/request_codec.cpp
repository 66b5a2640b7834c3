#include "frontend/request_codec.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "model/multimodal.h"

namespace cleave {
namespace {

using json = nlohmann::json;

Status bad(const std::string& what) { return Status(Code::invalid_argument, what); }

Result<int64_t> int_field(const json& j, const char* key, int64_t lo, int64_t hi) {
  return json_int(j.at(key), key, lo, hi);
}

Result<double> number_field(const json& j, const char* key, double lo, double hi) {
  return json_number(j.at(key), key, lo, hi);
}

Result<bool> bool_field(const json& j, const char* key) { return json_bool(j.at(key), key); }

Result<std::vector<std::string>> strings_field(const json& j, const char* key, bool one_allowed) {
  const json& v = j.at(key);
  std::vector<std::string> out;
  if (one_allowed && v.is_string()) {
    out.push_back(v.get<std::string>());
    return out;
  }
  if (!v.is_array()) return bad(std::string("\"") + key + "\" must be a list of strings");
  for (const json& s : v) {
    if (!s.is_string()) return bad(std::string("\"") + key + "\" must be a list of strings");
    out.push_back(s.get<std::string>());
  }
  return out;
}

const std::unordered_set<std::string>& known_keys() {
  static const std::unordered_set<std::string> keys = {
      "id",          "prompt", "prompt_ids",     "images",        "add_bos", "max_tokens",
      "temperature", "top_k",  "top_p",          "min_p",         "seed",    "repeat_penalty",
      "repeat_last_n", "stop", "ignore_eos",     "prefill_chunk", "priority", "ttft_target_ms", "tpot_target_ms",
      "deadline_ms", "max_cost"};
  return keys;
}

Result<GenerateRequest> parse_object(const json& j, const RequestContext& ctx) {
  if (!j.is_object()) return bad(std::string("a request must be a JSON object, got ") + j.type_name());
  for (const auto& [key, value] : j.items())
    if (!known_keys().count(key)) return bad("unknown field \"" + key + "\"");
  if (!j.contains("id")) return bad("a request needs \"id\"");
  if (j.contains("prompt") == j.contains("prompt_ids"))
    return bad("a request needs exactly one of \"prompt\" and \"prompt_ids\"");
  GenerateRequest r;
  auto id = j.at("id");
  if (!id.is_number_unsigned() && !(id.is_number_integer() && id.get<int64_t>() >= 0))
    return bad("\"id\" must be an unsigned integer");
  const uint64_t request_id = id.get<uint64_t>();
  bool add_bos = true;
  if (j.contains("add_bos")) {
    auto b = bool_field(j, "add_bos");
    if (!b.ok()) return b.status();
    add_bos = *b;
  }
  std::vector<std::string> image_files;
  if (j.contains("images")) {
    auto files = strings_field(j, "images", false);
    if (!files.ok()) return files.status();
    image_files = std::move(files.value());
  }
  if (!image_files.empty() && ctx.image_tokens < 1)
    return bad("\"images\" need a vision encoder (--mmproj)");
  if (j.contains("prompt_ids")) {
    if (!image_files.empty()) return bad("\"images\" need \"prompt\" text, not \"prompt_ids\"");
    const json& ids = j.at("prompt_ids");
    if (!ids.is_array()) return bad("\"prompt_ids\" must be a list of token ids");
    for (const json& t : ids) {
      if (!(t.is_number_unsigned() || t.is_number_integer()) || t.get<int64_t>() < 0 ||
          t.get<int64_t>() > std::numeric_limits<int32_t>::max())
        return bad("\"prompt_ids\" must hold token ids (integers from 0 to 2^31-1)");
      r.prompt.push_back(int32_t(t.get<int64_t>()));
    }
  } else {
    const json& p = j.at("prompt");
    if (!p.is_string()) return bad(std::string("\"prompt\" must be a string, got ") + p.type_name());
    if (!ctx.tokenizer) return bad("the model has no tokenizer for \"prompt\"");
    const std::string text = p.get<std::string>();
    if (image_files.empty()) {
      r.prompt = ctx.tokenizer->encode(text, add_bos);
    } else {
      std::vector<RgbImage> images;
      for (const std::string& file : image_files) {
        auto im = ctx.load_image ? ctx.load_image(file) : read_image_file(file);
        if (!im.ok()) return im.status();
        images.push_back(std::move(im.value()));
      }
      auto built = build_image_prompt(*ctx.tokenizer, text, std::move(images), ctx.image_tokens, add_bos);
      if (!built.ok()) return built.status();
      r = std::move(built.value());
    }
  }
  r.request_id = request_id;
  r.sampling = SamplingParams{};
  r.sampling.max_tokens = 16;
  SamplingParams& s = r.sampling;
  struct IntKey { const char* key; int64_t lo, hi; int32_t* out; };
  for (const IntKey& k : {IntKey{"max_tokens", 0, 1 << 24, &s.max_tokens},
                          IntKey{"top_k", 0, 1 << 30, &s.top_k},
                          IntKey{"repeat_last_n", 0, 1 << 24, &s.repeat_last_n},
                          IntKey{"prefill_chunk", 1, 1 << 20, &r.prefill_chunk},
                          IntKey{"priority", INT32_MIN, INT32_MAX, &r.priority}}) {
    if (!j.contains(k.key)) continue;
    auto v = int_field(j, k.key, k.lo, k.hi);
    if (!v.ok()) return v.status();
    *k.out = int32_t(*v);
  }
  struct NumKey { const char* key; double lo, hi; float* out; };
  for (const NumKey& k : {NumKey{"temperature", 0, 100, &s.temperature}, NumKey{"top_p", 0, 1, &s.top_p},
                          NumKey{"min_p", 0, 1, &s.min_p},
                          NumKey{"repeat_penalty", 0.01, 100, &s.repeat_penalty}}) {
    if (!j.contains(k.key)) continue;
    auto v = number_field(j, k.key, k.lo, k.hi);
    if (!v.ok()) return v.status();
    *k.out = float(*v);
  }
  for (auto [key, out] : {std::pair{"ttft_target_ms", &r.ttft_target_ms},
                          std::pair{"tpot_target_ms", &r.tpot_target_ms},
                          std::pair{"deadline_ms", &r.deadline_ms}, std::pair{"max_cost", &r.max_cost}}) {
    if (!j.contains(key)) continue;
    auto v = number_field(j, key, 0, 1e9);
    if (!v.ok()) return v.status();
    *out = *v;
  }
  if (j.contains("seed")) {
    const json& v = j.at("seed");
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
      return bad("\"seed\" must be an unsigned integer");
    s.seed = v.get<uint64_t>();
  }
  if (j.contains("stop")) {
    auto stop = strings_field(j, "stop", true);
    if (!stop.ok()) return stop.status();
    s.stop = std::move(stop.value());
  }
  if (j.contains("ignore_eos")) {
    auto b = bool_field(j, "ignore_eos");
    if (!b.ok()) return b.status();
    r.ignore_eos = *b;
  }
  return r;
}

}  // namespace

Result<int64_t> json_int(const json& v, std::string_view name, int64_t lo, int64_t hi) {
  const std::string quoted = "\"" + std::string(name) + "\"";
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    // (hi < 0: no unsigned value fits; the cast would wrap it to a huge bound.)
    if (hi < 0 || u > uint64_t(hi))
      return bad(quoted + " " + std::to_string(u) + " is above " + std::to_string(hi));
    if (int64_t(u) >= lo) return int64_t(u);
  }
  if (!v.is_number_integer()) return bad(quoted + " must be an integer, got " + v.type_name());
  const int64_t i = v.get<int64_t>();
  if (i < lo || i > hi)
    return bad(quoted + " " + std::to_string(i) + " is outside [" + std::to_string(lo) + ", " +
               std::to_string(hi) + "]");
  return i;
}

Result<double> json_number(const json& v, std::string_view name, double lo, double hi) {
  const std::string quoted = "\"" + std::string(name) + "\"";
  if (!v.is_number()) return bad(quoted + " must be a number, got " + v.type_name());
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < lo || d > hi) {
    char buf[96];
    std::snprintf(buf, sizeof buf, " %g is outside [%g, %g]", d, lo, hi);
    return bad(quoted + buf);
  }
  return d;
}

Result<bool> json_bool(const json& v, std::string_view name) {
  if (!v.is_boolean())
    return bad("\"" + std::string(name) + "\" must be true or false, got " + v.type_name());
  return v.get<bool>();
}

Result<GenerateRequest> parse_request_line(std::string_view line, const RequestContext& ctx) {
  json j;
  try {
    j = json::parse(line.begin(), line.end());
  } catch (const json::exception& e) {
    return bad(std::string("not JSON: ") + e.what());
  }
  try {
    return parse_object(j, ctx);
  } catch (const json::exception& e) {  // a type the checks above missed
    return bad(e.what());
  }
}

Result<std::vector<GenerateRequest>> read_request_file(const std::string& path,
                                                       const RequestContext& ctx) {
  std::ifstream f(path);
  if (!f) return Status(Code::io_error, "cannot read requests file '" + path + "'");
  std::vector<GenerateRequest> out;
  std::unordered_set<uint64_t> ids;
  std::string line;
  for (int line_no = 1; std::getline(f, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no) + ": ";
    auto r = parse_request_line(line, ctx);
    if (!r.ok()) return Status(r.status().code(), where + r.status().message());
    if (!ids.insert(r->request_id).second)
      return bad(where + "request id " + std::to_string(r->request_id) + " appears twice");
    out.push_back(std::move(r.value()));
  }
  if (f.bad()) return Status(Code::io_error, "reading requests file '" + path + "' failed");
  if (out.empty()) return bad("no requests in '" + path + "'");
  return out;
}

std::string logits_hash_hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)h);
  return buf;
}

std::string result_line(uint64_t id, const Completion& c) {
  json j;
  j["id"] = id;
  j["tokens"] = c.tokens;
  json hashes = json::array();
  for (uint64_t h : c.logits_hashes) hashes.push_back(logits_hash_hex(h));
  j["logits_hash"] = std::move(hashes);
  j["text"] = c.text;
  if (c.error.ok()) j["finish_reason"] = c.finish_reason;
  else j["error"] = c.error.to_string();
  j["ttft_ms"] = c.ttft_seconds * 1e3;
  j["total_ms"] = c.total_seconds * 1e3;
  j["stages"] = json::object();
  for (const auto& [origin, st] : c.stages)  // which actor on which node, and its step time
    j["stages"][origin] = {{"tokens", st.tokens}, {"ms", st.seconds * 1e3}};
  if (!c.encode_origin.empty()) {
    j["encoder"] = c.encode_origin;
    j["encode_ms"] = c.encode_seconds * 1e3;
  }
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace cleave
