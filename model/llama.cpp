#include "model/llama.h"

#include "storage/block.h"  // checksum_bytes

#include <string>

namespace cleave {
namespace {

std::string shape_str(const GgufTensorInfo& t) {
  std::string s = "[";
  for (uint32_t i = 0; i < t.n_dims; ++i) s += (i ? ", " : "") + std::to_string(t.ne[i]);
  return s + "]";
}

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

// Binds tensors by name with their expected shapes.
class Binder {
 public:
  explicit Binder(const GgufFile& f) : f_(f) {}

  Result<const GgufTensorInfo*> find(const std::string& name, std::vector<int64_t> ne) {
    const GgufTensorInfo* t = f_.find_tensor(name);
    if (!t) return Status(Code::not_found, "model: missing tensor '" + name + "'");
    bool same = t->n_dims == ne.size();
    for (size_t i = 0; same && i < ne.size(); ++i) same = t->ne[i] == ne[i];
    if (!same)
      return Status(Code::corruption, "model: tensor '" + name + "' has shape " + shape_str(*t) +
                                          ", expected " + shape_str(ne));
    return t;
  }

  Result<const float*> vector(const std::string& name, int64_t n) {
    auto t = find(name, {n});
    if (!t.ok()) return t.status();
    if ((*t)->type != DType::F32)
      return Status(Code::unsupported, "model: tensor '" + name + "' has type " +
                                           dtype_name((*t)->type) + ", norms must be F32");
    return reinterpret_cast<const float*>(f_.tensor_data(**t));
  }

  Result<WeightView> matrix(const std::string& name, int64_t cols, int64_t rows) {
    auto t = find(name, {cols, rows});
    if (!t.ok()) return t.status();
    return f_.view(**t);
  }

  // Stacked experts [cols, rows, n]: one view per expert.
  Result<std::vector<WeightView>> experts(const std::string& name, int64_t cols, int64_t rows,
                                          int64_t n) {
    auto t = find(name, {cols, rows, n});
    if (!t.ok()) return t.status();
    WeightView all = f_.view(**t);
    std::vector<WeightView> out(n);
    for (int64_t e = 0; e < n; ++e) {
      out[e] = all;
      out[e].rows = rows;
      out[e].data = static_cast<const uint8_t*>(all.data) + e * rows * all.row_bytes;
    }
    return out;
  }

 private:
  const GgufFile& f_;
};

Result<int32_t> get_dim(const GgufFile& f, const std::string& key, bool required = true,
                        int32_t fallback = 0) {
  auto v = f.get_uint(key);
  if (!v.ok()) {
    if (!required && v.status().code() == Code::not_found) return fallback;
    return Status(v.status().code(), "model: " + v.status().message());
  }
  if (*v == 0 || *v > (1u << 24))
    return Status(Code::corruption,
                  "model: " + key + " = " + std::to_string(*v) + " is out of range");
  return static_cast<int32_t>(*v);
}

}  // namespace

#define CLEAVE_ASSIGN(lhs, expr)           \
  do {                                     \
    auto _r = (expr);                      \
    if (!_r.ok()) return _r.status();      \
    lhs = std::move(*_r);                  \
  } while (0)

Result<std::unique_ptr<LlamaModel>> LlamaModel::load(std::shared_ptr<const GgufFile> file) {
  const GgufFile& f = *file;
  auto arch = f.get_string("general.architecture");
  if (!arch.ok()) return Status(arch.status().code(), "model: " + arch.status().message());
  if (*arch != "llama")
    return Status(Code::unsupported, "model: unknown architecture '" + *arch +
                                         "' (supported: llama)");

  auto m = std::unique_ptr<LlamaModel>(new LlamaModel());
  m->file_ = file;
  LlamaConfig& c = m->config_;
  CLEAVE_ASSIGN(c.dim, get_dim(f, "llama.embedding_length"));
  CLEAVE_ASSIGN(c.n_layers, get_dim(f, "llama.block_count"));
  CLEAVE_ASSIGN(c.n_heads, get_dim(f, "llama.attention.head_count"));
  CLEAVE_ASSIGN(c.n_kv_heads, get_dim(f, "llama.attention.head_count_kv", false, c.n_heads));
  CLEAVE_ASSIGN(c.ffn, get_dim(f, "llama.feed_forward_length"));
  CLEAVE_ASSIGN(c.context, get_dim(f, "llama.context_length"));
  auto experts = f.get_uint("llama.expert_count");
  if (experts.ok() && *experts > 0) {
    CLEAVE_ASSIGN(c.n_experts, get_dim(f, "llama.expert_count"));
    CLEAVE_ASSIGN(c.n_experts_used, get_dim(f, "llama.expert_used_count"));
  } else if (!experts.ok() && experts.status().code() != Code::not_found) {
    return Status(experts.status().code(), "model: " + experts.status().message());
  }
  auto base = f.get_float("llama.rope.freq_base");
  if (base.ok()) c.rope_base = static_cast<float>(*base);
  else if (base.status().code() != Code::not_found) return base.status();
  auto eps = f.get_float("llama.attention.layer_norm_rms_epsilon");
  if (eps.ok()) c.rms_eps = static_cast<float>(*eps);
  else if (eps.status().code() != Code::not_found) return eps.status();

  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || (c.dim / c.n_heads) % 2 != 0)
    return Status(Code::corruption, "model: embedding_length " + std::to_string(c.dim) +
                                        ", head_count " + std::to_string(c.n_heads) +
                                        ", head_count_kv " + std::to_string(c.n_kv_heads) +
                                        " do not give whole, even heads");
  if (c.n_experts > 0 && (c.n_experts_used < 1 || c.n_experts_used > c.n_experts))
    return Status(Code::corruption, "model: expert_used_count " +
                                        std::to_string(c.n_experts_used) + " not in [1, " +
                                        std::to_string(c.n_experts) + "]");
  c.head_dim = c.dim / c.n_heads;
  if (!(c.rms_eps > 0.f) || !(c.rope_base > 0.f))
    return Status(Code::corruption, "model: rms epsilon and rope base must be positive");

  const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
  if (!embd) return Status(Code::not_found, "model: missing tensor 'token_embd.weight'");
  c.n_vocab = static_cast<int32_t>(embd->ne[1]);

  Binder b(f);
  const int64_t q_dim = int64_t(c.n_heads) * c.head_dim, kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  CLEAVE_ASSIGN(m->token_embd_, b.matrix("token_embd.weight", c.dim, c.n_vocab));
  CLEAVE_ASSIGN(m->output_norm_, b.vector("output_norm.weight", c.dim));
  if (f.find_tensor("output.weight")) {
    CLEAVE_ASSIGN(m->output_, b.matrix("output.weight", c.dim, c.n_vocab));
  } else {
    m->output_ = m->token_embd_;
    c.tied_output = true;
  }
  m->layers_.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LlamaLayer& l = m->layers_[i];
    const std::string p = "blk." + std::to_string(i) + ".";
    CLEAVE_ASSIGN(l.attn_norm, b.vector(p + "attn_norm.weight", c.dim));
    CLEAVE_ASSIGN(l.wq, b.matrix(p + "attn_q.weight", c.dim, q_dim));
    CLEAVE_ASSIGN(l.wk, b.matrix(p + "attn_k.weight", c.dim, kv_dim));
    CLEAVE_ASSIGN(l.wv, b.matrix(p + "attn_v.weight", c.dim, kv_dim));
    CLEAVE_ASSIGN(l.wo, b.matrix(p + "attn_output.weight", q_dim, c.dim));
    CLEAVE_ASSIGN(l.ffn_norm, b.vector(p + "ffn_norm.weight", c.dim));
    if (c.n_experts == 0) {
      CLEAVE_ASSIGN(l.gate, b.matrix(p + "ffn_gate.weight", c.dim, c.ffn));
      CLEAVE_ASSIGN(l.up, b.matrix(p + "ffn_up.weight", c.dim, c.ffn));
      CLEAVE_ASSIGN(l.down, b.matrix(p + "ffn_down.weight", c.ffn, c.dim));
    } else {
      CLEAVE_ASSIGN(l.router, b.matrix(p + "ffn_gate_inp.weight", c.dim, c.n_experts));
      CLEAVE_ASSIGN(l.gate_exps, b.experts(p + "ffn_gate_exps.weight", c.dim, c.ffn, c.n_experts));
      CLEAVE_ASSIGN(l.up_exps, b.experts(p + "ffn_up_exps.weight", c.dim, c.ffn, c.n_experts));
      CLEAVE_ASSIGN(l.down_exps, b.experts(p + "ffn_down_exps.weight", c.ffn, c.dim, c.n_experts));
    }
  }
  return m;
}

uint64_t LlamaModel::weight_bytes_per_token() const {
  const LlamaConfig& c = config_;
  auto bytes = [](const WeightView& w) { return uint64_t(w.rows) * w.row_bytes; };
  uint64_t total = token_embd_.row_bytes + bytes(output_) + uint64_t(c.dim) * 4;
  for (const LlamaLayer& l : layers_) {
    total += bytes(l.wq) + bytes(l.wk) + bytes(l.wv) + bytes(l.wo) + 2ull * c.dim * 4;
    if (c.n_experts == 0) {
      total += bytes(l.gate) + bytes(l.up) + bytes(l.down);
    } else {
      total += bytes(l.router) + uint64_t(c.n_experts_used) *
                                     (bytes(l.gate_exps[0]) + bytes(l.up_exps[0]) +
                                      bytes(l.down_exps[0]));
    }
  }
  return total;
}

uint64_t LlamaModel::n_params() const {
  uint64_t n = 0;
  for (const GgufTensorInfo& t : file_->tensors()) n += uint64_t(t.n_elements());
  return n;
}

bool LlamaModel::multiplies_type(DType t) const {
  if (output_.type == t) return true;
  for (const LlamaLayer& l : layers_) {
    for (const WeightView* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down, &l.router})
      if (w->data && w->type == t) return true;
    for (const auto* e : {&l.gate_exps, &l.up_exps, &l.down_exps})
      if (!e->empty() && (*e)[0].type == t) return true;
  }
  return false;
}

void LlamaModel::prepare(Backend& backend, int32_t first, int32_t last, Matrices which,
                         bool output) const {
  if (output) prepare_one(backend, output_);
  for (int32_t i = first; i <= last; ++i) {
    const LlamaLayer& l = layers_[size_t(i)];
    if (which == Matrices::dense) {
      for (const WeightView* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down, &l.router})
        if (w->data) prepare_one(backend, *w);
    } else {
      for (const auto* e : {&l.gate_exps, &l.up_exps, &l.down_exps})
        for (const WeightView& w : *e) prepare_one(backend, w);
    }
  }
}

void LlamaModel::prepare_one(Backend& backend, const WeightView& w) const {
  // A backend that keeps its own copy (the CPU backend's panels) no longer
  // reads the file's pages: they go at once, so the peak RSS is not file +
  // copy (a later read faults them back in from the file). Never the
  // embedding table's (embed reads its rows), even when the output shares it.
  if (backend.prepare(w) && w.data != token_embd_.data)
    file_->release_pages(w.data, size_t(w.rows) * w.row_bytes);
}

Status check_compute(Compute compute, const LlamaModel& model, const char* who) {
  if (compute == Compute::exact || model.multiplies_type(DType::Q8_0)) return Status::Ok();
  return Status(Code::invalid_argument,
                std::string(who) + ": compute int8 needs Q8_0 weights; this model's matrices are " +
                    dtype_name(model.layer(0).wq.type));
}

uint64_t compute_fingerprint(uint64_t file_fingerprint, Compute compute) {
  if (compute == Compute::exact) return file_fingerprint;
  const uint64_t tag[2] = {file_fingerprint, 0x696e7438ull};  // "int8"
  return checksum_bytes(reinterpret_cast<const uint8_t*>(tag), sizeof tag);
}

}  // namespace cleave

namespace cleave {

Result<std::unique_ptr<WeightCopies>> LlamaModel::upload(Backend& backend, int32_t first,
                                                         int32_t last, bool output) {
  auto copies = std::make_unique<WeightCopies>(backend);
  const size_t norm_bytes = size_t(config_.dim) * sizeof(float);
  auto in = [&](Status status) {
    return status.ok() ? status : Status(status.code(), "model: " + status.message());
  };
  auto matrix = [&](WeightView& w, const std::string& what) {
    return in(copies->move_in(w.data, size_t(w.rows) * w.row_bytes, what));
  };
  const bool tied = output_.data == token_embd_.data;
  CLEAVE_RETURN_IF_ERROR(matrix(token_embd_, "token_embd.weight"));
  if (output) {
    CLEAVE_RETURN_IF_ERROR(in(copies->move_in(output_norm_, norm_bytes, "output_norm.weight")));
    if (tied) output_.data = token_embd_.data;
    else CLEAVE_RETURN_IF_ERROR(matrix(output_, "output.weight"));
  }
  for (int32_t i = first; i <= last; ++i) {
    LlamaLayer& l = layers_[size_t(i)];
    const std::string p = "blk." + std::to_string(i) + ".";
    CLEAVE_RETURN_IF_ERROR(in(copies->move_in(l.attn_norm, norm_bytes, p + "attn_norm.weight")));
    CLEAVE_RETURN_IF_ERROR(in(copies->move_in(l.ffn_norm, norm_bytes, p + "ffn_norm.weight")));
    const std::pair<WeightView*, const char*> mats[] = {
        {&l.wq, "attn_q"},    {&l.wk, "attn_k"}, {&l.wv, "attn_v"},    {&l.wo, "attn_output"},
        {&l.gate, "ffn_gate"}, {&l.up, "ffn_up"}, {&l.down, "ffn_down"}, {&l.router, "ffn_gate_inp"}};
    for (const auto& [w, name] : mats)
      if (w->data) CLEAVE_RETURN_IF_ERROR(matrix(*w, p + name + ".weight"));
    // Stacked experts: one copy of each stack, the per-expert views into it.
    for (auto [views, name] : {std::pair{&l.gate_exps, "ffn_gate_exps"}, std::pair{&l.up_exps, "ffn_up_exps"},
                               std::pair{&l.down_exps, "ffn_down_exps"}}) {
      if (views->empty()) continue;
      const size_t per = size_t((*views)[0].rows) * (*views)[0].row_bytes;
      const void* stack = (*views)[0].data;
      CLEAVE_RETURN_IF_ERROR(in(copies->move_in(stack, per * views->size(), p + name + ".weight")));
      for (size_t e = 0; e < views->size(); ++e)
        (*views)[e].data = static_cast<const uint8_t*>(stack) + e * per;
    }
  }
  return copies;
}

Status LlamaModel::upload_expert(WeightCopies& copies, int32_t layer, int32_t expert) {
  LlamaLayer& l = layers_[size_t(layer)];
  const std::string p = "blk." + std::to_string(layer) + ".";
  const bool stacked = !l.gate_exps.empty();
  const size_t e = size_t(expert);
  const std::pair<WeightView*, const char*> mats[] = {
      {stacked ? &l.gate_exps[e] : &l.gate, "ffn_gate"},
      {stacked ? &l.up_exps[e] : &l.up, "ffn_up"},
      {stacked ? &l.down_exps[e] : &l.down, "ffn_down"}};
  for (const auto& [w, name] : mats) {
    Status st = copies.move_in(w->data, size_t(w->rows) * w->row_bytes,
                               p + name + (stacked ? "_exps.weight[" + std::to_string(expert) + "]" : ".weight"));
    if (!st.ok()) return Status(st.code(), "model: " + st.message());
  }
  return Status::Ok();
}

}  // namespace cleave
