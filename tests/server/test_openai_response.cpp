// OpenAI response bodies (server/openai_response.h), parsed back and checked
// field by field: completion and chat objects, logprobs in both formats,
// streaming chunks and the SSE framing, models, tokenize / detokenize.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/openai_response.h"

using namespace cleave;
using namespace cleave::server;
using json = nlohmann::json;

namespace {

// Token texts without a tokenizer: ids 1..4 are words, 9 half of "é".
std::string piece(int32_t id) {
  switch (id) {
    case 1: return "Hello";
    case 2: return " world";
    case 3: return "!";
    case 4: return " \xc3\xa9t\xc3\xa9";  // " été": 4 characters, 6 bytes
    case 9: return "\xc3";
    default: return "<" + std::to_string(id) + ">";
  }
}

ResponseMeta meta(RequestKind kind) { return {response_id(kind, 0xabc), 1700000000, "shapes-lm"}; }

json parse(const std::string& s) {
  json j = json::parse(s, nullptr, false);
  REQUIRE_FALSE(j.is_discarded());
  return j;
}

// One SSE event -> its JSON.
json event(const std::string& sse) {
  REQUIRE(sse.rfind("data: ", 0) == 0);
  REQUIRE(sse.size() >= 8);
  REQUIRE(sse.substr(sse.size() - 2) == "\n\n");
  return parse(sse.substr(6, sse.size() - 8));
}

LogprobEntry entry(int32_t token, float lp, std::vector<TokenLogprob> top) { return {{token, lp}, std::move(top)}; }

void check_usage(const json& u, int p, int c, int cached) {
  CHECK(u["prompt_tokens"] == p);
  CHECK(u["completion_tokens"] == c);
  CHECK(u["total_tokens"] == p + c);
  CHECK(u["prompt_tokens_details"]["cached_tokens"] == cached);
}

}  // namespace

TEST_CASE("openai responses: finish reasons and ids") {
  CHECK(openai_finish_reason("stop") == "stop");
  CHECK(openai_finish_reason("length") == "length");
  CHECK(openai_finish_reason("context") == "length");
  CHECK(response_id(RequestKind::completion, 0xabc) == "cmpl-0000000000000abc");
  CHECK(response_id(RequestKind::chat, UINT64_MAX) == "chatcmpl-ffffffffffffffff");
}

TEST_CASE("openai responses: a completion object with logprobs") {
  ChoiceOutput a;
  a.index = 0;
  a.text = "Hello world \xc3\xa9t\xc3\xa9";
  a.finish_reason = "context";
  a.has_logprobs = true;
  a.logprobs = {entry(1, -0.5f, {{1, -0.5f}, {2, -1.5f}}), entry(2, -std::numeric_limits<float>::infinity(), {}),
                entry(4, -0.25f, {{4, -0.25f}, {3, -3.0f}})};
  ChoiceOutput b;
  b.index = 1;
  b.text = "!";
  b.finish_reason = "stop";
  const json j = parse(completion_response(meta(RequestKind::completion), {a, b}, {5, 4, 2}, piece));
  CHECK(j["id"] == "cmpl-0000000000000abc");
  CHECK(j["object"] == "text_completion");
  CHECK(j["created"] == 1700000000);
  CHECK(j["model"] == "shapes-lm");
  REQUIRE(j["choices"].size() == 2);
  const json& c0 = j["choices"][0];
  CHECK(c0["index"] == 0);
  CHECK(c0["text"] == "Hello world \xc3\xa9t\xc3\xa9");
  CHECK(c0["finish_reason"] == "length");  // the context filled up
  const json& lp = c0["logprobs"];
  CHECK(lp["tokens"] == json({"Hello", " world", " \xc3\xa9t\xc3\xa9"}));
  CHECK(lp["token_logprobs"][0] == -0.5);
  CHECK(lp["token_logprobs"][1] == -9999.0);  // -inf is not JSON
  CHECK(lp["token_logprobs"][2] == -0.25);
  REQUIRE(lp["top_logprobs"].size() == 3);
  CHECK(lp["top_logprobs"][0] == json({{"Hello", -0.5}, {" world", -1.5}}));
  CHECK(lp["top_logprobs"][1] == json::object());
  CHECK(lp["top_logprobs"][2]["!"] == -3.0);
  CHECK(lp["text_offset"] == json({0, 5, 11}));
  // Most likely first, as written.
  const std::string raw = completion_response(meta(RequestKind::completion), {a}, {}, piece);
  CHECK(raw.find(R"({"Hello":-0.5," world":-1.5})") != std::string::npos);
  const json& c1 = j["choices"][1];
  CHECK(c1["text"] == "!");
  CHECK(c1["logprobs"].is_null());
  CHECK(c1["finish_reason"] == "stop");
  check_usage(j["usage"], 5, 4, 2);
}

TEST_CASE("openai responses: a chat object with logprobs") {
  ChoiceOutput a;
  a.text = "Hello!";
  a.finish_reason = "length";
  a.has_logprobs = true;
  a.logprobs = {entry(1, -0.125f, {{1, -0.125f}, {9, -2.0f}}), entry(3, -1.0f, {})};
  const json j = parse(chat_response(meta(RequestKind::chat), {a}, {3, 2, 0}, piece));
  CHECK(j["id"] == "chatcmpl-0000000000000abc");
  CHECK(j["object"] == "chat.completion");
  CHECK(j["created"] == 1700000000);
  CHECK(j["model"] == "shapes-lm");
  REQUIRE(j["choices"].size() == 1);
  const json& c = j["choices"][0];
  CHECK(c["index"] == 0);
  CHECK(c["message"] == json({{"role", "assistant"}, {"content", "Hello!"}}));
  CHECK(c["finish_reason"] == "length");
  const json& content = c["logprobs"]["content"];
  REQUIRE(content.size() == 2);
  CHECK(content[0]["token"] == "Hello");
  CHECK(content[0]["logprob"] == -0.125);
  CHECK(content[0]["bytes"] == json({72, 101, 108, 108, 111}));
  REQUIRE(content[0]["top_logprobs"].size() == 2);
  CHECK(content[0]["top_logprobs"][1]["token"] == "\xef\xbf\xbd");  // half a character: U+FFFD ...
  CHECK(content[0]["top_logprobs"][1]["bytes"] == json({0xc3}));    // ... and its real byte
  CHECK(content[0]["top_logprobs"][1]["logprob"] == -2.0);
  CHECK(content[1]["top_logprobs"] == json::array());
  CHECK(c["logprobs"]["refusal"].is_null());
  check_usage(j["usage"], 3, 2, 0);
  // Without logprobs: null; text that is not UTF-8 is written with U+FFFD.
  ChoiceOutput b;
  b.text = "ab\xc3";
  b.finish_reason = "stop";
  const json k = parse(chat_response(meta(RequestKind::chat), {b}, {}, piece));
  CHECK(k["choices"][0]["logprobs"].is_null());
  CHECK(k["choices"][0]["message"]["content"] == "ab\xef\xbf\xbd");
}

TEST_CASE("openai responses: chat streaming chunks as OpenAI sends them") {
  const ResponseMeta m = meta(RequestKind::chat);
  const json first = event(chat_role_chunk(m, 1, false));
  CHECK(first["id"] == "chatcmpl-0000000000000abc");
  CHECK(first["object"] == "chat.completion.chunk");
  CHECK(first["created"] == 1700000000);
  CHECK(first["model"] == "shapes-lm");
  CHECK_FALSE(first.contains("usage"));
  REQUIRE(first["choices"].size() == 1);
  CHECK(first["choices"][0]["index"] == 1);
  CHECK(first["choices"][0]["delta"] == json({{"role", "assistant"}, {"content", ""}}));
  CHECK(first["choices"][0]["logprobs"].is_null());
  CHECK(first["choices"][0]["finish_reason"].is_null());

  ChoiceOutput d;
  d.index = 1;
  d.text = " world";
  d.has_logprobs = true;
  d.logprobs = {entry(2, -0.5f, {{2, -0.5f}})};
  const json mid = event(chat_chunk(m, d, true, piece));
  CHECK(mid["usage"].is_null());  // include_usage: null on every chunk but the last
  CHECK(mid["choices"][0]["delta"] == json({{"content", " world"}}));
  CHECK(mid["choices"][0]["logprobs"]["content"][0]["token"] == " world");
  CHECK(mid["choices"][0]["finish_reason"].is_null());

  ChoiceOutput end;
  end.index = 1;
  end.finish_reason = "context";
  const json last = event(chat_chunk(m, end, false, piece));
  CHECK(last["choices"][0]["delta"] == json::object());
  CHECK(last["choices"][0]["finish_reason"] == "length");
  CHECK(last["choices"][0]["logprobs"].is_null());

  const json usage = event(usage_chunk(m, RequestKind::chat, {7, 3, 4}));
  CHECK(usage["object"] == "chat.completion.chunk");
  CHECK(usage["choices"] == json::array());
  check_usage(usage["usage"], 7, 3, 4);
  CHECK(sse_done() == "data: [DONE]\n\n");
}

TEST_CASE("openai responses: completion streaming chunks") {
  const ResponseMeta m = meta(RequestKind::completion);
  ChoiceOutput d;
  d.text = " \xc3\xa9t\xc3\xa9";
  d.has_logprobs = true;
  d.logprobs = {entry(4, -0.75f, {})};
  d.text_offset = 11;  // characters already sent
  const json c = event(completion_chunk(m, d, false, piece));
  CHECK(c["object"] == "text_completion");
  CHECK(c["id"] == "cmpl-0000000000000abc");
  CHECK(c["choices"][0]["index"] == 0);
  CHECK(c["choices"][0]["text"] == " \xc3\xa9t\xc3\xa9");
  CHECK(c["choices"][0]["finish_reason"].is_null());
  CHECK(c["choices"][0]["logprobs"]["text_offset"] == json({11}));
  CHECK(c["choices"][0]["logprobs"]["tokens"] == json({" \xc3\xa9t\xc3\xa9"}));
  ChoiceOutput end;
  end.text = "!";
  end.finish_reason = "stop";
  const json e = event(completion_chunk(m, end, true, piece));
  CHECK(e["choices"][0]["finish_reason"] == "stop");
  CHECK(e["choices"][0]["logprobs"].is_null());
  CHECK(e["usage"].is_null());
  const json u = event(usage_chunk(m, RequestKind::completion, {1, 2, 0}));
  CHECK(u["object"] == "text_completion");
  CHECK(u["choices"] == json::array());
  check_usage(u["usage"], 1, 2, 0);
}

TEST_CASE("openai responses: errors as SSE events") {
  const ApiError e = ApiError::invalid("bad \xff thing", "messages", "context_length_exceeded");
  const std::string s = sse_error(e);
  const json j = event(s);
  CHECK(j["error"]["message"] == "bad \xef\xbf\xbd thing");
  CHECK(j["error"]["type"] == "invalid_request_error");
  CHECK(j["error"]["param"] == "messages");
  CHECK(j["error"]["code"] == "context_length_exceeded");
  CHECK(s == "data: " + error_body(e) + "\n\n");
  CHECK(sse_event("{}") == "data: {}\n\n");
}

TEST_CASE("openai responses: models, tokenize, detokenize") {
  const json models = parse(models_response({{"shapes-lm", 1700000000, "cleave", 128}, {"other", 5, "me", 0}}));
  CHECK(models["object"] == "list");
  REQUIRE(models["data"].size() == 2);
  CHECK(models["data"][0] ==
        json({{"id", "shapes-lm"}, {"object", "model"}, {"created", 1700000000}, {"owned_by", "cleave"},
              {"max_model_len", 128}}));
  CHECK_FALSE(models["data"][1].contains("max_model_len"));
  CHECK(models["data"][1]["owned_by"] == "me");
  CHECK(parse(models_response({}))["data"] == json::array());

  CHECK(parse(tokenize_response({1, 2, 9}, false, piece)) == json({{"tokens", {1, 2, 9}}}));
  const json pieces = parse(tokenize_response({1, 9}, true, piece));
  REQUIRE(pieces["tokens"].size() == 2);
  CHECK(pieces["tokens"][0] == json({{"id", 1}, {"piece", "Hello"}}));
  CHECK(pieces["tokens"][1] == json({{"id", 9}, {"piece", {0xc3}}}));  // not UTF-8: its bytes
  CHECK(parse(detokenize_response("Hello world")) == json({{"content", "Hello world"}}));
  CHECK(parse(detokenize_response("a\xc3"))["content"] == "a\xef\xbf\xbd");
}
