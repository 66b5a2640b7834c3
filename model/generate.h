// One request from prompt to finished text on an Engine: chunked prefill,
// then decode with sampling, EOS and stop strings, streaming pieces as they
// are produced.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/engine.h"
#include "model/request.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

namespace cleave {

struct GenerateResult {
  std::vector<int32_t> tokens;   // generated ids
  std::string text;              // generated text (stop string excluded)
  std::string finish_reason;     // "length", "stop" (EOS or stop string), "context"
  std::vector<float> logits;     // steps x n_vocab when keep_logits
  double prefill_seconds = 0, decode_seconds = 0;
  int32_t prefill_tokens = 0, decode_tokens = 0;
};

// on_text receives each piece of text as soon as it is safe to show.
Result<GenerateResult> generate(Engine& engine, const Tokenizer* tokenizer,
                                const GenerateRequest& request,
                                const std::function<void(const std::string&)>& on_text = {});

}  // namespace cleave
