// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c).
// Plain functions on raw pointers only: no STL here (see kern.h).
#include <immintrin.h>

#include "kernels/cpu/kern.h"

namespace {

struct V {
  using vec = __m256;
  static constexpr int W = 8;
  // Matmul microkernel: up to 6 x rows by np_for(rows) panels of 16 outputs
  // (two vectors each): at most 12 accumulators of the 16 registers.
  static constexpr int MR = 6;
  static constexpr int np_for(int mi) { return mi == 1 ? 4 : mi <= 3 ? 2 : 1; }
  static vec zero() { return _mm256_setzero_ps(); }
  static vec set1(float f) { return _mm256_set1_ps(f); }
  static vec loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, vec v) { _mm256_storeu_ps(p, v); }
  static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  static vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
  static vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
  static vec div(vec a, vec b) { return _mm256_div_ps(a, b); }
  static vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
  static vec min(vec a, vec b) { return _mm256_min_ps(a, b); }
  static vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static float fmas(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
  // Fixed tree: lanes i + i+4, then i + i+2, then 0 + 1.
  static float hsum(vec v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
  }
  // out[j] = hsum(a[j]) for j < N, bit for bit: 8 accumulators at a time,
  // transposed so each one gets exactly hsum's additions (same operands, same
  // order): lanes i + i+4, i + i+2, 0 + 1.
  template <int N>
  [[gnu::always_inline]] static inline void hsums(const vec* a, float* out) {
    for (int g = 0; g < N; g += 8) {
      const int cnt = N - g < 8 ? N - g : 8;
      // Slot 2m + k holds accumulator 4k + m; the result's lane 4k + m is then
      // accumulator 4k + m.
      vec s[8];
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        const int acc = 4 * (q & 1) + (q >> 1);
        s[q] = acc < cnt ? a[g + acc] : _mm256_setzero_ps();
      }
      vec p[4], t[2];
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q)  // [x s4 | y s4]
        p[q] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * q], s[2 * q + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * q], s[2 * q + 1], 0x31));
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q)  // two s2 pairs per 128-bit lane
        t[q] = _mm256_add_ps(_mm256_shuffle_ps(p[2 * q], p[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(p[2 * q], p[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      const vec f = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
      if (cnt == 8) {
        _mm256_storeu_ps(out + g, f);
      } else {
        float b[8];
        _mm256_storeu_ps(b, f);
        for (int q = 0; q < cnt; ++q) out[g + q] = b[q];
      }
    }
  }
  static float hmax(vec v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static vec load_f16(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static vec load_bf16(const uint8_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static vec load_q8(const int8_t* q, vec d) {
    const __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(i), d);
  }
  static float f16(uint16_t h) { return _cvtsh_ss(h); }
  // W floats to f16 at p, rounded to nearest even; true when one is a NaN
  // (the hardware quiets NaNs, fp32_to_fp16 keeps their payload).
  static bool store_f16(const float* x, uint8_t* p) {
    const __m256 v = _mm256_loadu_ps(x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
  }
  static vec pow2n(vec n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
  static float sqrt1(float x) { return __builtin_sqrtf(x); }
};

}  // namespace

#include "kernels/cpu/simd_impl.h"

namespace cleave::cpu {
CLEAVE_DEFINE_KERNEL_TABLE(kKernelsAvx2)
}  // namespace cleave::cpu
