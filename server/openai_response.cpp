#include "server/openai_response.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

namespace cleave::server {
namespace {

using json = nlohmann::ordered_json;  // fields in OpenAI's order

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

double logprob_value(float lp) { return std::isfinite(lp) && lp > -9999.0f ? double(lp) : -9999.0; }

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

int32_t code_points(const std::string& s) {  // continuation bytes do not start a character
  int32_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json head(const ResponseMeta& meta, const char* object) {
  return {{"id", meta.id}, {"object", object}, {"created", meta.created}, {"model", meta.model}};
}

json finish_json(const std::string& engine_reason) {
  return engine_reason.empty() ? json(nullptr) : json(openai_finish_reason(engine_reason));
}

// Completions: tokens, token_logprobs, top_logprobs ({token: logprob},
// most likely first; a token text seen twice keeps its first), text_offset.
json completion_logprobs(const ChoiceOutput& out, const TokenText& token_text) {
  if (!out.has_logprobs) return nullptr;
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  int32_t offset = out.text_offset;
  for (const LogprobEntry& e : out.logprobs) {
    const std::string piece = token_text(e.chosen.token);
    tokens.push_back(piece);
    lps.push_back(logprob_value(e.chosen.logprob));
    json top = json::object();
    for (const TokenLogprob& t : e.top) {
      const std::string key = dump(json(token_text(t.token)));  // the key as it will be written
      const std::string text = json::parse(key).get<std::string>();
      if (!top.contains(text)) top[text] = logprob_value(t.logprob);
    }
    tops.push_back(std::move(top));
    offsets.push_back(offset);
    offset += code_points(piece);
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json chat_logprobs(const ChoiceOutput& out, const TokenText& token_text) {
  if (!out.has_logprobs) return nullptr;
  auto one = [&](const TokenLogprob& t) {
    const std::string piece = token_text(t.token);
    return json{{"token", piece}, {"logprob", logprob_value(t.logprob)}, {"bytes", bytes_of(piece)}};
  };
  json content = json::array();
  for (const LogprobEntry& e : out.logprobs) {
    json item = one(e.chosen);
    json top = json::array();
    for (const TokenLogprob& t : e.top) top.push_back(one(t));
    item["top_logprobs"] = std::move(top);
    content.push_back(std::move(item));
  }
  return {{"content", content}, {"refusal", nullptr}};
}

}  // namespace

std::string openai_finish_reason(std::string_view engine_reason) {
  if (engine_reason == "context") return "length";
  return std::string(engine_reason);
}

std::string response_id(RequestKind kind, uint64_t n) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(n));
  return (kind == RequestKind::chat ? "chatcmpl-" : "cmpl-") + std::string(buf);
}

std::string completion_response(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                                const Usage& usage, const TokenText& token_text) {
  json j = head(meta, "text_completion");
  json cs = json::array();
  for (const ChoiceOutput& c : choices)
    cs.push_back({{"index", c.index},
                  {"text", c.text},
                  {"logprobs", completion_logprobs(c, token_text)},
                  {"finish_reason", finish_json(c.finish_reason)}});
  j["choices"] = std::move(cs);
  j["usage"] = usage_json(usage);
  return dump(j);
}

std::string chat_response(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                          const Usage& usage, const TokenText& token_text) {
  json j = head(meta, "chat.completion");
  json cs = json::array();
  for (const ChoiceOutput& c : choices)
    cs.push_back({{"index", c.index},
                  {"message", {{"role", "assistant"}, {"content", c.text}}},
                  {"logprobs", chat_logprobs(c, token_text)},
                  {"finish_reason", finish_json(c.finish_reason)}});
  j["choices"] = std::move(cs);
  j["usage"] = usage_json(usage);
  return dump(j);
}

std::string sse_event(std::string_view json_text) { return "data: " + std::string(json_text) + "\n\n"; }

std::string sse_done() { return "data: [DONE]\n\n"; }

std::string sse_error(const ApiError& e) { return sse_event(error_body(e)); }

namespace {

std::string chunk(const ResponseMeta& meta, const char* object, json choice, bool include_usage) {
  json j = head(meta, object);
  j["choices"] = json::array({std::move(choice)});
  if (include_usage) j["usage"] = nullptr;
  return sse_event(dump(j));
}

}  // namespace

std::string chat_role_chunk(const ResponseMeta& meta, int32_t index, bool include_usage) {
  return chunk(meta, "chat.completion.chunk",
               {{"index", index},
                {"delta", {{"role", "assistant"}, {"content", ""}}},
                {"logprobs", nullptr},
                {"finish_reason", nullptr}},
               include_usage);
}

std::string chat_chunk(const ResponseMeta& meta, const ChoiceOutput& out, bool include_usage,
                       const TokenText& token_text) {
  json delta = json::object();
  if (!out.text.empty()) delta["content"] = out.text;
  return chunk(meta, "chat.completion.chunk",
               {{"index", out.index},
                {"delta", std::move(delta)},
                {"logprobs", out.logprobs.empty() ? json(nullptr) : chat_logprobs(out, token_text)},
                {"finish_reason", finish_json(out.finish_reason)}},
               include_usage);
}

std::string completion_chunk(const ResponseMeta& meta, const ChoiceOutput& out, bool include_usage,
                             const TokenText& token_text) {
  return chunk(meta, "text_completion",
               {{"index", out.index},
                {"text", out.text},
                {"logprobs", out.logprobs.empty() ? json(nullptr) : completion_logprobs(out, token_text)},
                {"finish_reason", finish_json(out.finish_reason)}},
               include_usage);
}

std::string usage_chunk(const ResponseMeta& meta, RequestKind kind, const Usage& usage) {
  json j = head(meta, kind == RequestKind::chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = json::array();
  j["usage"] = usage_json(usage);
  return sse_event(dump(j));
}

std::string models_response(const std::vector<ModelCard>& models) {
  json data = json::array();
  for (const ModelCard& m : models) {
    json card = {{"id", m.id}, {"object", "model"}, {"created", m.created}, {"owned_by", m.owned_by}};
    if (m.max_model_len > 0) card["max_model_len"] = m.max_model_len;
    data.push_back(std::move(card));
  }
  return dump(json{{"object", "list"}, {"data", std::move(data)}});
}

std::string tokenize_response(const std::vector<int32_t>& tokens, bool with_pieces, const TokenText& token_text) {
  json out = json::array();
  for (int32_t id : tokens) {
    if (!with_pieces) {
      out.push_back(id);
      continue;
    }
    const std::string piece = token_text(id);
    out.push_back({{"id", id}, {"piece", is_valid_utf8(piece) ? json(piece) : bytes_of(piece)}});
  }
  return dump(json{{"tokens", std::move(out)}});
}

std::string detokenize_response(std::string_view text) {
  return dump(json{{"content", std::string(text)}});
}

}  // namespace cleave::server
