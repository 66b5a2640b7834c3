// The one JSONL request / result format, for every command that reads
// requests from a file (`cleave generate --requests`, `cleave node
// --requests`) and the job runner after them: the same fields, the same
// defaults, the same errors.
//
// A request line is one JSON object:
//   "id"            unsigned integer, required, unique within a file
//   "prompt"        text (tokenised with the model's tokenizer), or
//   "prompt_ids"    token ids; exactly one of the two
//   "images"        image files (PNG / JPEG); needs "prompt" and a vision
//                   encoder; `<image>` in the text places each, else first
//   "add_bos"       bool, default true (text prompts)
//   "max_tokens"    default 16 (OpenAI's completions default)
//   "temperature"   default 0.8 (0: greedy), "top_k" 40, "top_p" 0.95,
//   "min_p" 0.05, "repeat_penalty" 1, "repeat_last_n" 64, "seed" 0,
//   "stop"          a string or a list of strings,
//   "ignore_eos"    default false, "prefill_chunk" default 512
//   "priority"      int32, default 0: lower first under the priority
//                   scheduling policy (a nonzero one is refused under fcfs)
//   "ttft_target_ms", "tpot_target_ms", "deadline_ms"
//                   numbers in [0, 1e9], default 0 (none): goals the router
//                   checks on arrival; a request that cannot meet one fails
//                   at once with a `rejected` error naming the prediction
//   "max_cost"      number in [0, 1e9], default 0 (none): a cost budget in
//                   cost-seconds; needs the cost_aware router (refused
//                   otherwise), `rejected` when the cheapest prediction is over it
// (SamplingParams' defaults, llama.cpp's, except max_tokens). Any other key
// is refused, naming it: a field that would be ignored is an error.
//
// A result line: "id", "tokens", "logits_hash" (XXH3-64 of each token's
// logits row, 16 hex digits), "text", "finish_reason" or "error",
// "ttft_ms", "total_ms", "stages" ({origin: {tokens, ms}}) and, when a
// vision encoder ran, "encoder" and "encode_ms".
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "frontend/frontend.h"
#include "model/image.h"
#include "model/request.h"
#include "model/tokenizer.h"

namespace cleave {

struct RequestContext {
  const Tokenizer* tokenizer = nullptr;  // null: "prompt" is refused
  int32_t image_tokens = 0;              // the vision encoder's n_patches; 0: "images" refused
  // Reads an image file; default read_image_file (model/image.h).
  std::function<Result<RgbImage>(const std::string& path)> load_image;
};

// One line -> a request, or invalid_argument naming the field (image
// errors keep their code and name the file).
Result<GenerateRequest> parse_request_line(std::string_view line, const RequestContext& ctx);

// Every request of a JSONL file (blank lines skipped); errors are prefixed
// "PATH:LINE: ". Duplicate ids and an empty file are errors.
Result<std::vector<GenerateRequest>> read_request_file(const std::string& path,
                                                       const RequestContext& ctx);

// One result line (no newline).
std::string result_line(uint64_t id, const Completion& c);

// Range-checked JSON scalars, shared with the HTTP server's parser
// (server/openai_request.cpp); invalid_argument quoting `name`:
//   json_int     an integer in [lo, hi] ("\"n\" 0 is outside [1, 16]"); a
//                number with a fraction (1.5, 1e3) is refused, not truncated
//   json_number  a finite number in [lo, hi]
//   json_bool    true or false
Result<int64_t> json_int(const nlohmann::json& v, std::string_view name, int64_t lo, int64_t hi);
Result<double> json_number(const nlohmann::json& v, std::string_view name, double lo, double hi);
Result<bool> json_bool(const nlohmann::json& v, std::string_view name);

// "%016x" of a logits hash.
std::string logits_hash_hex(uint64_t h);

}  // namespace cleave
