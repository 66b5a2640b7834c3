// The tensor-core matmul's arithmetic and fragment layout (kernels/cuda/
// matmul_tc.cu) as host-and-device code, so that tests/kernels/
// test_mma_tf32.cpp checks both on the CPU: the TF32 split against float64
// and the lanes' fragments against the layout CuTe publishes for PTX's
// mma.m16n8k8 .tf32.
//
// Accuracy: F32 activations are split into two TF32 values, x = hi + lo +
// r with |r| <= 2^-22 |x|; weights stored in F16, BF16 or Q8_0 are exact in
// TF32 (at most 11 significant bits), F32 weights are split the same way.
// The mma multiplies TF32 values exactly and accumulates in F32, so a dot
// product computed as w*lo + w*hi (F32 weights: wlo*xhi + whi*xlo +
// whi*xhi, dropping wlo*xlo <= 2^-22 |w x|) is within about F32's own
// rounding of the exact sum: the "3xTF32" scheme.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CLEAVE_MMA_HD __host__ __device__ __forceinline__
#else
#define CLEAVE_MMA_HD inline
#endif

namespace cleave::cuda::mma {

constexpr int kChunk = 32;    // columns of k per chunk (one Q8_0 block)
constexpr int kSteps = 4;     // m16n8k8 steps per chunk
constexpr int kRows = 16;     // output features per tile (the mma's M)
constexpr int kTokens = 8;    // x rows per tile (the mma's N)
constexpr int kLaneCols = 8;  // a lane's columns of a chunk: 8 * (lane & 3) ...

CLEAVE_MMA_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
CLEAVE_MMA_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// x rounded to TF32 (10 stored mantissa bits, the low 13 bits zero) to
// nearest, ties away from zero (PTX's cvt.rna); infinities stay, a NaN
// stays a NaN.
CLEAVE_MMA_HD float to_tf32(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u)
    return (u & 0x007fffffu) != 0 ? bits_float((u | 0x00400000u) & 0xffffe000u) : x;
  return bits_float((u + 0x1000u) & 0xffffe000u);  // a carry into the exponent rounds up
}

struct Split {
  float hi, lo;
};
// x = hi + lo + r, |r| <= 2^-22 |x| for normal x: x - hi is exact in F32.
CLEAVE_MMA_HD Split split_tf32(float x) {
  const float hi = to_tf32(x);
  const float d = x - hi;
  return {hi, d == d ? to_tf32(d) : 0.0f};  // x infinite: hi carries it
}

// Lane l = 4 g + t (g = l >> 2, t = l & 3) holds, in PTX's m16n8k8 .tf32
// layout:
//   A (16 rows x 8 k):    a0 (g, t)  a1 (g + 8, t)  a2 (g, t + 4)  a3 (g + 8, t + 4)
//   B (8 k x 8 tokens):   b0 (t, g)  b1 (t + 4, g)
//   C (16 rows x 8 tok.): c0 (g, 2t) c1 (g, 2t + 1) c2 (g + 8, 2t) c3 (g + 8, 2t + 1)
CLEAVE_MMA_HD int a_row(int lane, int reg) { return (lane >> 2) + 8 * (reg & 1); }
CLEAVE_MMA_HD int a_k(int lane, int reg) { return (lane & 3) + 4 * (reg >> 1); }
CLEAVE_MMA_HD int b_k(int lane, int reg) { return (lane & 3) + 4 * reg; }
CLEAVE_MMA_HD int b_token(int lane) { return lane >> 2; }
CLEAVE_MMA_HD int c_row(int lane, int reg) { return (lane >> 2) + 8 * (reg >> 1); }
CLEAVE_MMA_HD int c_token(int lane, int reg) { return 2 * (lane & 3) + (reg & 1); }

// Step j of a chunk gives the mma's k index kk the chunk column
// 8 (kk & 3) + 2 j + (kk >> 2): over the 4 steps each of the 32 columns
// once, and lane l's A and B values are its own 8 columns 8t .. 8t + 7, so
// a lane loads 16 contiguous bytes of an F16 row per chunk.
CLEAVE_MMA_HD int chunk_col(int kk, int step) { return 8 * (kk & 3) + 2 * step + (kk >> 2); }
// The same columns as offsets into the lane's 8 loaded values.
CLEAVE_MMA_HD int lane_a_offset(int reg, int step) { return 2 * step + (reg >> 1); }
CLEAVE_MMA_HD int lane_b_offset(int reg, int step) { return 2 * step + reg; }

}  // namespace cleave::cuda::mma
