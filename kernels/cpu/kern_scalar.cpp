// Portable kernels: the same algorithms as the SIMD files over an 8-lane
// array "vector" (mul then add, no fused multiply-add).
#include <cmath>
#include <cstring>

#include "kernels/cpu/kern.h"
#include "kernels/dtype.h"

namespace {

struct V {
  struct vec {
    float v[8];
  };
  static constexpr int W = 8;
  // Attention: one loader for every KV type pair (simd_attention.h, LAnyKv):
  // this table is for checks, and its instantiations per pair made the
  // sanitizer builds' compile of this file take minutes.
  static constexpr bool kOneKvLoader = true;
  static constexpr int MR = 2;
  static constexpr int np_for(int mi) { return mi == 1 ? 2 : 1; }
#define CLEAVE_LANES(expr) \
  vec r;                   \
  for (int i = 0; i < 8; ++i) r.v[i] = (expr); \
  return r
  static vec zero() { CLEAVE_LANES(0.0f); }
  static vec set1(float f) { CLEAVE_LANES(f); }
  static vec loadu(const float* p) {  // p may be unaligned (odd weight row strides)
    vec r;
    std::memcpy(r.v, static_cast<const void*>(p), sizeof r.v);
    return r;
  }
  static void storeu(float* p, vec a) { std::memcpy(p, a.v, sizeof a.v); }
  static vec add(vec a, vec b) { CLEAVE_LANES(a.v[i] + b.v[i]); }
  static vec sub(vec a, vec b) { CLEAVE_LANES(a.v[i] - b.v[i]); }
  static vec mul(vec a, vec b) { CLEAVE_LANES(a.v[i] * b.v[i]); }
  static vec div(vec a, vec b) { CLEAVE_LANES(a.v[i] / b.v[i]); }
  static vec max(vec a, vec b) { CLEAVE_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
  static vec swap_pairs(vec a) { CLEAVE_LANES(a.v[i ^ 1]); }
  static void keep(vec&) {}  // no fma in this file
  static vec min(vec a, vec b) { CLEAVE_LANES(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
  static float fmas(float a, float b, float c) {
    const float p = a * b;
    return p + c;
  }
  static vec fmadd(vec a, vec b, vec c) { CLEAVE_LANES(fmas(a.v[i], b.v[i], c.v[i])); }
  static float hsum(vec a) {
    float s4[4], s2[2];
    for (int i = 0; i < 4; ++i) s4[i] = a.v[i] + a.v[i + 4];
    for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
  }
  template <int N>
  static void hsums(const vec* a, float* out) {
    for (int j = 0; j < N; ++j) out[j] = hsum(a[j]);
  }
  static float hmax(vec a) {
    float m = a.v[0];
    for (int i = 1; i < 8; ++i) m = a.v[i] > m ? a.v[i] : m;
    return m;
  }
  static float f16(uint16_t h) { return cleave::fp16_to_fp32(h); }
  static vec load_f16(const uint8_t* p) {
    uint16_t h[8];
    std::memcpy(h, p, 16);
    CLEAVE_LANES(f16(h[i]));
  }
  static vec load_bf16(const uint8_t* p) {
    uint16_t h[8];
    std::memcpy(h, p, 16);
    CLEAVE_LANES(cleave::bf16_to_fp32(h[i]));
  }
  static vec load_q8(const int8_t* q, vec d) { CLEAVE_LANES(float(q[i]) * d.v[i]); }
  static vec load_q4(const uint8_t* q, int shift, vec d) { CLEAVE_LANES(float(int((q[i] >> shift) & 15) - 8) * d.v[i]); }
  static vec pow2n(vec n) {
    vec r;
    for (int i = 0; i < 8; ++i) {
      const uint32_t e = uint32_t(int32_t(n.v[i]) + 127) << 23;
      std::memcpy(&r.v[i], &e, 4);
    }
    return r;
  }
  static void prefetch(const uint8_t* p) { (void)p; }
  static void prefetch_l2(const uint8_t* p) { (void)p; }
  // The portable path quantises each block with quantize_row_q8_0 itself.
  static bool amax32(const float* x, float* amax) {
    (void)x, (void)amax;
    return false;
  }
  static void round_q8_32(const float* x, float id, int8_t* q) { (void)x, (void)id, (void)q; }
  static void round_q4_32(const float* x, float id, uint8_t* q) { (void)x, (void)id, (void)q; }
  // W floats to f16 at p by the portable formula; never asks for a redo.
  static bool store_f16(const float* x, uint8_t* p) {
    for (int i = 0; i < 8; ++i) {
      const uint16_t h = cleave::fp32_to_fp16(x[i]);
      std::memcpy(p + 2 * i, &h, 2);
    }
    return false;
  }
  static float sqrt1(float x) { return std::sqrt(x); }
#undef CLEAVE_LANES
};

}  // namespace

#include "kernels/cpu/simd_impl.h"

namespace cleave::cpu {
CLEAVE_DEFINE_KERNEL_TABLE(kKernelsScalar)
}  // namespace cleave::cpu
