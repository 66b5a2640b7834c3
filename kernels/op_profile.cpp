#include "kernels/op_profile.h"

#include <algorithm>
#include <chrono>

namespace cleave {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

double ProfilingBackend::total_seconds() const {
  double s = 0;
  for (const auto& [name, t] : times_) s += t.seconds;
  return s;
}

void ProfilingBackend::record(const std::string& name, double seconds, double rows) {
  OpTime& t = times_[name];
  t.seconds += seconds;
  t.calls += 1;
  t.rows += rows;
}

void ProfilingBackend::upload(void* dst, const void* src, size_t bytes) {
  const auto t0 = Clock::now();
  inner().upload(dst, src, bytes);
  record("upload", since(t0), 0);
}

void ProfilingBackend::download(void* dst, const void* src, size_t bytes) {
  const auto t0 = Clock::now();
  inner().download(dst, src, bytes);
  record("download", since(t0), 0);
}

void ProfilingBackend::sync() {
  const auto t0 = Clock::now();
  inner().sync();
  record("sync", since(t0), 0);
}

void ProfilingBackend::matmul(const WeightView& w, const float* x, int64_t n, float* y) {
  const auto t0 = Clock::now();
  inner().matmul(w, x, n, y);
  record("matmul " + std::to_string(w.rows) + "x" + std::to_string(w.cols), since(t0), double(n));
}

// A group by its matrices' shapes: "matmul 768x768+256x768+256x768", or
// "matmul 128x64 x2" when all share one (a group of one: as matmul).
void ProfilingBackend::matmuls(const MatmulJob* jobs, int64_t count) {
  const auto t0 = Clock::now();
  inner().matmuls(jobs, count);
  const double seconds = since(t0);
  std::string name = "matmul";
  double rows = 0;
  bool same = true;
  for (int64_t i = 0; i < count; ++i) {
    rows += double(jobs[i].n);
    same = same && jobs[i].w->rows == jobs[0].w->rows && jobs[i].w->cols == jobs[0].w->cols;
  }
  for (int64_t i = 0; i < (same ? std::min<int64_t>(count, 1) : count); ++i)
    name += (i ? "+" : " ") + std::to_string(jobs[i].w->rows) + "x" + std::to_string(jobs[i].w->cols);
  if (same && count > 1) name += " x" + std::to_string(count);
  record(name, seconds, rows);
}

void ProfilingBackend::rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim,
                               float eps, float* y) {
  const auto t0 = Clock::now();
  inner().rmsnorm(x, weight, n, dim, eps, y);
  record("rmsnorm", since(t0), double(n));
}

void ProfilingBackend::rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim,
                            const int32_t* positions, float freq_base) {
  const auto t0 = Clock::now();
  inner().rope(x, n, n_heads, head_dim, positions, freq_base);
  record("rope", since(t0), double(n));
}

void ProfilingBackend::softmax(float* x, int64_t n, int64_t len) {
  const auto t0 = Clock::now();
  inner().softmax(x, n, len);
  record("softmax", since(t0), double(n));
}

void ProfilingBackend::silu_mul(const float* gate, const float* up, int64_t count, float* out) {
  const auto t0 = Clock::now();
  inner().silu_mul(gate, up, count, out);
  record("silu_mul", since(t0), 0);
}

void ProfilingBackend::embed(const WeightView& table, const int32_t* ids, int64_t n, float* out) {
  const auto t0 = Clock::now();
  inner().embed(table, ids, n, out);
  record("embed", since(t0), double(n));
}

void ProfilingBackend::topk_gating(const float* logits, int64_t n, int64_t n_expert, int64_t k,
                                   int32_t* ids, float* weights) {
  const auto t0 = Clock::now();
  inner().topk_gating(logits, n, n_expert, k, ids, weights);
  record("topk_gating", since(t0), double(n));
}

void ProfilingBackend::kv_write(const PagedKv& kv, int32_t layer, const float* k, const float* v,
                                const AttnRow* rows, int64_t n) {
  const auto t0 = Clock::now();
  inner().kv_write(kv, layer, k, v, rows, n);
  record("kv_write", since(t0), double(n));
}

void ProfilingBackend::attention(const PagedKv& kv, int32_t layer, const float* q,
                                 const AttnRow* rows, int64_t n, int32_t n_heads, float scale,
                                 float* out) {
  const auto t0 = Clock::now();
  inner().attention(kv, layer, q, rows, n, n_heads, scale, out);
  record("attention", since(t0), double(n));
}

void ProfilingBackend::layer_norm(const float* x, const float* w, const float* b, int64_t n,
                                  int64_t dim, float eps, float* y) {
  const auto t0 = Clock::now();
  inner().layer_norm(x, w, b, n, dim, eps, y);
  record("layer_norm", since(t0), double(n));
}

void ProfilingBackend::gelu(const float* x, int64_t count, Gelu kind, float* y) {
  const auto t0 = Clock::now();
  inner().gelu(x, count, kind, y);
  record("gelu", since(t0), 0);
}

void ProfilingBackend::add(const float* a, const float* b, int64_t count, int64_t period, float* y) {
  const auto t0 = Clock::now();
  inner().add(a, b, count, period, y);
  record("add", since(t0), 0);
}

void ProfilingBackend::full_attention(const float* q, const float* k, const float* v, int64_t n_seq,
                                      int64_t T, int64_t n_heads, int64_t head_dim, int64_t ld,
                                      float scale, float* out) {
  const auto t0 = Clock::now();
  inner().full_attention(q, k, v, n_seq, T, n_heads, head_dim, ld, scale, out);
  record("full_attention", since(t0), double(n_seq * T));
}

void ProfilingBackend::moe_combine(const float* y, const int32_t* rows, const float* w, int64_t n,
                                   int64_t k, int64_t dim, float* out) {
  const auto t0 = Clock::now();
  inner().moe_combine(y, rows, w, n, k, dim, out);
  record("moe_combine", since(t0), double(n));
}

void ProfilingBackend::copy(void* dst, const void* src, size_t bytes) {
  const auto t0 = Clock::now();
  inner().copy(dst, src, bytes);
  record("copy", since(t0), 0);
}

}  // namespace cleave
