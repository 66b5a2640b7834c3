// Sampling. Every random draw comes from a counter-based generator keyed by
// (seed, request, position), so a request's tokens never depend on what else
// ran beside it or on how it was batched.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cleave {

struct SamplingParams {
  float temperature = 0.8f;  // <= 0: greedy
  int32_t top_k = 40;        // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off
  int32_t repeat_last_n = 64;
  // OpenAI's: logit -= presence * (count > 0) + frequency * count, counting
  // each token in the generated tokens only (0: off).
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
  int32_t max_tokens = 64;
  std::vector<std::string> stop;  // stop strings
};

// Philox-style counter-based draws in [0, 1) (53-bit resolution).
uint64_t counter_rng_u64(uint64_t seed, uint64_t request, uint64_t position);
double counter_rng_uniform(uint64_t seed, uint64_t request, uint64_t position);

// Pick the next token from one row of logits. `history` is the request's
// tokens so far (prompt and generated) for the repetition penalty; the
// presence and frequency penalties count history[n_prompt..). Greedy
// ties go to the lowest id. Deterministic in (logits, params, history,
// request, position).
int32_t sample_token(const float* logits, int32_t n_vocab, const SamplingParams& params,
                     const std::vector<int32_t>& history, uint64_t request, uint64_t position,
                     size_t n_prompt = 0);

// OpenAI's logprobs: the log-softmax of the raw logits row (before any
// penalty or temperature) for the chosen token and the `top` most likely
// ones (descending, ties to the lowest id). Computed in double.
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
};
struct LogprobEntry {
  TokenLogprob chosen;
  std::vector<TokenLogprob> top;
};
LogprobEntry token_logprobs(const float* logits, int32_t n_vocab, int32_t chosen, int32_t top);

// Finds stop strings in streamed text. push() returns the text that is safe
// to emit (it cannot be the start of a stop string); stopped() turns true
// once a stop string is complete, and the stop string itself is not emitted.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string push(const std::string& text);
  std::string flush();  // held text once generation ends without a stop
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace cleave
