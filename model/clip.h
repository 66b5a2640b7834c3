// CLIP vision encoders with an MLP projector, as llama.cpp's LLaVA-style
// mmproj GGUF files describe them (general.architecture = "clip"): weight
// views into the mapped file, checked by name, shape and type at load.
//
// Forward pass (pre-norm ViT):
//   patches   conv(patch_size, stride patch_size) = matmul of v.patch_embd
//             over each flattened patch (c, ky, kx; kx innermost) + bias
//   tokens    [v.class_embd;] patches, + v.position_embd, then v.pre_ln
//   block i   x += attn_out(attn(ln1(x)));  x += ffn_down(act(ffn_up(ln2(x))))
//             full (non-causal) attention, scale 1/sqrt(head_dim); act is
//             GELU (tanh approximation, as ggml_gelu) when clip.use_gelu,
//             else quick GELU x * sigmoid(1.702 x)
//   features  the hidden state `feature_layer` (below); v.post_ln only when
//             every block ran; the class token dropped
//   projector mm.2(GELU_tanh(mm.0(features)))
//
// Feature layer, llama.cpp's convention: `clip.vision.feature_layer` holds
// hidden-state indices (llama.cpp writes an int array; a scalar is read the
// same way): 0 is the encoder input after pre_ln, h the output of block
// h - 1, so h blocks run and later ones are skipped. One index is supported
// (several, stacked as granite-vision does, are unsupported). Without the
// key, block_count - 1 blocks run: the penultimate block's output, which is
// what LLaVA feeds its projector (select_layer -2) and what llama.cpp does
// for these files (its converter keeps every block and drops post_ln).
// v.post_ln is applied only when all block_count blocks ran, as in the
// Hugging Face model (llama.cpp applies it whenever present; its LLaVA files
// have none, so both agree).
//
// Legacy llama.cpp files stored fc1 as ffn_down and fc2 as ffn_up; as
// llama.cpp does, the two are swapped when the shapes say so (ffn_down
// reading embedding_length), unless feed_forward_length == embedding_length.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/backend_buffer.h"
#include "model/gguf.h"
#include "model/image.h"

namespace cleave {

struct ClipConfig {
  int32_t image_size = 0;
  int32_t patch_size = 0;
  int32_t n_patches = 0;       // (image_size / patch_size)^2
  int32_t n_positions = 0;     // n_patches + 1 with a class token
  int32_t dim = 0;             // embedding_length
  int32_t ffn = 0;             // feed_forward_length
  int32_t n_layers = 0;        // block_count
  int32_t n_heads = 0;
  int32_t head_dim = 0;
  int32_t feature_layer = 0;   // hidden-state index = blocks that run, in [0, n_layers]
  int32_t mm_hidden = 0;       // rows of mm.0
  int32_t projection_dim = 0;  // rows of mm.2: the language model's embedding size
  int32_t clip_projection_dim = 0;  // clip.vision.projection_dim (unused by the MLP projector; 0: absent)
  float eps = 1e-5f;
  float image_mean[3] = {0, 0, 0};
  float image_std[3] = {1, 1, 1};
  bool use_gelu = false;
  bool has_class_embd = false;
  bool has_pre_ln = false;
  bool use_post_ln = false;  // the file has v.post_ln and every block runs
  bool ffn_swapped = false;  // legacy fc1/fc2 naming detected
  DType weight_type = DType::F32;  // type of the attention matrices (for reports)
};

struct ClipLayer {
  std::vector<float> ln1_w, ln1_b, ln2_w, ln2_b;
  WeightView q, k, v, o;
  std::vector<float> q_b, k_b, v_b, o_b;
  WeightView up, down;  // dim -> ffn, ffn -> dim
  std::vector<float> up_b, down_b;
};

class ClipModel {
 public:
  // Reads the clip.* keys and binds every tensor. unsupported for another
  // architecture, projector type, weight type or key form; not_found for a
  // missing key or tensor; corruption for a wrong shape or an out-of-range
  // value; each names the key or tensor and the values.
  static Result<std::unique_ptr<ClipModel>> load(std::shared_ptr<const GgufFile> file);

  const ClipConfig& config() const { return config_; }
  const GgufFile& file() const { return *file_; }
  // Floats one image takes (3 x image_size x image_size) and gives
  // (n_patches x projection_dim).
  size_t input_floats() const { return size_t(3) * config_.image_size * config_.image_size; }
  size_t output_floats() const { return size_t(config_.n_patches) * config_.projection_dim; }

  // A decoded image as this encoder's input: preprocess_image with the
  // file's image_size, image_mean and image_std.
  Result<std::vector<float>> preprocess(const RgbImage& image) const {
    return preprocess_image(image, config_.image_size, config_.image_mean, config_.image_std);
  }

  // Encodes n images: pixels is n x 3 x image_size x image_size (CHW, already
  // normalised, e.g. by preprocess_image), out is n x n_patches x
  // projection_dim, both host memory. Every op runs on `backend`; each
  // image's result is the same whether it is encoded alone or with others.
  // A backend whose memory is not the host's (a GPU) needs the model placed
  // there first (on()): the host then uploads the patches and downloads the
  // output, and touches nothing else. invalid_argument for n < 1, null
  // pointers, or a model placed on another backend (or not placed);
  // unsupported when the backend lacks matmul for the weight type,
  // out_of_memory when the batch's scratch cannot be allocated. On the host,
  // scratch is per calling thread (kept between calls, grown to the largest
  // batch): concurrent calls from different threads with their own backends
  // are safe.
  Status encode(Backend& backend, const float* pixels, int64_t n, float* out) const;

  // This model with its weights copied into the memory of `backend` (which
  // must outlive it) once, in their stored types: the model encode() takes
  // with that backend. out_of_memory naming the tensor when there is no room.
  Result<std::unique_ptr<ClipModel>> on(Backend& backend) const;

 private:
  ClipModel() = default;
  ClipModel(const ClipModel&) = default;
  struct Buffers;
  void run(Backend& backend, Buffers& buf, const float* pixels, int64_t n, float* out) const;
  // A norm's, bias's or embedding's floats where the ops read them: its copy
  // in the placed backend's memory, else the host vector itself.
  const float* at(const std::vector<float>& v) const;
  std::shared_ptr<const GgufFile> file_;
  ClipConfig config_;
  WeightView patch_embd_;               // dim x (3 * patch * patch)
  std::vector<float> patch_b_;          // empty when absent
  std::vector<float> class_embd_;       // empty when absent
  std::vector<float> position_embd_;    // n_positions x dim
  std::vector<float> pre_ln_w_, pre_ln_b_, post_ln_w_, post_ln_b_;
  std::vector<ClipLayer> layers_;       // the blocks that run (feature_layer of them)
  WeightView mm0_, mm2_;
  std::vector<float> mm0_b_, mm2_b_;
  // Placed on a backend (on()): its copies of the weights, and each host
  // vector's copy by the vector's address.
  const Backend* placed_ = nullptr;
  std::shared_ptr<WeightCopies> copies_;
  std::unordered_map<const float*, const float*> placed_vectors_;
};

}  // namespace cleave
