#include "model/request.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace cleave {

Status validate_request(const GenerateRequest& request, int32_t context, int32_t n_vocab,
                        int32_t n_embd) {
  if (request.prompt.empty()) return Status(Code::invalid_argument, "request: the prompt is empty");
  if (int64_t(request.prompt.size()) > context)
    return Status(Code::out_of_range, "request: prompt of " + std::to_string(request.prompt.size()) +
                                          " tokens exceeds the context of " +
                                          std::to_string(context) + " tokens");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t t = request.prompt[i];
    if (t < 0 || t >= n_vocab)
      return Status(Code::invalid_argument, "request: prompt token " + std::to_string(i) + " is " +
                                                std::to_string(t) + ", outside the vocabulary [0, " +
                                                std::to_string(n_vocab) + ")");
  }
  if (request.prefill_chunk < 1)
    return Status(Code::invalid_argument, "request: prefill chunk must be positive, got " +
                                              std::to_string(request.prefill_chunk));
  if (request.logprobs < -1 || request.logprobs > 20)
    return Status(Code::invalid_argument, "request: logprobs must be in [-1, 20], got " +
                                              std::to_string(request.logprobs));
  if (request.sampling.max_tokens < 0)
    return Status(Code::invalid_argument, "request: max tokens must not be negative, got " +
                                              std::to_string(request.sampling.max_tokens));
  for (const auto& [name, v] : {std::pair{"ttft_target_ms", request.ttft_target_ms},
                                std::pair{"tpot_target_ms", request.tpot_target_ms},
                                std::pair{"deadline_ms", request.deadline_ms}})
    if (!std::isfinite(v) || v < 0 || v > 1e9)
      return Status(Code::out_of_range, std::string("request: ") + name + " must be in [0, 1e9] ms, got " +
                                            std::to_string(v));
  if (!std::isfinite(request.max_cost) || request.max_cost < 0 || request.max_cost > 1e9)
    return Status(Code::out_of_range, "request: max_cost must be in [0, 1e9], got " + std::to_string(request.max_cost));
  int64_t prev_end = 0;
  for (size_t i = 0; i < request.images.size(); ++i) {
    const PromptImage& im = request.images[i];
    const std::string who = "request: image " + std::to_string(i) + " at position " +
                            std::to_string(im.position) + " with " +
                            std::to_string(im.n_tokens) + " tokens ";
    const int64_t end = int64_t(im.position) + im.n_tokens;
    if (im.n_tokens < 1) return Status(Code::invalid_argument, who + "is empty");
    if (im.position < 0 || end > int64_t(request.prompt.size()))
      return Status(Code::out_of_range, who + "reaches outside the prompt of " +
                                            std::to_string(request.prompt.size()) + " tokens");
    if (im.position < prev_end)
      return Status(Code::invalid_argument,
                    who + "starts before the previous image ends (" + std::to_string(prev_end) +
                        "): images must be in prompt order and not overlap");
    prev_end = end;
    const size_t floats = im.embeddings.size();
    const bool size_ok = n_embd > 0 ? floats == size_t(im.n_tokens) * size_t(n_embd)
                                    : floats % size_t(im.n_tokens) == 0;
    if (floats != 0 && !size_ok)
      return Status(Code::invalid_argument,
                    who + "has " + std::to_string(floats) + " embedding floats; expected " +
                        (n_embd > 0 ? std::to_string(im.n_tokens) + " x n_embd " +
                                          std::to_string(n_embd)
                                    : "a multiple of its token count") +
                        " (or none before encoding)");
  }
  return Status();
}

Status check_images_encoded(const GenerateRequest& request) {
  for (size_t i = 0; i < request.images.size(); ++i)
    if (request.images[i].embeddings.empty())
      return Status(Code::invalid_argument,
                    "request " + std::to_string(request.request_id) + ": image " +
                        std::to_string(i) + " at position " +
                        std::to_string(request.images[i].position) +
                        " is not encoded (no embeddings); encode the images first");
  return Status();
}

std::vector<KeySpan> image_key_spans(const GenerateRequest& request) {
  std::vector<KeySpan> spans;
  spans.reserve(request.images.size());
  for (const PromptImage& im : request.images)
    spans.push_back(KeySpan{im.position, im.n_tokens, BlockKey{im.hash.lo, im.hash.hi}});
  return spans;
}

std::span<const float> image_rows(const GenerateRequest& request, int32_t first, int32_t n,
                                  int32_t n_embd, std::vector<float>& scratch) {
  const int64_t end = int64_t(first) + n;
  const PromptImage* only = nullptr;
  int64_t only_from = 0, only_rows = 0, sources = 0;
  for (const PromptImage& im : request.images) {
    const int64_t lo = std::max<int64_t>(first, im.position);
    const int64_t hi = std::min<int64_t>(end, int64_t(im.position) + im.n_tokens);
    if (lo >= hi) continue;
    only = &im, only_from = lo - im.position, only_rows = hi - lo;
    ++sources;
  }
  if (sources == 0) return {};
  if (sources == 1)
    return {only->embeddings.data() + only_from * n_embd, size_t(only_rows * n_embd)};
  scratch.clear();
  for (const PromptImage& im : request.images) {
    const int64_t lo = std::max<int64_t>(first, im.position);
    const int64_t hi = std::min<int64_t>(end, int64_t(im.position) + im.n_tokens);
    if (lo >= hi) continue;
    const float* src = im.embeddings.data() + (lo - im.position) * n_embd;
    scratch.insert(scratch.end(), src, src + (hi - lo) * n_embd);
  }
  return scratch;
}

RequestProgress::RequestProgress(GenerateRequest request, const Tokenizer* tokenizer,
                                 int32_t context, int32_t n_vocab)
    : request_(std::move(request)),
      tokenizer_(tokenizer),
      context_(context),
      n_vocab_(n_vocab),
      history_(request_.prompt),
      stops_(request_.sampling.stop) {
  // The generated text continues the prompt: keep SPM's leading space.
  if (tokenizer_) stream_ = std::make_unique<StreamDecoder>(*tokenizer_, /*at_text_start=*/false);
  if (request_.sampling.max_tokens == 0) finish_reason_ = "length";
}

int32_t RequestProgress::step(const float* logits) {
  CLEAVE_CHECK(!finished());
  if (request_.keep_logits) {
    logits_.insert(logits_.end(), logits, logits + n_vocab_);
    last_logits_.assign(logits, logits + n_vocab_);
  }
  const uint64_t position = history_.size();
  const int32_t token = sample_token(logits, n_vocab_, request_.sampling, history_,
                                     request_.rng_stream.value_or(request_.request_id), position,
                                     request_.prompt.size());
  if (request_.logprobs >= 0)
    last_logprobs_ = token_logprobs(logits, n_vocab_, token, request_.logprobs);
  append(token);
  return token;
}

// generate()'s order of finish checks: EOS (its text is never shown), stop
// string, max_tokens, context. Once finished, the held text is flushed
// through the stop matcher (a stop string may still complete in it).
void RequestProgress::append(int32_t token) {
  generated_.push_back(token);
  history_.push_back(token);
  auto show = [&](const std::string& piece) { pending_text_ += stops_.push(piece); };
  if (!request_.ignore_eos && tokenizer_ && tokenizer_->is_eog(token)) {
    finish_reason_ = "stop";
  } else {
    if (stream_) show(stream_->push(token));
    if (stops_.stopped()) finish_reason_ = "stop";
    else if (n_generated() >= request_.sampling.max_tokens) finish_reason_ = "length";
    else if (int64_t(history_.size()) >= context_) finish_reason_ = "context";
  }
  if (finished() && stream_ && !stops_.stopped()) {
    show(stream_->flush());
    pending_text_ += stops_.flush();
  }
}

std::string RequestProgress::take_text() {
  std::string out = std::move(pending_text_);
  pending_text_.clear();
  text_ += out;
  return out;
}

Status RequestProgress::replay(const std::vector<int32_t>& generated) {
  if (!generated_.empty())
    return Status(Code::invalid_argument, "replay: request " + std::to_string(id()) +
                                              " has already generated tokens");
  // Replays on a fresh copy so a bad list leaves this request untouched.
  RequestProgress replayed(request_, tokenizer_, context_, n_vocab_);
  for (size_t i = 0; i < generated.size(); ++i) {
    const int32_t t = generated[i];
    if (t < 0 || t >= n_vocab_)
      return Status(Code::invalid_argument, "replay: generated token " + std::to_string(i) + " is " +
                                                std::to_string(t) + ", outside the vocabulary [0, " +
                                                std::to_string(n_vocab_) + ")");
    if (replayed.finished())
      return Status(Code::invalid_argument,
                    "replay: request " + std::to_string(id()) + " finished (" +
                        replayed.finish_reason_ + ") after " + std::to_string(i) + " of the " +
                        std::to_string(generated.size()) + " generated tokens");
    replayed.append(t);
  }
  *this = std::move(replayed);
  return Status();
}

}  // namespace cleave
