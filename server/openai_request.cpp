#include "server/openai_request.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "frontend/request_codec.h"
#include "model/multimodal.h"

namespace cleave::server {
namespace {

using json = nlohmann::json;

// A refusal is thrown as Refused inside this file and caught at each entry
// point (parse_*), so the nested parsers stay flat; nothing leaves it.
struct Refused {
  ApiError error;
};

[[noreturn]] void refuse(std::string param, std::string message) {
  throw Refused{ApiError::invalid(std::move(message), std::move(param))};
}

template <class T>
T take(Result<T> r, const std::string& param) {
  if (!r.ok()) refuse(param, r.status().message());
  return std::move(r.value());
}

int64_t int_of(const json& v, const std::string& param, int64_t lo, int64_t hi) {
  return take(json_int(v, param, lo, hi), param);
}
double number_of(const json& v, const std::string& param, double lo, double hi) {
  return take(json_number(v, param, lo, hi), param);
}
bool bool_of(const json& v, const std::string& param) { return take(json_bool(v, param), param); }
std::string string_of(const json& v, const std::string& param) {
  if (!v.is_string()) refuse(param, "\"" + param + "\" must be a string, got " + v.type_name());
  return v.get<std::string>();
}
// Checked as the float it is kept as: a positive double too small for a
// float (1e-50) rounds to 0, and repetition_penalty 0 divides logits by 0.
double positive_of(const json& v, const std::string& param, double hi) {
  const double d = number_of(v, param, 0, hi);
  if (!(float(d) > 0)) {
    char buf[32] = "0";
    if (d > 0) std::snprintf(buf, sizeof buf, "%g", d);
    refuse(param, "\"" + param + "\" must be above 0, got " + buf + (d > 0 ? " (0 as a float)" : ""));
  }
  return d;
}

size_t utf8_error(std::string_view s) {  // offset of the first bad byte; npos when none
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const unsigned c = p[i];
    size_t n;
    uint32_t cp;
    if (c < 0x80) { ++i; continue; }
    if (c >= 0xC2 && c <= 0xDF) { n = 1; cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) { n = 2; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { n = 3; cp = c & 0x07; }
    else return i;
    if (i + n >= s.size()) return i;  // truncated
    for (size_t k = 1; k <= n; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = cp << 6 | (p[i + k] & 0x3F);
    }
    if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return i;
    i += n + 1;
  }
  return std::string_view::npos;
}

// The body as a JSON object; a key twice in one object is refused (which
// of the two would count is a guess).
json parse_body(std::string_view body) {
  const size_t bad = utf8_error(body);
  if (bad != std::string_view::npos)
    refuse("", "the request body is not valid UTF-8 (byte " + std::to_string(bad) + ")");
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) keys.emplace_back();
    else if (ev == json::parse_event_t::object_end && !keys.empty()) keys.pop_back();
    else if (ev == json::parse_event_t::key && !keys.empty() && duplicate.empty() &&
             !keys.back().insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  json j;
  try {
    j = json::parse(body.begin(), body.end(), cb);
  } catch (const json::exception& e) {
    refuse("", std::string("the request body is not valid JSON: ") + e.what());
  }
  if (!duplicate.empty()) refuse(duplicate, "the field \"" + duplicate + "\" appears twice in one object");
  if (!j.is_object()) refuse("", std::string("the request body must be a JSON object, got ") + j.type_name());
  return j;
}

// The field, or null when absent or JSON null.
const json* opt(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

void only_keys(const json& j, const std::set<std::string>& known, const std::string& where) {
  for (const auto& [key, value] : j.items()) {
    if (known.count(key)) continue;
    const std::string param = where.empty() ? key : where + "." + key;
    std::string hint;
    if (key == "chat_template") hint = " (the chat template is the server's setting: --chat-template)";
    refuse(param, "unknown field \"" + param + "\"" + hint);
  }
}

void no_text_marker(const std::string& text, const std::string& param) {
  if (text.find(kImageMarker) != std::string::npos)
    refuse(param, "the text holds \"" + std::string(kImageMarker) +
                      "\", which this server keeps for marking images; send images as image_url parts");
}

const std::set<std::string> kCommon = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "seed", "n", "ignore_eos", "stream", "stream_options", "user", "logit_bias",
    "logprobs", "priority", "ttft_target_ms", "tpot_target_ms", "deadline_ms", "max_cost"};

void parse_common(const json& j, ParsedRequest& p) {
  SamplingParams& s = p.sampling;
  if (auto v = opt(j, "model")) p.model = string_of(*v, "model");
  if (auto v = opt(j, "max_tokens")) p.max_tokens = int32_t(int_of(*v, "max_tokens", 1, INT32_MAX));
  if (auto v = opt(j, "temperature")) s.temperature = float(number_of(*v, "temperature", 0, 2));
  if (auto v = opt(j, "top_p")) s.top_p = float(positive_of(*v, "top_p", 1));
  if (auto v = opt(j, "top_k")) s.top_k = int32_t(std::max<int64_t>(0, int_of(*v, "top_k", -1, 1 << 30)));
  if (auto v = opt(j, "min_p")) s.min_p = float(number_of(*v, "min_p", 0, 1));
  if (auto v = opt(j, "presence_penalty")) s.presence_penalty = float(number_of(*v, "presence_penalty", -2, 2));
  if (auto v = opt(j, "frequency_penalty"))
    s.frequency_penalty = float(number_of(*v, "frequency_penalty", -2, 2));
  if (auto v = opt(j, "repetition_penalty")) s.repeat_penalty = float(positive_of(*v, "repetition_penalty", 100));
  if (auto v = opt(j, "stop")) {
    std::vector<std::string> stops;
    if (v->is_string()) {
      stops.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      if (v->size() > 4) refuse("stop", "\"stop\" holds " + std::to_string(v->size()) + " strings; at most 4");
      for (size_t i = 0; i < v->size(); ++i) stops.push_back(string_of((*v)[i], "stop[" + std::to_string(i) + "]"));
    } else {
      refuse("stop", std::string("\"stop\" must be a string or a list of strings, got ") + v->type_name());
    }
    for (const std::string& stop : stops)
      if (stop.empty()) refuse("stop", "\"stop\" strings must not be empty");
    s.stop = std::move(stops);
  }
  if (auto v = opt(j, "seed")) {
    if (v->is_number_unsigned()) p.seed = v->get<uint64_t>();
    else if (v->is_number_integer()) p.seed = uint64_t(v->get<int64_t>());
    else refuse("seed", std::string("\"seed\" must be an integer, got ") + (v->is_number() ? "a fraction or an out-of-range number" : v->type_name()));
  }
  if (auto v = opt(j, "n")) p.n = int32_t(int_of(*v, "n", 1, 16));
  if (auto v = opt(j, "ignore_eos")) p.ignore_eos = bool_of(*v, "ignore_eos");
  if (auto v = opt(j, "priority")) p.priority = int32_t(int_of(*v, "priority", INT32_MIN, INT32_MAX));
  for (auto [key, out] : {std::pair{"ttft_target_ms", &p.ttft_target_ms},
                          std::pair{"tpot_target_ms", &p.tpot_target_ms},
                          std::pair{"deadline_ms", &p.deadline_ms}, std::pair{"max_cost", &p.max_cost}})
    if (auto v = opt(j, key)) *out = number_of(*v, key, 0, 1e9);
  if (auto v = opt(j, "stream")) p.stream = bool_of(*v, "stream");
  if (auto v = opt(j, "stream_options")) {
    if (!v->is_object()) refuse("stream_options", std::string("\"stream_options\" must be an object, got ") + v->type_name());
    if (!p.stream) refuse("stream_options", "\"stream_options\" is only allowed when \"stream\" is true");
    only_keys(*v, {"include_usage"}, "stream_options");
    if (auto u = opt(*v, "include_usage")) p.include_usage = bool_of(*u, "stream_options.include_usage");
  }
  if (auto v = opt(j, "user")) string_of(*v, "user");  // metadata: accepted, not used
  if (auto v = opt(j, "logit_bias")) {
    if (!v->is_object() || !v->empty()) refuse("logit_bias", "\"logit_bias\" is not supported (only {} is accepted)");
  }
}

// "data:image/png;base64,...." -> the decoded image.
std::string base64_decode(std::string_view s, const std::string& param) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  size_t end = s.size();
  while (end > 0 && s.size() - end < 2 && s[end - 1] == '=') --end;
  if ((s.size() != end && s.size() % 4 != 0) || end % 4 == 1)
    refuse(param, "the image data is not valid base64 (its length " + std::to_string(s.size()) + " does not fit)");
  std::string out;
  out.reserve(end / 4 * 3 + 2);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < end; ++i) {
    const int v = value(s[i]);
    if (v < 0) refuse(param, "the image data is not valid base64 (character " + std::to_string(i) + ")");
    acc = (acc << 6 | uint32_t(v)) & 0xFFFFFF;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(char((acc >> bits) & 0xFF));
    }
  }
  return out;
}

// "file:///abs/path" inside the allowed directory -> the decoded image.
RgbImage read_local_image(const std::string& url, const std::string& param, const ParseOptions& options) {
  const std::string path = url.substr(7);
  std::error_code ec;
  const auto root = std::filesystem::canonical(options.media_root, ec);
  if (ec) refuse(param, "the local media directory cannot be read: " + ec.message());
  const auto real = std::filesystem::canonical(path, ec);
  if (ec) refuse(param, "the image file \"" + path.substr(0, 256) + "\" cannot be read: " + ec.message());
  const auto rel = real.lexically_relative(root);
  if (rel.empty() || *rel.begin() == "..")
    refuse(param, "the image file \"" + path.substr(0, 256) + "\" is outside the allowed media directory");
  std::ifstream in(real, std::ios::binary);
  std::string bytes;
  char buf[65536];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    bytes.append(buf, size_t(in.gcount()));
    if (bytes.size() > options.image_limits.max_bytes)
      refuse(param, "the image file is above the limit of " + std::to_string(options.image_limits.max_bytes) + " bytes");
  }
  if (in.bad()) refuse(param, "the image file \"" + path.substr(0, 256) + "\" could not be read");
  auto image = decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), options.image_limits);
  if (!image.ok()) refuse(param, "the image could not be decoded: " + image.status().to_string());
  return std::move(image.value());
}

RgbImage decode_data_url(const std::string& url, const std::string& param, const ImageLimits& limits) {
  if (url.rfind("data:", 0) != 0) {
    const size_t colon = url.find(':');
    const std::string scheme = colon == std::string::npos || colon > 16 ? "" : url.substr(0, colon + 1);
    refuse(param, "this server fetches no image URLs" + (scheme.empty() ? "" : " (got a \"" + scheme + "\" URL)") +
                      "; send the image inline: data:image/png;base64,... or data:image/jpeg;base64,...");
  }
  const size_t comma = url.find(',');
  if (comma == std::string::npos) refuse(param, "the data URL has no ',' before its data");
  const std::string header = url.substr(5, comma - 5);
  std::string mime = header.substr(0, header.find(';'));
  for (char& c : mime) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (mime != "image/png" && mime != "image/jpeg" && mime != "image/jpg")
    refuse(param, "images must be PNG or JPEG (data:image/png or data:image/jpeg), got \"" + mime + "\"");
  if (header.size() < 7 || header.compare(header.size() - 7, 7, ";base64") != 0)
    refuse(param, "the data URL must be base64 encoded (data:" + mime + ";base64,...)");
  const std::string_view payload = std::string_view(url).substr(comma + 1);
  if (payload.size() / 4 * 3 > limits.max_bytes + 3)
    refuse(param, "the image is about " + std::to_string(payload.size() / 4 * 3) + " bytes, above the limit of " +
                      std::to_string(limits.max_bytes));
  const std::string bytes = base64_decode(payload, param);
  auto image = decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), limits);
  if (!image.ok()) refuse(param, "the image could not be decoded: " + image.status().to_string());
  return std::move(image.value());
}

void parse_message(const json& m, size_t i, ParsedRequest& p, const ParseOptions& options) {
  const std::string where = "messages[" + std::to_string(i) + "]";
  if (!m.is_object()) refuse(where, "\"" + where + "\" must be an object, got " + m.type_name());
  for (const char* key : {"name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"})
    if (m.contains(key))
      refuse(where + "." + key, "\"" + std::string(key) + "\" in messages is not supported by this server");
  only_keys(m, {"role", "content"}, where);
  const json* role_v = opt(m, "role");
  if (!role_v) refuse(where + ".role", "\"" + where + ".role\" is required");
  ChatMessage msg;
  msg.role = string_of(*role_v, where + ".role");
  if (msg.role == "tool" || msg.role == "function")
    refuse(where + ".role", "\"" + msg.role + "\" messages are not supported (this server does not call tools)");
  if (msg.role != "system" && msg.role != "developer" && msg.role != "user" && msg.role != "assistant")
    refuse(where + ".role", "unknown role \"" + msg.role + "\"; use system, developer, user or assistant");
  const json* content = opt(m, "content");
  const std::string cwhere = where + ".content";
  if (!content) refuse(cwhere, "\"" + cwhere + "\" is required");
  if (content->is_string()) {
    msg.text = content->get<std::string>();
    no_text_marker(msg.text, cwhere);
  } else if (content->is_array()) {
    if (content->empty()) refuse(cwhere, "\"" + cwhere + "\" must not be an empty list");
    bool last_text = false;
    for (size_t k = 0; k < content->size(); ++k) {
      const json& part = (*content)[k];
      const std::string pw = cwhere + "[" + std::to_string(k) + "]";
      if (!part.is_object()) refuse(pw, "\"" + pw + "\" must be an object, got " + part.type_name());
      const json* type_v = opt(part, "type");
      if (!type_v) refuse(pw + ".type", "\"" + pw + ".type\" is required");
      const std::string type = string_of(*type_v, pw + ".type");
      if (type == "text") {
        only_keys(part, {"type", "text"}, pw);
        const json* t = opt(part, "text");
        if (!t) refuse(pw + ".text", "\"" + pw + ".text\" is required");
        const std::string text = string_of(*t, pw + ".text");
        no_text_marker(text, pw + ".text");
        if (last_text) msg.text += "\n";
        msg.text += text;
        last_text = true;
      } else if (type == "image_url") {
        if (msg.role != "user") refuse(pw, "images are only allowed in user messages, not in " + msg.role + " ones");
        only_keys(part, {"type", "image_url"}, pw);
        const json* iu = opt(part, "image_url");
        if (!iu || !iu->is_object()) refuse(pw + ".image_url", "\"" + pw + ".image_url\" must be an object {\"url\": ...}");
        only_keys(*iu, {"url", "detail"}, pw + ".image_url");
        if (auto d = opt(*iu, "detail"); d && string_of(*d, pw + ".image_url.detail") != "auto")
          refuse(pw + ".image_url.detail", "only \"detail\": \"auto\" is supported (the encoder has one resolution)");
        const json* url = opt(*iu, "url");
        if (!url) refuse(pw + ".image_url.url", "\"" + pw + ".image_url.url\" is required");
        if (int32_t(p.images.size()) >= options.max_images)
          refuse(pw, "a request may hold at most " + std::to_string(options.max_images) + " images");
        const std::string u = string_of(*url, pw + ".image_url.url");
        if (!options.media_root.empty() && u.rfind("file://", 0) == 0)
          p.images.push_back(read_local_image(u, pw + ".image_url.url", options));
        else
          p.images.push_back(decode_data_url(u, pw + ".image_url.url", options.image_limits));
        p.image_params.push_back(pw);
        msg.text += kImageMarker;
        ++msg.n_images;
        last_text = false;
      } else {
        refuse(pw + ".type", "content parts of type \"" + type + "\" are not supported; use text or image_url");
      }
    }
  } else {
    refuse(cwhere, "\"" + cwhere + "\" must be a string or a list of content parts, got " + content->type_name());
  }
  p.messages.push_back(std::move(msg));
}

ParsedRequest completion(std::string_view body) {
  const json j = parse_body(body);
  std::set<std::string> known = kCommon;
  known.insert({"prompt", "echo", "best_of", "suffix"});
  only_keys(j, known, "");
  ParsedRequest p;
  p.kind = RequestKind::completion;
  p.sampling = openai_sampling_defaults();
  parse_common(j, p);
  const json* prompt = opt(j, "prompt");
  if (!prompt) refuse("prompt", "\"prompt\" is required");
  auto ids = [&](const json& a, const std::string& name) {
    std::vector<int32_t> out;
    for (size_t i = 0; i < a.size(); ++i)
      out.push_back(int32_t(int_of(a[i], name + "[" + std::to_string(i) + "]", 0, INT32_MAX)));
    return out;
  };
  const std::string several = "several prompts in one request are not supported; send one request per prompt";
  if (prompt->is_string()) {
    p.prompt_text = prompt->get<std::string>();
  } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_string()) {
    if (prompt->size() > 1) refuse("prompt", several);
    p.prompt_text = (*prompt)[0].get<std::string>();
  } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_array()) {
    if (prompt->size() > 1) refuse("prompt", several);
    p.prompt_ids = ids((*prompt)[0], "prompt[0]");
  } else if (prompt->is_array() && !prompt->empty()) {
    p.prompt_ids = ids(*prompt, "prompt");
  } else {
    refuse("prompt", std::string("\"prompt\" must be a string, a non-empty list of token ids, or a list of one of those, got ") +
                         (prompt->is_array() ? "an empty list" : prompt->type_name()));
  }
  if (p.prompt_ids.empty() && !p.prompt_text) refuse("prompt", "\"prompt\" holds no token ids");
  if (auto v = opt(j, "logprobs")) p.logprobs = int32_t(int_of(*v, "logprobs", 0, 5));
  if (auto v = opt(j, "echo"); v && bool_of(*v, "echo"))
    refuse("echo", "\"echo\" is not supported (the response never repeats the prompt)");
  if (auto v = opt(j, "best_of"); v && int_of(*v, "best_of", 1, 16) != p.n)
    refuse("best_of", "\"best_of\" other than \"n\" is not supported (no server-side candidates)");
  if (auto v = opt(j, "suffix"); v && !string_of(*v, "suffix").empty())
    refuse("suffix", "\"suffix\" is not supported (no insertion)");
  if (!p.max_tokens) p.max_tokens = 16;  // OpenAI's completions default
  return p;
}

ParsedRequest chat(std::string_view body, const ParseOptions& options) {
  const json j = parse_body(body);
  std::set<std::string> known = kCommon;
  known.insert({"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
                "functions", "function_call"});
  only_keys(j, known, "");
  ParsedRequest p;
  p.kind = RequestKind::chat;
  p.sampling = openai_sampling_defaults();
  for (const char* key : {"tools", "tool_choice", "functions", "function_call"})
    if (opt(j, key)) refuse(key, "\"" + std::string(key) + "\" is not supported (this server does not call tools)");
  parse_common(j, p);
  const json* messages = opt(j, "messages");
  if (!messages) refuse("messages", "\"messages\" is required");
  if (!messages->is_array()) refuse("messages", std::string("\"messages\" must be a list, got ") + messages->type_name());
  if (messages->empty()) refuse("messages", "\"messages\" must not be empty");
  for (size_t i = 0; i < messages->size(); ++i) parse_message((*messages)[i], i, p, options);
  if (auto v = opt(j, "max_completion_tokens")) {
    const int32_t m = int32_t(int_of(*v, "max_completion_tokens", 1, INT32_MAX));
    if (p.max_tokens && *p.max_tokens != m)
      refuse("max_completion_tokens", "\"max_tokens\" " + std::to_string(*p.max_tokens) +
                                          " and \"max_completion_tokens\" " + std::to_string(m) + " differ");
    p.max_tokens = m;
  }
  bool logprobs = false;
  if (auto v = opt(j, "logprobs")) logprobs = bool_of(*v, "logprobs");
  int32_t top = 0;
  if (auto v = opt(j, "top_logprobs")) {
    top = int32_t(int_of(*v, "top_logprobs", 0, 20));
    if (!logprobs) refuse("top_logprobs", "\"top_logprobs\" needs \"logprobs\": true");
  }
  p.logprobs = logprobs ? top : -1;
  if (auto v = opt(j, "response_format")) {
    if (!v->is_object()) refuse("response_format", std::string("\"response_format\" must be an object, got ") + v->type_name());
    only_keys(*v, {"type"}, "response_format");
    const json* t = opt(*v, "type");
    if (!t) refuse("response_format.type", "\"response_format.type\" is required");
    const std::string type = string_of(*t, "response_format.type");
    if (type != "text")
      refuse("response_format", "only {\"type\": \"text\"} is supported, got \"" + type + "\" (no constrained decoding)");
  }
  return p;
}

template <class F>
auto guarded(F&& f) -> ApiResult<decltype(f())> {
  try {
    return f();
  } catch (const Refused& r) {
    return r.error;
  } catch (const json::exception& e) {  // a type the checks above missed
    return ApiError::invalid(e.what());
  }
}

ApiError context_exceeded(std::string message, const std::string& param) {
  return ApiError::invalid(std::move(message), param, "context_length_exceeded");
}

}  // namespace

bool is_valid_utf8(std::string_view s) { return utf8_error(s) == std::string_view::npos; }

SamplingParams openai_sampling_defaults() {
  SamplingParams s;
  s.temperature = 1.0f;
  s.top_k = 0;
  s.top_p = 1.0f;
  s.min_p = 0.0f;
  s.repeat_penalty = 1.0f;
  s.repeat_last_n = -1;
  s.presence_penalty = 0.0f;
  s.frequency_penalty = 0.0f;
  return s;
}

ApiResult<ParsedRequest> parse_completion_request(std::string_view body, const ParseOptions&) {
  return guarded([&] { return completion(body); });
}

ApiResult<ParsedRequest> parse_chat_request(std::string_view body, const ParseOptions& options) {
  return guarded([&] { return chat(body, options); });
}

ApiResult<GenerateRequest> build_generate_request(ParsedRequest p, const PromptContext& ctx) {
  if (!ctx.tokenizer) return ApiError::internal("the server has no tokenizer");
  const Tokenizer& tok = *ctx.tokenizer;
  const bool is_chat = p.kind == RequestKind::chat;
  const std::string what = is_chat ? "messages" : "prompt";
  GenerateRequest r;
  if (!is_chat) {
    if (p.prompt_text) {
      r.prompt = tok.encode(*p.prompt_text, true);
    } else {
      for (size_t i = 0; i < p.prompt_ids.size(); ++i)
        if (p.prompt_ids[i] >= tok.n_vocab())
          return ApiError::invalid("prompt token " + std::to_string(i) + " (id " + std::to_string(p.prompt_ids[i]) +
                                       ") is outside the vocabulary [0, " + std::to_string(tok.n_vocab()) + ")",
                                   "prompt");
      r.prompt = std::move(p.prompt_ids);
    }
  } else {
    if (!p.images.empty() && ctx.image_tokens < 1)
      return ApiError::invalid("this server has no vision encoder (--mmproj), so it takes no images",
                               p.image_params.empty() ? "messages" : p.image_params[0]);
    auto info = chat_template_info(ctx.chat_template);
    if (!info.ok()) return ApiError::internal("the server's chat template: " + info.status().message());
    auto pieces = render_chat(ctx.chat_template, p.messages, true);
    if (!pieces.ok()) return ApiError::invalid(pieces.status().message(), "messages");
    auto built = tokenize_chat(*pieces, *info, tok, ctx.special_tokens, std::move(p.images), ctx.image_tokens);
    if (!built.ok()) return ApiError::invalid(built.status().message(), "messages");
    r = std::move(built.value());
  }
  if (r.prompt.empty()) return ApiError::invalid("the " + what + " gave no tokens", what);
  const int64_t prompt = int64_t(r.prompt.size()), context = ctx.context;
  const std::string limit = "This model's maximum context length is " + std::to_string(context) + " tokens. ";
  int64_t max_tokens;
  if (p.max_tokens) {
    max_tokens = *p.max_tokens;
    if (prompt + max_tokens > context)
      return context_exceeded(limit + "However, you requested " + std::to_string(prompt + max_tokens) + " tokens (" +
                                  std::to_string(prompt) + " in the " + what + ", " + std::to_string(max_tokens) +
                                  " in the completion). Please reduce the length of the " + what + " or completion.",
                              what);
  } else {
    max_tokens = context - prompt;
    if (max_tokens < 1)
      return context_exceeded(limit + "However, your " + what + " resulted in " + std::to_string(prompt) +
                                  " tokens, which leaves no room for a completion. Please reduce the length of the " +
                                  what + ".",
                              what);
  }
  r.sampling = p.sampling;
  r.sampling.max_tokens = int32_t(max_tokens);
  r.sampling.seed = p.seed.value_or(ctx.default_seed);
  r.logprobs = p.logprobs;
  r.ignore_eos = p.ignore_eos;
  r.priority = p.priority;
  r.ttft_target_ms = p.ttft_target_ms;
  r.tpot_target_ms = p.tpot_target_ms;
  r.deadline_ms = p.deadline_ms;
  r.max_cost = p.max_cost;
  const Status s = validate_request(r, ctx.context, tok.n_vocab());
  if (!s.ok()) {
    ApiError e = from_status(s);
    if (e.status == 400) e.param = what;
    return e;
  }
  return r;
}

ApiResult<TokenizeRequest> parse_tokenize_request(std::string_view body) {
  return guarded([&] {
    const json j = parse_body(body);
    only_keys(j, {"content", "add_special", "with_pieces", "model"}, "");
    TokenizeRequest t;
    const json* c = opt(j, "content");
    if (!c) refuse("content", "\"content\" is required");
    t.content = string_of(*c, "content");
    if (auto v = opt(j, "add_special")) t.add_special = bool_of(*v, "add_special");
    if (auto v = opt(j, "with_pieces")) t.with_pieces = bool_of(*v, "with_pieces");
    if (auto v = opt(j, "model")) t.model = string_of(*v, "model");
    return t;
  });
}

ApiResult<DetokenizeRequest> parse_detokenize_request(std::string_view body, const VocabOf& n_vocab_of) {
  return guarded([&] {
    const json j = parse_body(body);
    only_keys(j, {"tokens", "model"}, "");
    DetokenizeRequest d;
    if (auto v = opt(j, "model")) d.model = string_of(*v, "model");
    const json* t = opt(j, "tokens");
    if (!t) refuse("tokens", "\"tokens\" is required");
    if (!t->is_array()) refuse("tokens", std::string("\"tokens\" must be a list of token ids, got ") + t->type_name());
    // The bound is the named model's, so the model is looked up first.
    ApiResult<int32_t> n_vocab = n_vocab_of(d.model);
    if (!n_vocab.ok()) throw Refused{n_vocab.error()};
    for (size_t i = 0; i < t->size(); ++i) {
      const std::string name = "tokens[" + std::to_string(i) + "]";
      auto v = json_int((*t)[i], name, 0, int64_t(*n_vocab) - 1);
      if (!v.ok()) refuse("tokens", v.status().message());
      d.tokens.push_back(int32_t(*v));
    }
    return d;
  });
}

ApiResult<std::vector<int32_t>> parse_detokenize_request(std::string_view body, int32_t n_vocab) {
  auto d = parse_detokenize_request(body, [n_vocab](const std::string&) -> ApiResult<int32_t> { return n_vocab; });
  if (!d.ok()) return d.error();
  return std::move(d->tokens);
}

}  // namespace cleave::server
