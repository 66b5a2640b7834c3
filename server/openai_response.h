// OpenAI response bodies as JSON text: completion and chat objects, their
// streaming chunks as server-sent events, the models list, and
// llama-server's /tokenize and /detokenize answers. Text that is not UTF-8
// (a piece of a multi-byte character) is written with U+FFFD, never
// thrown on; logprobs that are not finite are written as -9999 (as vLLM).
//
// Streaming, as OpenAI sends it: per choice, chat starts with a chunk whose
// delta is {"role":"assistant","content":""}, then {"content": TEXT}
// chunks, then one with an empty delta and the finish_reason; completions
// send {"text": TEXT} chunks, the last with the finish_reason. With
// include_usage every chunk carries "usage": null and a last chunk has
// "choices": [] and the usage. Then "data: [DONE]".
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "model/sampler.h"
#include "server/api_error.h"
#include "server/openai_request.h"

namespace cleave::server {

// OpenAI's finish_reason for the engine's: "stop" -> "stop", "length" and
// "context" (the context filled up) -> "length"; anything else unchanged.
std::string openai_finish_reason(std::string_view engine_reason);

// "cmpl-" (completions) or "chatcmpl-" (chat) and 16 hex digits of n.
std::string response_id(RequestKind kind, uint64_t n);

struct ResponseMeta {
  std::string id;        // response_id()
  int64_t created = 0;   // Unix seconds
  std::string model;     // the served model's name
};

struct Usage {
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;  // prompt tokens served from the prefix cache
};

// A token's text for logprobs (Tokenizer::token_bytes, say).
using TokenText = std::function<std::string(int32_t token)>;

// One choice's output, or (streaming) what one chunk adds to it.
struct ChoiceOutput {
  int32_t index = 0;
  std::string text;
  std::string finish_reason;  // the engine's ("stop", "length", "context"); empty: not finished
  bool has_logprobs = false;  // the request asked for them: "logprobs" is null otherwise
  std::vector<LogprobEntry> logprobs;  // one per token of text
  // Completions' text_offset: characters (code points) of the choice's text
  // before this output (0 for a whole choice).
  int32_t text_offset = 0;
};

// {"id","object":"text_completion","created","model","choices":[{"index",
// "text","logprobs":null|{"tokens","token_logprobs","top_logprobs":[{TOKEN:
// LOGPROB}],"text_offset"},"finish_reason"}],"usage":{"prompt_tokens",
// "completion_tokens","total_tokens","prompt_tokens_details":{"cached_tokens"}}}
std::string completion_response(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                                const Usage& usage, const TokenText& token_text);

// {"id","object":"chat.completion","created","model","choices":[{"index",
// "message":{"role":"assistant","content"},"logprobs":null|{"content":[{
// "token","logprob","bytes","top_logprobs":[{"token","logprob","bytes"}]}]},
// "finish_reason"}],"usage":{...}}
std::string chat_response(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                          const Usage& usage, const TokenText& token_text);

// "data: JSON\n\n"
std::string sse_event(std::string_view json);
// "data: [DONE]\n\n"
std::string sse_done();
// "data: {\"error\":{...}}\n\n" (error_body)
std::string sse_error(const ApiError& e);

// The SSE events of a stream (each a whole "data: ...\n\n").
// Chat: the first chunk of choice `index`: delta {"role":"assistant","content":""}.
std::string chat_role_chunk(const ResponseMeta& meta, int32_t index, bool include_usage);
// Chat: delta {"content": text} (omitted when text is empty) with the
// chunk's logprobs; finish_reason set when out.finish_reason is (send the
// final one with empty text: delta {}).
std::string chat_chunk(const ResponseMeta& meta, const ChoiceOutput& out, bool include_usage,
                       const TokenText& token_text);
// Completions: {"index","text","logprobs","finish_reason"} of one chunk.
std::string completion_chunk(const ResponseMeta& meta, const ChoiceOutput& out, bool include_usage,
                             const TokenText& token_text);
// The closing usage chunk: "choices": [] and the usage.
std::string usage_chunk(const ResponseMeta& meta, RequestKind kind, const Usage& usage);

struct ModelCard {
  std::string id;
  int64_t created = 0;
  std::string owned_by = "cleave";
  int32_t max_model_len = 0;  // the context; 0: left out
};
// {"object":"list","data":[{"id","object":"model","created","owned_by","max_model_len"}]}
std::string models_response(const std::vector<ModelCard>& models);

// llama-server's /tokenize: {"tokens":[id,...]}, or with pieces
// {"tokens":[{"id","piece"}]} where the piece is a string when it is UTF-8
// and its list of bytes when not.
std::string tokenize_response(const std::vector<int32_t>& tokens, bool with_pieces, const TokenText& token_text);
// /detokenize: {"content": text}
std::string detokenize_response(std::string_view text);

}  // namespace cleave::server
