// Where a forward pass spends its time, op by op: a Backend that forwards
// every call to another one and adds up the wall time of each, with matmuls
// kept apart by their weight's shape (so the output matrix, the attention
// projections and the FFN show separately; a group of matmuls run as one
// region is one op, named by its shapes). The CPU backend's ops return
// when their work is done, so the times are the ops' own; on an asynchronous
// backend they would be launch times only (sync() is timed as its own op).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "kernels/backend.h"
#include "kernels/forwarding_backend.h"

namespace cleave {

struct OpTime {
  double seconds = 0;
  uint64_t calls = 0;
  double rows = 0;  // rows (matmul: x rows; attention: query rows) over all calls
};

class ProfilingBackend final : public ForwardingBackend {
 public:
  explicit ProfilingBackend(std::shared_ptr<Backend> inner) : ForwardingBackend(std::move(inner)) {}

  // By op name; matmuls as "matmul ROWSxCOLS" of their weight (rows = outputs).
  const std::map<std::string, OpTime>& times() const { return times_; }
  double total_seconds() const;
  void reset() { times_.clear(); }

  // Timed (the rest forwards untimed: memory, sharing, links, prepare).
  void upload(void* dst, const void* src, size_t bytes) override;
  void download(void* dst, const void* src, size_t bytes) override;
  void sync() override;
  void matmul(const WeightView& w, const float* x, int64_t n, float* y) override;
  void matmuls(const MatmulJob* jobs, int64_t count) override;
  void rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps,
               float* y) override;
  void rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim, const int32_t* positions,
            float freq_base) override;
  void softmax(float* x, int64_t n, int64_t len) override;
  void silu_mul(const float* gate, const float* up, int64_t count, float* out) override;
  void embed(const WeightView& table, const int32_t* ids, int64_t n, float* out) override;
  void topk_gating(const float* logits, int64_t n, int64_t n_expert, int64_t k, int32_t* ids,
                   float* weights) override;
  void kv_write(const PagedKv& kv, int32_t layer, const float* k, const float* v,
                const AttnRow* rows, int64_t n) override;
  void attention(const PagedKv& kv, int32_t layer, const float* q, const AttnRow* rows, int64_t n,
                 int32_t n_heads, float scale, float* out) override;
  void layer_norm(const float* x, const float* w, const float* b, int64_t n, int64_t dim, float eps,
                  float* y) override;
  void gelu(const float* x, int64_t count, Gelu kind, float* y) override;
  void add(const float* a, const float* b, int64_t count, int64_t period, float* y) override;
  void full_attention(const float* q, const float* k, const float* v, int64_t n_seq, int64_t T,
                      int64_t n_heads, int64_t head_dim, int64_t ld, float scale, float* out) override;
  void moe_combine(const float* y, const int32_t* rows, const float* w, int64_t n, int64_t k,
                   int64_t dim, float* out) override;
  void copy(void* dst, const void* src, size_t bytes) override;

 private:
  void record(const std::string& name, double seconds, double rows);

  std::map<std::string, OpTime> times_;
};

}  // namespace cleave
