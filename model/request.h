// One request's decoding state, apart from where its forward passes run:
// sampling, EOS / stop strings / max tokens / context limits, and the text
// streamed so far. generate(), the batch scheduler and every actor topology
// drive the same class, so a request's tokens depend only on (model, prompt,
// sampling params, seed, request id), never on who ran it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/image.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "storage/prefix.h"

namespace cleave {

// An image in the prompt, LLaVA style: prompt[position, position + n_tokens)
// hold placeholder ids whose rows take the image's embeddings instead of
// token embeddings. The content hash keys the KV prefix (a different image
// never reuses KV, the same one does) and the encoders' embedding cache.
struct PromptImage {
  int32_t position = 0;
  int32_t n_tokens = 0;
  ImageHash hash;
  RgbImage image;                 // decoded pixels, for the encoder; may be dropped once encoded
  std::vector<float> embeddings;  // n_tokens x n_embd once encoded, empty before
};

struct GenerateRequest {
  std::vector<int32_t> prompt;  // token ids (already tokenised)
  std::vector<PromptImage> images;  // in prompt order, not overlapping
  SamplingParams sampling;
  uint64_t request_id = 0;      // keys the sampler's RNG unless rng_stream is set
  // Keys the sampler's RNG instead of request_id: a server gives choice i of
  // a request with a fixed seed the stream i, so its text does not depend
  // on the ids the server hands out (or on the topology).
  std::optional<uint64_t> rng_stream;
  // Report each sampled token's logprob and this many top alternatives
  // (OpenAI's logprobs / top_logprobs, at most 20); -1: none.
  int32_t logprobs = -1;
  int32_t prefill_chunk = 512;  // tokens per prefill forward (llama.cpp's ubatch)
  bool ignore_eos = false;
  bool keep_logits = false;     // record each step's logits row
  // vLLM's priority: under the priority scheduling policy a lower value is
  // served first and may preempt a running request of a higher value (whose
  // KV is recomputed, as any preemption's). Any other policy refuses a
  // nonzero value.
  int32_t priority = 0;
  // Service goals, in milliseconds; 0: none. The router predicts the
  // request's TTFT and TPOT when it arrives and refuses it at once
  // (Code::rejected, HTTP 429) when a goal cannot be met, instead of
  // serving it late (actors/slo_predictor.h). deadline_ms bounds the whole
  // request, counted as TTFT + (max_tokens - 1) x TPOT.
  double ttft_target_ms = 0, tpot_target_ms = 0, deadline_ms = 0;
  // Cost budget, in cost-seconds (a stage on a node of `cost = c` charges c
  // per second of its work for the request; actors/cost_budget.h); 0: none.
  // Only the cost_aware router reads it: it refuses at once (Code::rejected)
  // a request whose cheapest predicted cost exceeds it and places within it.
  double max_cost = 0;
};

// invalid_argument / out_of_range naming the problem: empty prompt, prompt
// longer than the context, token outside [0, n_vocab), prefill_chunk < 1,
// max_tokens < 0, a goal (ttft_target_ms, tpot_target_ms, deadline_ms) or
// max_cost not finite or outside [0, 1e9]; images out of prompt order, overlapping, empty
// (n_tokens < 1) or reaching past the prompt, embeddings neither empty nor
// n_tokens x n_embd floats. n_embd is the language model's width; 0 (a
// router that has no model) checks only that the size is a multiple of
// n_tokens. Images may still be unencoded: see check_images_encoded().
Status validate_request(const GenerateRequest& request, int32_t context, int32_t n_vocab,
                        int32_t n_embd = 0);

// invalid_argument naming the first image whose embeddings are empty: a
// request must be encoded (encode_images, model/multimodal.h) before an
// engine runs it.
Status check_images_encoded(const GenerateRequest& request);

// The engine's view of the request's images (Engine::open_sequence): their
// positions and content hashes.
std::vector<KeySpan> image_key_spans(const GenerateRequest& request);

// Engine::Item::embeddings for prompt positions [first, first + n): one row
// of n_embd floats for each position inside an image, in order. Points into
// the image's embeddings when the rows come from one image, else copies them
// into scratch. Positions past the prompt (generated tokens) have none. The
// request must have passed validate_request() with n_embd and
// check_images_encoded().
std::span<const float> image_rows(const GenerateRequest& request, int32_t first, int32_t n,
                                  int32_t n_embd, std::vector<float>& scratch);

class RequestProgress {
 public:
  // tokenizer may be null (no text, no EOS); it must outlive this object.
  // The request must have passed validate_request().
  RequestProgress(GenerateRequest request, const Tokenizer* tokenizer, int32_t context,
                  int32_t n_vocab);

  const GenerateRequest& request() const { return request_; }
  uint64_t id() const { return request_.request_id; }
  // Prompt and generated tokens, in order.
  const std::vector<int32_t>& history() const { return history_; }
  const std::vector<int32_t>& generated() const { return generated_; }
  int32_t n_generated() const { return int32_t(generated_.size()); }
  bool finished() const { return !finish_reason_.empty(); }
  // "length", "stop" (EOS or stop string) or "context"; empty while running.
  const std::string& finish_reason() const { return finish_reason_; }

  // Samples the next token from the logits of history().back() (n_vocab
  // floats: the runner feeds history() up to its end, then calls step()),
  // appends it and updates the finish state. Returns the token. Must not be
  // called once finished(). The finish checks run in generate()'s order: EOS
  // (unless ignore_eos), stop string, max_tokens, context full.
  int32_t step(const float* logits);

  // Text that became safe to show since the last call (stop strings held
  // back and removed; the rest flushed once finished()).
  std::string take_text();
  // All text shown so far (what take_text() returned, in total).
  const std::string& text() const { return text_; }
  // Logits of every step() (steps x n_vocab; replayed tokens have none) when
  // keep_logits, else empty; last_logits() is the final row, also only when
  // keep_logits.
  const std::vector<float>& logits() const { return logits_; }
  const std::vector<float>& last_logits() const { return last_logits_; }
  // The last step()'s logprobs when the request asked for them
  // (request().logprobs >= 0).
  const LogprobEntry& last_logprobs() const { return last_logprobs_; }

  // Re-creates the state after `generated` tokens were produced elsewhere
  // (a decode actor that died): appends them without sampling and re-derives
  // text and finish state. invalid_argument when called after step(), when a
  // token is outside the vocabulary, or when the request would already have
  // finished before the last of them.
  Status replay(const std::vector<int32_t>& generated);

 private:
  void append(int32_t token);

  GenerateRequest request_;
  const Tokenizer* tokenizer_;
  int32_t context_, n_vocab_;
  std::vector<int32_t> history_, generated_;
  std::string finish_reason_;
  std::string text_, pending_text_;
  StopMatcher stops_;
  std::unique_ptr<StreamDecoder> stream_;
  std::vector<float> logits_, last_logits_;
  LogprobEntry last_logprobs_;
};

}  // namespace cleave
