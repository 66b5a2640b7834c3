// The vision encoder's element-wise kernels (see vision_ops.h). Batch
// invariance: a row's LayerNorm is reduced by one block in a fixed order, and
// GELU and add are per element, so no value depends on the launch shape.
#include "kernels/cuda/vision_ops.h"

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/reduce.cuh"

namespace cleave::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    layer_norm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                      const float* __restrict__ b, int64_t dim, float eps, float* y) {
  __shared__ float sh[32];
  const int64_t i = blockIdx.x;
  const float* xr = x + i * dim;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) s += xr[c];
  const float mean = block_sum(s, sh) / float(dim);
  float q = 0.0f;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    const float d = xr[c] - mean;
    q = fmaf(d, d, q);
  }
  const float inv = 1.0f / sqrtf(block_sum(q, sh) / float(dim) + eps);
  // y may be x: every thread has read its elements (block_sum synchronised).
  float* yr = y + i * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) yr[c] = fmaf((xr[c] - mean) * inv, w[c], b[c]);
}

__global__ void gelu_kernel(const float* x, int64_t count, bool tanh_form, float* y) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    const float z = tanh_form ? v * (-2.0f * 0.79788456080286535588f) * fmaf(v * v, 0.044715f, 1.0f)
                              : v * -1.702f;
    y[i] = v / (1.0f + expf(z));
  }
}

__global__ void add_kernel(const float* a, const float* __restrict__ b, int64_t count,
                           int64_t period, float* y) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = a[i] + b[i % period];
}

int grid(int64_t count, int sm_count) {
  int64_t g = (count + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(sm_count > 0 ? sm_count : 1) * 16;
  if (g > cap) g = cap;
  return int(g < 1 ? 1 : g);
}

}  // namespace

void launch_layer_norm(const float* x, const float* w, const float* b, unsigned rows, int64_t dim,
                       float eps, float* y, cudaStream_t stream) {
  layer_norm_kernel<<<rows, kThreads, 0, stream>>>(x, w, b, dim, eps, y);
  CLEAVE_CUDA_CHECK_LAUNCH("layer_norm_kernel");
}

void launch_gelu(const float* x, int64_t count, bool tanh_form, float* y, int sm_count,
                 cudaStream_t stream) {
  gelu_kernel<<<grid(count, sm_count), kThreads, 0, stream>>>(x, count, tanh_form, y);
  CLEAVE_CUDA_CHECK_LAUNCH("gelu_kernel");
}

void launch_add(const float* a, const float* b, int64_t count, int64_t period, float* y,
                int sm_count, cudaStream_t stream) {
  add_kernel<<<grid(count, sm_count), kThreads, 0, stream>>>(a, b, count, period, y);
  CLEAVE_CUDA_CHECK_LAUNCH("add_kernel");
}

namespace {
__global__ void full_attention_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                      const float* __restrict__ v, int64_t T, int64_t n_heads,
                                      int64_t hd, int64_t ld, float scale, float* __restrict__ out) {
  extern __shared__ float sm[];  // T scores, then 32 for the reductions
  float* scores = sm;
  float* red = sm + T;
  const int64_t r = int64_t(blockIdx.x) / n_heads, h = int64_t(blockIdx.x) % n_heads;
  const int64_t first = r / T * T;  // the sequence's first row
  const float* qi = q + r * ld + h * hd;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
    const float* kj = k + (first + j) * ld + h * hd;
    float acc = 0.0f;
    for (int64_t d = 0; d < hd; ++d) acc = fmaf(qi[d], kj[d], acc);
    scores[j] = acc * scale;
    m = fmaxf(m, scores[j]);
  }
  m = block_max(m, red);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
    scores[j] = expf(scores[j] - m);
    sum += scores[j];
  }
  sum = block_sum(sum, red);  // its __syncthreads also publishes scores
  const float inv = 1.0f / sum;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    const float* vd = v + first * ld + h * hd + d;
    float acc = 0.0f;
    for (int64_t j = 0; j < T; ++j) acc = fmaf(scores[j], vd[j * ld], acc);
    out[r * ld + h * hd + d] = acc * inv;
  }
}
}  // namespace

void launch_full_attention(const float* q, const float* k, const float* v, int64_t n_seq, int64_t T,
                           int64_t n_heads, int64_t head_dim, int64_t ld, float scale, float* out,
                           cudaStream_t stream) {
  const int64_t blocks = n_seq * T * n_heads;
  if (blocks <= 0) return;
  const size_t shared = size_t(T + 32) * sizeof(float);
  full_attention_kernel<<<unsigned(blocks), 128, shared, stream>>>(q, k, v, T, n_heads, head_dim, ld,
                                                                    scale, out);
  CLEAVE_CUDA_CHECK_LAUNCH("full_attention_kernel");
}

}  // namespace cleave::cuda
