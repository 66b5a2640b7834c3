// The llama architecture (dense and Mixtral-style MoE) as weight views into a
// mapped GGUF file: nothing is converted or copied up front; the kernels read
// each matrix in its stored type.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/backend_buffer.h"
#include "model/gguf.h"

namespace cleave {

struct LlamaConfig {
  int32_t n_vocab = 0;
  int32_t dim = 0;
  int32_t n_layers = 0;
  int32_t n_heads = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t ffn = 0;
  int32_t n_experts = 0;       // 0: dense
  int32_t n_experts_used = 0;
  int32_t context = 0;
  float rope_base = 10000.f;
  float rms_eps = 1e-5f;
  bool tied_output = false;
};

struct LlamaLayer {
  const float* attn_norm = nullptr;
  WeightView wq, wk, wv, wo;
  const float* ffn_norm = nullptr;
  WeightView gate, up, down;                       // dense
  WeightView router;                               // MoE: n_experts x dim
  std::vector<WeightView> gate_exps, up_exps, down_exps;  // MoE: one view per expert
};

class LlamaModel {
 public:
  // Reads the config and binds every tensor, checking names, shapes and
  // types: unsupported for another architecture or tensor type, not_found
  // for a missing tensor, corruption for a wrong shape; each names the values.
  static Result<std::unique_ptr<LlamaModel>> load(std::shared_ptr<const GgufFile> file);

  const LlamaConfig& config() const { return config_; }
  const GgufFile& file() const { return *file_; }
  const WeightView& token_embd() const { return token_embd_; }
  const WeightView& output() const { return output_; }
  const float* output_norm() const { return output_norm_; }
  const LlamaLayer& layer(int i) const { return layers_[i]; }
  // Bytes of weights read to produce one token at batch 1 (all matrices
  // except the embedding table, plus one embedding row; MoE counts only the
  // experts used).
  uint64_t weight_bytes_per_token() const;
  uint64_t n_params() const;
  // Whether any matrix the forward pass multiplies by (layers, output) is
  // stored in type t.
  bool multiplies_type(DType t) const;
  // Which matrices of a layer prepare() takes: attention, the dense FFN and
  // the router; or the MoE experts (apart, as expert hosts may compute them
  // elsewhere).
  enum class Matrices { dense, experts };
  // backend.prepare() on those matrices of layers [first, last] and, with
  // `output`, the output matrix.
  void prepare(Backend& backend, int32_t first, int32_t last, Matrices which, bool output) const;
  // backend.prepare(w); when the backend keeps its own copy (the CPU
  // backend's panels), w's file pages are released after.
  void prepare_one(Backend& backend, const WeightView& w) const;
  // For a backend whose memory is not the host's: copies what a forward
  // pass over layers [first, last] reads (the token embeddings, those
  // layers' norms and matrices, MoE experts included, and, with `output`,
  // the final norm and output head) into its memory once, in their stored
  // types, and rebinds the model's views to the copies.
  // out_of_memory naming the tensor when the backend has no room.
  Result<std::unique_ptr<WeightCopies>> upload(Backend& backend, int32_t first, int32_t last,
                                               bool output);
  // One expert's three matrices of `layer` (a dense model's FFN is expert
  // 0) copied into copies' backend, the views rebound to them: what an
  // expert host on a device holds. out_of_memory naming the tensor.
  Status upload_expert(WeightCopies& copies, int32_t layer, int32_t expert);

 private:
  std::shared_ptr<const GgufFile> file_;
  LlamaConfig config_;
  WeightView token_embd_, output_;
  const float* output_norm_ = nullptr;
  std::vector<LlamaLayer> layers_;
};

// Whether `compute` applies to this model: Compute::int8 works on Q8_0
// weights only, so a model without any is refused (invalid_argument naming
// `who` and the model's types) rather than run exactly under an int8 flag.
Status check_compute(Compute compute, const LlamaModel& model, const char* who);

// The fingerprint KV blocks are made under: the model file's, and for
// Compute::int8 that mixed with the compute, since int8 gives other KV bits
// (blocks of the two never mix, and a stage of the other compute is refused).
uint64_t compute_fingerprint(uint64_t file_fingerprint, Compute compute);

}  // namespace cleave
