// Launchers of the vision encoder's element-wise kernels (Backend::layer_norm,
// gelu, add) on a stream. Each checks its launch; the CUDA backend calls them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cleave::cuda {

// One block per row: mean, then the variance about it, each in
// block_sum's fixed order, then (x - mean) * inv * w + b.
void launch_layer_norm(const float* x, const float* w, const float* b, unsigned rows, int64_t dim,
                       float eps, float* y, cudaStream_t stream);
// y = x / (1 + exp(-z)): z = 2 sqrt(2/pi) x (1 + 0.044715 x^2) (tanh form) or
// 1.702 x (quick), the CPU kernels' formula.
void launch_gelu(const float* x, int64_t count, bool tanh_form, float* y, int sm_count,
                 cudaStream_t stream);
// y[i] = a[i] + b[i % period].
void launch_add(const float* a, const float* b, int64_t count, int64_t period, float* y,
                int sm_count, cudaStream_t stream);

// Backend::full_attention: one block per (row, head); the row's T scores in
// shared memory (each a d-ordered fma chain), max and sum in block_max /
// block_sum's fixed order, then each output value a j-ordered fma chain.
// Every value's order depends on the shapes only, not on the batch.
void launch_full_attention(const float* q, const float* k, const float* v, int64_t n_seq, int64_t T,
                           int64_t n_heads, int64_t head_dim, int64_t ld, float scale, float* out,
                           cudaStream_t stream);

}  // namespace cleave::cuda
