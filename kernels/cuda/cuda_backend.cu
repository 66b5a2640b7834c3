// The CUDA backend: every op of kernels/backend.h on device memory.
//
// Batch invariance (DESIGN.md invariant 1): each output value is reduced in an
// order that depends only on the shapes of its own inputs (k, dim, head_dim,
// block_size), never on n, on where the row sits in the batch, or on the
// launch configuration. Concretely:
//  - matmul: one warp per output feature r; lane l owns the chunks
//    l, l+32, l+64, ... of the row (a chunk is 16 bytes of weights for F32,
//    F16, BF16, or a quarter of a Q8_0 block) and accumulates them in
//    ascending order with explicit fmaf; the warp then sums its 32 lanes with
//    a fixed xor-butterfly. Several x rows (a tile of 1, 4 or 8) share each
//    weight load, each with its own accumulator running the same sequence,
//    so the tile size (chosen from n) never changes a result. The vector
//    (16-byte) and the scalar path (unaligned pointers, ragged k) run the
//    same per-lane sequence too.
//  - rmsnorm, softmax: one 256-thread block per row, per-thread strided
//    partials, fixed warp-then-block tree.
//  - attention: one block per (row, head); whole KV blocks in absolute
//    position order, online softmax rescaled once per block.
// All arithmetic uses IEEE division/sqrt/expf (no fast math).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <memory>
#include <string>

// nvcc's front end flags `status_ = Status(...)` in common/status.h (a
// [[nodiscard]] class type returned by value) though g++ does not.
#pragma nv_diag_suppress 2810
#include "kernels/backend.h"
#pragma nv_diag_default 2810
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/vision_ops.h"

namespace cleave {
namespace {

using cuda::block_max;
using cuda::block_sum;
using cuda::warp_max;
using cuda::warp_sum;

constexpr int kWarp = 32;
constexpr int kMatmulWarps = 8;  // warps (output features) per matmul block
constexpr int kRowThreads = 256;  // threads per block for row-wise reductions
constexpr int kAttnThreads = 128;
constexpr int kUnroll = 4;  // weight chunks in flight per lane (n > 1)
#ifndef CLEAVE_MATVEC_UNROLL
#define CLEAVE_MATVEC_UNROLL 4
#endif
constexpr int kUnrollMatvec = CLEAVE_MATVEC_UNROLL;  // the same for n = 1

__device__ __forceinline__ float f16_bits_to_f32(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b & 0xffffu)));
}
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t b) {
  return __uint_as_float((b & 0xffffu) << 16);
}

// ---------------------------------------------------------------- matmul --

template <DType T>
struct Chunk;  // elements per 16-byte chunk
template <>
struct Chunk<DType::F32> {
  static constexpr int V = 4;
};
template <>
struct Chunk<DType::F16> {
  static constexpr int V = 8;
};
template <>
struct Chunk<DType::BF16> {
  static constexpr int V = 8;
};

template <DType T>
__device__ __forceinline__ float load_w(const uint8_t* row, int64_t c) {
  if constexpr (T == DType::F32) {
    return __ldg(reinterpret_cast<const float*>(row) + c);
  } else {
    uint32_t b = __ldg(reinterpret_cast<const unsigned short*>(row) + c);
    return T == DType::F16 ? f16_bits_to_f32(b) : bf16_bits_to_f32(b);
  }
}

template <DType T>
__device__ __forceinline__ void convert_chunk(const uint4& raw, float* w) {
  if constexpr (T == DType::F32) {
    w[0] = __uint_as_float(raw.x);
    w[1] = __uint_as_float(raw.y);
    w[2] = __uint_as_float(raw.z);
    w[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t u[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (T == DType::F16) {
        w[2 * j] = f16_bits_to_f32(u[j]);
        w[2 * j + 1] = f16_bits_to_f32(u[j] >> 16);
      } else {
        w[2 * j] = bf16_bits_to_f32(u[j]);
        w[2 * j + 1] = bf16_bits_to_f32(u[j] >> 16);
      }
    }
  }
}

// V floats (a multiple of 4) from 16-byte aligned x.
template <int V>
__device__ __forceinline__ void load_x(const float* x, float* out) {
  const float4* xv = reinterpret_cast<const float4*>(x);
#pragma unroll
  for (int q = 0; q < V / 4; ++q) {
    const float4 f = __ldg(xv + q);
    out[4 * q] = f.x;
    out[4 * q + 1] = f.y;
    out[4 * q + 2] = f.z;
    out[4 * q + 3] = f.w;
  }
}

// y[i][r] for one output feature r per warp and NT x rows per tile.
// kVec: weight rows and x rows are 16-byte aligned and k % V == 0.
template <DType T, int NT, bool kVec>
__global__ void __launch_bounds__(kMatmulWarps* kWarp)
    matmul_plain_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t R, int64_t K,
                        const float* __restrict__ x, int64_t n, float* __restrict__ y) {
  constexpr int V = Chunk<T>::V;
  const int lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * kMatmulWarps + (threadIdx.x >> 5);
  if (r >= R) return;
  const uint8_t* wrow = w + r * row_bytes;
  const int64_t nchunks = (K + V - 1) / V;
  const int64_t ntiles = (n + NT - 1) / NT;
  for (int64_t tile = blockIdx.y; tile < ntiles; tile += gridDim.y) {
    const float* xr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      int64_t i = tile * NT + t;
      xr[t] = x + (i < n ? i : n - 1) * K;  // surplus rows recompute the last, unstored
    }
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;

    if constexpr (kVec) {
      // n = 1 (NT == 1): x is loaded together with the weights, so every
      // load of an unrolled step is in flight at once.
      constexpr int U = NT == 1 ? kUnrollMatvec : kUnroll;
      const uint4* wv = reinterpret_cast<const uint4*>(wrow);
      for (int64_t ch0 = lane; ch0 < nchunks; ch0 += int64_t(kWarp) * U) {
        uint4 raw[U];
        float xpre[NT == 1 ? U * V : 1];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t ch = ch0 + int64_t(kWarp) * u;
          if (ch < nchunks) {
            raw[u] = __ldg(wv + ch);
            if constexpr (NT == 1) load_x<V>(xr[0] + ch * V, xpre + u * V);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t ch = ch0 + int64_t(kWarp) * u;
          if (ch >= nchunks) break;
          float wf[V];
          convert_chunk<T>(raw[u], wf);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            float xf[V];
            if constexpr (NT == 1) {
#pragma unroll
              for (int e = 0; e < V; ++e) xf[e] = xpre[u * V + e];
            } else {
              load_x<V>(xr[t] + ch * V, xf);
            }
#pragma unroll
            for (int e = 0; e < V; ++e) acc[t] = fmaf(wf[e], xf[e], acc[t]);
          }
        }
      }
    } else {
      // Same per-lane sequence as the vector path, one element at a time.
      for (int64_t ch = lane; ch < nchunks; ch += kWarp) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int64_t c = ch * V + e;
          if (c >= K) break;
          const float wf = load_w<T>(wrow, c);
#pragma unroll
          for (int t = 0; t < NT; ++t) acc[t] = fmaf(wf, __ldg(xr[t] + c), acc[t]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = warp_sum(acc[t]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int64_t i = tile * NT + t;
      if (lane == t && i < n) y[i * R + r] = acc[t];
    }
  }
}

template <bool kAligned2>
__device__ __forceinline__ uint32_t load_u16(const uint8_t* p) {
  if constexpr (kAligned2) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
  } else {
    return uint32_t(__ldg(p)) | (uint32_t(__ldg(p + 1)) << 8);
  }
}

// 8 floats of x for a Q8_0 quarter block (32-byte aligned when kVecX).
template <bool kVecX>
__device__ __forceinline__ void load_xq(const float* x, float* out) {
  if constexpr (kVecX) {
    load_x<8>(x, out);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __ldg(x + j);
  }
}

// Q8_0: lane l owns quarter (l & 3) of blocks (l >> 2), (l >> 2) + 8, ...;
// per quarter p = sum_j q_j * x_j (8 fmaf in order), then acc = fmaf(d, p, acc).
template <int NT, bool kVecX, bool kAligned2>
__global__ void __launch_bounds__(kMatmulWarps* kWarp)
    matmul_q8_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t R, int64_t K,
                     const float* __restrict__ x, int64_t n, float* __restrict__ y) {
  constexpr int kQuarter = 8;
  const int lane = threadIdx.x & 31;
  const int part = lane & 3;
  const int64_t r = int64_t(blockIdx.x) * kMatmulWarps + (threadIdx.x >> 5);
  if (r >= R) return;
  const uint8_t* wrow = w + r * row_bytes;
  const int64_t nb = K / kQ8Block;
  const int64_t ntiles = (n + NT - 1) / NT;
  for (int64_t tile = blockIdx.y; tile < ntiles; tile += gridDim.y) {
    const float* xr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      int64_t i = tile * NT + t;
      xr[t] = x + (i < n ? i : n - 1) * K;
    }
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;

    constexpr int U = NT == 1 ? kUnrollMatvec : kUnroll;
    for (int64_t b0 = lane >> 2; b0 < nb; b0 += 8 * U) {
      uint32_t dbits[U], q[U][4];
      float xpre[NT == 1 ? U * kQuarter : 1];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t b = b0 + 8 * u;
        if (b < nb) {
          const uint8_t* blk = wrow + b * kQ8BlockBytes;
          dbits[u] = load_u16<kAligned2>(blk);
#pragma unroll
          for (int j = 0; j < 4; ++j) q[u][j] = load_u16<kAligned2>(blk + 2 + part * kQuarter + 2 * j);
          if constexpr (NT == 1) load_xq<kVecX>(xr[0] + b * kQ8Block + part * kQuarter, xpre + u * kQuarter);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t b = b0 + 8 * u;
        if (b >= nb) break;
        const float d = f16_bits_to_f32(dbits[u]);
        float qf[kQuarter];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          qf[2 * j] = float(int8_t(q[u][j] & 0xffu));
          qf[2 * j + 1] = float(int8_t((q[u][j] >> 8) & 0xffu));
        }
        const int64_t c0 = b * kQ8Block + part * kQuarter;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          float xf[kQuarter];
          if constexpr (NT == 1) {
#pragma unroll
            for (int j = 0; j < kQuarter; ++j) xf[j] = xpre[u * kQuarter + j];
          } else {
            load_xq<kVecX>(xr[t] + c0, xf);
          }
          float p = 0.0f;
#pragma unroll
          for (int j = 0; j < kQuarter; ++j) p = fmaf(qf[j], xf[j], p);
          acc[t] = fmaf(d, p, acc[t]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = warp_sum(acc[t]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int64_t i = tile * NT + t;
      if (lane == t && i < n) y[i * R + r] = acc[t];
    }
  }
}

// ------------------------------------------------------------ row ops --

__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ weight, int64_t dim,
                   float eps, float* __restrict__ y) {
  __shared__ float sh[kWarp];
  const int64_t i = blockIdx.x;
  const float* xr = x + i * dim;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) ss = fmaf(xr[c], xr[c], ss);
  ss = block_sum(ss, sh);
  const float scale = 1.0f / sqrtf(ss / float(dim) + eps);
  float* yr = y + i * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) yr[c] = xr[c] * scale * weight[c];
}

__global__ void __launch_bounds__(kRowThreads) softmax_kernel(float* __restrict__ x, int64_t len) {
  __shared__ float sh[kWarp];
  float* xr = x + int64_t(blockIdx.x) * len;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < len; c += blockDim.x) m = fmaxf(m, xr[c]);
  m = block_max(m, sh);
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < len; c += blockDim.x) {
    const float e = expf(xr[c] - m);
    xr[c] = e;
    s += e;
  }
  s = block_sum(s, sh);
  for (int64_t c = threadIdx.x; c < len; c += blockDim.x) xr[c] = xr[c] / s;
}

// One thread per (row, head, pair). theta = pos * base^(-2j/head_dim) in
// double, so large positions keep their angle accurate.
__global__ void rope_kernel(float* __restrict__ x, int64_t n, int64_t n_heads, int64_t head_dim,
                            const int32_t* __restrict__ positions, double log_base) {
  const int64_t half = head_dim / 2;
  const int64_t total = n * n_heads * half;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % half;
    const int64_t rh = idx / half;  // row * n_heads + head
    const int64_t i = rh / n_heads;
    const double freq = exp(-double(2 * j) / double(head_dim) * log_base);
    const double theta = double(positions[i]) * freq;
    double sn, cs;
    sincos(theta, &sn, &cs);
    const float c = float(cs), s = float(sn);
    float* p = x + rh * head_dim + 2 * j;
    const float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
  }
}

__global__ void silu_mul_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                                int64_t count, float* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void embed_kernel(DType type, const uint8_t* __restrict__ table, size_t row_bytes,
                             int64_t cols, const int32_t* __restrict__ ids,
                             float* __restrict__ out) {
  const int64_t i = blockIdx.x;
  const uint8_t* row = table + int64_t(ids[i]) * row_bytes;
  float* o = out + i * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v;
    switch (type) {
      case DType::F32: v = load_w<DType::F32>(row, c); break;
      case DType::F16: v = load_w<DType::F16>(row, c); break;
      case DType::BF16: v = load_w<DType::BF16>(row, c); break;
      default: {
        const uint8_t* blk = row + (c / kQ8Block) * kQ8BlockBytes;
        const float d = f16_bits_to_f32(uint32_t(blk[0]) | (uint32_t(blk[1]) << 8));
        v = d * float(int8_t(blk[2 + c % kQ8Block]));
      }
    }
    o[c] = v;
  }
}

// One thread per row: softmax over the experts (sequential, fixed order),
// then k rounds of selection under the total order (p desc, index asc).
__global__ void topk_gating_kernel(const float* __restrict__ logits, int64_t n, int64_t n_expert,
                                   int64_t k, int32_t* __restrict__ ids,
                                   float* __restrict__ weights) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float* l = logits + i * n_expert;
  float m = -INFINITY;
  for (int64_t e = 0; e < n_expert; ++e) m = fmaxf(m, l[e]);
  float s = 0.0f;
  for (int64_t e = 0; e < n_expert; ++e) s += expf(l[e] - m);
  float prev_p = INFINITY;
  int64_t prev_id = -1;
  float sel_sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    float best_p = -1.0f;
    int64_t best = -1;
    for (int64_t e = 0; e < n_expert; ++e) {
      const float p = expf(l[e] - m) / s;
      const bool after_prev = p < prev_p || (p == prev_p && e > prev_id);
      if (after_prev && p > best_p) {  // strict: ties keep the lower index
        best_p = p;
        best = e;
      }
    }
    ids[i * k + j] = int32_t(best);
    weights[i * k + j] = best_p;
    sel_sum += best_p;
    prev_p = best_p;
    prev_id = best;
  }
  for (int64_t j = 0; j < k; ++j) weights[i * k + j] = weights[i * k + j] / sel_sum;
}

// PagedKv without its host-only methods; F32 K and V only (check_f32_kv).
struct KvDev {
  float* data;
  int32_t n_blocks, block_size, n_layers, n_kv_heads, head_dim;
  __device__ size_t offset(int32_t block, int32_t layer, int32_t kv, int32_t head,
                           int32_t slot) const {
    const size_t layer_elems = size_t(2) * n_kv_heads * block_size * head_dim;
    return size_t(block) * layer_elems * n_layers + size_t(layer) * layer_elems +
           ((size_t(kv) * n_kv_heads + head) * block_size + slot) * head_dim;
  }
};

KvDev to_dev(const PagedKv& kv) {
  return KvDev{reinterpret_cast<float*>(kv.data), kv.n_blocks, kv.block_size, kv.n_layers, kv.n_kv_heads, kv.head_dim};
}

// grid (n, n_kv_heads)
__global__ void kv_write_kernel(KvDev kv, int32_t layer, const float* __restrict__ k,
                                const float* __restrict__ v, const AttnRow* __restrict__ rows) {
  const int64_t i = blockIdx.x;
  const int32_t h = blockIdx.y;
  const AttnRow row = rows[i];
  const int32_t blk = row.block_table[row.pos / kv.block_size];
  const int32_t slot = row.pos % kv.block_size;
  const int32_t hd = kv.head_dim;
  float* kd = kv.data + kv.offset(blk, layer, 0, h, slot);
  float* vd = kv.data + kv.offset(blk, layer, 1, h, slot);
  const int64_t src = (i * kv.n_kv_heads + h) * hd;
  for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) {
    kd[c] = k[src + c];
    vd[c] = v[src + c];
  }
}

// grid (n, n_heads), kAttnThreads threads. Shared: q[hd] acc[hd] s[bs] p[bs].
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(KvDev kv, int32_t layer, const float* __restrict__ q,
                     const AttnRow* __restrict__ rows, int32_t n_heads, float scale,
                     float* __restrict__ out) {
  extern __shared__ float sm[];
  const int32_t hd = kv.head_dim, bs = kv.block_size;
  float* qs = sm;
  float* acc = qs + hd;
  float* s = acc + hd;
  float* p = s + bs;
  const int64_t i = blockIdx.x;
  const int32_t h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  const AttnRow row = rows[i];
  const int32_t kh = h / (n_heads / kv.n_kv_heads);
  const float* qrow = q + (i * n_heads + h) * hd;
  for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) {
    qs[c] = qrow[c];
    acc[c] = 0.0f;
  }
  __syncthreads();
  float m = -INFINITY, l = 0.0f;
  const int32_t nblk = row.pos / bs + 1;
  for (int32_t b = 0; b < nblk; ++b) {
    const int32_t blk = row.block_table[b];
    const float* kb = kv.data + kv.offset(blk, layer, 0, kh, 0);
    const float* vb = kv.data + kv.offset(blk, layer, 1, kh, 0);
    const int32_t valid = min(bs, row.pos - b * bs + 1);
    for (int32_t j = warp; j < valid; j += nwarps) {
      float d = 0.0f;
      for (int32_t c = lane; c < hd; c += kWarp) d = fmaf(qs[c], kb[int64_t(j) * hd + c], d);
      d = warp_sum(d);
      if (lane == 0) s[j] = d * scale;
    }
    __syncthreads();
    float mb = m;
    for (int32_t j = 0; j < valid; ++j) mb = fmaxf(mb, s[j]);
    const float corr = expf(m - mb);  // 0 for the first block (m = -inf)
    for (int32_t j = threadIdx.x; j < valid; j += blockDim.x) p[j] = expf(s[j] - mb);
    __syncthreads();
    l *= corr;
    for (int32_t j = 0; j < valid; ++j) l += p[j];
    for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) {
      float a = acc[c] * corr;
      for (int32_t j = 0; j < valid; ++j) a = fmaf(p[j], vb[int64_t(j) * hd + c], a);
      acc[c] = a;
    }
    m = mb;
    __syncthreads();  // s and p are rewritten by the next block
  }
  float* o = out + (i * n_heads + h) * hd;
  for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) o[c] = acc[c] / l;
}

// ------------------------------------------------------------- backend --

int grid_for(int64_t count, int threads, int max_blocks) {
  int64_t b = (count + threads - 1) / threads;
  if (b < 1) b = 1;
  return int(b < max_blocks ? b : max_blocks);
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "cuda backend: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

// All ops are queued on one blocking stream and return without waiting;
// upload/download/sync/free wait for it. Not safe to call from two threads at
// once (the row staging ring is per backend); use one backend per thread.
class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const cudaDeviceProp& prop) : device_(device) {
    sm_count_ = prop.multiProcessorCount;
    isa_ = "sm_" + std::to_string(prop.major) + std::to_string(prop.minor);
    CLEAVE_CUDA_CHECK(cudaSetDevice(device_));
    // A blocking stream: work on the legacy default stream (cudaMemcpy,
    // events recorded on stream 0) stays ordered with it.
    CLEAVE_CUDA_CHECK(cudaStreamCreate(&stream_));
    for (RowSlot& slot : row_slots_)
      CLEAVE_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
  }
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    for (RowSlot& slot : row_slots_) {
      if (slot.dev) cudaFree(slot.dev);
      if (slot.host) cudaFreeHost(slot.host);
      cudaEventDestroy(slot.done);
    }
    cudaStreamDestroy(stream_);
  }

  Caps caps() const override {
    Caps c;
    c.name = "cuda";
    c.isa = isa_;
    c.threads = sm_count_;
    return c;
  }
  // The KV kernels read and write F32 only (F16 / Q8_0 caches: not yet).
  bool supports(Op op, DType t) const override {
    if (op == Op::kv_write || op == Op::attention) return t == DType::F32;
    return dtype_known(static_cast<uint32_t>(t));
  }

  // nullptr when the device is out of memory; any other error aborts.
  void* alloc(size_t bytes) override {
    use();
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;
    }
    CLEAVE_CUDA_CHECK(err);
    return p;
  }
  void free(void* ptr) override {
    if (!ptr) return;
    use();
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    CLEAVE_CUDA_CHECK(cudaFree(ptr));
  }
  // nullptr when out of (page-lockable) host memory; any other error aborts.
  void* alloc_pinned_host(size_t bytes) override {
    use();
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;
    }
    CLEAVE_CUDA_CHECK(err);
    return p;
  }
  void free_pinned_host(void* ptr) override {
    if (!ptr) return;
    use();
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));  // no copy may still read it
    CLEAVE_CUDA_CHECK(cudaFreeHost(ptr));
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use();
    CLEAVE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use();
    CLEAVE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void sync() override {
    use();
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void matmul(const WeightView& w, const float* x, int64_t n, float* y) override {
    if (n <= 0 || w.rows <= 0) return;
    use();
    if (w.cols <= 0) {
      CLEAVE_CUDA_CHECK(cudaMemsetAsync(y, 0, size_t(n * w.rows) * sizeof(float), stream_));
      return;
    }
    if (n == 1) {
      matmul_nt<1>(w, x, n, y);
    } else if (n <= 4) {
      matmul_nt<4>(w, x, n, y);
    } else {
      matmul_nt<8>(w, x, n, y);
    }
  }

  void rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps,
               float* y) override {
    if (n <= 0 || dim <= 0) return;
    use();
    rmsnorm_kernel<<<grid1d(n), kRowThreads, 0, stream_>>>(x, weight, dim, eps, y);
    CLEAVE_CUDA_CHECK_LAUNCH("rmsnorm_kernel");
  }

  void rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim, const int32_t* positions,
            float freq_base) override {
    const int64_t total = n * n_heads * (head_dim / 2);
    if (total <= 0) return;
    use();
    rope_kernel<<<grid_for(total, 256, sm_count_ * 16), 256, 0, stream_>>>(
        x, n, n_heads, head_dim, positions, std::log(double(freq_base)));
    CLEAVE_CUDA_CHECK_LAUNCH("rope_kernel");
  }

  void softmax(float* x, int64_t n, int64_t len) override {
    if (n <= 0 || len <= 0) return;
    use();
    softmax_kernel<<<grid1d(n), kRowThreads, 0, stream_>>>(x, len);
    CLEAVE_CUDA_CHECK_LAUNCH("softmax_kernel");
  }

  void silu_mul(const float* gate, const float* up, int64_t count, float* out) override {
    if (count <= 0) return;
    use();
    silu_mul_kernel<<<grid_for(count, 256, sm_count_ * 16), 256, 0, stream_>>>(gate, up, count,
                                                                               out);
    CLEAVE_CUDA_CHECK_LAUNCH("silu_mul_kernel");
  }

  void layer_norm(const float* x, const float* w, const float* b, int64_t n, int64_t dim,
                  float eps, float* y) override {
    if (n <= 0 || dim <= 0) return;
    use();
    cuda::launch_layer_norm(x, w, b, grid1d(n), dim, eps, y, stream_);
  }

  void gelu(const float* x, int64_t count, Gelu kind, float* y) override {
    if (count <= 0) return;
    use();
    cuda::launch_gelu(x, count, kind == Gelu::tanh, y, sm_count_, stream_);
  }

  void add(const float* a, const float* b, int64_t count, int64_t period, float* y) override {
    if (count <= 0) return;
    if (period <= 0 || count % period != 0) fail("add: count is not a multiple of period");
    use();
    cuda::launch_add(a, b, count, period, y, sm_count_, stream_);
  }

  void embed(const WeightView& table, const int32_t* ids, int64_t n, float* out) override {
    if (n <= 0 || table.cols <= 0) return;
    use();
    check_type(table.type);
    embed_kernel<<<grid1d(n), 256, 0, stream_>>>(table.type,
                                                  static_cast<const uint8_t*>(table.data),
                                                  table.row_bytes, table.cols, ids, out);
    CLEAVE_CUDA_CHECK_LAUNCH("embed_kernel");
  }

  void topk_gating(const float* logits, int64_t n, int64_t n_expert, int64_t k, int32_t* ids,
                   float* weights) override {
    if (n <= 0 || k <= 0) return;
    if (k > n_expert) fail("topk_gating: k > n_expert");
    use();
    topk_gating_kernel<<<unsigned((n + 127) / 128), 128, 0, stream_>>>(logits, n, n_expert, k,
                                                                        ids, weights);
    CLEAVE_CUDA_CHECK_LAUNCH("topk_gating_kernel");
  }

  void kv_write(const PagedKv& kv, int32_t layer, const float* k, const float* v,
                const AttnRow* rows, int64_t n) override {
    if (n <= 0) return;
    check_f32_kv(kv, "kv_write");
    use();
    const AttnRow* rows_dev = stage_rows(rows, n);
    const int threads = kv.head_dim >= 256 ? 256 : ((kv.head_dim + 31) / 32) * 32;
    kv_write_kernel<<<dim3(unsigned(n), unsigned(kv.n_kv_heads)), threads, 0, stream_>>>(
        to_dev(kv), layer, k, v, rows_dev);
    CLEAVE_CUDA_CHECK_LAUNCH("kv_write_kernel");
  }

  void attention(const PagedKv& kv, int32_t layer, const float* q, const AttnRow* rows, int64_t n,
                 int32_t n_heads, float scale, float* out) override {
    if (n <= 0 || n_heads <= 0) return;
    if (kv.n_kv_heads <= 0 || n_heads % kv.n_kv_heads != 0)
      fail("attention: n_heads is not a multiple of n_kv_heads");
    check_f32_kv(kv, "attention");
    use();
    const AttnRow* rows_dev = stage_rows(rows, n);
    const size_t smem = (size_t(2) * kv.head_dim + size_t(2) * kv.block_size) * sizeof(float);
    if (smem > 48 * 1024) fail("attention: head_dim/block_size too large for shared memory");
    attention_kernel<<<dim3(unsigned(n), unsigned(n_heads)), kAttnThreads, smem, stream_>>>(
        to_dev(kv), layer, q, rows_dev, n_heads, scale, out);
    CLEAVE_CUDA_CHECK_LAUNCH("attention_kernel");
  }

 private:
  void use() const { CLEAVE_CUDA_CHECK(cudaSetDevice(device_)); }

  static unsigned grid1d(int64_t n) {
    if (n > 0x7fffffff) fail("too many rows for one launch");
    return unsigned(n);
  }

  static void check_f32_kv(const PagedKv& kv, const char* op) {
    if (kv.k_type != DType::F32 || kv.v_type != DType::F32)
      fail((std::string(op) + ": the cuda backend's KV cache is F32 only").c_str());
  }

  static void check_type(DType t) {
    if (!dtype_known(static_cast<uint32_t>(t))) fail("unknown weight type");
  }

  // The host AttnRow array (whose block_table pointers are device memory)
  // copied to the device, ordered on the stream. It goes through a ring of
  // pinned staging slots so the copy is truly asynchronous (a pageable copy
  // would wait for the stream); a slot is reused only after the event of its
  // previous copy, kRowSlots calls ago, has completed. Device-side reuse is
  // ordered by the stream itself.
  const AttnRow* stage_rows(const AttnRow* rows, int64_t n) {
    const size_t bytes = size_t(n) * sizeof(AttnRow);
    RowSlot& slot = row_slots_[next_slot_];
    next_slot_ = (next_slot_ + 1) % kRowSlots;
    if (slot.used) CLEAVE_CUDA_CHECK(cudaEventSynchronize(slot.done));
    if (bytes > slot.cap) {
      CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
      if (slot.dev) CLEAVE_CUDA_CHECK(cudaFree(slot.dev));
      if (slot.host) CLEAVE_CUDA_CHECK(cudaFreeHost(slot.host));
      size_t cap = 4096;
      while (cap < bytes) cap *= 2;
      CLEAVE_CUDA_CHECK(cudaMalloc(&slot.dev, cap));
      CLEAVE_CUDA_CHECK(cudaMallocHost(&slot.host, cap));
      slot.cap = cap;
    }
    std::memcpy(slot.host, rows, bytes);
    CLEAVE_CUDA_CHECK(cudaMemcpyAsync(slot.dev, slot.host, bytes, cudaMemcpyHostToDevice, stream_));
    CLEAVE_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
    slot.used = true;
    return static_cast<const AttnRow*>(slot.dev);
  }

  dim3 matmul_grid(int64_t rows, int64_t ntiles) const {
    const int64_t gx = (rows + kMatmulWarps - 1) / kMatmulWarps;
    if (gx > 0x7fffffff) fail("matmul: too many output rows");
    // Enough blocks to fill the GPU (8 blocks of 8 warps per SM); extra
    // x-row tiles loop inside the warp, which re-reads its weight row from
    // cache. The split never changes a result.
    const int64_t target = int64_t(sm_count_) * 8;
    int64_t gy = (target + gx - 1) / gx;
    if (gy > ntiles) gy = ntiles;
    if (gy > 65535) gy = 65535;
    if (gy < 1) gy = 1;
    return dim3(unsigned(gx), unsigned(gy));
  }

  template <int NT>
  void matmul_nt(const WeightView& w, const float* x, int64_t n, float* y) {
    const auto* wd = static_cast<const uint8_t*>(w.data);
    const dim3 grid = matmul_grid(w.rows, (n + NT - 1) / NT);
    const dim3 block(kMatmulWarps * kWarp);
    const bool x16 = reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const bool w16 = reinterpret_cast<uintptr_t>(wd) % 16 == 0 && w.row_bytes % 16 == 0;
    // Plain types take the 16-byte vector path when x, the rows and cols allow.
    auto plain = [&](auto type_tag, int64_t lanes) {
      constexpr DType T = decltype(type_tag)::value;
      if (x16 && w16 && w.cols % lanes == 0)
        matmul_plain_kernel<T, NT, true>
            <<<grid, block, 0, stream_>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
      else
        matmul_plain_kernel<T, NT, false>
            <<<grid, block, 0, stream_>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
    };
    switch (w.type) {
      case DType::F32: plain(std::integral_constant<DType, DType::F32>{}, 4); break;
      case DType::F16: plain(std::integral_constant<DType, DType::F16>{}, 8); break;
      case DType::BF16: plain(std::integral_constant<DType, DType::BF16>{}, 8); break;
      case DType::Q8_0: {
        if (w.cols % kQ8Block != 0) fail("matmul: Q8_0 cols not a multiple of 32");
        const bool a2 = reinterpret_cast<uintptr_t>(wd) % 2 == 0 && w.row_bytes % 2 == 0;
        if (x16 && a2)
          matmul_q8_kernel<NT, true, true>
              <<<grid, block, 0, stream_>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
        else if (a2)
          matmul_q8_kernel<NT, false, true>
              <<<grid, block, 0, stream_>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
        else if (x16)
          matmul_q8_kernel<NT, true, false>
              <<<grid, block, 0, stream_>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
        else
          matmul_q8_kernel<NT, false, false>
              <<<grid, block, 0, stream_>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
        break;
      }
      default: fail("matmul: unknown weight type");
    }
    CLEAVE_CUDA_CHECK_LAUNCH("matmul kernel");
  }

  int device_ = 0;
  int sm_count_ = 0;
  std::string isa_;
  cudaStream_t stream_ = nullptr;
  struct RowSlot {
    void* host = nullptr;  // pinned
    void* dev = nullptr;
    size_t cap = 0;
    cudaEvent_t done = nullptr;
    bool used = false;
  };
  static constexpr int kRowSlots = 8;
  RowSlot row_slots_[kRowSlots];
  int next_slot_ = 0;
};

std::string cuda_error(const char* call, cudaError_t err) {
  return std::string(call) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

}  // namespace

Result<std::unique_ptr<Backend>> make_cuda_backend(int device) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear, so later CUDA calls do not see it
    // "No GPU" only when there is none (or no driver); anything else is a
    // broken CUDA install or device, and says so.
    const bool none = err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver;
    return Status(Code::unavailable, std::string("cuda backend: ") +
                                         (none ? "no GPU: " : "CUDA start-up failed: ") +
                                         cuda_error("cudaGetDeviceCount", err));
  }
  if (count <= 0) return Status(Code::unavailable, "cuda backend: no GPU: device count is 0");
  if (device < 0 || device >= count)
    return Status(Code::invalid_argument, "cuda backend: device " + std::to_string(device) +
                                              " out of range (" + std::to_string(count) +
                                              " devices)");
  err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status(Code::unavailable, "cuda backend: " + cuda_error("cudaSetDevice", err));
  }
  cudaDeviceProp prop;
  std::memset(&prop, 0, sizeof(prop));
  err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status(Code::unavailable,
                  "cuda backend: " + cuda_error("cudaGetDeviceProperties", err));
  }
  return std::unique_ptr<Backend>(new CudaBackend(device, prop));
}

}  // namespace cleave
