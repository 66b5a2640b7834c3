// libFuzzer target for the OpenAI request parser (server/openai_request.h)
// and the response builders (server/openai_response.h). Any body goes
// through parse_completion_request, parse_chat_request, parse_tokenize_request
// and parse_detokenize_request. Each gives either an ApiError (400, a type, a
// message, a param that is UTF-8; error_body() is UTF-8 JSON that reads back
// to the same fields; only errors about the body as a whole name no field)
// or a value in the documented ranges (n 1..16, temperature [0, 2], top_p
// (0, 1], at most 4 non-empty stop strings, logprobs -1..5 / -1..20, at most
// max_images images whose pixels match their size, `<image>` markers only
// where images are). An accepted completion or chat request then goes
// through build_generate_request with the llama (SentencePiece) vocabulary,
// a context of 64 and 3 tokens per image: chat with every built-in template,
// once with the vocabulary's own special tokens (it has none of the
// templates': they stay text) and once as if it had them all. That gives a
// 400 the parsed request explains (completions: an exact oracle; chat: the
// template's refusal, the context, no vision encoder) or a GenerateRequest
// that passes validate_request, keeps the parsed settings, fits the context
// and crosses the wire codec unchanged. The response builders, fed what came
// back (token pieces that split UTF-8 characters, logprobs that are not
// finite), give JSON that parses and says what was built.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "fuzz_check.h"
#include "model/gguf.h"
#include "model/image.h"
#include "model/multimodal.h"
#include "model/request.h"
#include "model/tokenizer.h"
#include "schema/codec.h"
#include "server/api_error.h"
#include "server/chat_template.h"
#include "server/openai_request.h"
#include "server/openai_response.h"

namespace {

using namespace cleave;
using namespace cleave::server;
using fuzz::fail;
using json = nlohmann::json;

constexpr int32_t kContext = 64;
constexpr int32_t kImageTokens = 3;
constexpr uint64_t kDefaultSeed = 0x5eed;
constexpr int32_t kMaxImages = 4;
constexpr int32_t kMaxSide = 128;

struct Globals {
  std::shared_ptr<const GgufFile> file;
  std::unique_ptr<Tokenizer> tok;
  SpecialTokenLookup vocab_special;  // the vocabulary's control tokens
  SpecialTokenLookup chat_special;   // the templates' special tokens, as ids near the vocabulary's end
  std::vector<std::string> templates;
  ParseOptions options;
};
const Globals* g = nullptr;

// ---------------------------------------------------------------------------
// JSON and errors

json parse_json(const std::string& text, const char* who) {
  if (!is_valid_utf8(text)) fail("%s: the JSON is not UTF-8: %.300s", who, text.c_str());
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) fail("%s: not JSON: %.300s", who, text.c_str());
  return j;
}

// "data: JSON\n\n", one line of data.
json parse_sse(const std::string& event, const char* who) {
  if (event.size() < 8 || event.compare(0, 6, "data: ") != 0 || event.compare(event.size() - 2, 2, "\n\n") != 0)
    fail("%s: not one SSE event: %.300s", who, event.c_str());
  const std::string data = event.substr(6, event.size() - 8);
  if (data.find_first_of("\r\n") != std::string::npos) fail("%s: an SSE event with a line break in its data", who);
  return parse_json(data, who);
}

// Reading what came back without nlohmann's const operator[] (undefined for
// a missing key): a missing field or element is null.
const json& at(const json& j, const char* key) {
  static const json null;
  if (!j.is_object()) return null;
  auto it = j.find(key);
  return it == j.end() ? null : *it;
}
const json& elem(const json& j, size_t i) {
  static const json null;
  return j.is_array() && i < j.size() ? j[i] : null;
}
size_t count(const json& j) { return j.is_array() || j.is_object() ? j.size() : 0; }

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

void check_error(const ApiError& e, const char* who) {
  if (e.status != 400) fail("%s: status %d (%s), not 400", who, e.status, e.message.c_str());
  if (e.message.empty()) fail("%s: an error without a message", who);
  if (e.type != "invalid_request_error") fail("%s: error type \"%s\"", who, e.type.c_str());
  // guarded()'s fallback: a json::exception that the parser's own checks missed.
  if (starts_with(e.message, "[json.exception")) fail("%s: an unchecked JSON access: %s", who, e.message.c_str());
  if (e.param.empty() && !starts_with(e.message, "the request body") && e.message != "unknown field \"\"")
    fail("%s: an error that names no field: %s", who, e.message.c_str());
  if (!is_valid_utf8(e.param)) fail("%s: the param is not UTF-8", who);
  const std::string body = error_body(e);
  const json j = parse_json(body, who);
  const json& err = at(j, "error");
  if (!at(err, "message").is_string() || at(err, "type") != e.type)
    fail("%s: error_body lost its shape: %s", who, body.c_str());
  if (is_valid_utf8(e.message) && at(err, "message") != e.message)
    fail("%s: error_body changed the message: %s", who, body.c_str());
  if (e.param.empty() ? !at(err, "param").is_null() : at(err, "param") != e.param)
    fail("%s: error_body's param is not \"%s\": %s", who, e.param.c_str(), body.c_str());
  if (e.code.empty() ? !at(err, "code").is_null() : at(err, "code") != e.code)
    fail("%s: error_body's code is not \"%s\": %s", who, e.code.c_str(), body.c_str());
  if (sse_error(e) != sse_event(body)) fail("%s: sse_error is not the error body's event", who);
  parse_sse(sse_error(e), who);
}

// ---------------------------------------------------------------------------
// Parsed requests

size_t count_markers(std::string_view text) {
  size_t n = 0;
  for (size_t pos = text.find(kImageMarker); pos != std::string_view::npos; pos = text.find(kImageMarker, pos + 1)) ++n;
  return n;
}

void check_parsed(const ParsedRequest& p, RequestKind kind, const char* who) {
  if (p.kind != kind) fail("%s: the wrong kind", who);
  const SamplingParams& s = p.sampling;
  if (p.n < 1 || p.n > 16) fail("%s: n %d", who, p.n);
  if (!(s.temperature >= 0 && s.temperature <= 2)) fail("%s: temperature %g", who, double(s.temperature));
  if (!(s.top_p > 0 && s.top_p <= 1)) fail("%s: top_p %g", who, double(s.top_p));
  if (s.top_k < 0 || s.top_k > (1 << 30)) fail("%s: top_k %d", who, s.top_k);
  if (!(s.min_p >= 0 && s.min_p <= 1)) fail("%s: min_p %g", who, double(s.min_p));
  if (!(s.presence_penalty >= -2 && s.presence_penalty <= 2) || !(s.frequency_penalty >= -2 && s.frequency_penalty <= 2))
    fail("%s: penalties %g, %g", who, double(s.presence_penalty), double(s.frequency_penalty));
  if (!(s.repeat_penalty > 0 && s.repeat_penalty <= 100)) fail("%s: repetition_penalty %g", who, double(s.repeat_penalty));
  if (s.repeat_last_n != -1) fail("%s: repeat_last_n %d, not the whole history", who, s.repeat_last_n);
  if (s.stop.size() > 4) fail("%s: %zu stop strings", who, s.stop.size());
  for (const std::string& stop : s.stop)
    if (stop.empty() || !is_valid_utf8(stop)) fail("%s: an empty or non-UTF-8 stop string", who);
  if (p.max_tokens && *p.max_tokens < 1) fail("%s: max_tokens %d", who, *p.max_tokens);
  if (p.include_usage && !p.stream) fail("%s: include_usage without stream", who);
  if (!is_valid_utf8(p.model)) fail("%s: the model name is not UTF-8", who);
  if (p.images.size() > size_t(kMaxImages)) fail("%s: %zu images, above max_images", who, p.images.size());
  if (p.image_params.size() != p.images.size()) fail("%s: %zu image params for %zu images", who, p.image_params.size(), p.images.size());
  for (const RgbImage& im : p.images)
    if (im.width < 1 || im.height < 1 || im.width > kMaxSide || im.height > kMaxSide ||
        im.rgb.size() != size_t(im.width) * size_t(im.height) * 3)
      fail("%s: an image of %dx%d with %zu bytes", who, im.width, im.height, im.rgb.size());
  if (kind == RequestKind::completion) {
    if (p.logprobs < -1 || p.logprobs > 5) fail("%s: logprobs %d", who, p.logprobs);
    if (!p.max_tokens) fail("%s: a completion without max_tokens (default 16)", who);
    if (!p.messages.empty() || !p.images.empty()) fail("%s: a completion with messages or images", who);
    if (p.prompt_text.has_value() == !p.prompt_ids.empty()) fail("%s: a prompt both text and ids, or neither", who);
    if (p.prompt_text && !is_valid_utf8(*p.prompt_text)) fail("%s: the prompt is not UTF-8", who);
    for (int32_t id : p.prompt_ids)
      if (id < 0) fail("%s: token id %d", who, id);
    return;
  }
  if (p.logprobs < -1 || p.logprobs > 20) fail("%s: top_logprobs %d", who, p.logprobs);
  if (p.prompt_text || !p.prompt_ids.empty()) fail("%s: a chat request with a prompt", who);
  if (p.messages.empty()) fail("%s: no messages", who);
  size_t images = 0;
  for (const ChatMessage& m : p.messages) {
    if (m.role != "system" && m.role != "developer" && m.role != "user" && m.role != "assistant")
      fail("%s: role \"%s\"", who, m.role.c_str());
    if (!is_valid_utf8(m.text)) fail("%s: message text not UTF-8", who);
    if (m.n_images < 0 || count_markers(m.text) != size_t(m.n_images) || (m.role != "user" && m.n_images != 0))
      fail("%s: a %s message with %d images and %zu markers", who, m.role.c_str(), m.n_images, count_markers(m.text));
    images += size_t(m.n_images);
  }
  if (images != p.images.size()) fail("%s: %zu images in the messages, %zu decoded", who, images, p.images.size());
}

// ---------------------------------------------------------------------------
// Engine requests

bool same_sampling(const SamplingParams& a, const SamplingParams& b) {
  auto same = [](float x, float y) { return std::memcmp(&x, &y, sizeof x) == 0; };
  return same(a.temperature, b.temperature) && a.top_k == b.top_k && same(a.top_p, b.top_p) && same(a.min_p, b.min_p) &&
         same(a.repeat_penalty, b.repeat_penalty) && a.repeat_last_n == b.repeat_last_n &&
         same(a.presence_penalty, b.presence_penalty) && same(a.frequency_penalty, b.frequency_penalty) &&
         a.seed == b.seed && a.max_tokens == b.max_tokens && a.stop == b.stop;
}

// What the wire carries comes back as it was, and re-encodes to the same bytes.
void check_wire(GenerateRequest r, uint64_t choice, const char* who) {
  r.request_id = 1000 + choice;
  r.rng_stream = choice;
  const codec::Bytes bytes = codec::encode(r);
  auto back = codec::decode_as<GenerateRequest>(bytes);
  if (!back.ok()) fail("%s: the codec refuses a built request: %s", who, back.status().to_string().c_str());
  const GenerateRequest& b = *back;
  if (b.prompt != r.prompt || !same_sampling(b.sampling, r.sampling) || b.request_id != r.request_id ||
      b.rng_stream != r.rng_stream || b.logprobs != r.logprobs || b.prefill_chunk != r.prefill_chunk ||
      b.ignore_eos != r.ignore_eos || b.keep_logits != r.keep_logits || b.images.size() != r.images.size())
    fail("%s: the request changed on the wire", who);
  for (size_t i = 0; i < r.images.size(); ++i) {
    const PromptImage &x = r.images[i], &y = b.images[i];
    if (x.position != y.position || x.n_tokens != y.n_tokens || !(x.hash == y.hash) || x.image.width != y.image.width ||
        x.image.height != y.image.height || x.image.rgb != y.image.rgb || x.embeddings != y.embeddings)
      fail("%s: image %zu changed on the wire", who, i);
  }
  if (codec::encode(b) != bytes) fail("%s: the request re-encodes to other bytes", who);
}

// A request build_generate_request gave: valid, the parsed settings, within the context.
void check_request(const ParsedRequest& p, const GenerateRequest& r, const PromptContext& ctx, const char* who) {
  const Status st = validate_request(r, ctx.context, g->tok->n_vocab());
  if (!st.ok()) fail("%s: validate_request refuses a built request: %s", who, st.to_string().c_str());
  const int64_t prompt = int64_t(r.prompt.size()), max_tokens = r.sampling.max_tokens;
  if (max_tokens < 1 || prompt + max_tokens > ctx.context)
    fail("%s: %lld prompt tokens and %lld to generate in a context of %d", who, (long long)prompt,
         (long long)max_tokens, ctx.context);
  if (p.max_tokens ? max_tokens != *p.max_tokens : max_tokens != ctx.context - prompt)
    fail("%s: max_tokens %lld, not the request's or the rest of the context", who, (long long)max_tokens);
  SamplingParams want = p.sampling;
  want.max_tokens = int32_t(max_tokens);
  want.seed = p.seed.value_or(ctx.default_seed);
  if (!same_sampling(r.sampling, want)) fail("%s: the sampling settings changed", who);
  if (r.logprobs != p.logprobs || r.ignore_eos != p.ignore_eos || r.request_id != 0 || r.rng_stream || r.keep_logits)
    fail("%s: logprobs, ignore_eos or the route's fields changed", who);
  if (r.images.size() != p.images.size()) fail("%s: %zu images built of %zu", who, r.images.size(), p.images.size());
  for (size_t i = 0; i < r.images.size(); ++i) {
    const PromptImage& im = r.images[i];
    const RgbImage& src = p.images[i];
    if (im.n_tokens != ctx.image_tokens || im.image.width != src.width || im.image.height != src.height ||
        im.image.rgb != src.rgb || !(im.hash == image_hash(src)) || !im.embeddings.empty())
      fail("%s: image %zu is not the request's", who, i);
    for (int32_t k = 0; k < im.n_tokens; ++k)
      if (r.prompt[size_t(im.position + k)] != kImagePlaceholderId) fail("%s: image %zu without placeholders", who, i);
  }
}

// Completions have an exact oracle: the prompt is the text's tokens (with
// the tokenizer's BOS) or the ids as given.
void build_completion(const ParsedRequest& p, const PromptContext& ctx) {
  const char* who = "build_generate_request (completion)";
  const Tokenizer& tok = *g->tok;
  auto r = build_generate_request(p, ctx);
  const std::vector<int32_t> want = p.prompt_text ? tok.encode(*p.prompt_text, true) : p.prompt_ids;
  bool outside = false;
  for (int32_t id : want) outside = outside || id >= tok.n_vocab();
  const int64_t max_tokens = p.max_tokens.value_or(0);
  const bool exceeds = int64_t(want.size()) + max_tokens > ctx.context;
  if (r.ok()) {
    if (outside || want.empty() || exceeds) fail("%s: accepted a prompt it should refuse", who);
    if (r->prompt != want) fail("%s: the prompt is not the text's tokens or the ids given", who);
    check_request(p, *r, ctx, who);
    return check_wire(*r, 0, who);
  }
  const ApiError& e = r.error();
  check_error(e, who);
  if (e.param != "prompt") fail("%s: param \"%s\", not prompt", who, e.param.c_str());
  if (outside) {
    if (e.message.find("outside the vocabulary") == std::string::npos) fail("%s: %s", who, e.message.c_str());
  } else if (want.empty()) {
    if (e.message != "the prompt gave no tokens") fail("%s: %s", who, e.message.c_str());
  } else if (!exceeds || e.code != "context_length_exceeded") {
    fail("%s: refused a prompt of %zu tokens + %lld: %s", who, want.size(), (long long)max_tokens, e.message.c_str());
  }
}

// Chat: a refusal must be the template's, the context's or the missing
// vision encoder's; whatever the parser accepted, the templates and
// tokenize_chat agree on (markers and images). Returns the prompt built
// (empty on a refusal).
std::vector<int32_t> build_chat(const ParsedRequest& p, const PromptContext& ctx, const char* who) {
  auto r = build_generate_request(p, ctx);
  if (r.ok()) {
    check_request(p, *r, ctx, who);
    check_wire(*r, uint64_t(p.n - 1), who);
    return std::move(r->prompt);
  }
  const ApiError& e = r.error();
  check_error(e, who);
  if (!p.images.empty() && ctx.image_tokens < 1) {
    if (e.param != p.image_params[0] || e.message.find("vision encoder") == std::string::npos)
      fail("%s: an image without a vision encoder: %s (%s)", who, e.message.c_str(), e.param.c_str());
    return {};
  }
  if (e.param != "messages") fail("%s: param \"%s\", not messages: %s", who, e.param.c_str(), e.message.c_str());
  auto pieces = render_chat(ctx.chat_template, p.messages, true);
  if (!pieces.ok()) {
    if (e.message != pieces.status().message() || !e.code.empty())
      fail("%s: not the template's refusal (%s): %s", who, pieces.status().message().c_str(), e.message.c_str());
    return {};
  }
  auto info = chat_template_info(ctx.chat_template);
  if (!info.ok()) fail("%s: %s", who, info.status().to_string().c_str());
  auto built = tokenize_chat(*pieces, *info, *g->tok, ctx.special_tokens, p.images, ctx.image_tokens);
  if (!built.ok()) fail("%s: tokenize_chat refuses what render_chat gave: %s", who, built.status().to_string().c_str());
  const int64_t prompt = int64_t(built->prompt.size());
  if (prompt == 0) {
    if (e.message != "the messages gave no tokens") fail("%s: %s", who, e.message.c_str());
  } else if (e.code != "context_length_exceeded" || prompt + p.max_tokens.value_or(1) <= ctx.context) {
    fail("%s: refused %lld prompt tokens + %d: %s", who, (long long)prompt, p.max_tokens.value_or(0), e.message.c_str());
  }
  return {};
}

// ---------------------------------------------------------------------------
// Responses

std::string piece_of(int32_t token) { return g->tok->token_bytes(token); }

void check_logprob_number(const json& v, const char* who) {
  if (!v.is_number() || !(v.get<double>() >= -9999.0 && v.get<double>() <= 0))
    fail("%s: a logprob that is not a number in [-9999, 0]: %s", who, v.dump().c_str());
}

// The reply a route would write for a request built from p, with choices
// whose text and logprobs come from the prompt's tokens.
void check_responses(const ParsedRequest& p, const std::vector<int32_t>& prompt, uint64_t salt) {
  const bool chat = p.kind == RequestKind::chat;
  const char* who = chat ? "chat response" : "completion response";
  const ResponseMeta meta{response_id(p.kind, salt), 1700000000, p.model.empty() ? "cleave" : p.model};
  const char* reasons[] = {"stop", "length", "context", ""};
  const float lps[] = {-0.25f, -INFINITY, NAN, -1e6f, 0.0f, -9999.5f, INFINITY};
  const size_t n_tokens = std::min<size_t>(prompt.size(), 24);
  std::vector<ChoiceOutput> choices;
  Usage usage{int32_t(prompt.size()), 0, int32_t(salt % (prompt.size() + 1))};
  for (int32_t i = 0; i < p.n; ++i) {
    ChoiceOutput c;
    c.index = i;
    c.finish_reason = reasons[(salt + size_t(i)) % 4];
    c.has_logprobs = p.logprobs >= 0;
    for (size_t k = size_t(i) % (n_tokens + 1); k < n_tokens; ++k) {
      c.text += piece_of(prompt[k]);  // byte tokens: pieces of UTF-8 characters
      if (!c.has_logprobs) continue;
      LogprobEntry e;
      e.chosen = {prompt[k], lps[k % 7]};
      for (int32_t t = 0; t < p.logprobs; ++t) e.top.push_back({prompt[(k + size_t(t)) % prompt.size()], lps[(k + size_t(t) + 1) % 7]});
      c.logprobs.push_back(std::move(e));
    }
    usage.completion_tokens += int32_t(c.logprobs.size());
    choices.push_back(std::move(c));
  }
  const std::string body = chat ? chat_response(meta, choices, usage, piece_of) : completion_response(meta, choices, usage, piece_of);
  const json j = parse_json(body, who);
  const json& cs = at(j, "choices");
  if (at(j, "object") != (chat ? "chat.completion" : "text_completion") || at(j, "id") != meta.id ||
      at(j, "model") != meta.model || !cs.is_array() || cs.size() != choices.size())
    fail("%s: wrong head or choices: %.300s", who, body.c_str());
  const json& u = at(j, "usage");
  if (at(u, "prompt_tokens") != usage.prompt_tokens || at(u, "completion_tokens") != usage.completion_tokens ||
      at(u, "total_tokens") != usage.prompt_tokens + usage.completion_tokens ||
      at(at(u, "prompt_tokens_details"), "cached_tokens") != usage.cached_tokens)
    fail("%s: wrong usage: %s", who, u.dump().c_str());
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceOutput& c = choices[i];
    const json& jc = elem(cs, i);
    const json& text = chat ? at(at(jc, "message"), "content") : at(jc, "text");
    if (at(jc, "index") != c.index || !text.is_string() || (is_valid_utf8(c.text) && text != c.text))
      fail("%s: choice %zu lost its text", who, i);
    const std::string reason = c.finish_reason.empty() ? "" : openai_finish_reason(c.finish_reason);
    if (reason.empty() ? !at(jc, "finish_reason").is_null() : at(jc, "finish_reason") != reason)
      fail("%s: choice %zu: finish_reason %s", who, i, at(jc, "finish_reason").dump().c_str());
    const json& lp = at(jc, "logprobs");
    if (!c.has_logprobs) {
      if (!lp.is_null()) fail("%s: logprobs nobody asked for", who);
      continue;
    }
    if (chat) {
      const json& content = at(lp, "content");
      if (!content.is_array() || content.size() != c.logprobs.size()) fail("%s: logprobs.content", who);
      for (size_t k = 0; k < c.logprobs.size(); ++k) {
        const json& entry = elem(content, k);
        check_logprob_number(at(entry, "logprob"), who);
        const std::string piece = piece_of(c.logprobs[k].chosen.token);
        const json& bytes = at(entry, "bytes");
        if (!bytes.is_array() || bytes.size() != piece.size() || !at(entry, "token").is_string())
          fail("%s: logprobs token %zu: %s", who, k, entry.dump().c_str());
        for (size_t b = 0; b < piece.size(); ++b)
          if (elem(bytes, b) != int(static_cast<unsigned char>(piece[b]))) fail("%s: logprobs bytes", who);
        const json& top = at(entry, "top_logprobs");
        if (!top.is_array() || top.size() != c.logprobs[k].top.size()) fail("%s: top_logprobs of token %zu", who, k);
        for (const json& t : top) check_logprob_number(at(t, "logprob"), who);
      }
    } else {
      const size_t n = c.logprobs.size();
      const json &tokens = at(lp, "tokens"), &lps_out = at(lp, "token_logprobs"), &tops = at(lp, "top_logprobs"),
                 &offsets = at(lp, "text_offset");
      if (!tokens.is_array() || tokens.size() != n || !lps_out.is_array() || lps_out.size() != n ||
          !tops.is_array() || tops.size() != n || !offsets.is_array() || offsets.size() != n)
        fail("%s: logprobs lists of other lengths than %zu: %s", who, n, lp.dump().c_str());
      int64_t last = -1;
      for (size_t k = 0; k < n; ++k) {
        if (!elem(tokens, k).is_string()) fail("%s: logprobs token %zu", who, k);
        check_logprob_number(elem(lps_out, k), who);
        const json& top = elem(tops, k);
        if (!top.is_object() || top.size() > c.logprobs[k].top.size()) fail("%s: top_logprobs %zu", who, k);
        for (const auto& [key, value] : top.items()) check_logprob_number(value, who);
        const json& off = elem(offsets, k);
        if (!off.is_number_integer() || off.get<int64_t>() < last) fail("%s: text_offset %s", who, off.dump().c_str());
        last = off.get<int64_t>();
      }
    }
  }
  // The stream of the same choices.
  for (const ChoiceOutput& c : choices) {
    ChoiceOutput last;
    last.index = c.index;
    last.finish_reason = c.finish_reason.empty() ? "stop" : c.finish_reason;
    ChoiceOutput middle = c;
    middle.finish_reason.clear();
    auto usage_null = [](const json& ch) { return ch.is_object() && ch.contains("usage") && at(ch, "usage").is_null(); };
    if (chat) {
      const json role = parse_sse(chat_role_chunk(meta, c.index, p.include_usage), "chat_role_chunk");
      if (at(at(elem(at(role, "choices"), 0), "delta"), "role") != "assistant" || usage_null(role) != p.include_usage)
        fail("chat_role_chunk: %s", role.dump().c_str());
      for (const ChoiceOutput* o : {&middle, &last}) {
        const json ch = parse_sse(chat_chunk(meta, *o, p.include_usage, piece_of), "chat_chunk");
        const json& delta = at(elem(at(ch, "choices"), 0), "delta");
        if (at(ch, "object") != "chat.completion.chunk" || count(at(ch, "choices")) != 1 || !delta.is_object() ||
            delta.contains("content") == o->text.empty() || usage_null(ch) != p.include_usage)
          fail("chat_chunk: %s", ch.dump().c_str());
      }
    } else {
      for (const ChoiceOutput* o : {&middle, &last}) {
        const json ch = parse_sse(completion_chunk(meta, *o, p.include_usage, piece_of), "completion_chunk");
        if (at(ch, "object") != "text_completion" || count(at(ch, "choices")) != 1 ||
            !at(elem(at(ch, "choices"), 0), "text").is_string() || usage_null(ch) != p.include_usage)
          fail("completion_chunk: %s", ch.dump().c_str());
      }
    }
  }
  const json uc = parse_sse(usage_chunk(meta, p.kind, usage), "usage_chunk");
  if (!at(uc, "choices").is_array() || count(at(uc, "choices")) != 0 ||
      at(at(uc, "usage"), "total_tokens") != usage.prompt_tokens + usage.completion_tokens)
    fail("usage_chunk: %s", uc.dump().c_str());
  const json models =
      parse_json(models_response({ModelCard{meta.model, meta.created, "cleave", kContext}}), "models_response");
  if (count(at(models, "data")) != 1 || at(elem(at(models, "data"), 0), "max_model_len") != kContext ||
      at(elem(at(models, "data"), 0), "id") != meta.model)
    fail("models_response: %s", models.dump().c_str());
}

// /tokenize and /detokenize: the answer lists the tokens (pieces as text
// when UTF-8, else their bytes); the text comes back as JSON.
void check_tokenize(std::string_view body) {
  const char* who = "parse_tokenize_request";
  auto t = parse_tokenize_request(body);
  if (!t.ok()) return check_error(t.error(), who);
  if (!is_valid_utf8(t->content)) fail("%s: content not UTF-8", who);
  const std::vector<int32_t> tokens = g->tok->encode(t->content, t->add_special);
  const json j = parse_json(tokenize_response(tokens, t->with_pieces, piece_of), "tokenize_response");
  const json& list = at(j, "tokens");
  if (!list.is_array() || list.size() != tokens.size()) fail("tokenize_response: wrong token count");
  for (size_t i = 0; i < tokens.size(); ++i) {
    const json& e = elem(list, i);
    if (!t->with_pieces) {
      if (e != tokens[i]) fail("tokenize_response: token %zu", i);
      continue;
    }
    const std::string piece = piece_of(tokens[i]);
    json want_piece = json::array();
    for (unsigned char c : piece) want_piece.push_back(int(c));
    if (is_valid_utf8(piece)) want_piece = piece;
    if (at(e, "id") != tokens[i] || at(e, "piece") != want_piece)
      fail("tokenize_response: token %zu: %s", i, e.dump().c_str());
  }
  const json d = parse_json(detokenize_response(g->tok->decode(tokens)), "detokenize_response");
  if (!at(d, "content").is_string()) fail("detokenize_response: no content");
}

void check_detokenize(std::string_view body) {
  const char* who = "parse_detokenize_request";
  auto d = parse_detokenize_request(body, g->tok->n_vocab());
  if (!d.ok()) return check_error(d.error(), who);
  for (int32_t id : *d)
    if (id < 0 || id >= g->tok->n_vocab()) fail("%s: token %d outside the vocabulary", who, id);
  const std::string text = g->tok->decode(*d);
  const json j = parse_json(detokenize_response(text), "detokenize_response");
  if (!at(j, "content").is_string() || (is_valid_utf8(text) && at(j, "content") != text))
    fail("detokenize_response: content");
}

// The special tokens of every built-in template, as if the vocabulary had
// them (ids counted down from its end); others are the vocabulary's own.
SpecialTokenLookup chat_specials(int32_t n_vocab, SpecialTokenLookup vocab) {
  auto map = std::make_shared<std::unordered_map<std::string, int32_t>>();
  int32_t id = n_vocab;
  for (const char* t : {"<|im_start|>", "<|im_end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                        "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "[INST]",
                        "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<start_of_turn>", "<end_of_turn>"})
    (*map)[t] = --id;
  return [map, vocab](std::string_view text) -> int32_t {
    auto it = map->find(std::string(text));
    return it != map->end() ? it->second : vocab(text);
  };
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  auto* globals = new Globals;
  const std::string path = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";
  auto file = GgufFile::open(path);
  if (!file.ok()) fail("%s", file.status().to_string().c_str());
  auto tok = Tokenizer::from_gguf(**file);
  if (!tok.ok()) fail("%s", tok.status().to_string().c_str());
  auto special = special_tokens_from_gguf(**file);
  if (!special.ok()) fail("%s", special.status().to_string().c_str());
  globals->file = std::move(file.value());
  globals->tok = std::move(tok.value());
  globals->vocab_special = std::move(special.value());
  globals->chat_special = chat_specials(globals->tok->n_vocab(), globals->vocab_special);
  globals->templates = chat_template_names();
  globals->options.image_limits = ImageLimits{size_t(1) << 20, kMaxSide, kMaxSide};
  globals->options.max_images = kMaxImages;
  g = globals;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  PromptContext ctx;
  ctx.tokenizer = g->tok.get();
  ctx.image_tokens = kImageTokens;
  ctx.context = kContext;
  ctx.default_seed = kDefaultSeed;

  auto completion = parse_completion_request(body, g->options);
  if (!completion.ok()) {
    check_error(completion.error(), "parse_completion_request");
  } else {
    check_parsed(*completion, RequestKind::completion, "parse_completion_request");
    ctx.chat_template = "chatml";  // not used by completions
    ctx.special_tokens = g->vocab_special;
    build_completion(*completion, ctx);
    const std::vector<int32_t> prompt =
        completion->prompt_text ? g->tok->encode(*completion->prompt_text, true) : completion->prompt_ids;
    if (!prompt.empty() && prompt.size() <= size_t(kContext)) {
      std::vector<int32_t> in_vocab;
      for (int32_t id : prompt) in_vocab.push_back(id % g->tok->n_vocab());
      check_responses(*completion, in_vocab, size);
    }
  }

  auto chat = parse_chat_request(body, g->options);
  if (!chat.ok()) {
    check_error(chat.error(), "parse_chat_request");
  } else {
    check_parsed(*chat, RequestKind::chat, "parse_chat_request");
    std::vector<int32_t> shown;  // the first prompt built, for the responses
    for (const std::string& name : g->templates) {
      ctx.chat_template = name;
      for (const SpecialTokenLookup* special : {&g->vocab_special, &g->chat_special}) {
        ctx.special_tokens = *special;
        const std::string who = "build_generate_request (chat, " + name +
                                (special == &g->vocab_special ? ", the vocabulary's specials)" : ", chat specials)");
        std::vector<int32_t> prompt = build_chat(*chat, ctx, who.c_str());
        if (shown.empty()) shown = std::move(prompt);
      }
    }
    if (!chat->images.empty()) {  // no vision encoder: refused, naming the first image
      ctx.image_tokens = 0;
      build_chat(*chat, ctx, "build_generate_request (chat, no vision encoder)");
    }
    if (!shown.empty()) check_responses(*chat, shown, size);
  }

  check_tokenize(body);
  check_detokenize(body);
  return 0;
}
