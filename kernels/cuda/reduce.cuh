// Warp and block reductions shared by the CUDA kernels, each in a fixed
// order (DESIGN.md invariant 1: a value's reduction order depends on its
// shapes only). Device code only; included by .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace cleave::cuda {

// Fixed xor butterfly: every lane ends with the same, order-fixed sum
// (a + b == b + a exactly, so the mirrored lanes agree bit for bit).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Block-wide sum / max for the block's threads; result broadcast to all.
// `sh` holds at least 32 floats. Contains __syncthreads: call uniformly.
__device__ __forceinline__ float block_sum(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // sh may still be read by a previous reduction
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float t = lane < int(blockDim.x >> 5) ? sh[lane] : 0.0f;
  t = warp_sum(t);
  return t;
}
__device__ __forceinline__ float block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float t = lane < int(blockDim.x >> 5) ? sh[lane] : -INFINITY;
  t = warp_max(t);
  return t;
}

}  // namespace cleave::cuda
