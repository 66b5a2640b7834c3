// AVX-512 kernels (compiled with -mavx512f/bw/vl/dq ... by kernels/CMakeLists.txt).
// Plain functions on raw pointers only: no STL here (see kern.h).
// GCC 12 warns on _mm512_undefined_*() inside its own intrinsics (a GCC bug).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kernels/cpu/kern.h"

namespace {

struct V {
  using vec = __m512;
  static constexpr int W = 16;
  static constexpr bool kOneKvLoader = false;  // attention: a loader per KV type pair
  // Matmul microkernel: up to 12 x rows by np_for(rows) panels of 16 outputs
  // (one vector each): 8 independent chains at 1-2 rows (decode streams 8
  // panels), 24 accumulators at 6 and 12. Twelve rows by two panels widen
  // half as many F16 weights per FMA as six by four: on Intel cores the
  // widening takes the FMA ports (+10 % at 32 decode streams, more prefill).
  static constexpr int MR = 12;
  static constexpr int np_for(int mi) { return mi <= 2 ? 8 : mi <= 6 ? 4 : 2; }
  static vec zero() { return _mm512_setzero_ps(); }
  static vec set1(float f) { return _mm512_set1_ps(f); }
  static vec loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
  static vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
  static vec div(vec a, vec b) { return _mm512_div_ps(a, b); }
  static vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
  static vec swap_pairs(vec a) { return _mm512_permute_ps(a, 0xB1); }  // (x1, x0, x3, x2, ...)
  // A value the compiler must materialise (no fma built across it).
  static void keep(vec& a) { asm("" : "+v"(a)); }
  static vec min(vec a, vec b) { return _mm512_min_ps(a, b); }
  static vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float fmas(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
  // Fixed tree: lanes i + i+8, then i + i+4, then i + i+2, then 0 + 1.
  static float hsum(vec v) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
  }
  // out[j] = hsum(a[j]) for j < N, bit for bit: 16 accumulators at a time,
  // transposed so each one gets exactly hsum's additions (same operands, same
  // order): lanes i + i+8, i + i+4, i + i+2, 0 + 1.
  template <int N>
  [[gnu::always_inline]] static inline void hsums(const vec* a, float* out) {
    for (int g = 0; g < N; g += 16) {
      const int cnt = N - g < 16 ? N - g : 16;
      // Slot 4m + k holds accumulator 4k + m; the result's lane 4k + m is then
      // accumulator 4k + m.
      vec s[16];
#pragma GCC unroll 16
      for (int q = 0; q < 16; ++q) {
        const int acc = 4 * (q & 3) + (q >> 2);
        s[q] = acc < cnt ? a[g + acc] : _mm512_setzero_ps();
      }
      vec p[8], r[4], t[2];
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q)  // [x s8 | y s8]
        p[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0x44),
                             _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0xEE));
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q)  // four s4, one per 128-bit lane
        r[q] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * q], p[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(p[2 * q], p[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q)  // two s2 pairs per 128-bit lane
        t[q] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * q], r[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(r[2 * q], r[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      const vec f = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
      if (cnt == 16)
        _mm512_storeu_ps(out + g, f);
      else
        _mm512_mask_storeu_ps(out + g, __mmask16((1u << cnt) - 1), f);
    }
  }
  static float hmax(vec v) { return _mm512_reduce_max_ps(v); }
  static vec load_f16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static vec load_bf16(const uint8_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static vec load_q8(const int8_t* q, vec d) {
    const __m512i i = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(i), d);
  }
  // W Q4_0 values: the nibbles at bit `shift` (0 or 4) of W bytes, (q - 8) d.
  static vec load_q4(const uint8_t* q, int shift, vec d) {
    __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    i = _mm512_and_si512(_mm512_srl_epi32(i, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(15));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i, _mm512_set1_epi32(8))), d);
  }
  static float f16(uint16_t h) { return _cvtsh_ss(h); }
  // W floats to f16 at p, rounded to nearest even; true when one is a NaN
  // (the hardware quiets NaNs, fp32_to_fp16 keeps their payload).
  static bool store_f16(const float* x, uint8_t* p) {
    const __m512 v = _mm512_loadu_ps(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
  }
  // 2^n for integral n in [-126, 127].
  static vec pow2n(vec n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  // The largest |x| of 32 floats into *amax; false when one is not finite.
  static bool amax32(const float* x, float* amax) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x)), b = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
    const __m512 big = _mm512_set1_ps(3.40282347e+38f);
    if ((_mm512_cmp_ps_mask(a, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(b, big, _CMP_LE_OQ)) != 0xFFFF) return false;
    *amax = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
    return true;
  }
  // q[j] = roundf(x[j] * id) for 32 floats (half away from zero: trunc,
  // then one more away from zero when the exact remainder is at least 0.5).
  static void round_q8_32(const float* x, float id, int8_t* q) {
    const __m512 idv = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f);
    const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u)), one = _mm512_set1_epi32(0x3f800000);
    for (int h = 0; h < 32; h += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + h), idv);
      __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
      const __m512 step = _mm512_castsi512_ps(_mm512_or_si512(one, _mm512_and_si512(_mm512_castps_si512(v), sign)));
      t = _mm512_mask_add_ps(t, up, t, step);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + h), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(t)));
    }
  }
  // Q4_0's values of 32 floats: q[j] = min(15, trunc(x[j] id + 8.5)) (the
  // product rounded first; at least 0), packed as byte j = q[j] | q[j + 16] << 4.
  static void round_q4_32(const float* x, float id, uint8_t* qs) {
    const __m512 idv = _mm512_set1_ps(id), off = _mm512_set1_ps(8.5f);
    const __m512i top = _mm512_set1_epi32(15), zero = _mm512_setzero_si512();
    __m512i q[2];
    for (int h = 0; h < 2; ++h) {
      __m512 p = _mm512_mul_ps(_mm512_loadu_ps(x + 16 * h), idv);
      keep(p);
      q[h] = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(_mm512_add_ps(p, off)), zero), top);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs),
                     _mm512_cvtepi32_epi8(_mm512_or_si512(q[0], _mm512_slli_epi32(q[1], 4))));
  }
  static void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
  static void prefetch_l2(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
  static float sqrt1(float x) { return __builtin_sqrtf(x); }
};

}  // namespace

#include "kernels/cpu/simd_impl.h"

namespace cleave::cpu {
CLEAVE_DEFINE_KERNEL_TABLE(kKernelsAvx512)
}  // namespace cleave::cpu
