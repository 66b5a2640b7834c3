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
  const int32_t n_embd = engine.config().dim;
  CLEAVE_RETURN_IF_ERROR(validate_request(req, engine.context(), n_vocab, n_embd));
  CLEAVE_RETURN_IF_ERROR(check_images_encoded(req));

  auto seq = engine.open_sequence(image_key_spans(req));
  if (!seq.ok()) return seq.status();
  SequenceGuard guard{engine, *seq};

  GenerateResult out;
  std::vector<float> logits(n_vocab);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<float> scratch;
  for (size_t at = 0; at < req.prompt.size(); at += req.prefill_chunk) {
    int32_t len = int32_t(std::min<size_t>(req.prefill_chunk, req.prompt.size() - at));
    const auto rows = image_rows(req, int32_t(at), len, n_embd, scratch);
    CLEAVE_RETURN_IF_ERROR(engine.forward({{*seq, req.prompt.data() + at, len, rows}}, logits.data()));
  }
  out.prefill_seconds = seconds_since(t0);
  out.prefill_tokens = int32_t(req.prompt.size());

  RequestProgress progress(req, tokenizer, engine.context(), n_vocab);
  auto show = [&] {
    std::string piece = progress.take_text();
    if (on_text && !piece.empty()) on_text(piece);
  };
  t0 = std::chrono::steady_clock::now();
  while (!progress.finished()) {
    int32_t token = progress.step(logits.data());
    show();
    if (progress.finished()) break;
    CLEAVE_RETURN_IF_ERROR(engine.forward({{*seq, &token, 1}}, logits.data()));
    ++out.decode_tokens;
  }
  out.decode_seconds = seconds_since(t0);

  out.tokens = progress.generated();
  out.text = progress.text();
  out.finish_reason = progress.finish_reason();
  out.logits = progress.logits();
  return out;
}

}  // namespace cleave
