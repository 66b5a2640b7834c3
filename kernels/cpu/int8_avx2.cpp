// The int8 matmul with AVX2: a panel's 16 weight rows as two 8-lane halves;
// each 4-byte product sum per lane from vpmaddubsw (|w| unsigned times x
// carrying w's sign, at most 2 * 128 * 127 per pair: no saturation) and
// vpmaddwd. The integer sums equal VNNI's exactly, so the outputs do too.
#include <immintrin.h>

#include "kernels/cpu/int8.h"

namespace cleave::cpu {
namespace {

// Also in int8_avx512.cpp: each ISA file keeps its own copy, as shared
// inline functions could be emitted with the other file's ISA (kern.h).
inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

constexpr int kMR = 2;

template <int MI>
void panel_rows(const uint8_t* panel, int64_t nb, int64_t cols, const int8_t* xq, const float* xd,
                float* y, int64_t ldy, int valid) {
  const __m256i bias = _mm256_set1_epi8(char(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MI][2];
  for (int ii = 0; ii < MI; ++ii) acc[ii][0] = acc[ii][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + size_t(b) * kPanelBlockBytes;
    __m256i s[MI][2];
    for (int ii = 0; ii < MI; ++ii) s[ii][0] = s[ii][1] = _mm256_setzero_si256();
    for (int k4 = 0; k4 < 8; ++k4) {
      __m256i w[2], aw[2];
      for (int h = 0; h < 2; ++h) {
        // Back to signed weights: u8 - 128 is a flip of the top bit.
        w[h] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 64 + 64 * k4 + 32 * h)), bias);
        aw[h] = _mm256_abs_epi8(w[h]);
      }
      for (int ii = 0; ii < MI; ++ii) {
        const __m256i xb = _mm256_set1_epi32(load_i32(xq + ii * cols + b * 32 + 4 * k4));
        for (int h = 0; h < 2; ++h) {
          const __m256i p16 = _mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xb, w[h]));
          s[ii][h] = _mm256_add_epi32(s[ii][h], _mm256_madd_epi16(p16, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_loadu_ps(reinterpret_cast<const float*>(pb) + 8 * h);
      for (int ii = 0; ii < MI; ++ii) {
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[ii * nb + b]));
        acc[ii][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[ii][h]), scale, acc[ii][h]);
      }
    }
  }
  for (int ii = 0; ii < MI; ++ii) {
    if (valid == 16) {
      _mm256_storeu_ps(y + ii * ldy, acc[ii][0]);
      _mm256_storeu_ps(y + ii * ldy + 8, acc[ii][1]);
    } else {
      alignas(32) float tmp[16];
      _mm256_store_ps(tmp, acc[ii][0]);
      _mm256_store_ps(tmp + 8, acc[ii][1]);
      for (int j = 0; j < valid; ++j) y[ii * ldy + j] = tmp[j];
    }
  }
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

}  // namespace

void int8_quantize_rows_avx2(const float* x, int64_t n, int64_t cols, int8_t* xq, float* xd,
                             int32_t* xc) {
  const int64_t nb = cols / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  const __m256 fmax = _mm256_set1_ps(3.40282347e38f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * cols + b * 32;
      __m256 v[4], m = _mm256_setzero_ps();
      int finite = 0xff;
      for (int h = 0; h < 4; ++h) {
        v[h] = _mm256_loadu_ps(xb + 8 * h);
        const __m256 a = _mm256_andnot_ps(sign, v[h]);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, fmax, _CMP_LE_OQ));
        m = _mm256_max_ps(m, a);
      }
      const bool ok = finite == 0xff;
      const float amax = hmax8(m);
      const float d = ok ? amax / 127.0f : __builtin_nanf("");
      const float id = ok && d != 0.0f ? 1.0f / d : 0.0f;
      const __m256 vid = _mm256_set1_ps(id);
      __m256i q[4];
      for (int h = 0; h < 4; ++h) {  // roundf, as the AVX-512 quantiser
        const __m256 p = _mm256_mul_ps(v[h], vid);
        const __m256 a = _mm256_andnot_ps(sign, p);
        __m256 t = _mm256_round_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        t = _mm256_add_ps(t, _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(a, t), half, _CMP_GE_OQ), one));
        q[h] = ok ? _mm256_cvttps_epi32(_mm256_or_ps(t, _mm256_and_ps(p, sign))) : _mm256_setzero_si256();
      }
      // int32 -> int8 in order: pack to int16 (lanes interleave per 128 bits),
      // then to int8, then undo the interleave.
      const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * cols + b * 32), bytes);
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      xd[i * nb + b] = d;
      xc[i * nb + b] = -128 * _mm_cvtsi128_si32(s4);
    }
}

void int8_matmul_avx2(const Int8MatmulArgs* a, int64_t p0, int64_t p1) {
  const int64_t nb = a->cols / 32;
  const int64_t xg = int8_rows_per_pass(a->cols, kMR);  // as the AVX-512 kernel
  for (int64_t i0 = 0; i0 < a->n; i0 += xg) {
  const int64_t i1 = a->n - i0 < xg ? a->n : i0 + xg;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = a->panels + size_t(p) * size_t(nb) * kPanelBlockBytes;
    const int64_t r = p * kPanelRows;
    const int valid = a->rows - r >= 16 ? 16 : int(a->rows - r);
    for (int64_t i = i0; i < i1; i += kMR) {
      const int64_t nb_i = i * nb;
      if (i1 - i >= 2)
        panel_rows<2>(panel, nb, a->cols, a->xq + i * a->cols, a->xd + nb_i, a->y + i * a->rows + r,
                      a->rows, valid);
      else
        panel_rows<1>(panel, nb, a->cols, a->xq + i * a->cols, a->xd + nb_i, a->y + i * a->rows + r,
                      a->rows, valid);
    }
  }
  }
}

}  // namespace cleave::cpu
