// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c).
// Plain functions on raw pointers only: no STL here (see kern.h).
#include <immintrin.h>

#include "kernels/cpu/kern.h"

namespace {

struct V {
  using vec = __m256;
  static constexpr int W = 8;
  static constexpr bool kOneKvLoader = false;  // attention: a loader per KV type pair
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
  static vec swap_pairs(vec a) { return _mm256_permute_ps(a, 0xB1); }  // (x1, x0, x3, x2, ...)
  // A value the compiler must materialise (no fma built across it).
  static void keep(vec& a) { asm("" : "+v"(a)); }
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
  // W Q4_0 values: the nibbles at bit `shift` (0 or 4) of W bytes, (q - 8) d.
  static vec load_q4(const uint8_t* q, int shift, vec d) {
    __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    i = _mm256_and_si256(_mm256_srl_epi32(i, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(15));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(i, _mm256_set1_epi32(8))), d);
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
  // The largest |x| of 32 floats into *amax; false when one is not finite.
  static bool amax32(const float* x, float* amax) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 big = _mm256_set1_ps(3.40282347e+38f);
    __m256 m = _mm256_setzero_ps();
    for (int h = 0; h < 32; h += 8) {
      const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + h), absmask);
      if (_mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ)) != 0xFF) return false;
      m = _mm256_max_ps(m, a);
    }
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    *amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
    return true;
  }
  // q[j] = roundf(x[j] * id) for 32 floats (half away from zero: trunc,
  // then one more away from zero when the exact remainder is at least 0.5).
  static void round_q8_32(const float* x, float id, int8_t* q) {
    const __m256 idv = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u))), one = _mm256_set1_ps(1.0f);
    for (int h = 0; h < 32; h += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + h), idv);
      __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 up = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(v, t), absmask), half, _CMP_GE_OQ);
      const __m256 step = _mm256_or_ps(one, _mm256_and_ps(v, sign));
      t = _mm256_add_ps(t, _mm256_and_ps(up, step));
      const __m256i i = _mm256_cvttps_epi32(t);
      const __m256i p16 = _mm256_packs_epi32(i, i);       // per 128-bit lane: a0-3 a0-3 | a4-7 a4-7
      const __m256i p8 = _mm256_packs_epi16(p16, p16);    // bytes: a0-3 x4 | a4-7 x4
      const int32_t lo = _mm256_extract_epi32(p8, 0), hi = _mm256_extract_epi32(p8, 4);
      __builtin_memcpy(q + h, &lo, 4);
      __builtin_memcpy(q + h + 4, &hi, 4);
    }
  }
  // Q4_0's values of 32 floats: q[j] = min(15, trunc(x[j] id + 8.5)) (the
  // product rounded first; at least 0), packed as byte j = q[j] | q[j + 16] << 4.
  static void round_q4_32(const float* x, float id, uint8_t* qs) {
    const __m256 idv = _mm256_set1_ps(id), off = _mm256_set1_ps(8.5f);
    const __m256i top = _mm256_set1_epi32(15), zero = _mm256_setzero_si256();
    __m256i q[4];
    for (int h = 0; h < 4; ++h) {
      __m256 p = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * h), idv);
      keep(p);
      q[h] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvttps_epi32(_mm256_add_ps(p, off)), zero), top);
    }
    const __m256i a = _mm256_or_si256(q[0], _mm256_slli_epi32(q[2], 4));  // bytes 0-7
    const __m256i b = _mm256_or_si256(q[1], _mm256_slli_epi32(q[3], 4));  // bytes 8-15
    const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // a0-7 | b0-7
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs),
                     _mm_packus_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1)));
  }
  static void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
  static void prefetch_l2(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
  static float sqrt1(float x) { return __builtin_sqrtf(x); }
};

}  // namespace

#include "kernels/cpu/simd_impl.h"

namespace cleave::cpu {
CLEAVE_DEFINE_KERNEL_TABLE(kKernelsAvx2)
}  // namespace cleave::cpu
