#include "model/generate.h"

#include <chrono>

namespace cleave {
namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Closes the engine sequence however generate() returns.
struct SequenceGuard {
  Engine& engine;
  int32_t seq;
  ~SequenceGuard() { engine.close_sequence(seq); }
};
}  // namespace

Result<GenerateResult> generate(Engine& engine, const Tokenizer* tokenizer,
                                const GenerateRequest& req,
                                const std::function<void(const std::string&)>& on_text) {
  const int32_t n_vocab = engine.config().n_vocab;
  if (req.prompt.empty()) return Status(Code::invalid_argument, "generate: the prompt is empty");
  if (int64_t(req.prompt.size()) > engine.context())
    return Status(Code::out_of_range, "generate: prompt of " + std::to_string(req.prompt.size()) +
                                          " tokens exceeds the context of " +
                                          std::to_string(engine.context()) + " tokens");
  if (req.prefill_chunk < 1)
    return Status(Code::invalid_argument, "generate: prefill chunk must be positive");
  if (req.sampling.max_tokens < 0)
    return Status(Code::invalid_argument, "generate: max tokens must not be negative");

  auto seq = engine.open_sequence();
  if (!seq.ok()) return seq.status();
  SequenceGuard guard{engine, *seq};

  GenerateResult out;
  std::vector<float> logits(n_vocab);
  std::vector<int32_t> history = req.prompt;

  auto t0 = std::chrono::steady_clock::now();
  for (size_t at = 0; at < req.prompt.size(); at += req.prefill_chunk) {
    int32_t len = int32_t(std::min<size_t>(req.prefill_chunk, req.prompt.size() - at));
    CLEAVE_RETURN_IF_ERROR(engine.forward({{*seq, req.prompt.data() + at, len}}, logits.data()));
  }
  out.prefill_seconds = seconds_since(t0);
  out.prefill_tokens = int32_t(req.prompt.size());

  StopMatcher stops(req.sampling.stop);
  std::unique_ptr<StreamDecoder> stream;
  if (tokenizer) stream = std::make_unique<StreamDecoder>(*tokenizer, /*at_text_start=*/false);
  auto emit = [&](const std::string& piece) {
    std::string safe = stops.push(piece);
    out.text += safe;
    if (on_text && !safe.empty()) on_text(safe);
  };

  out.finish_reason = "length";
  t0 = std::chrono::steady_clock::now();
  for (int32_t step = 0; step < req.sampling.max_tokens; ++step) {
    if (req.keep_logits) out.logits.insert(out.logits.end(), logits.begin(), logits.end());
    const uint64_t position = history.size();
    int32_t tok = sample_token(logits.data(), n_vocab, req.sampling, history, req.request_id,
                               position);
    out.tokens.push_back(tok);
    history.push_back(tok);
    if (!req.ignore_eos && tokenizer && tokenizer->is_eog(tok)) {
      out.finish_reason = "stop";
      break;
    }
    if (stream) emit(stream->push(tok));
    if (stops.stopped()) {
      out.finish_reason = "stop";
      break;
    }
    if (step + 1 == req.sampling.max_tokens) break;
    if (int64_t(history.size()) >= engine.context()) {
      out.finish_reason = "context";
      break;
    }
    CLEAVE_RETURN_IF_ERROR(engine.forward({{*seq, &tok, 1}}, logits.data()));
    ++out.decode_tokens;
  }
  out.decode_seconds = seconds_since(t0);
  if (stream && !stops.stopped()) {
    emit(stream->flush());
    std::string rest = stops.flush();
    out.text += rest;
    if (on_text && !rest.empty()) on_text(rest);
  }
  return out;
}

}  // namespace cleave
