// A Backend that hands every call to another one: the base of wrappers that
// change or watch a few ops (ProfilingBackend times them; the benchmark's
// one-by-one backend runs matmul groups as single matmuls) and forward the
// rest unchanged.
#pragma once

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace cleave {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {}

  Caps caps() const override { return inner_->caps(); }
  bool supports(Op op, DType t) const override { return inner_->supports(op, t); }
  void* alloc(size_t bytes) override { return inner_->alloc(bytes); }
  void free(void* ptr) override { inner_->free(ptr); }
  void upload(void* dst, const void* src, size_t bytes) override { inner_->upload(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { inner_->download(dst, src, bytes); }
  void sync() override { inner_->sync(); }
  void* alloc_pinned_host(size_t bytes) override { return inner_->alloc_pinned_host(bytes); }
  void free_pinned_host(void* ptr) override { inner_->free_pinned_host(ptr); }
  Result<SharedRegion> alloc_shared(size_t bytes) override { return inner_->alloc_shared(bytes); }
  void free_shared(const SharedRegion& r) override { inner_->free_shared(r); }
  Result<const void*> open_shared(const std::string& h, size_t bytes) override {
    return inner_->open_shared(h, bytes);
  }
  void close_shared(const void* p, size_t bytes) override { inner_->close_shared(p, bytes); }
  Status checksum_blocks(const void* p, size_t block_bytes, int64_t n, uint64_t* out) override {
    return inner_->checksum_blocks(p, block_bytes, n, out);
  }
  Result<std::string> new_link_id() override { return inner_->new_link_id(); }
  Result<std::unique_ptr<DeviceLink>> open_link(const std::string& id, int rank, double timeout_s) override {
    return inner_->open_link(id, rank, timeout_s);
  }
  bool prepare(const WeightView& w) override { return inner_->prepare(w); }
  void matmul(const WeightView& w, const float* x, int64_t n, float* y) override { inner_->matmul(w, x, n, y); }
  void matmuls(const MatmulJob* jobs, int64_t count) override { inner_->matmuls(jobs, count); }
  void rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps, float* y) override {
    inner_->rmsnorm(x, weight, n, dim, eps, y);
  }
  void rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim, const int32_t* positions,
            float freq_base) override {
    inner_->rope(x, n, n_heads, head_dim, positions, freq_base);
  }
  void softmax(float* x, int64_t n, int64_t len) override { inner_->softmax(x, n, len); }
  void silu_mul(const float* gate, const float* up, int64_t count, float* out) override {
    inner_->silu_mul(gate, up, count, out);
  }
  void embed(const WeightView& table, const int32_t* ids, int64_t n, float* out) override {
    inner_->embed(table, ids, n, out);
  }
  void topk_gating(const float* logits, int64_t n, int64_t n_expert, int64_t k, int32_t* ids,
                   float* weights) override {
    inner_->topk_gating(logits, n, n_expert, k, ids, weights);
  }
  void kv_write(const PagedKv& kv, int32_t layer, const float* k, const float* v, const AttnRow* rows,
                int64_t n) override {
    inner_->kv_write(kv, layer, k, v, rows, n);
  }
  void attention(const PagedKv& kv, int32_t layer, const float* q, const AttnRow* rows, int64_t n,
                 int32_t n_heads, float scale, float* out) override {
    inner_->attention(kv, layer, q, rows, n, n_heads, scale, out);
  }
  void layer_norm(const float* x, const float* w, const float* b, int64_t n, int64_t dim, float eps,
                  float* y) override {
    inner_->layer_norm(x, w, b, n, dim, eps, y);
  }
  void gelu(const float* x, int64_t count, Gelu kind, float* y) override { inner_->gelu(x, count, kind, y); }
  void add(const float* a, const float* b, int64_t count, int64_t period, float* y) override {
    inner_->add(a, b, count, period, y);
  }
  void full_attention(const float* q, const float* k, const float* v, int64_t n_seq, int64_t T,
                      int64_t n_heads, int64_t head_dim, int64_t ld, float scale, float* out) override {
    inner_->full_attention(q, k, v, n_seq, T, n_heads, head_dim, ld, scale, out);
  }
  void moe_combine(const float* y, const int32_t* rows, const float* w, int64_t n, int64_t k, int64_t dim,
                   float* out) override {
    inner_->moe_combine(y, rows, w, n, k, dim, out);
  }
  void copy(void* dst, const void* src, size_t bytes) override { inner_->copy(dst, src, bytes); }

 protected:
  Backend& inner() { return *inner_; }

 private:
  std::shared_ptr<Backend> inner_;
};

}  // namespace cleave
