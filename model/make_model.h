// Small llama-architecture test models with deterministic weights.
//
// Weight formula (so any reader can reproduce a tensor without the file):
//   key(T)  = splitmix64(seed ^ fnv1a64(T))            for the tensor named T
//   z(T, j) = mix(key(T) + (j + 1) * 0x9E3779B97F4A7C15) (splitmix64's output
//             mix; j is the flat element index, innermost dimension first)
//   u(T, j) = (z >> 40) * 2^-23 - 1                    uniform in [-1, 1)
//   norm weights (1-D):   1 + 0.1 * u
//   token_embd.weight:    u
//   output.weight:        u / sqrt(dim)
//   other matrices:       u / sqrt(ne[0])               (fan-in)
// Values are computed in float32 and then stored in spec.type (F16/BF16
// round to nearest even, Q8_0 quantised row by row as ggml does); 1-D norm
// weights and the MoE router (ffn_gate_inp) are always F32.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/dtype.h"

namespace cleave {

struct ModelSpec {
  int32_t dim = 288, n_layers = 6, n_heads = 6, n_kv_heads = 6, ffn = 768;
  int32_t n_experts = 0, n_experts_used = 0;  // 0 = dense
  int32_t context = 2048;
  float rope_base = 10000.f, rms_eps = 1e-5f;
  bool tied_output = false;  // no output.weight when true
  DType type = DType::F32;   // type of the 2-D / 3-D weight matrices
  uint64_t seed = 1;
  std::string name = "cleave-test";
};

// invalid_argument naming the field and its value when the spec is unusable.
Status validate_spec(const ModelSpec& spec);

// "f32" | "f16" | "bf16" | "q8_0" (case-insensitive); invalid_argument otherwise.
Result<DType> dtype_from_name(const std::string& name);

// The deterministic value of element j of the tensor named `tensor` before
// scaling (u in the formula above).
float test_weight_uniform(uint64_t seed, const std::string& tensor, uint64_t j);

// Writes a GGUF model. Reads every tokenizer.* key from vocab_path (copied
// unchanged) and the vocabulary size (length of tokenizer.ggml.tokens).
Status write_test_model(const ModelSpec& spec, const std::string& vocab_path,
                        const std::string& out_path);

}  // namespace cleave
