#include "model/clip.h"

#include <algorithm>
#include <cmath>
#include <new>
#include <string>

namespace cleave {
namespace {

std::string shape_str(const int64_t* ne, size_t n) {
  std::string s = "[";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

Status with_prefix(const Status& st) { return Status(st.code(), "clip: " + st.message()); }

// Binds tensors by name, checking shape and type.
class Binder {
 public:
  explicit Binder(const GgufFile& f) : f_(f) {}

  bool has(const std::string& name) const { return f_.find_tensor(name) != nullptr; }

  Result<const GgufTensorInfo*> find(const std::string& name, const std::vector<int64_t>& ne) {
    const GgufTensorInfo* t = f_.find_tensor(name);
    if (!t) return Status(Code::not_found, "clip: missing tensor '" + name + "'");
    bool same = t->n_dims == ne.size();
    for (size_t i = 0; same && i < ne.size(); ++i) same = t->ne[i] == ne[i];
    if (!same)
      return Status(Code::corruption, "clip: tensor '" + name + "' has shape " +
                                          shape_str(t->ne, t->n_dims) + ", expected " +
                                          shape_str(ne.data(), ne.size()));
    return t;
  }

  // Small tensors (norms, biases, embeddings) are copied out as floats.
  Result<std::vector<float>> floats(const std::string& name, const std::vector<int64_t>& ne) {
    auto t = find(name, ne);
    if (!t.ok()) return t.status();
    const WeightView w = f_.view(**t);
    std::vector<float> out(size_t(w.rows) * size_t(w.cols));
    for (int64_t r = 0; r < w.rows; ++r)
      dequantize_row(w.type, static_cast<const uint8_t*>(w.data) + size_t(r) * w.row_bytes, w.cols,
                     out.data() + size_t(r) * size_t(w.cols));
    return out;
  }

  Result<std::vector<float>> vector(const std::string& name, int64_t n) { return floats(name, {n}); }

  Result<WeightView> matrix(const std::string& name, int64_t cols, int64_t rows) {
    auto t = find(name, {cols, rows});
    if (!t.ok()) return t.status();
    return f_.view(**t);
  }

 private:
  const GgufFile& f_;
};

Result<int32_t> get_dim(const GgufFile& f, const std::string& key) {
  auto v = f.get_uint(key);
  if (!v.ok()) return with_prefix(v.status());
  if (*v == 0 || *v > (1u << 20))
    return Status(Code::corruption, "clip: " + key + " = " + std::to_string(*v) + " is out of range");
  return static_cast<int32_t>(*v);
}

Result<bool> get_flag(const GgufFile& f, const std::string& key, bool fallback) {
  auto v = f.get_bool(key);
  if (v.ok()) return *v;
  if (v.status().code() == Code::not_found) return fallback;
  return with_prefix(v.status());
}

Status get_rgb(const GgufFile& f, const std::string& key, float out[3], bool positive) {
  auto v = f.get_float_array(key);
  if (!v.ok()) return with_prefix(v.status());
  if (v->size() != 3)
    return Status(Code::corruption, "clip: " + key + " has " + std::to_string(v->size()) +
                                        " values, expected 3 (R, G, B)");
  for (int c = 0; c < 3; ++c) {
    const float x = (*v)[size_t(c)];
    if (!std::isfinite(x) || (positive && !(x > 0)))
      return Status(Code::corruption, "clip: " + key + "[" + std::to_string(c) + "] = " +
                                          std::to_string(x) + " is not " +
                                          (positive ? "positive and finite" : "finite"));
    out[c] = x;
  }
  return Status::Ok();
}

#define CLEAVE_ASSIGN(lhs, expr)      \
  do {                                \
    auto _r = (expr);                 \
    if (!_r.ok()) return _r.status(); \
    lhs = std::move(*_r);             \
  } while (0)

}  // namespace

Result<std::unique_ptr<ClipModel>> ClipModel::load(std::shared_ptr<const GgufFile> file) {
  if (!file) return Status(Code::invalid_argument, "clip: no model file");
  const GgufFile& f = *file;
  auto arch = f.get_string("general.architecture");
  if (!arch.ok()) return with_prefix(arch.status());
  if (*arch != "clip")
    return Status(Code::unsupported, "clip: architecture '" + *arch + "' is not a clip vision encoder");
  auto has_vision = f.get_bool("clip.has_vision_encoder");
  if (!has_vision.ok()) return with_prefix(has_vision.status());
  if (!*has_vision)
    return Status(Code::unsupported, "clip: clip.has_vision_encoder is false (text encoders are not supported)");
  auto proj_type = f.get_string("clip.projector_type");
  if (proj_type.ok()) {
    if (*proj_type != "mlp")
      return Status(Code::unsupported, "clip: clip.projector_type '" + *proj_type +
                                           "' is not supported (supported: mlp)");
  } else if (proj_type.status().code() != Code::not_found) {
    return with_prefix(proj_type.status());  // absent: llama.cpp's default, mlp
  }

  auto m = std::unique_ptr<ClipModel>(new ClipModel());
  m->file_ = file;
  ClipConfig& c = m->config_;
  CLEAVE_ASSIGN(c.image_size, get_dim(f, "clip.vision.image_size"));
  CLEAVE_ASSIGN(c.patch_size, get_dim(f, "clip.vision.patch_size"));
  CLEAVE_ASSIGN(c.dim, get_dim(f, "clip.vision.embedding_length"));
  CLEAVE_ASSIGN(c.ffn, get_dim(f, "clip.vision.feed_forward_length"));
  CLEAVE_ASSIGN(c.n_layers, get_dim(f, "clip.vision.block_count"));
  CLEAVE_ASSIGN(c.n_heads, get_dim(f, "clip.vision.attention.head_count"));
  // CLIP's own visual projection size: llama.cpp's converter writes it (768
  // for CLIP-L), but the MLP projector ignores it; the output size is mm.2's.
  if (f.find("clip.vision.projection_dim"))
    CLEAVE_ASSIGN(c.clip_projection_dim, get_dim(f, "clip.vision.projection_dim"));
  auto eps = f.get_float("clip.vision.attention.layer_norm_epsilon");
  if (!eps.ok()) return with_prefix(eps.status());
  if (!(std::isfinite(*eps) && *eps > 0 && *eps < 1))
    return Status(Code::corruption, "clip: clip.vision.attention.layer_norm_epsilon = " +
                                        std::to_string(*eps) + " is not in (0, 1)");
  c.eps = float(*eps);
  CLEAVE_RETURN_IF_ERROR(get_rgb(f, "clip.vision.image_mean", c.image_mean, false));
  CLEAVE_RETURN_IF_ERROR(get_rgb(f, "clip.vision.image_std", c.image_std, true));
  CLEAVE_ASSIGN(c.use_gelu, get_flag(f, "clip.use_gelu", false));

  if (c.image_size % c.patch_size != 0)
    return Status(Code::corruption, "clip: image_size " + std::to_string(c.image_size) +
                                        " is not a multiple of patch_size " + std::to_string(c.patch_size));
  if (c.image_size > 8192)
    return Status(Code::corruption, "clip: image_size " + std::to_string(c.image_size) + " is over 8192");
  if (c.dim % c.n_heads != 0)
    return Status(Code::corruption, "clip: embedding_length " + std::to_string(c.dim) +
                                        " is not a multiple of head_count " + std::to_string(c.n_heads));
  c.head_dim = c.dim / c.n_heads;
  const int32_t side = c.image_size / c.patch_size;
  c.n_patches = side * side;

  // llama.cpp's convention: a hidden-state index h (0 = the encoder input
  // after pre_ln, h = the output of block h - 1), so h blocks run. Default
  // n_layers - 1: the penultimate block's output, as llama.cpp runs LLaVA
  // files (LLaVA's select_layer -2).
  const std::string fl_key = "clip.vision.feature_layer";
  c.feature_layer = c.n_layers - 1;
  if (const GgufKv* fl = f.find(fl_key)) {
    int64_t h = 0;
    if (fl->value.type == GgufType::ARRAY) {
      auto list = f.get_int_array(fl_key);
      if (!list.ok()) return with_prefix(list.status());
      if (list->size() != 1)
        return Status(Code::unsupported, "clip: " + fl_key + " lists " + std::to_string(list->size()) +
                                             " layers; only one feature layer is supported (no stacking)");
      h = (*list)[0];
    } else {
      auto v = f.get_int(fl_key);
      if (!v.ok()) return with_prefix(v.status());
      h = *v;
    }
    if (h < 0 || h > c.n_layers)
      return Status(Code::corruption, "clip: " + fl_key + " = " + std::to_string(h) +
                                          " is not a hidden-state index in [0, " + std::to_string(c.n_layers) +
                                          "]");
    c.feature_layer = int32_t(h);
  }

  Binder b(f);
  const int64_t dim = c.dim, p = c.patch_size;
  {
    auto t = b.find("v.patch_embd.weight", {p, p, 3, dim});
    if (!t.ok()) return t.status();
    // The conv kernel [out][in][ky][kx] read as a dim x (3 * p * p) matrix.
    WeightView w = f.view(**t);
    w.cols = 3 * p * p;
    w.rows = dim;
    w.row_bytes = dtype_row_bytes(w.type, w.cols);
    m->patch_embd_ = w;
  }
  if (b.has("v.patch_embd.bias")) CLEAVE_ASSIGN(m->patch_b_, b.vector("v.patch_embd.bias", dim));
  c.has_class_embd = b.has("v.class_embd");
  if (c.has_class_embd) CLEAVE_ASSIGN(m->class_embd_, b.vector("v.class_embd", dim));
  c.n_positions = c.n_patches + (c.has_class_embd ? 1 : 0);
  CLEAVE_ASSIGN(m->position_embd_, b.floats("v.position_embd.weight", {dim, c.n_positions}));
  c.has_pre_ln = b.has("v.pre_ln.weight") || b.has("v.pre_ln.bias");
  if (c.has_pre_ln) {
    CLEAVE_ASSIGN(m->pre_ln_w_, b.vector("v.pre_ln.weight", dim));
    CLEAVE_ASSIGN(m->pre_ln_b_, b.vector("v.pre_ln.bias", dim));
  }
  const bool has_post_ln = b.has("v.post_ln.weight") || b.has("v.post_ln.bias");
  if (has_post_ln) {
    CLEAVE_ASSIGN(m->post_ln_w_, b.vector("v.post_ln.weight", dim));
    CLEAVE_ASSIGN(m->post_ln_b_, b.vector("v.post_ln.bias", dim));
  }
  c.use_post_ln = has_post_ln && c.feature_layer == c.n_layers;

  // Legacy fc1/fc2 naming: ffn_down holding the dim -> ffn matrix.
  if (const GgufTensorInfo* down = f.find_tensor("v.blk.0.ffn_down.weight"))
    c.ffn_swapped = c.ffn != c.dim && down->n_dims == 2 && down->ne[0] == dim;
  const std::string up_name = c.ffn_swapped ? "ffn_down" : "ffn_up";
  const std::string down_name = c.ffn_swapped ? "ffn_up" : "ffn_down";

  // Every block is checked; only those that run are kept.
  m->layers_.resize(size_t(c.feature_layer));
  for (int32_t i = 0; i < c.n_layers; ++i) {
    ClipLayer scratch;
    ClipLayer& l = i < c.feature_layer ? m->layers_[size_t(i)] : scratch;
    const std::string pre = "v.blk." + std::to_string(i) + ".";
    CLEAVE_ASSIGN(l.ln1_w, b.vector(pre + "ln1.weight", dim));
    CLEAVE_ASSIGN(l.ln1_b, b.vector(pre + "ln1.bias", dim));
    CLEAVE_ASSIGN(l.q, b.matrix(pre + "attn_q.weight", dim, dim));
    CLEAVE_ASSIGN(l.q_b, b.vector(pre + "attn_q.bias", dim));
    CLEAVE_ASSIGN(l.k, b.matrix(pre + "attn_k.weight", dim, dim));
    CLEAVE_ASSIGN(l.k_b, b.vector(pre + "attn_k.bias", dim));
    CLEAVE_ASSIGN(l.v, b.matrix(pre + "attn_v.weight", dim, dim));
    CLEAVE_ASSIGN(l.v_b, b.vector(pre + "attn_v.bias", dim));
    CLEAVE_ASSIGN(l.o, b.matrix(pre + "attn_out.weight", dim, dim));
    CLEAVE_ASSIGN(l.o_b, b.vector(pre + "attn_out.bias", dim));
    CLEAVE_ASSIGN(l.ln2_w, b.vector(pre + "ln2.weight", dim));
    CLEAVE_ASSIGN(l.ln2_b, b.vector(pre + "ln2.bias", dim));
    CLEAVE_ASSIGN(l.up, b.matrix(pre + up_name + ".weight", dim, c.ffn));
    CLEAVE_ASSIGN(l.up_b, b.vector(pre + up_name + ".bias", c.ffn));
    CLEAVE_ASSIGN(l.down, b.matrix(pre + down_name + ".weight", c.ffn, dim));
    CLEAVE_ASSIGN(l.down_b, b.vector(pre + down_name + ".bias", dim));
    if (i == 0) c.weight_type = l.q.type;
  }

  const GgufTensorInfo* mm0 = f.find_tensor("mm.0.weight");
  if (!mm0) return Status(Code::not_found, "clip: missing tensor 'mm.0.weight'");
  if (mm0->n_dims != 2 || mm0->ne[1] < 1 || mm0->ne[1] > (1 << 20))
    return Status(Code::corruption, "clip: tensor 'mm.0.weight' has shape " +
                                        shape_str(mm0->ne, mm0->n_dims) + ", expected [" +
                                        std::to_string(dim) + ", hidden]");
  c.mm_hidden = int32_t(mm0->ne[1]);
  CLEAVE_ASSIGN(m->mm0_, b.matrix("mm.0.weight", dim, c.mm_hidden));
  CLEAVE_ASSIGN(m->mm0_b_, b.vector("mm.0.bias", c.mm_hidden));
  const GgufTensorInfo* mm2 = f.find_tensor("mm.2.weight");
  if (!mm2) return Status(Code::not_found, "clip: missing tensor 'mm.2.weight'");
  if (mm2->n_dims != 2 || mm2->ne[1] < 1 || mm2->ne[1] > (1 << 20))
    return Status(Code::corruption, "clip: tensor 'mm.2.weight' has shape " +
                                        shape_str(mm2->ne, mm2->n_dims) + ", expected [" +
                                        std::to_string(c.mm_hidden) + ", n_embd]");
  c.projection_dim = int32_t(mm2->ne[1]);
  CLEAVE_ASSIGN(m->mm2_, b.matrix("mm.2.weight", c.mm_hidden, c.projection_dim));
  CLEAVE_ASSIGN(m->mm2_b_, b.vector("mm.2.bias", c.projection_dim));
  return m;
}

// The activations: host vectors (per thread, see encode()) for a backend
// whose memory is the host's, else buffers in the backend's memory.
struct ClipModel::Buffers {
  Buffers() = default;
  explicit Buffers(Backend* be) : device(be) {}
  float* get(int i, int64_t floats) {
    if (!device) {
      host[i].resize(size_t(floats));
      return host[i].data();
    }
    if (!dev[i]) dev[i] = std::make_unique<BackendBuffer<float>>(*device);
    return dev[i]->grow(size_t(floats));
  }
  Backend* device = nullptr;
  std::vector<float> host[12];
  std::unique_ptr<BackendBuffer<float>> dev[12];
  std::vector<float> patches;  // host: the pixels rearranged, before the upload
};

Status ClipModel::encode(Backend& backend, const float* pixels, int64_t n, float* out) const {
  if (n < 1 || n > (1 << 16) || pixels == nullptr || out == nullptr)
    return Status(Code::invalid_argument, "clip: encode needs 1..65536 images and buffers (got " +
                                              std::to_string(n) + ")");
  const bool host = backend.caps().host_memory;
  if (placed_ ? placed_ != &backend : !host)
    return Status(Code::invalid_argument, std::string("clip: the weights are ") +
                                              (placed_ ? "placed on another backend" : "on the host") +
                                              "; encode on the " + backend.caps().name +
                                              " backend needs ClipModel::on() for it");
  auto check = [&](const WeightView& w, const char* what) -> Status {
    if (!backend.supports(Op::matmul, w.type))
      return Status(Code::unsupported, std::string("clip: backend ") + backend.caps().name +
                                           " has no matmul for " + dtype_name(w.type) + " (" + what + ")");
    return Status::Ok();
  };
  CLEAVE_RETURN_IF_ERROR(check(patch_embd_, "v.patch_embd.weight"));
  CLEAVE_RETURN_IF_ERROR(check(mm0_, "mm.0.weight"));
  CLEAVE_RETURN_IF_ERROR(check(mm2_, "mm.2.weight"));
  for (const ClipLayer& l : layers_)
    for (const WeightView* w : {&l.q, &l.k, &l.v, &l.o, &l.up, &l.down})
      CLEAVE_RETURN_IF_ERROR(check(*w, "v.blk.*"));
  // The backend's own form of each matrix (the CPU backend's panels), made
  // on the first call and found again on later ones.
  if (host) {
    for (const WeightView* w : {&patch_embd_, &mm0_, &mm2_}) backend.prepare(*w);
    for (const ClipLayer& l : layers_)
      for (const WeightView* w : {&l.q, &l.k, &l.v, &l.o, &l.up, &l.down}) backend.prepare(*w);
  }

  // Scratch grows with the batch: a batch too large for memory is an error,
  // not an exception out of the library.
  try {
    if (host) {
      // Kept per thread and only grown: fresh buffers of a large batch come
      // from mmap and page-fault on every call, which made one call of 16
      // images 4x slower than 16 calls of one (bench --encoder).
      thread_local Buffers scratch;
      run(backend, scratch, pixels, n, out);
    } else {
      Buffers scratch(&backend);
      run(backend, scratch, pixels, n, out);
    }
  } catch (const std::bad_alloc&) {
    return Status(Code::out_of_memory, "clip: no memory for the scratch of " + std::to_string(n) +
                                           " images");
  }
  return Status::Ok();
}

Result<std::unique_ptr<ClipModel>> ClipModel::on(Backend& backend) const {
  auto m = std::unique_ptr<ClipModel>(new ClipModel(*this));
  m->placed_ = &backend;
  m->placed_vectors_.clear();
  m->copies_ = std::make_shared<WeightCopies>(backend);
  WeightCopies& copies = *m->copies_;
  auto in = [&](Status status) {
    return status.ok() ? status : Status(status.code(), "clip: " + status.message());
  };
  auto matrix = [&](WeightView& w, const std::string& what) {
    return in(copies.move_in(w.data, size_t(w.rows) * w.row_bytes, what));
  };
  auto vector = [&](const std::vector<float>& v, const std::string& what) -> Status {
    if (v.empty()) return Status::Ok();
    const float* p = v.data();
    CLEAVE_RETURN_IF_ERROR(in(copies.move_in(p, v.size() * sizeof(float), what)));
    m->placed_vectors_[v.data()] = p;
    return Status::Ok();
  };
  CLEAVE_RETURN_IF_ERROR(matrix(m->patch_embd_, "v.patch_embd.weight"));
  CLEAVE_RETURN_IF_ERROR(matrix(m->mm0_, "mm.0.weight"));
  CLEAVE_RETURN_IF_ERROR(matrix(m->mm2_, "mm.2.weight"));
  for (const auto* v : {&m->patch_b_, &m->class_embd_, &m->position_embd_, &m->pre_ln_w_, &m->pre_ln_b_,
                        &m->post_ln_w_, &m->post_ln_b_, &m->mm0_b_, &m->mm2_b_})
    CLEAVE_RETURN_IF_ERROR(vector(*v, "an encoder vector"));
  for (size_t i = 0; i < m->layers_.size(); ++i) {
    ClipLayer& l = m->layers_[i];
    const std::string p = "v.blk." + std::to_string(i) + ".";
    for (auto [w, name] : {std::pair{&l.q, "attn_q"}, std::pair{&l.k, "attn_k"}, std::pair{&l.v, "attn_v"},
                           std::pair{&l.o, "attn_out"}, std::pair{&l.up, "ffn_up"},
                           std::pair{&l.down, "ffn_down"}})
      CLEAVE_RETURN_IF_ERROR(matrix(*w, p + name + ".weight"));
    for (const auto* v : {&l.ln1_w, &l.ln1_b, &l.ln2_w, &l.ln2_b, &l.q_b, &l.k_b, &l.v_b, &l.o_b, &l.up_b,
                          &l.down_b})
      CLEAVE_RETURN_IF_ERROR(vector(*v, p + "norm or bias"));
  }
  return m;
}

const float* ClipModel::at(const std::vector<float>& v) const {
  if (!placed_ || v.empty()) return v.data();
  return placed_vectors_.at(v.data());
}

void ClipModel::run(Backend& backend, Buffers& buf, const float* pixels, int64_t n, float* out) const {
  const ClipConfig& c = config_;
  const int64_t dim = c.dim, p = c.patch_size, side = c.image_size / c.patch_size;
  const int64_t np = c.n_patches, T = c.n_positions, rows = n * T, pdim = 3 * p * p;
  const int64_t S = c.image_size;
  const int64_t first_patch = c.has_class_embd ? 1 : 0;
  const bool host = buf.device == nullptr;
  // x[r] += b on each of `rows` rows (b may be empty: no bias).
  auto add_bias = [&](float* x, int64_t nrows, const std::vector<float>& b) {
    if (b.empty() || nrows <= 0) return;
    backend.add(x, at(b), nrows * int64_t(b.size()), int64_t(b.size()), x);
  };
  auto layer_norm = [&](const float* x, const std::vector<float>& w, const std::vector<float>& b, float* y) {
    backend.layer_norm(x, at(w), at(b), rows, dim, c.eps, y);
  };

  // Patch embedding: one row of 3 * p * p pixels per patch, (c, ky, kx)
  // order, arranged on the host (the image is the input).
  buf.patches.resize(size_t(n * np * pdim));
  for (int64_t img = 0; img < n; ++img) {
    const float* px = pixels + img * 3 * S * S;
    for (int64_t py = 0; py < side; ++py)
      for (int64_t pxi = 0; pxi < side; ++pxi) {
        float* dst = buf.patches.data() + ((img * np) + py * side + pxi) * pdim;
        for (int64_t ch = 0; ch < 3; ++ch)
          for (int64_t ky = 0; ky < p; ++ky)
            for (int64_t kx = 0; kx < p; ++kx)
              *dst++ = px[(ch * S + py * p + ky) * S + pxi * p + kx];
      }
  }
  const float* patches = buf.patches.data();
  if (!host) {
    float* dev = buf.get(0, n * np * pdim);
    backend.upload(dev, patches, buf.patches.size() * sizeof(float));
    patches = dev;
  }
  float* pe = buf.get(1, n * np * dim);
  backend.matmul(patch_embd_, patches, n * np, pe);
  add_bias(pe, n * np, patch_b_);

  float* x = buf.get(2, rows * dim);
  for (int64_t img = 0; img < n; ++img) {
    float* xi = x + img * T * dim;
    if (c.has_class_embd) backend.copy(xi, at(class_embd_), size_t(dim) * sizeof(float));
    backend.copy(xi + first_patch * dim, pe + img * np * dim, size_t(np * dim) * sizeof(float));
  }
  backend.add(x, at(position_embd_), rows * dim, T * dim, x);
  if (c.has_pre_ln) layer_norm(x, pre_ln_w_, pre_ln_b_, x);

  float* h = buf.get(3, rows * dim);
  float* q = buf.get(4, rows * dim);
  float* k = buf.get(5, rows * dim);
  float* v = buf.get(6, rows * dim);
  float* att = buf.get(7, rows * dim);
  float* tmp = buf.get(8, rows * dim);
  float* ff = buf.get(9, rows * c.ffn);
  const float scale = 1.0f / std::sqrt(float(c.head_dim));
  for (const ClipLayer& l : layers_) {
    layer_norm(x, l.ln1_w, l.ln1_b, h);
    backend.matmul(l.q, h, rows, q);
    backend.matmul(l.k, h, rows, k);
    backend.matmul(l.v, h, rows, v);
    add_bias(q, rows, l.q_b);
    add_bias(k, rows, l.k_b);
    add_bias(v, rows, l.v_b);
    // Full attention within each image and head; each image alone, so the
    // result does not depend on the batch.
    backend.full_attention(q, k, v, n, T, c.n_heads, c.head_dim, dim, scale, att);
    backend.matmul(l.o, att, rows, tmp);
    add_bias(tmp, rows, l.o_b);
    backend.add(x, tmp, rows * dim, rows * dim, x);

    layer_norm(x, l.ln2_w, l.ln2_b, h);
    backend.matmul(l.up, h, rows, ff);
    add_bias(ff, rows, l.up_b);
    backend.gelu(ff, rows * c.ffn, c.use_gelu ? Gelu::tanh : Gelu::quick, ff);
    backend.matmul(l.down, ff, rows, tmp);
    add_bias(tmp, rows, l.down_b);
    backend.add(x, tmp, rows * dim, rows * dim, x);
  }
  if (c.use_post_ln) layer_norm(x, post_ln_w_, post_ln_b_, x);

  // Projector over the patch tokens (class token dropped).
  float* feats = x;
  if (first_patch) {
    feats = buf.get(10, n * np * dim);
    for (int64_t img = 0; img < n; ++img)
      backend.copy(feats + img * np * dim, x + (img * T + first_patch) * dim, size_t(np * dim) * sizeof(float));
  }
  float* hidden = buf.get(11, n * np * c.mm_hidden);
  backend.matmul(mm0_, feats, n * np, hidden);
  add_bias(hidden, n * np, mm0_b_);
  backend.gelu(hidden, n * np * c.mm_hidden, Gelu::tanh, hidden);
  float* y = host ? out : buf.get(0, n * np * c.projection_dim);  // the patches are used up
  backend.matmul(mm2_, hidden, n * np, y);
  add_bias(y, n * np, mm2_b_);
  if (!host) backend.download(out, y, size_t(n * np * c.projection_dim) * sizeof(float));
}

}  // namespace cleave
