// Weight and activation loaders shared by the CUDA kernels (both matmuls,
// embed): F32, F16 and BF16 elements widened exactly to F32, 16-byte
// vector loads of x, 2-byte loads at any alignment. Device code only;
// included by .cu files.
#pragma once

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
#include "kernels/dtype.h"

namespace cleave::cuda {

__device__ __forceinline__ float f16_bits_to_f32(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b & 0xffffu)));
}
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t b) {
  return __uint_as_float((b & 0xffffu) << 16);
}

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

template <bool kAligned2>
__device__ __forceinline__ uint32_t load_u16(const uint8_t* p) {
  if constexpr (kAligned2) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
  } else {
    return uint32_t(__ldg(p)) | (uint32_t(__ldg(p + 1)) << 8);
  }
}

// The matmuls' launch-time dispatch on the weight type: plain(type_tag)
// for F32, F16 and BF16 (type_tag an integral_constant<DType>), or
// q8(vec_x, aligned2) for Q8_0 (bool_constants: x rows 16-byte aligned,
// weight rows 2-byte aligned); Q8_0 needs cols % 32 == 0.
template <class Plain, class Q8>
void dispatch_weight_type(const WeightView& w, bool x16, Plain&& plain, Q8&& q8) {
  switch (w.type) {
    case DType::F32: plain(std::integral_constant<DType, DType::F32>{}); break;
    case DType::F16: plain(std::integral_constant<DType, DType::F16>{}); break;
    case DType::BF16: plain(std::integral_constant<DType, DType::BF16>{}); break;
    case DType::Q8_0: {
      if (w.cols % kQ8Block != 0) fail("matmul: Q8_0 cols not a multiple of 32");
      const bool a2 = reinterpret_cast<uintptr_t>(w.data) % 2 == 0 && w.row_bytes % 2 == 0;
      const std::true_type yes;
      const std::false_type no;
      if (x16 && a2) q8(yes, yes);
      else if (a2) q8(no, yes);
      else if (x16) q8(yes, no);
      else q8(no, no);
      break;
    }
    default: fail("matmul: unknown weight type");
  }
}

}  // namespace cleave::cuda
