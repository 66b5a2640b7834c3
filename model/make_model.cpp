#include "model/make_model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <string_view>
#include <vector>

#include "model/gguf.h"

namespace cleave {

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline uint64_t splitmix64(uint64_t x) {
  return mix64(x + kGamma);
}

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

inline float to_uniform(uint64_t z) {
  return static_cast<float>(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

Status bad(const char* field, const std::string& value, const char* why) {
  return Status(Code::invalid_argument,
                std::string("model spec: ") + field + " = " + value + ": " + why);
}

// Generates one tensor: element j = scale * u(T, j) (+ bias), stored in `type`.
struct Gen {
  uint64_t seed;
  GgufWriter& w;
  std::vector<float> row;

  // row_scale: a factor per row (rows = product of ne[1..]), or empty.
  Status add(const std::string& name, DType type, std::vector<int64_t> ne, float scale,
             float bias = 0.f, const std::vector<float>& row_scale = {}) {
    int64_t cols = ne[0];
    int64_t rows = 1;
    for (size_t d = 1; d < ne.size(); ++d) rows *= ne[d];
    size_t rb = dtype_row_bytes(type, cols);
    std::vector<uint8_t> data(rb * static_cast<size_t>(rows));
    row.resize(static_cast<size_t>(cols));
    uint64_t state = splitmix64(seed ^ fnv1a64(name));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        state += kGamma;
        row[c] = bias + scale * to_uniform(mix64(state));
        if (!row_scale.empty()) row[c] *= row_scale[size_t(r)];
      }
      uint8_t* out = data.data() + static_cast<size_t>(r) * rb;
      switch (type) {
        case DType::F32:
          std::memcpy(out, row.data(), rb);
          break;
        case DType::F16:
          for (int64_t c = 0; c < cols; ++c) {
            uint16_t h = fp32_to_fp16(row[c]);
            std::memcpy(out + 2 * c, &h, 2);
          }
          break;
        case DType::BF16:
          for (int64_t c = 0; c < cols; ++c) {
            uint16_t h = fp32_to_bf16(row[c]);
            std::memcpy(out + 2 * c, &h, 2);
          }
          break;
        case DType::Q8_0:
          quantize_row_q8_0(row.data(), cols, out);
          break;
        case DType::Q4_0:  // a KV cache type only; validate_spec refuses it for weights
          return Status(Code::invalid_argument, "make-model: Q4_0 is not a weight type");
      }
    }
    w.add_tensor(name, type, std::move(ne), std::move(data));
    return Status::Ok();
  }
};

}  // namespace

float test_weight_uniform(uint64_t seed, const std::string& tensor, uint64_t j) {
  uint64_t key = splitmix64(seed ^ fnv1a64(tensor));
  return to_uniform(mix64(key + (j + 1) * kGamma));
}

Result<DType> dtype_from_name(const std::string& name) {
  std::string s;
  for (char c : name) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "f32") return DType::F32;
  if (s == "f16") return DType::F16;
  if (s == "bf16") return DType::BF16;
  if (s == "q8_0") return DType::Q8_0;
  return Status(Code::invalid_argument,
                "unknown weight type '" + name + "' (expected f32, f16, bf16 or q8_0)");
}

Status validate_spec(const ModelSpec& s) {
  auto pos = [](const char* f, int32_t v) -> Status {
    if (v <= 0) return bad(f, std::to_string(v), "must be positive");
    return Status::Ok();
  };
  CLEAVE_RETURN_IF_ERROR(pos("dim", s.dim));
  CLEAVE_RETURN_IF_ERROR(pos("n_layers", s.n_layers));
  CLEAVE_RETURN_IF_ERROR(pos("n_heads", s.n_heads));
  CLEAVE_RETURN_IF_ERROR(pos("n_kv_heads", s.n_kv_heads));
  CLEAVE_RETURN_IF_ERROR(pos("ffn", s.ffn));
  CLEAVE_RETURN_IF_ERROR(pos("context", s.context));
  if (s.dim % s.n_heads != 0) {
    return bad("dim", std::to_string(s.dim),
               ("not a multiple of n_heads " + std::to_string(s.n_heads)).c_str());
  }
  if (s.n_heads % s.n_kv_heads != 0) {
    return bad("n_kv_heads", std::to_string(s.n_kv_heads),
               ("does not divide n_heads " + std::to_string(s.n_heads)).c_str());
  }
  int32_t hd = s.dim / s.n_heads;
  if (hd % 2 != 0) {
    return bad("dim", std::to_string(s.dim),
               ("head_dim dim / n_heads = " + std::to_string(hd) + " must be even").c_str());
  }
  if (s.n_experts < 0) return bad("n_experts", std::to_string(s.n_experts), "must be >= 0");
  if (s.n_experts == 0 && s.n_experts_used != 0) {
    return bad("n_experts_used", std::to_string(s.n_experts_used), "must be 0 for a dense model");
  }
  if (s.n_experts > 0 && (s.n_experts_used < 1 || s.n_experts_used > s.n_experts)) {
    return bad("n_experts_used", std::to_string(s.n_experts_used),
               ("must be in 1..n_experts " + std::to_string(s.n_experts)).c_str());
  }
  if (!(std::isfinite(s.router_skew) && s.router_skew >= 0 && s.router_skew <= 100))
    return bad("router_skew", std::to_string(s.router_skew), "must be in [0, 100]");
  if (s.router_skew > 0 && s.n_experts == 0)
    return bad("router_skew", std::to_string(s.router_skew), "needs a MoE model (experts > 0)");
  if (!(std::isfinite(s.rope_base) && s.rope_base > 0)) {
    return bad("rope_base", std::to_string(s.rope_base), "must be positive and finite");
  }
  if (!(std::isfinite(s.rms_eps) && s.rms_eps > 0)) {
    return bad("rms_eps", std::to_string(s.rms_eps), "must be positive and finite");
  }
  if (!dtype_known(static_cast<uint32_t>(s.type))) {
    return bad("type", std::to_string(static_cast<uint32_t>(s.type)), "unknown weight type");
  }
  if (s.type == DType::Q8_0) {
    if (s.dim % kQ8Block != 0)
      return bad("dim", std::to_string(s.dim), "must be a multiple of 32 for Q8_0");
    if (s.ffn % kQ8Block != 0)
      return bad("ffn", std::to_string(s.ffn), "must be a multiple of 32 for Q8_0");
  }
  if (s.name.empty()) return bad("name", "''", "must not be empty");
  // Bound the size so products below cannot overflow (and tests stay sane).
  long double params =
      static_cast<long double>(s.dim) * s.ffn * 3 * std::max(1, s.n_experts) + 4.0L * s.dim * s.dim;
  params *= s.n_layers;
  if (params > 1e11L) {
    return bad("n_layers", std::to_string(s.n_layers), "model too large (over 1e11 parameters)");
  }
  return Status::Ok();
}

Status write_test_model(const ModelSpec& spec, const std::string& vocab_path,
                        const std::string& out_path) {
  CLEAVE_RETURN_IF_ERROR(validate_spec(spec));
  auto vocab = GgufFile::open(vocab_path);
  if (!vocab.ok()) return vocab.status();
  const GgufFile& vf = **vocab;
  const GgufKv* tokens = vf.find("tokenizer.ggml.tokens");
  if (!tokens || tokens->value.type != GgufType::ARRAY ||
      tokens->value.array_type != GgufType::STRING || tokens->value.arr_s.empty()) {
    return Status(Code::invalid_argument,
                  "make_model: '" + vocab_path + "' has no tokenizer.ggml.tokens string array");
  }
  const int64_t n_vocab = static_cast<int64_t>(tokens->value.arr_s.size());

  GgufWriter w;
  const int64_t dim = spec.dim, ffn = spec.ffn, hd = spec.dim / spec.n_heads;
  const int64_t nq = spec.n_heads * hd, nkv = spec.n_kv_heads * hd;
  w.set_string("general.architecture", "llama");
  w.set_string("general.name", spec.name);
  w.set_u32("general.alignment", 32);
  w.set_u32("llama.context_length", static_cast<uint32_t>(spec.context));
  w.set_u32("llama.embedding_length", static_cast<uint32_t>(spec.dim));
  w.set_u32("llama.block_count", static_cast<uint32_t>(spec.n_layers));
  w.set_u32("llama.feed_forward_length", static_cast<uint32_t>(spec.ffn));
  w.set_u32("llama.attention.head_count", static_cast<uint32_t>(spec.n_heads));
  w.set_u32("llama.attention.head_count_kv", static_cast<uint32_t>(spec.n_kv_heads));
  w.set_f32("llama.rope.freq_base", spec.rope_base);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", spec.rms_eps);
  w.set_u32("llama.rope.dimension_count", static_cast<uint32_t>(hd));
  w.set_u32("llama.vocab_size", static_cast<uint32_t>(n_vocab));
  if (spec.n_experts > 0) {
    w.set_u32("llama.expert_count", static_cast<uint32_t>(spec.n_experts));
    w.set_u32("llama.expert_used_count", static_cast<uint32_t>(spec.n_experts_used));
  }
  for (const GgufKv& kv : vf.metadata()) {
    if (kv.key.rfind("tokenizer.", 0) == 0) w.set(kv.key, kv.value);
  }

  Gen g{spec.seed, w, {}};
  const DType t = spec.type;
  const float fan_dim = 1.0f / std::sqrt(static_cast<float>(dim));
  const float fan_ffn = 1.0f / std::sqrt(static_cast<float>(ffn));
  const float fan_q = 1.0f / std::sqrt(static_cast<float>(nq));
  CLEAVE_RETURN_IF_ERROR(g.add("token_embd.weight", t, {dim, n_vocab}, 1.0f));
  CLEAVE_RETURN_IF_ERROR(g.add("output_norm.weight", DType::F32, {dim}, 0.1f, 1.0f));
  if (!spec.tied_output) {
    CLEAVE_RETURN_IF_ERROR(g.add("output.weight", t, {dim, n_vocab}, fan_dim));
  }
  for (int32_t l = 0; l < spec.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    CLEAVE_RETURN_IF_ERROR(g.add(p + "attn_norm.weight", DType::F32, {dim}, 0.1f, 1.0f));
    CLEAVE_RETURN_IF_ERROR(g.add(p + "attn_q.weight", t, {dim, nq}, fan_dim));
    CLEAVE_RETURN_IF_ERROR(g.add(p + "attn_k.weight", t, {dim, nkv}, fan_dim));
    CLEAVE_RETURN_IF_ERROR(g.add(p + "attn_v.weight", t, {dim, nkv}, fan_dim));
    CLEAVE_RETURN_IF_ERROR(g.add(p + "attn_output.weight", t, {nq, dim}, fan_q));
    CLEAVE_RETURN_IF_ERROR(g.add(p + "ffn_norm.weight", DType::F32, {dim}, 0.1f, 1.0f));
    if (spec.n_experts == 0) {
      CLEAVE_RETURN_IF_ERROR(g.add(p + "ffn_gate.weight", t, {dim, ffn}, fan_dim));
      CLEAVE_RETURN_IF_ERROR(g.add(p + "ffn_up.weight", t, {dim, ffn}, fan_dim));
      CLEAVE_RETURN_IF_ERROR(g.add(p + "ffn_down.weight", t, {ffn, dim}, fan_ffn));
    } else {
      const int64_t ne = spec.n_experts;
      std::vector<float> skew;
      if (spec.router_skew > 0)
        for (int64_t e = 0; e < ne; ++e)
          skew.push_back(1.f + spec.router_skew * float(ne - 1 - e) / float(std::max<int64_t>(ne - 1, 1)));
      CLEAVE_RETURN_IF_ERROR(g.add(p + "ffn_gate_inp.weight", DType::F32, {dim, ne}, fan_dim, 0.f, skew));
      CLEAVE_RETURN_IF_ERROR(g.add(p + "ffn_gate_exps.weight", t, {dim, ffn, ne}, fan_dim));
      CLEAVE_RETURN_IF_ERROR(g.add(p + "ffn_up_exps.weight", t, {dim, ffn, ne}, fan_dim));
      CLEAVE_RETURN_IF_ERROR(g.add(p + "ffn_down_exps.weight", t, {ffn, dim, ne}, fan_ffn));
    }
  }
  return w.write(out_path);
}

Status validate_clip_spec(const ClipSpec& s) {
  auto pos = [](const char* f, int32_t v) -> Status {
    if (v <= 0 || v > 65536) return bad(f, std::to_string(v), "must be in [1, 65536]");
    return Status::Ok();
  };
  CLEAVE_RETURN_IF_ERROR(pos("image_size", s.image_size));
  CLEAVE_RETURN_IF_ERROR(pos("patch_size", s.patch_size));
  CLEAVE_RETURN_IF_ERROR(pos("dim", s.dim));
  CLEAVE_RETURN_IF_ERROR(pos("n_layers", s.n_layers));
  CLEAVE_RETURN_IF_ERROR(pos("n_heads", s.n_heads));
  CLEAVE_RETURN_IF_ERROR(pos("ffn", s.ffn));
  CLEAVE_RETURN_IF_ERROR(pos("projection_dim", s.projection_dim));
  if (s.mm_hidden < 0) return bad("mm_hidden", std::to_string(s.mm_hidden), "must be >= 0");
  if (s.image_size % s.patch_size != 0)
    return bad("image_size", std::to_string(s.image_size),
               ("not a multiple of patch_size " + std::to_string(s.patch_size)).c_str());
  if (s.dim % s.n_heads != 0)
    return bad("dim", std::to_string(s.dim),
               ("not a multiple of n_heads " + std::to_string(s.n_heads)).c_str());
  if (s.feature_layer < -1 || s.feature_layer > s.n_layers)
    return bad("feature_layer", std::to_string(s.feature_layer), "must be -1 or in [0, n_layers]");
  if (!(std::isfinite(s.eps) && s.eps > 0))
    return bad("eps", std::to_string(s.eps), "must be positive and finite");
  if (!dtype_known(static_cast<uint32_t>(s.type)))
    return bad("type", std::to_string(static_cast<uint32_t>(s.type)), "unknown weight type");
  if (s.type == DType::Q8_0) {  // every quantised row (ne[0]) must be whole 32-blocks
    const int32_t hidden = s.mm_hidden > 0 ? s.mm_hidden : s.projection_dim;
    if (s.patch_size % kQ8Block != 0)
      return bad("patch_size", std::to_string(s.patch_size), "must be a multiple of 32 for Q8_0");
    for (auto [f, v] : {std::pair<const char*, int32_t>{"dim", s.dim}, {"ffn", s.ffn}, {"mm_hidden", hidden}})
      if (v % kQ8Block != 0) return bad(f, std::to_string(v), "must be a multiple of 32 for Q8_0");
  }
  const long double params = static_cast<long double>(s.dim) * (4.0L * s.dim + 2.0L * s.ffn) * s.n_layers +
                             static_cast<long double>(s.image_size) * s.image_size * s.dim;
  if (params > 1e10L) return bad("n_layers", std::to_string(s.n_layers), "model too large");
  return Status::Ok();
}

Status write_test_clip_model(const ClipSpec& spec, const std::string& out_path) {
  CLEAVE_RETURN_IF_ERROR(validate_clip_spec(spec));
  GgufWriter w;
  w.set_string("general.architecture", "clip");
  w.set_string("general.name", spec.name);
  w.set_u32("general.alignment", 32);
  w.set_bool("clip.has_text_encoder", false);
  w.set_bool("clip.has_vision_encoder", true);
  w.set_bool("clip.has_llava_projector", true);
  w.set_string("clip.projector_type", "mlp");
  w.set_bool("clip.use_gelu", spec.use_gelu);
  w.set_u32("clip.vision.image_size", static_cast<uint32_t>(spec.image_size));
  w.set_u32("clip.vision.patch_size", static_cast<uint32_t>(spec.patch_size));
  w.set_u32("clip.vision.embedding_length", static_cast<uint32_t>(spec.dim));
  w.set_u32("clip.vision.feed_forward_length", static_cast<uint32_t>(spec.ffn));
  w.set_u32("clip.vision.block_count", static_cast<uint32_t>(spec.n_layers));
  w.set_u32("clip.vision.attention.head_count", static_cast<uint32_t>(spec.n_heads));
  w.set_f32("clip.vision.attention.layer_norm_epsilon", spec.eps);
  w.set_u32("clip.vision.projection_dim", static_cast<uint32_t>(spec.projection_dim));
  w.set_f32_array("clip.vision.image_mean", {spec.image_mean[0], spec.image_mean[1], spec.image_mean[2]});
  w.set_f32_array("clip.vision.image_std", {spec.image_std[0], spec.image_std[1], spec.image_std[2]});
  if (spec.feature_layer >= 0)  // llama.cpp writes a list of hidden-state indices
    w.set_i32_array("clip.vision.feature_layer", {spec.feature_layer});

  Gen g{spec.seed, w, {}};
  const DType t = spec.type;
  const int64_t dim = spec.dim, ffn = spec.ffn, p = spec.patch_size, proj = spec.projection_dim;
  const int64_t hidden = spec.mm_hidden > 0 ? spec.mm_hidden : proj;
  const int64_t side = spec.image_size / spec.patch_size;
  const int64_t n_pos = side * side + (spec.class_embd ? 1 : 0);
  auto fan = [](int64_t n) { return 1.0f / std::sqrt(static_cast<float>(n)); };
  auto norm = [&](const std::string& name) -> Status {
    CLEAVE_RETURN_IF_ERROR(g.add(name + ".weight", DType::F32, {dim}, 0.1f, 1.0f));
    return g.add(name + ".bias", DType::F32, {dim}, 0.1f);
  };
  auto linear = [&](const std::string& name, int64_t in, int64_t out) -> Status {
    CLEAVE_RETURN_IF_ERROR(g.add(name + ".weight", t, {in, out}, fan(in)));
    return g.add(name + ".bias", DType::F32, {out}, 0.1f);
  };
  CLEAVE_RETURN_IF_ERROR(g.add("v.patch_embd.weight", t, {p, p, 3, dim}, fan(3 * p * p)));
  if (spec.patch_bias) CLEAVE_RETURN_IF_ERROR(g.add("v.patch_embd.bias", DType::F32, {dim}, 0.1f));
  if (spec.class_embd) CLEAVE_RETURN_IF_ERROR(g.add("v.class_embd", DType::F32, {dim}, 0.1f));
  CLEAVE_RETURN_IF_ERROR(g.add("v.position_embd.weight", t, {dim, n_pos}, 0.5f));
  if (spec.pre_ln) CLEAVE_RETURN_IF_ERROR(norm("v.pre_ln"));
  for (int32_t l = 0; l < spec.n_layers; ++l) {
    const std::string pre = "v.blk." + std::to_string(l) + ".";
    CLEAVE_RETURN_IF_ERROR(norm(pre + "ln1"));
    CLEAVE_RETURN_IF_ERROR(linear(pre + "attn_q", dim, dim));
    CLEAVE_RETURN_IF_ERROR(linear(pre + "attn_k", dim, dim));
    CLEAVE_RETURN_IF_ERROR(linear(pre + "attn_v", dim, dim));
    CLEAVE_RETURN_IF_ERROR(linear(pre + "attn_out", dim, dim));
    CLEAVE_RETURN_IF_ERROR(norm(pre + "ln2"));
    CLEAVE_RETURN_IF_ERROR(linear(pre + "ffn_up", dim, ffn));
    CLEAVE_RETURN_IF_ERROR(linear(pre + "ffn_down", ffn, dim));
  }
  if (spec.post_ln) CLEAVE_RETURN_IF_ERROR(norm("v.post_ln"));
  CLEAVE_RETURN_IF_ERROR(linear("mm.0", dim, hidden));
  CLEAVE_RETURN_IF_ERROR(linear("mm.2", hidden, proj));
  return w.write(out_path);
}

}  // namespace cleave
