// The tensor-core matmul (Backend::matmul on sm_80 and newer, every n):
// y[i][r] = x[i] . w[r] with TF32 mma.sync (m16n8k8, F32 accumulators) on
// weights in their stored type (F32, F16, BF16, Q8_0) and F32 activations
// split into two TF32 values. kernels/cuda/mma_tf32.cuh holds the split, its
// accuracy and the fragment layout; tests/kernels/test_mma_tf32.cpp checks
// them on the CPU.
//
// Batch invariance (DESIGN.md invariant 1): a block computes 16 output
// features; its 8 warps take the chunks of 32 columns w, w + 8, w + 16, ...
// in ascending order, each into its own accumulators, and warp 0 adds the
// other warps' sums in warp order. Per chunk and step the products go in a
// fixed order (F32 weights: wlo*xhi, whi*xlo, whi*xhi; others w*xlo, w*xhi;
// Q8_0 per block into a fresh sum, then acc = fmaf(d, sum, acc)). An element
// of an mma's result depends only on its own row of A, column of B and
// accumulator, so which x rows share a tile (NT tiles of 8, chosen from n),
// the zero rows padding a tile and the grid's split never change a row's
// bits: the order depends on K alone. Decode (n = 1) takes this kernel too,
// so a token's bits do not depend on whether it came in a prefill or a step.
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
#include "kernels/cuda/mma_tf32.cuh"
#include "kernels/cuda/weights.cuh"

namespace cleave::cuda {
namespace {

using mma::kChunk;
using mma::kLaneCols;
using mma::kRows;
using mma::kSteps;
using mma::kTokens;
constexpr int kWarp = 32;
constexpr int kTcWarps = 8;  // warps per block, each a share of the chunks

// d += a * b for one m16n8k8 TF32 tile (a, b: TF32 bit patterns).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // launch_matmul_tc is only called on sm_80 and newer
#endif
}

// The lane's 8 weights of a row at columns c0 .. c0 + 7, widened to F32;
// zeros past K. kVec: the row is 16-byte aligned and the chunk is whole.
template <DType T, bool kVec>
__device__ __forceinline__ void load_lane_w(const uint8_t* row, int64_t c0, int64_t K,
                                            float (&out)[kLaneCols]) {
  if constexpr (kVec) {
    if constexpr (T == DType::F32) {
      const uint4* p = reinterpret_cast<const uint4*>(row + c0 * 4);
      convert_chunk<T>(__ldg(p), out);
      convert_chunk<T>(__ldg(p + 1), out + 4);
    } else {
      convert_chunk<T>(__ldg(reinterpret_cast<const uint4*>(row + c0 * 2)), out);
    }
  } else {
#pragma unroll
    for (int e = 0; e < kLaneCols; ++e) out[e] = c0 + e < K ? load_w<T>(row, c0 + e) : 0.0f;
  }
}

// The lane's 8 activations of an x row split into TF32 hi and lo; zeros
// for a padding row or past K.
template <bool kVec>
__device__ __forceinline__ void load_lane_x(const float* xrow, bool present, int64_t c0,
                                            int64_t K, uint32_t (&hi)[kLaneCols],
                                            uint32_t (&lo)[kLaneCols]) {
  float v[kLaneCols];
  if (!present) {
#pragma unroll
    for (int e = 0; e < kLaneCols; ++e) v[e] = 0.0f;
  } else if constexpr (kVec) {
    load_x<kLaneCols>(xrow + c0, v);
  } else {
#pragma unroll
    for (int e = 0; e < kLaneCols; ++e) v[e] = c0 + e < K ? __ldg(xrow + c0 + e) : 0.0f;
  }
#pragma unroll
  for (int e = 0; e < kLaneCols; ++e) {
    const mma::Split s = mma::split_tf32(v[e]);
    hi[e] = mma::float_bits(s.hi);
    lo[e] = mma::float_bits(s.lo);
  }
}

// Step j's A fragment from the lane's two rows (g and g + 8) of values.
__device__ __forceinline__ void a_fragment(const uint32_t (&w)[2][kLaneCols], int step,
                                           uint32_t (&a)[4]) {
#pragma unroll
  for (int reg = 0; reg < 4; ++reg) a[reg] = w[reg & 1][mma::lane_a_offset(reg, step)];
}
__device__ __forceinline__ void b_fragment(const uint32_t (&x)[kLaneCols], int step,
                                           uint32_t (&b)[2]) {
#pragma unroll
  for (int reg = 0; reg < 2; ++reg) b[reg] = x[mma::lane_b_offset(reg, step)];
}

// The lane's two weight rows (g and g + 8 of the block's 16); rows past R
// are computed from row R - 1 and not stored.
__device__ __forceinline__ void lane_weight_rows(const uint8_t* w, size_t row_bytes, int64_t R, int64_t r0,
                                                 int lane, const uint8_t* (&wrow)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = r0 + mma::a_row(lane, h);
    wrow[h] = w + (r < R ? r : R - 1) * row_bytes;
  }
}

// The block's x rows of one tile: row tile * 8 NT + 8 nt + g for each nt.
template <int NT>
struct TileRows {
  const float* row[NT];
  bool present[NT];
  __device__ TileRows(const float* x, int64_t n, int64_t K, int64_t first, int lane) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int64_t i = first + int64_t(kTokens) * nt + mma::b_token(lane);
      present[nt] = i < n;
      row[nt] = x + (present[nt] ? i : 0) * K;
    }
  }
};

// Warps 1.. hand their sums to warp 0, which adds them in warp order and
// stores the tile's results. Contains __syncthreads: called by the whole
// block.
template <int NT>
__device__ __forceinline__ void reduce_store(const float (&acc)[NT][4],
                                             float (*partial)[NT * 4][kWarp], int lane,
                                             int warp, int64_t r0, int64_t R, int64_t first,
                                             int64_t n, float* __restrict__ y) {
  if (warp > 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[warp - 1][nt * 4 + e][lane] = acc[nt][e];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float s = acc[nt][e];
#pragma unroll
        for (int v = 0; v < kTcWarps - 1; ++v) s += partial[v][nt * 4 + e][lane];
        const int64_t r = r0 + mma::c_row(lane, e);
        const int64_t i = first + int64_t(kTokens) * nt + mma::c_token(lane, e);
        if (r < R && i < n) y[i * R + r] = s;
      }
  }
  __syncthreads();  // partial is reused by the next tile
}

// F32, F16, BF16 weights. kVec: x, the weight rows and K allow 16-byte loads
// of whole chunks.
template <DType T, int NT, bool kVec>
__global__ void __launch_bounds__(kTcWarps* kWarp)
    matmul_tc_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t R, int64_t K,
                     const float* __restrict__ x, int64_t n, float* __restrict__ y) {
  __shared__ float partial[kTcWarps - 1][NT * 4][kWarp];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * kRows;
  const uint8_t* wrow[2];
  lane_weight_rows(w, row_bytes, R, r0, lane, wrow);
  const int64_t nchunks = (K + kChunk - 1) / kChunk;
  const int64_t per_tile = int64_t(kTokens) * NT;
  const int64_t ntiles = (n + per_tile - 1) / per_tile;
  for (int64_t tile = blockIdx.y; tile < ntiles; tile += gridDim.y) {
    const TileRows<NT> rows(x, n, K, tile * per_tile, lane);
    float acc[NT][4] = {};

    for (int64_t ch = warp; ch < nchunks; ch += kTcWarps) {
      const int64_t c0 = ch * kChunk + int64_t(kLaneCols) * (lane & 3);
      uint32_t whi[2][kLaneCols], wlo[2][kLaneCols];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float wv[kLaneCols];
        load_lane_w<T, kVec>(wrow[h], c0, K, wv);
#pragma unroll
        for (int e = 0; e < kLaneCols; ++e) {
          if constexpr (T == DType::F32) {
            const mma::Split s = mma::split_tf32(wv[e]);
            whi[h][e] = mma::float_bits(s.hi);
            wlo[h][e] = mma::float_bits(s.lo);
          } else {
            whi[h][e] = mma::float_bits(wv[e]);  // exact in TF32
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t xhi[kLaneCols], xlo[kLaneCols];
        load_lane_x<kVec>(rows.row[nt], rows.present[nt], c0, K, xhi, xlo);
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          uint32_t ah[4], bh[2], bl[2];
          a_fragment(whi, j, ah);
          b_fragment(xhi, j, bh);
          b_fragment(xlo, j, bl);
          if constexpr (T == DType::F32) {
            uint32_t al[4];
            a_fragment(wlo, j, al);
            mma_tf32(acc[nt], al, bh);
          }
          mma_tf32(acc[nt], ah, bl);
          mma_tf32(acc[nt], ah, bh);
        }
      }
    }
    reduce_store<NT>(acc, partial, lane, warp, r0, R, tile * per_tile, n, y);
  }
}

// Q8_0 weights (K % 32 == 0): a chunk is one block; q is exact in TF32 and
// the block's scale d multiplies the block's sum. kVecX: x rows 16-byte
// aligned; kAligned2: weight rows 2-byte aligned.
template <int NT, bool kVecX, bool kAligned2>
__global__ void __launch_bounds__(kTcWarps* kWarp)
    matmul_tc_q8_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t R, int64_t K,
                        const float* __restrict__ x, int64_t n, float* __restrict__ y) {
  static_assert(kChunk == kQ8Block, "a chunk is one Q8_0 block");
  __shared__ float partial[kTcWarps - 1][NT * 4][kWarp];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * kRows;
  const uint8_t* wrow[2];
  lane_weight_rows(w, row_bytes, R, r0, lane, wrow);
  const int64_t nchunks = K / kChunk;
  const int64_t per_tile = int64_t(kTokens) * NT;
  const int64_t ntiles = (n + per_tile - 1) / per_tile;
  for (int64_t tile = blockIdx.y; tile < ntiles; tile += gridDim.y) {
    const TileRows<NT> rows(x, n, K, tile * per_tile, lane);
    float acc[NT][4] = {};

    for (int64_t ch = warp; ch < nchunks; ch += kTcWarps) {
      const int lane_col = kLaneCols * (lane & 3);
      const int64_t c0 = ch * kChunk + lane_col;
      uint32_t wq[2][kLaneCols];
      float d[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint8_t* blk = wrow[h] + ch * kQ8BlockBytes;
        d[h] = f16_bits_to_f32(load_u16<kAligned2>(blk));
#pragma unroll
        for (int j = 0; j < kLaneCols / 2; ++j) {
          const uint32_t q = load_u16<kAligned2>(blk + 2 + lane_col + 2 * j);
          wq[h][2 * j] = mma::float_bits(float(int8_t(q & 0xffu)));
          wq[h][2 * j + 1] = mma::float_bits(float(int8_t((q >> 8) & 0xffu)));
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t xhi[kLaneCols], xlo[kLaneCols];
        load_lane_x<kVecX>(rows.row[nt], rows.present[nt], c0, K, xhi, xlo);
        float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          uint32_t a[4], bh[2], bl[2];
          a_fragment(wq, j, a);
          b_fragment(xhi, j, bh);
          b_fragment(xlo, j, bl);
          mma_tf32(sum, a, bl);
          mma_tf32(sum, a, bh);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = fmaf(d[e >> 1], sum[e], acc[nt][e]);
      }
    }
    reduce_store<NT>(acc, partial, lane, warp, r0, R, tile * per_tile, n, y);
  }
}

dim3 tc_grid(int64_t rows, int64_t ntiles, int sm_count) {
  const int64_t gx = (rows + kRows - 1) / kRows;
  if (gx > 0x7fffffff) fail("matmul: too many output rows");
  // Enough blocks to fill the GPU (about 4 blocks of 8 warps per SM); extra
  // tiles loop inside the block. The split never changes a result.
  const int64_t target = int64_t(sm_count) * 4;
  int64_t gy = (target + gx - 1) / gx;
  if (gy > ntiles) gy = ntiles;
  if (gy > 65535) gy = 65535;
  if (gy < 1) gy = 1;
  return dim3(unsigned(gx), unsigned(gy));
}

template <int NT>
void matmul_tc_nt(const WeightView& w, const float* x, int64_t n, float* y, int sm_count,
                  cudaStream_t stream) {
  const auto* wd = static_cast<const uint8_t*>(w.data);
  const dim3 grid = tc_grid(w.rows, (n + kTokens * NT - 1) / (kTokens * NT), sm_count);
  const dim3 block(kTcWarps * kWarp);
  const bool x16 = reinterpret_cast<uintptr_t>(x) % 16 == 0 && w.cols % 4 == 0;
  const bool w16 = reinterpret_cast<uintptr_t>(wd) % 16 == 0 && w.row_bytes % 16 == 0;
  auto plain = [&](auto type_tag) {
    constexpr DType T = decltype(type_tag)::value;
    if (x16 && w16 && w.cols % kChunk == 0)
      matmul_tc_kernel<T, NT, true>
          <<<grid, block, 0, stream>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
    else
      matmul_tc_kernel<T, NT, false>
          <<<grid, block, 0, stream>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
  };
  auto q8 = [&](auto vec_x, auto aligned2) {
    matmul_tc_q8_kernel<NT, decltype(vec_x)::value, decltype(aligned2)::value>
        <<<grid, block, 0, stream>>>(wd, w.row_bytes, w.rows, w.cols, x, n, y);
  };
  dispatch_weight_type(w, x16, plain, q8);
  CLEAVE_CUDA_CHECK_LAUNCH("tensor-core matmul kernel");
}

// Independent chains of mma on registers: the TF32 tensor-core rate.
__global__ void __launch_bounds__(kTcWarps* kWarp) mma_peak_kernel(int iters, float* out) {
  constexpr int kChains = 4;
  uint32_t a[4], b[2];
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = mma::float_bits(1.0f + float(threadIdx.x & 7) * 0.125f);
  b[0] = b[1] = mma::float_bits(0.5f);
  float acc[kChains][4] = {};
  for (int i = 0; i < iters; ++i)
#pragma unroll
    for (int c = 0; c < kChains; ++c) mma_tf32(acc[c], a, b);
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[int64_t(blockIdx.x) * blockDim.x + threadIdx.x] = s;
}

}  // namespace

void launch_matmul_tc(const WeightView& w, const float* x, int64_t n, float* y, int sm_count,
                      cudaStream_t stream) {
  if (n <= kTokens) {
    matmul_tc_nt<1>(w, x, n, y, sm_count, stream);
  } else if (n <= 2 * kTokens) {
    matmul_tc_nt<2>(w, x, n, y, sm_count, stream);
  } else {
    matmul_tc_nt<4>(w, x, n, y, sm_count, stream);
  }
}

double measure_tf32_mma_peak(int sm_count, cudaStream_t stream) {
  const int blocks = sm_count * 4, threads = kTcWarps * kWarp, iters = 1 << 14;
  float* out = nullptr;
  CLEAVE_CUDA_CHECK(cudaMalloc(&out, sizeof(float) * size_t(blocks) * threads));
  cudaEvent_t start, stop;
  CLEAVE_CUDA_CHECK(cudaEventCreate(&start));
  CLEAVE_CUDA_CHECK(cudaEventCreate(&stop));
  mma_peak_kernel<<<blocks, threads, 0, stream>>>(64, out);  // warm-up
  CLEAVE_CUDA_CHECK(cudaEventRecord(start, stream));
  mma_peak_kernel<<<blocks, threads, 0, stream>>>(iters, out);
  CLEAVE_CUDA_CHECK(cudaEventRecord(stop, stream));
  CLEAVE_CUDA_CHECK_LAUNCH("mma peak kernel");
  CLEAVE_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CLEAVE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(out);
  const double flops = double(blocks) * kTcWarps * iters * 4 * (2.0 * kRows * kTokens * 8);
  return flops / (double(ms) * 1e-3);
}

}  // namespace cleave::cuda
