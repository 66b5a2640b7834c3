// The CUDA matmul (Backend::matmul): y[i][r] = x[i] . w[r] for weights in
// their stored type (F32, F16, BF16, Q8_0) and F32 activations.
//
// Batch invariance (DESIGN.md invariant 1): one warp per output feature r;
// lane l owns the chunks l, l+32, l+64, ... of the row (a chunk is 16 bytes
// of weights for F32, F16, BF16, or a quarter of a Q8_0 block) and
// accumulates them in ascending order with explicit fmaf; the warp then sums
// its 32 lanes with a fixed xor-butterfly. Several x rows (a tile of 1, 4 or
// 8) share each weight load, each with its own accumulator running the same
// sequence, so the tile size (chosen from n) never changes a result. The
// vector (16-byte) and the scalar path (unaligned pointers, ragged k) run the
// same per-lane sequence too.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

// nvcc's front end flags `status_ = Status(...)` in common/status.h (a
// [[nodiscard]] class type returned by value) though g++ does not.
#pragma nv_diag_suppress 2810
#include "kernels/backend.h"
#pragma nv_diag_default 2810
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/weights.cuh"

namespace cleave::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kMatmulWarps = 8;  // warps (output features) per matmul block
constexpr int kUnroll = 4;  // weight chunks in flight per lane (n > 1)
#ifndef CLEAVE_MATVEC_UNROLL
#define CLEAVE_MATVEC_UNROLL 4
#endif
constexpr int kUnrollMatvec = CLEAVE_MATVEC_UNROLL;  // the same for n = 1

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

dim3 matmul_grid(int64_t rows, int64_t ntiles, int sm_count) {
  const int64_t gx = (rows + kMatmulWarps - 1) / kMatmulWarps;
  if (gx > 0x7fffffff) fail("matmul: too many output rows");
  // Enough blocks to fill the GPU (8 blocks of 8 warps per SM); extra
  // x-row tiles loop inside the warp, which re-reads its weight row from
  // cache. The split never changes a result.
  const int64_t target = int64_t(sm_count) * 8;
  int64_t gy = (target + gx - 1) / gx;
  if (gy > ntiles) gy = ntiles;
  if (gy > 65535) gy = 65535;
  if (gy < 1) gy = 1;
  return dim3(unsigned(gx), unsigned(gy));
}

template <int NT>
void matmul_nt(const WeightView& w, const float* x, int64_t n, float* y, int sm_count,
               cudaStream_t stream) {
  const auto* wd = static_cast<const uint8_t*>(w.data);
  const dim3 grid = matmul_grid(w.rows, (n + NT - 1) / NT, sm_count);
  const dim3 block(kMatmulWarps * kWarp);
  const bool x16 = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const bool w16 = reinterpret_cast<uintptr_t>(wd) % 16 == 0 && w.row_bytes % 16 == 0;
  // Plain types take the 16-byte vector path when x, the rows and cols allow.
  auto plain = [&](auto type_tag) {
    constexpr DType T = decltype(type_tag)::value;
    if (x16 && w16 && w.cols % Chunk<T>::V == 0)
      matmul_plain_kernel<T, NT, true>
          <<<grid, block, 0, stream>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
    else
      matmul_plain_kernel<T, NT, false>
          <<<grid, block, 0, stream>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
  };
  auto q8 = [&](auto vec_x, auto aligned2) {
    matmul_q8_kernel<NT, decltype(vec_x)::value, decltype(aligned2)::value>
        <<<grid, block, 0, stream>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
  };
  dispatch_weight_type(w, x16, plain, q8);
  CLEAVE_CUDA_CHECK_LAUNCH("matmul kernel");
}

}  // namespace

void launch_matmul(const WeightView& w, const float* x, int64_t n, float* y, int sm_count,
                   cudaStream_t stream) {
  if (n == 1) {
    matmul_nt<1>(w, x, n, y, sm_count, stream);
  } else if (n <= 4) {
    matmul_nt<4>(w, x, n, y, sm_count, stream);
  } else {
    matmul_nt<8>(w, x, n, y, sm_count, stream);
  }
}

}  // namespace cleave::cuda
