// OpenAI request bodies -> what a route needs: /v1/completions and
// /v1/chat/completions (the fields below; any other is refused, naming it:
// a setting the server would ignore is an error), and llama-server's
// /tokenize and /detokenize. Nothing here throws: bad JSON, wrong types,
// numbers out of range, invalid UTF-8, bad images are all ApiError 400
// naming the request field (`param`).
//
// Both routes (a field given as null is the same as absent):
//   model              string; optional (the route checks it against the served model)
//   max_tokens         integer >= 1; chat default: until the context is full;
//                      completions default 16 (OpenAI's and vLLM's)
//   temperature        [0, 2], default 1 (0: greedy)
//   top_p              (0, 1], default 1
//   top_k              -1 or 0 (off, the default) or >= 1 (vLLM's extension)
//   min_p              [0, 1], default 0 (vLLM's)
//   presence_penalty, frequency_penalty   [-2, 2], default 0
//   repetition_penalty (0, 100], default 1: over the whole history, prompt
//                      and output, as vLLM (repeat_last_n -1)
//   stop               a string or up to 4 non-empty strings
//   seed               integer (negative ones taken modulo 2^64); absent:
//                      PromptContext::default_seed
//   n                  1..16 choices, default 1
//   ignore_eos         bool (vLLM's)
//   priority           int32, default 0 (vLLM's): lower first under
//                      --scheduling-policy priority; nonzero under fcfs: 400
//   ttft_target_ms, tpot_target_ms, deadline_ms
//                      numbers in [0, 1e9], 0: none: goals the router checks
//                      on arrival against its predictions; one that cannot
//                      be met is refused at once with 429 (slo_unattainable)
//   max_cost           number in [0, 1e9], 0: none: a cost budget in
//                      cost-seconds (actors/cost_budget.h); needs the
//                      cost_aware router (400 otherwise), 429
//                      (slo_unattainable) when the cheapest prediction is over it
//   stream             bool; stream_options {"include_usage": bool} only with stream
//   user               string: metadata only (OpenAI's abuse-monitoring id),
//                      accepted and not used; the one accepted field that
//                      changes nothing
//   logit_bias         only null or {} (no bias) is accepted
// /v1/completions:
//   prompt             required: a string, a list of token ids, or a list of
//                      one of those; several prompts are refused (send one
//                      request per prompt)
//   logprobs           0..5: the chosen token's logprob and that many top ones
//   echo               only false (echoing the prompt is not supported)
//   best_of            only equal to n (no server-side candidates)
//   suffix             only null or "" (no insertion)
// /v1/chat/completions:
//   messages           required, non-empty: {"role", "content"}; role system,
//                      developer (as system), user or assistant; content a
//                      string or a non-empty list of parts {"type":"text",
//                      "text"} and, in user messages, {"type":"image_url",
//                      "image_url":{"url":"data:image/png;base64,..." or
//                      image/jpeg, "detail":"auto"}} (no URLs are fetched);
//                      adjacent text parts are joined with "\n"; the text
//                      "<image>" is refused (it marks images)
//   max_completion_tokens  as max_tokens (both given and different: refused)
//   logprobs           bool; top_logprobs 0..20, only with logprobs true
//   response_format    only {"type":"text"}
//   tools, tool_choice, functions, function_call: refused (not supported)
// The chat template is the server's setting (--chat-template), not a field.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/image.h"
#include "model/request.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "server/api_error.h"
#include "server/chat_template.h"

namespace cleave::server {

// A value or the ApiError that explains why there is none.
template <class T>
class [[nodiscard]] ApiResult {
 public:
  ApiResult(T value) : value_(std::move(value)) {}     // NOLINT: implicit by design
  ApiResult(ApiError error) : error_(std::move(error)) {}  // NOLINT
  bool ok() const { return value_.has_value(); }
  const ApiError& error() const { return error_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  std::optional<T> value_;
  ApiError error_;
};

enum class RequestKind { completion, chat };

struct ParseOptions {
  ImageLimits image_limits;  // each image's encoded size and dimensions
  int32_t max_images = 8;    // image parts per request
  // Local images: "file:///abs/path.png" URLs are read when the file's real
  // path (symlinks resolved) lies inside this directory (vLLM's
  // --allowed-local-media-path); empty: refused, only data URLs.
  std::string media_root;
};

struct ParsedRequest {
  RequestKind kind = RequestKind::completion;
  std::string model;  // empty when not given
  // completion: the prompt as text, or as token ids (prompt_text empty then)
  std::optional<std::string> prompt_text;
  std::vector<int32_t> prompt_ids;
  // chat: the messages (images as `<image>` markers), the decoded images in
  // order, and the field of each ("messages[1].content[0]") for errors
  std::vector<ChatMessage> messages;
  std::vector<RgbImage> images;
  std::vector<std::string> image_params;
  // temperature, top_k, top_p, min_p, penalties, stop; max_tokens and seed
  // are the two below
  SamplingParams sampling;
  std::optional<int32_t> max_tokens;  // none: until the context is full
  std::optional<uint64_t> seed;
  int32_t n = 1;
  bool stream = false;
  bool include_usage = false;
  int32_t logprobs = -1;  // top alternatives per token (completions logprobs, chat top_logprobs); -1: none
  bool ignore_eos = false;
  int32_t priority = 0;
  double ttft_target_ms = 0, tpot_target_ms = 0, deadline_ms = 0;
  double max_cost = 0;
};

// The OpenAI sampling defaults (temperature 1, top_p 1, top_k off, min_p 0,
// no penalties; repeat_last_n -1).
SamplingParams openai_sampling_defaults();

ApiResult<ParsedRequest> parse_completion_request(std::string_view body, const ParseOptions& options = {});
ApiResult<ParsedRequest> parse_chat_request(std::string_view body, const ParseOptions& options = {});

struct PromptContext {
  const Tokenizer* tokenizer = nullptr;  // required
  std::string chat_template;             // the server's template (chat_template_names())
  SpecialTokenLookup special_tokens;     // may be empty (special_tokens_from_gguf)
  int32_t image_tokens = 0;              // the vision encoder's n_patches; 0: none
  int32_t context = 0;                   // the model's context length
  uint64_t default_seed = 0;             // the seed of a request that gives none
};

// The engine request of one choice: the prompt (completions: text tokenised
// with the tokenizer's BOS rule, or the ids as given; chat: render_chat then
// tokenize_chat with the template's BOS convention), its images, sampling
// with max_tokens resolved (absent: context - prompt tokens), logprobs,
// ignore_eos. request_id and rng_stream are the route's (choice i of a
// request: rng_stream i). Errors: a token id outside the vocabulary
// ("prompt"), an empty prompt, an image without a vision encoder (naming the
// part: "this server has no vision encoder (--mmproj)"), a conversation the
// template refuses ("messages"), and code "context_length_exceeded" when
// prompt + max_tokens pass the context (the message names both).
ApiResult<GenerateRequest> build_generate_request(ParsedRequest parsed, const PromptContext& ctx);

// /tokenize, llama-server's body: {"content": string, "add_special": bool
// (default false: no BOS), "with_pieces": bool (default false)}, and vLLM's
// "model": string (optional: the served model whose tokenizer to use).
struct TokenizeRequest {
  std::string content;
  bool add_special = false;
  bool with_pieces = false;
  std::string model;  // empty when not given
};
ApiResult<TokenizeRequest> parse_tokenize_request(std::string_view body);

// /detokenize: {"tokens": [id, ...], "model": string (optional)}, each id in
// [0, n_vocab) of the model the body names.
struct DetokenizeRequest {
  std::vector<int32_t> tokens;
  std::string model;  // empty when not given
};
// `n_vocab_of(model)` ("" when the body names none): that model's vocabulary
// size, or the error that answers the request (a model not served).
using VocabOf = std::function<ApiResult<int32_t>(const std::string& model)>;
ApiResult<DetokenizeRequest> parse_detokenize_request(std::string_view body, const VocabOf& n_vocab_of);
// One vocabulary, whatever model the body names: the ids.
ApiResult<std::vector<int32_t>> parse_detokenize_request(std::string_view body, int32_t n_vocab);

// Well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool is_valid_utf8(std::string_view s);

}  // namespace cleave::server
