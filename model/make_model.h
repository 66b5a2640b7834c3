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
// router_skew S > 0 scales router row e (expert e's logits) by
// 1 + S * (n_experts - 1 - e) / (n_experts - 1): a logit of larger spread
// reaches the top-k more often, so low-numbered experts are routed more
// tokens (a skewed load, for expert balancing). 0: every row alike.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/dtype.h"

namespace cleave {

struct ModelSpec {
  int32_t dim = 288, n_layers = 6, n_heads = 6, n_kv_heads = 6, ffn = 768;
  int32_t n_experts = 0, n_experts_used = 0;  // 0 = dense
  float router_skew = 0;  // MoE only: see above
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

// A small CLIP vision encoder + MLP projector (llama.cpp mmproj layout, see
// model/clip.h), weights by the formula above with:
//   ln*/pre_ln/post_ln weights 1 + 0.1 u;  every bias and v.class_embd 0.1 u
//   v.position_embd.weight 0.5 u;          matrices u / sqrt(fan-in)
//   (v.patch_embd.weight's fan-in is 3 * patch_size^2)
// Norms, biases and v.class_embd are F32; v.patch_embd, v.position_embd and
// the matrices are stored in spec.type (Q8_0 needs patch_size, dim, ffn and
// the projector's hidden size to be multiples of 32).
struct ClipSpec {
  int32_t image_size = 32, patch_size = 8, dim = 64, n_layers = 2, n_heads = 4, ffn = 128;
  int32_t projection_dim = 64;  // the language model's embedding size (mm.2 rows)
  int32_t mm_hidden = 0;        // mm.0 rows; 0: projection_dim (as LLaVA)
  // Hidden-state index (blocks that run, model/clip.h), written as
  // clip.vision.feature_layer = [feature_layer] when >= 0; -1: no key (the
  // encoder then runs n_layers - 1 blocks).
  int32_t feature_layer = -1;
  bool use_gelu = true;
  bool class_embd = true, pre_ln = true, post_ln = true, patch_bias = false;
  float eps = 1e-5f;
  float image_mean[3] = {0.48145466f, 0.4578275f, 0.40821073f};  // CLIP's
  float image_std[3] = {0.26862954f, 0.26130258f, 0.27577711f};
  DType type = DType::F32;
  uint64_t seed = 1;
  std::string name = "cleave-test-clip";
};

// invalid_argument naming the field and its value when the spec is unusable.
Status validate_clip_spec(const ClipSpec& spec);
Status write_test_clip_model(const ClipSpec& spec, const std::string& out_path);

}  // namespace cleave
