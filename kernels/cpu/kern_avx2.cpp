// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c).
// Plain functions on raw pointers only: no STL here (see kern.h).
#include <immintrin.h>

#include "kernels/cpu/kern.h"

namespace {

struct V {
  using vec = __m256;
  static constexpr int W = 8;
  static constexpr int MR = 4;  // 4 x rows by 3 weight rows = 12 accumulators
  static constexpr int NR = 3;
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
