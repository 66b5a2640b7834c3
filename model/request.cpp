#include "model/request.h"

namespace cleave {

Status validate_request(const GenerateRequest& request, int32_t context, int32_t n_vocab) {
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
  if (request.sampling.max_tokens < 0)
    return Status(Code::invalid_argument, "request: max tokens must not be negative, got " +
                                              std::to_string(request.sampling.max_tokens));
  return Status();
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
  if (request_.keep_logits) logits_.insert(logits_.end(), logits, logits + n_vocab_);
  last_logits_.assign(logits, logits + n_vocab_);
  const uint64_t position = history_.size();
  const int32_t token = sample_token(logits, n_vocab_, request_.sampling, history_,
                                     request_.request_id, position);
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
