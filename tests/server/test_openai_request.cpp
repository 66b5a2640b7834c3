// OpenAI request parsing (server/openai_request.h): a table of bad bodies
// with the field each error names, good bodies with every setting read,
// images from data URLs, and the engine request each turns into.
#include <doctest/doctest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/multimodal.h"
#include "model/tokenizer.h"
#include "server/openai_request.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb/stb_image_write.h>

using namespace cleave;
using namespace cleave::server;

namespace {

const Tokenizer& spm() {
  static std::unique_ptr<Tokenizer> t = [] {
    auto f = GgufFile::open(std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf");
    REQUIRE_MESSAGE(f.ok(), f.status().to_string());
    auto r = Tokenizer::from_gguf(**f);
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    return std::move(r).value();
  }();
  return *t;
}

RgbImage test_image() {
  RgbImage im;
  im.width = 4;
  im.height = 3;
  for (int i = 0; i < 4 * 3 * 3; ++i) im.rgb.push_back(uint8_t(i * 7));
  return im;
}

void append(void* ctx, void* data, int size) {
  auto* out = static_cast<std::string*>(ctx);
  out->append(static_cast<const char*>(data), size_t(size));
}

std::string png_bytes() {
  const RgbImage im = test_image();
  std::string out;
  REQUIRE(stbi_write_png_to_func(append, &out, im.width, im.height, 3, im.rgb.data(), im.width * 3) != 0);
  return out;
}

std::string jpeg_bytes() {
  const RgbImage im = test_image();
  std::string out;
  REQUIRE(stbi_write_jpg_to_func(append, &out, im.width, im.height, 3, im.rgb.data(), 90) != 0);
  return out;
}

std::string base64(const std::string& in) {
  static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < in.size(); i += 3) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16;
    if (i + 1 < in.size()) v |= uint32_t(uint8_t(in[i + 1])) << 8;
    if (i + 2 < in.size()) v |= uint8_t(in[i + 2]);
    out += a[v >> 18 & 63];
    out += a[v >> 12 & 63];
    out += i + 1 < in.size() ? a[v >> 6 & 63] : '=';
    out += i + 2 < in.size() ? a[v & 63] : '=';
  }
  return out;
}

std::string png_url() { return "data:image/png;base64," + base64(png_bytes()); }

std::string corrupt_png_url() {
  std::string png = png_bytes();
  png[png.size() / 2] ^= 0x40;  // inside IDAT: the CRC no longer matches
  return "data:image/png;base64," + base64(png);
}

// A chat body whose one user message has these content parts.
std::string chat_with_parts(const std::string& parts) {
  return R"({"messages":[{"role":"user","content":[)" + parts + "]}]}";
}
std::string image_part(const std::string& url) {
  return R"({"type":"image_url","image_url":{"url":")" + url + R"("}})";
}

ParsedRequest completion_ok(const std::string& body) {
  auto r = parse_completion_request(body);
  REQUIRE_MESSAGE(r.ok(), r.error().message);
  return std::move(r).value();
}

ParsedRequest chat_ok(const std::string& body, const ParseOptions& options = {}) {
  auto r = parse_chat_request(body, options);
  REQUIRE_MESSAGE(r.ok(), r.error().message);
  return std::move(r).value();
}

}  // namespace

TEST_CASE("openai requests: bad bodies are 400 naming the field") {
  struct Row {
    bool chat;
    std::string body;
    std::string param;
    std::string says;  // part of the message
  };
  const std::string msgs = R"("messages":[{"role":"user","content":"hi"}])";
  auto c = [](const std::string& fields) { return R"({"prompt":"hi",)" + fields + "}"; };
  const std::vector<Row> rows = {
      // Not JSON, not an object, not UTF-8, twice the same key.
      {false, "", "", "not valid JSON"},
      {false, R"({"prompt": "hi")", "", "not valid JSON"},
      {false, "[1, 2]", "", "must be a JSON object"},
      {false, "{\"prompt\": \"\xff\xfe\"}", "", "not valid UTF-8 (byte 12)"},
      {false, "{\"prompt\": \"\xed\xa0\x80\"}", "", "not valid UTF-8"},  // an encoded surrogate
      {false, "{\"prompt\": \"\xc0\xaf\"}", "", "not valid UTF-8"},      // overlong
      {false, R"({"prompt": "\ud800"})", "", "surrogate"},
      {false, R"({"prompt":"hi","prompt":"x"})", "prompt", "appears twice"},
      {false, c(R"("temperature": 1e400)"), "", "number overflow"},
      // prompt
      {false, "{}", "prompt", "required"},
      {false, R"({"prompt": null})", "prompt", "required"},
      {false, R"({"prompt": 5})", "prompt", "must be a string"},
      {false, R"({"prompt": []})", "prompt", "empty list"},
      {false, R"({"prompt": ["a", "b"]})", "prompt", "several prompts"},
      {false, R"({"prompt": [[1], [2]]})", "prompt", "several prompts"},
      {false, R"({"prompt": [[]]})", "prompt", "no token ids"},
      {false, R"({"prompt": [1, -2]})", "prompt[1]", "outside [0, 2147483647]"},
      {false, R"({"prompt": [1, 2.5]})", "prompt[1]", "must be an integer"},
      {false, R"({"prompt": [1, 4294967296]})", "prompt[1]", "is above 2147483647"},
      {false, R"({"prompt": [1, "2"]})", "prompt[1]", "must be an integer"},
      // numbers
      {false, c(R"("max_tokens": -1)"), "max_tokens", "-1 is outside [1, 2147483647]"},
      {false, c(R"("max_tokens": 0)"), "max_tokens", "0 is outside"},
      {false, c(R"("max_tokens": 1e30)"), "max_tokens", "must be an integer"},
      {false, c(R"("max_tokens": 99999999999)"), "max_tokens", "99999999999 is above"},
      {false, c(R"("max_tokens": "5")"), "max_tokens", "must be an integer, got string"},
      {false, c(R"("temperature": 2.5)"), "temperature", "2.5 is outside [0, 2]"},
      {false, c(R"("temperature": -0.1)"), "temperature", "-0.1 is outside"},
      {false, c(R"("temperature": "hot")"), "temperature", "must be a number"},
      {false, c(R"("top_p": 0)"), "top_p", "must be above 0"},
      {false, c(R"("top_p": 1.5)"), "top_p", "1.5 is outside [0, 1]"},
      {false, c(R"("top_k": -2)"), "top_k", "-2 is outside [-1,"},
      {false, c(R"("top_k": 1.5)"), "top_k", "must be an integer"},
      {false, c(R"("min_p": 2)"), "min_p", "outside [0, 1]"},
      {false, c(R"("presence_penalty": 3)"), "presence_penalty", "3 is outside [-2, 2]"},
      {false, c(R"("frequency_penalty": -2.5)"), "frequency_penalty", "-2.5 is outside [-2, 2]"},
      {false, c(R"("repetition_penalty": 0)"), "repetition_penalty", "must be above 0"},
      {false, c(R"("repetition_penalty": -1)"), "repetition_penalty", "outside [0, 100]"},
      {false, c(R"("seed": 1.5)"), "seed", "must be an integer"},
      {false, c(R"("seed": "1")"), "seed", "must be an integer, got string"},
      {false, c(R"("n": 0)"), "n", "0 is outside [1, 16]"},
      {false, c(R"("n": 17)"), "n", "17 is above 16"},
      {false, c(R"("n": 1000000000000)"), "n", "is above 16"},
      // stop
      {false, c(R"("stop": ["a", "b", "c", "d", "e"])"), "stop", "at most 4"},
      {false, c(R"("stop": [""])"), "stop", "must not be empty"},
      {false, c(R"("stop": "")"), "stop", "must not be empty"},
      {false, c(R"("stop": [1])"), "stop[0]", "must be a string"},
      {false, c(R"("stop": {})"), "stop", "a string or a list"},
      // completions-only settings
      {false, c(R"("logprobs": 6)"), "logprobs", "6 is above 5"},
      {false, c(R"("logprobs": true)"), "logprobs", "must be an integer"},
      {false, c(R"("echo": true)"), "echo", "not supported"},
      {false, c(R"("best_of": 3)"), "best_of", "not supported"},
      {false, c(R"("suffix": "end")"), "suffix", "not supported"},
      // flags, stream options, metadata, unknown fields
      {false, c(R"("stream": "yes")"), "stream", "true or false"},
      {false, c(R"("ignore_eos": "true")"), "ignore_eos", "true or false"},
      {false, c(R"("stream_options": {"include_usage": true})"), "stream_options", "only allowed when \"stream\""},
      {false, c(R"("stream": false, "stream_options": {"include_usage": true})"), "stream_options", "only allowed"},
      {false, c(R"("stream": true, "stream_options": {"include_usage": 1})"), "stream_options.include_usage",
       "true or false"},
      {false, c(R"("stream": true, "stream_options": {"continuous": true})"), "stream_options.continuous", "unknown"},
      {false, c(R"("stream": true, "stream_options": true)"), "stream_options", "must be an object"},
      {false, c(R"("foo": 1)"), "foo", "unknown field \"foo\""},
      {false, c(R"("chat_template": "chatml")"), "chat_template", "--chat-template"},
      {false, c(R"("messages": [])"), "messages", "unknown field"},
      {false, c(R"("logit_bias": {"1": 5})"), "logit_bias", "not supported"},
      {false, c(R"("user": 5)"), "user", "must be a string"},
      {false, c(R"("model": 5)"), "model", "must be a string"},
      // chat: messages
      {true, "{}", "messages", "required"},
      {true, R"({"messages": []})", "messages", "must not be empty"},
      {true, R"({"messages": "hi"})", "messages", "must be a list"},
      {true, R"({"messages": [5]})", "messages[0]", "must be an object"},
      {true, R"({"messages": [{"role":"user","content":"a"}, 7]})", "messages[1]", "must be an object"},
      {true, R"({"messages": [{"content": "x"}]})", "messages[0].role", "required"},
      {true, R"({"messages": [{"role": 5, "content": "x"}]})", "messages[0].role", "must be a string"},
      {true, R"({"messages": [{"role": "robot", "content": "x"}]})", "messages[0].role", "unknown role \"robot\""},
      {true, R"({"messages": [{"role": "tool", "content": "x"}]})", "messages[0].role", "not supported"},
      {true, R"({"messages": [{"role": "user"}]})", "messages[0].content", "required"},
      {true, R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content", "a string or a list"},
      {true, R"({"messages": [{"role": "user", "content": []}]})", "messages[0].content", "empty list"},
      {true, R"({"messages": [{"role": "user", "content": "x", "name": "bob"}]})", "messages[0].name",
       "not supported"},
      {true, R"({"messages": [{"role": "user", "content": "x", "mood": "ok"}]})", "messages[0].mood", "unknown"},
      {true, R"({"messages": [{"role": "user", "content": "look <image>"}]})", "messages[0].content",
       "keeps for marking images"},
      {true, chat_with_parts(R"({"type":"text","text":"<image>"})"), "messages[0].content[0].text", "<image>"},
      {true, chat_with_parts(R"({"type":"input_audio"})"), "messages[0].content[0].type", "not supported"},
      {true, chat_with_parts(R"({"text":"x"})"), "messages[0].content[0].type", "required"},
      {true, chat_with_parts(R"({"type":"text"})"), "messages[0].content[0].text", "required"},
      {true, chat_with_parts(R"({"type":"text","text":5})"), "messages[0].content[0].text", "must be a string"},
      {true, chat_with_parts("3"), "messages[0].content[0]", "must be an object"},
      // chat: images
      {true, chat_with_parts(image_part("http://example.com/a.png")), "messages[0].content[0].image_url.url",
       "fetches no image URLs (got a \"http:\" URL)"},
      {true, chat_with_parts(image_part("file:///etc/passwd")), "messages[0].content[0].image_url.url",
       "\"file:\""},
      {true, chat_with_parts(image_part("data:image/webp;base64,AAAA")), "messages[0].content[0].image_url.url",
       "PNG or JPEG"},
      {true, chat_with_parts(image_part("data:image/png,rawbytes")), "messages[0].content[0].image_url.url",
       "base64 encoded"},
      {true, chat_with_parts(image_part("data:image/png;base64")), "messages[0].content[0].image_url.url",
       "no ','"},
      {true, chat_with_parts(image_part("data:image/png;base64,@@@@")), "messages[0].content[0].image_url.url",
       "not valid base64 (character 0)"},
      {true, chat_with_parts(image_part("data:image/png;base64,QUJD=")), "messages[0].content[0].image_url.url",
       "not valid base64"},
      {true, chat_with_parts(image_part("data:image/png;base64,")), "messages[0].content[0].image_url.url",
       "could not be decoded: invalid_argument"},
      {true, chat_with_parts(image_part(corrupt_png_url())), "messages[0].content[0].image_url.url",
       "could not be decoded: corruption"},
      {true, chat_with_parts(image_part("data:image/png;base64," + base64("not an image at all"))),
       "messages[0].content[0].image_url.url", "could not be decoded: unsupported"},
      {true, chat_with_parts(R"({"type":"image_url","image_url":"data:image/png;base64,AAAA"})"),
       "messages[0].content[0].image_url", "must be an object"},
      {true, chat_with_parts(R"({"type":"image_url","image_url":{"url":")" + png_url() + R"(","detail":"high"}})"),
       "messages[0].content[0].image_url.detail", "\"auto\""},
      {true, chat_with_parts(R"({"type":"image_url","image_url":{}})"), "messages[0].content[0].image_url.url",
       "required"},
      {true, R"({"messages": [{"role": "system", "content": [)" + image_part(png_url()) + "]}]}",
       "messages[0].content[0]", "only allowed in user messages"},
      // chat: settings
      {true, "{" + msgs + R"(, "max_tokens": 5, "max_completion_tokens": 6})", "max_completion_tokens", "differ"},
      {true, "{" + msgs + R"(, "max_completion_tokens": 0})", "max_completion_tokens", "outside"},
      {true, "{" + msgs + R"(, "top_logprobs": 3})", "top_logprobs", "needs \"logprobs\": true"},
      {true, "{" + msgs + R"(, "logprobs": false, "top_logprobs": 3})", "top_logprobs", "needs"},
      {true, "{" + msgs + R"(, "logprobs": true, "top_logprobs": 21})", "top_logprobs", "21 is above 20"},
      {true, "{" + msgs + R"(, "logprobs": 1})", "logprobs", "true or false"},
      {true, "{" + msgs + R"(, "response_format": {"type": "json_object"}})", "response_format", "json_object"},
      {true, "{" + msgs + R"(, "response_format": {"type": "text", "schema": 1}})", "response_format.schema",
       "unknown"},
      {true, "{" + msgs + R"(, "tools": [{"type": "function"}]})", "tools", "not supported"},
      {true, "{" + msgs + R"(, "tool_choice": "auto"})", "tool_choice", "not supported"},
      {true, "{" + msgs + R"(, "prompt": "hi"})", "prompt", "unknown field"},
      {true, "{" + msgs + R"(, "echo": false})", "echo", "unknown field"},
      {true, "{" + msgs + R"(, "stream_options": {"include_usage": true}})", "stream_options", "only allowed"},
      {true, "{" + msgs + R"(, "n": 0})", "n", "outside [1, 16]"},
      {true, "{" + msgs + R"(, "temperature": 3})", "temperature", "outside [0, 2]"},
  };
  CHECK(rows.size() >= 40);
  for (const Row& row : rows) {
    CAPTURE(row.body);
    auto r = row.chat ? parse_chat_request(row.body) : parse_completion_request(row.body);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().status == 400);
    CHECK(r.error().type == "invalid_request_error");
    CHECK(r.error().param == row.param);
    CHECK_MESSAGE(r.error().message.find(row.says) != std::string::npos, r.error().message);
  }
  // Deep nesting is an error, not a stack overflow.
  const std::string deep = R"({"prompt":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  auto d = parse_completion_request(deep);
  REQUIRE_FALSE(d.ok());
  CHECK(d.error().param == "prompt[0][0]");
  // More images than the server takes.
  ParseOptions one;
  one.max_images = 1;
  auto two = parse_chat_request(chat_with_parts(image_part(png_url()) + "," + image_part(png_url())), one);
  REQUIRE_FALSE(two.ok());
  CHECK(two.error().param == "messages[0].content[1]");
  CHECK(two.error().message.find("at most 1 images") != std::string::npos);
  // Images larger than the limit are refused before decoding.
  ParseOptions small;
  small.image_limits.max_bytes = 16;
  auto big = parse_chat_request(chat_with_parts(image_part(png_url())), small);
  REQUIRE_FALSE(big.ok());
  CHECK(big.error().message.find("above the limit of 16") != std::string::npos);
}

TEST_CASE("openai requests: completion defaults are OpenAI's") {
  const ParsedRequest p = completion_ok(R"({"model": "m", "prompt": "Hello"})");
  CHECK(p.kind == RequestKind::completion);
  CHECK(p.model == "m");
  REQUIRE(p.prompt_text);
  CHECK(*p.prompt_text == "Hello");
  CHECK(p.sampling.temperature == 1.0f);
  CHECK(p.sampling.top_p == 1.0f);
  CHECK(p.sampling.top_k == 0);
  CHECK(p.sampling.min_p == 0.0f);
  CHECK(p.sampling.repeat_penalty == 1.0f);
  CHECK(p.sampling.repeat_last_n == -1);
  CHECK(p.sampling.presence_penalty == 0.0f);
  CHECK(p.sampling.frequency_penalty == 0.0f);
  CHECK(p.sampling.stop.empty());
  CHECK(p.max_tokens == 16);  // completions: OpenAI's default
  CHECK_FALSE(p.seed);
  CHECK(p.n == 1);
  CHECK_FALSE(p.stream);
  CHECK_FALSE(p.include_usage);
  CHECK(p.logprobs == -1);
  CHECK_FALSE(p.ignore_eos);
  // A field given as null is absent.
  const ParsedRequest q = completion_ok(
      R"({"prompt": "x", "max_tokens": null, "temperature": null, "stop": null, "seed": null, "stream_options": null,
          "logprobs": null, "user": null, "echo": null, "suffix": null, "logit_bias": null})");
  CHECK(q.max_tokens == 16);
  CHECK(q.sampling.temperature == 1.0f);
  CHECK(q.logprobs == -1);
}

TEST_CASE("openai requests: every completion setting is read") {
  const ParsedRequest p = completion_ok(
      R"({"prompt": ["Hi"], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.25,
          "stop": ["x", "yz"], "seed": 42, "n": 3, "presence_penalty": -1.5, "frequency_penalty": 2,
          "repetition_penalty": 1.25, "ignore_eos": true, "logprobs": 5, "echo": false, "best_of": 3, "suffix": "",
          "stream": true, "stream_options": {"include_usage": true}, "user": "u-1", "logit_bias": {}})");
  CHECK(*p.prompt_text == "Hi");
  CHECK(p.max_tokens == 7);
  CHECK(p.sampling.temperature == 0.0f);
  CHECK(p.sampling.top_p == 0.5f);
  CHECK(p.sampling.top_k == 3);
  CHECK(p.sampling.min_p == 0.25f);
  CHECK(p.sampling.stop == std::vector<std::string>{"x", "yz"});
  CHECK(p.seed == 42u);
  CHECK(p.n == 3);
  CHECK(p.sampling.presence_penalty == -1.5f);
  CHECK(p.sampling.frequency_penalty == 2.0f);
  CHECK(p.sampling.repeat_penalty == 1.25f);
  CHECK(p.sampling.repeat_last_n == -1);
  CHECK(p.ignore_eos);
  CHECK(p.logprobs == 5);
  CHECK(p.stream);
  CHECK(p.include_usage);
  // Token prompts, top_k -1, negative seeds, one stop string.
  CHECK(completion_ok(R"({"prompt": [1, 2, 3]})").prompt_ids == std::vector<int32_t>{1, 2, 3});
  CHECK(completion_ok(R"({"prompt": [[5, 6]]})").prompt_ids == std::vector<int32_t>{5, 6});
  CHECK_FALSE(completion_ok(R"({"prompt": [1]})").prompt_text);
  CHECK(completion_ok(R"({"prompt": "", "top_k": -1})").sampling.top_k == 0);
  CHECK(completion_ok(R"({"prompt": "", "seed": -1})").seed == UINT64_MAX);
  CHECK(completion_ok(R"({"prompt": "", "seed": 18446744073709551615})").seed == UINT64_MAX);
  CHECK(completion_ok(R"({"prompt": "", "stop": "END"})").sampling.stop == std::vector<std::string>{"END"});
  CHECK(completion_ok(R"({"prompt": "", "stream": true, "stream_options": {}})").include_usage == false);
  CHECK(completion_ok(R"({"prompt": "", "logprobs": 0})").logprobs == 0);
  // UTF-8 text comes through as given.
  CHECK(*completion_ok("{\"prompt\": \"h\xc3\xa9llo \xf0\x9f\x98\x80\"}").prompt_text == "h\xc3\xa9llo \xf0\x9f\x98\x80");
}

TEST_CASE("openai requests: chat messages, parts and images") {
  const ParsedRequest p = chat_ok(
      R"({"model": "m", "messages": [{"role": "developer", "content": "Be brief."},
          {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"},)" +
      image_part(png_url()) + R"(, {"type": "text", "text": "three"},)" +
      R"({"type":"image_url","image_url":{"url":"data:image/jpeg;base64,)" + base64(jpeg_bytes()) +
      R"(","detail":"auto"}}]},
          {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}],
          "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 4, "response_format": {"type": "text"},
          "stream": true, "stream_options": {"include_usage": false}})");
  CHECK(p.kind == RequestKind::chat);
  REQUIRE(p.messages.size() == 3);
  CHECK(p.messages[0].role == "developer");
  CHECK(p.messages[0].text == "Be brief.");
  CHECK(p.messages[0].n_images == 0);
  CHECK(p.messages[1].role == "user");
  CHECK(p.messages[1].text == "one\ntwo<image>three<image>");
  CHECK(p.messages[1].n_images == 2);
  CHECK(p.messages[2].text == "ok");
  REQUIRE(p.images.size() == 2);
  const RgbImage want = test_image();
  CHECK(p.images[0].width == want.width);
  CHECK(p.images[0].height == want.height);
  CHECK(p.images[0].rgb == want.rgb);  // PNG is lossless
  CHECK(p.images[1].width == 4);       // JPEG: the size, not the exact pixels
  CHECK(p.image_params == std::vector<std::string>{"messages[1].content[2]", "messages[1].content[4]"});
  CHECK(p.max_tokens == 9);
  CHECK(p.logprobs == 4);
  CHECK(p.stream);
  CHECK_FALSE(p.include_usage);
  // Chat's max_tokens default: until the context is full.
  const ParsedRequest q = chat_ok(R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": true})");
  CHECK_FALSE(q.max_tokens);
  CHECK(q.logprobs == 0);
  CHECK(chat_ok(R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": false})").logprobs == -1);
  CHECK(chat_ok(R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 3})")
            .max_tokens == 3);
  // Unpadded base64 and an upper-case media type are fine.
  std::string url = png_url();
  while (url.back() == '=') url.pop_back();
  CHECK(chat_ok(chat_with_parts(image_part(url))).images.size() == 1);
  CHECK(chat_ok(chat_with_parts(image_part("data:IMAGE/PNG;base64," + base64(png_bytes())))).images.size() == 1);
}

TEST_CASE("openai requests: completion prompts become engine requests") {
  PromptContext ctx;
  ctx.tokenizer = &spm();
  ctx.context = 64;
  ctx.default_seed = 99;
  auto r = build_generate_request(completion_ok(R"({"prompt": "Hello world", "temperature": 0.5})"), ctx);
  REQUIRE_MESSAGE(r.ok(), r.error().message);
  CHECK(r->prompt == spm().encode("Hello world", true));
  CHECK(r->sampling.max_tokens == 16);
  CHECK(r->sampling.temperature == 0.5f);
  CHECK(r->sampling.seed == 99);  // none given: the server's
  CHECK(r->logprobs == -1);
  CHECK(r->images.empty());
  auto seeded = build_generate_request(completion_ok(R"({"prompt": [5, 6], "seed": 7, "logprobs": 2,
                                                          "ignore_eos": true, "max_tokens": 62})"), ctx);
  REQUIRE_MESSAGE(seeded.ok(), seeded.error().message);
  CHECK(seeded->prompt == std::vector<int32_t>{5, 6});
  CHECK(seeded->sampling.seed == 7);
  CHECK(seeded->sampling.max_tokens == 62);
  CHECK(seeded->logprobs == 2);
  CHECK(seeded->ignore_eos);
  // Token ids are checked against the vocabulary.
  auto oov = build_generate_request(completion_ok(R"({"prompt": [1, 32000]})"), ctx);
  REQUIRE_FALSE(oov.ok());
  CHECK(oov.error().param == "prompt");
  CHECK(oov.error().message.find("id 32000) is outside the vocabulary [0, 32000)") != std::string::npos);
  // The context: prompt + max_tokens must fit, the message names both.
  ctx.context = 8;
  auto over = build_generate_request(completion_ok(R"({"prompt": [1, 2, 3, 4, 5], "max_tokens": 4})"), ctx);
  REQUIRE_FALSE(over.ok());
  CHECK(over.error().status == 400);
  CHECK(over.error().code == "context_length_exceeded");
  CHECK(over.error().param == "prompt");
  CHECK(over.error().message ==
        "This model's maximum context length is 8 tokens. However, you requested 9 tokens (5 in the prompt, 4 in "
        "the completion). Please reduce the length of the prompt or completion.");
  CHECK(build_generate_request(completion_ok(R"({"prompt": [1, 2, 3, 4, 5], "max_tokens": 3})"), ctx).ok());
}

TEST_CASE("openai requests: chat prompts through the template, images through the encoder's tokens") {
  PromptContext ctx;
  ctx.tokenizer = &spm();
  ctx.chat_template = "llama-2";
  ctx.context = 128;
  const std::string body =
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})";
  auto r = build_generate_request(chat_ok(body), ctx);
  REQUIRE_MESSAGE(r.ok(), r.error().message);
  CHECK(r->prompt == spm().encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]", true));  // one BOS
  CHECK(r->sampling.max_tokens == 128 - int32_t(r->prompt.size()));  // until the context is full
  // A prompt that fills the context leaves no room.
  ctx.context = int32_t(r->prompt.size());
  auto full = build_generate_request(chat_ok(body), ctx);
  REQUIRE_FALSE(full.ok());
  CHECK(full.error().code == "context_length_exceeded");
  CHECK(full.error().param == "messages");
  CHECK(full.error().message.find("your messages resulted in " + std::to_string(r->prompt.size()) + " tokens") !=
        std::string::npos);
  ctx.context = 128;
  // A conversation the template cannot express names "messages".
  auto alt = build_generate_request(
      chat_ok(R"({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})"), ctx);
  REQUIRE_FALSE(alt.ok());
  CHECK(alt.error().param == "messages");
  CHECK(alt.error().message.find("alternating") != std::string::npos);

  // Images: refused without an encoder, naming the part; placed with one.
  const std::string with_image = chat_with_parts(R"({"type":"text","text":"what is this"},)" + image_part(png_url()));
  auto no_encoder = build_generate_request(chat_ok(with_image), ctx);
  REQUIRE_FALSE(no_encoder.ok());
  CHECK(no_encoder.error().param == "messages[0].content[1]");
  CHECK(no_encoder.error().message.find("no vision encoder (--mmproj)") != std::string::npos);
  ctx.image_tokens = 4;
  ctx.chat_template = "chatml";
  auto img = build_generate_request(chat_ok(with_image), ctx);
  REQUIRE_MESSAGE(img.ok(), img.error().message);
  REQUIRE(img->images.size() == 1);
  CHECK(img->images[0].n_tokens == 4);
  CHECK(img->images[0].hash == image_hash(test_image()));
  CHECK(img->images[0].image.rgb == test_image().rgb);
  const int32_t at = img->images[0].position;
  // chatml's tokens stay text on this vocabulary: the image sits right after "what is this".
  const std::vector<int32_t> before = spm().encode("<|im_start|>user\nwhat is this", true);
  CHECK(at == int32_t(before.size()));
  CHECK(std::vector<int32_t>(img->prompt.begin(), img->prompt.begin() + at) == before);
  for (int32_t k = 0; k < 4; ++k) CHECK(img->prompt[size_t(at + k)] == kImagePlaceholderId);
  // shapes: BOS, the image, the words.
  ctx.chat_template = "shapes";
  auto shapes = build_generate_request(chat_ok(chat_with_parts(image_part(png_url()) +
                                                               R"(,{"type":"text","text":"describe"})")),
                                       ctx);
  REQUIRE_MESSAGE(shapes.ok(), shapes.error().message);
  CHECK(shapes->images[0].position == 1);
  auto shapes_sys = build_generate_request(
      chat_ok(R"({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "describe"}]})"), ctx);
  REQUIRE_FALSE(shapes_sys.ok());
  CHECK(shapes_sys.error().param == "messages");
  CHECK(shapes_sys.error().message.find("has the role system") != std::string::npos);
}

TEST_CASE("openai requests: /tokenize and /detokenize bodies") {
  auto t = parse_tokenize_request(R"({"content": "Hello", "add_special": true, "with_pieces": true})");
  REQUIRE(t.ok());
  CHECK(t->content == "Hello");
  CHECK(t->add_special);
  CHECK(t->with_pieces);
  auto d = parse_tokenize_request(R"({"content": ""})");
  REQUIRE(d.ok());
  CHECK_FALSE(d->add_special);  // llama-server's default
  CHECK_FALSE(d->with_pieces);
  CHECK(d->model.empty());
  // vLLM's "model": which served model's tokenizer.
  CHECK(parse_tokenize_request(R"({"content": "x", "model": "m2"})")->model == "m2");
  struct Bad {
    std::string body, param;
  };
  for (const Bad& b : std::vector<Bad>{{"{}", "content"},
                                       {R"({"content": 1})", "content"},
                                       {R"({"content": "x", "add_special": 1})", "add_special"},
                                       {R"({"content": "x", "parse_special": true})", "parse_special"},
                                       {R"({"content": "x", "model": 1})", "model"},
                                       {"nope", ""}}) {
    CAPTURE(b.body);
    auto r = parse_tokenize_request(b.body);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().param == b.param);
  }
  auto ids = parse_detokenize_request(R"({"tokens": [0, 1, 31999]})", 32000);
  REQUIRE(ids.ok());
  CHECK(*ids == std::vector<int32_t>{0, 1, 31999});
  for (const Bad& b : std::vector<Bad>{{"{}", "tokens"},
                                       {R"({"tokens": 5})", "tokens"},
                                       {R"({"tokens": [32000]})", "tokens"},
                                       {R"({"tokens": [-1]})", "tokens"},
                                       {R"({"tokens": [1.5]})", "tokens"},
                                       {R"({"tokens": [], "x": 1})", "x"}}) {
    CAPTURE(b.body);
    auto r = parse_detokenize_request(b.body, 32000);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().param == b.param);
  }
  auto oov = parse_detokenize_request(R"({"tokens": [3, 32000]})", 32000);
  CHECK(oov.error().message.find("\"tokens[1]\" 32000 is above 31999") != std::string::npos);
  // An empty vocabulary takes no id at all (the bound is -1: no wrap to a huge one).
  CHECK_FALSE(parse_detokenize_request(R"({"tokens": [5]})", 0).ok());
  // "model": the ids are checked against that model's vocabulary, and an
  // error from the lookup (a model not served) is the answer.
  auto vocab_of = [](const std::string& model) -> ApiResult<int32_t> {
    if (model.empty()) return 10;
    if (model == "big") return 100;
    return ApiError{404, "no " + model, "not_found_error", "model", "model_not_found"};
  };
  auto big = parse_detokenize_request(R"({"tokens": [50], "model": "big"})", vocab_of);
  REQUIRE(big.ok());
  CHECK(big->model == "big");
  CHECK(big->tokens == std::vector<int32_t>{50});
  auto small = parse_detokenize_request(R"({"tokens": [50]})", vocab_of);
  REQUIRE_FALSE(small.ok());
  CHECK(small.error().param == "tokens");
  auto unknown = parse_detokenize_request(R"({"tokens": [1], "model": "x"})", vocab_of);
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.error().status == 404);
  CHECK(unknown.error().code == "model_not_found");
  CHECK(parse_detokenize_request(R"({"tokens": [1], "model": 2})", vocab_of).error().param == "model");
}

TEST_CASE("openai requests: UTF-8 validation") {
  CHECK(is_valid_utf8(""));
  CHECK(is_valid_utf8("plain"));
  CHECK(is_valid_utf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf"));
  for (const char* bad : {"\x80", "\xc3", "\xe2\x82", "\xc0\x80", "\xe0\x80\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80",
                          "\xf5\x80\x80\x80", "\xff", "a\xc3(b"}) {
    CAPTURE(bad);
    CHECK_FALSE(is_valid_utf8(bad));
  }
}

// What fuzz_openai found (tests/fuzz/regressions/openai/, replayed by the
// ctest fuzz_openai too): top_p and repetition_penalty were checked above 0
// as doubles and kept as floats, so 1e-50 passed and became 0 (a
// repetition_penalty of 0 divides positive logits by 0). Every input there
// is refused naming its field or parses into the documented ranges.
#include <filesystem>
#include <fstream>
#include <iterator>

TEST_CASE("openai requests: a positive setting that rounds to 0 as a float is refused") {
  for (const char* field : {"top_p", "repetition_penalty"}) {
    CAPTURE(field);
    const std::string setting = "\"" + std::string(field) + "\": 1e-50";
    for (auto r : {parse_completion_request(R"({"prompt": "a", )" + setting + "}"),
                   parse_chat_request(R"({"messages": [{"role": "user", "content": "a"}], )" + setting + "}")}) {
      REQUIRE_FALSE(r.ok());
      CHECK(r.error().status == 400);
      CHECK(r.error().param == field);
      CHECK(r.error().message.find("must be above 0, got 1e-50 (0 as a float)") != std::string::npos);
    }
    // The smallest float is still above 0.
    auto tiny = parse_completion_request(R"({"prompt": "a", ")" + std::string(field) + R"(": 1.5e-45})");
    REQUIRE(tiny.ok());
    CHECK((std::string(field) == "top_p" ? tiny->sampling.top_p : tiny->sampling.repeat_penalty) > 0.0f);
  }

  namespace fs = std::filesystem;
  const fs::path dir = fs::path(CLEAVE_SOURCE_DIR) / "tests/fuzz/regressions/openai";
  size_t n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    INFO(entry.path().string());
    ++n;
    for (auto r : {parse_completion_request(body), parse_chat_request(body)}) {
      if (!r.ok()) {
        CHECK(r.error().status == 400);
        CHECK_FALSE(r.error().message.empty());
        continue;
      }
      CHECK(r->sampling.top_p > 0.0f);
      CHECK(r->sampling.top_p <= 1.0f);
      CHECK(r->sampling.repeat_penalty > 0.0f);
      CHECK(r->sampling.repeat_penalty <= 100.0f);
    }
  }
  CHECK(n >= 2);
}
