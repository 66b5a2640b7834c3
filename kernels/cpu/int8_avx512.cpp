// The int8 matmul with AVX-512 VNNI (vpdpbusd): a panel's 16 weight rows are
// the 16 lanes, each vpdpbusd adds 4 bytes of one x row (broadcast) times 4
// bytes of each weight row. Chosen only where the CPU reports AVX512_VNNI.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kernels/cpu/int8.h"

namespace cleave::cpu {
namespace {

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// MI x rows (stride cols) against one panel; y rows at stride ldy, `valid`
// lanes stored. Fewer than 4 rows: two integer chains per row (k4 even and
// odd), so vpdpbusd's latency is hidden; the integer sum is the same.
template <int MI>
[[gnu::always_inline]] inline void panel_rows(const uint8_t* panel, int64_t nb, int64_t cols,
                                              const int8_t* xq, const float* xd, const int32_t* xc,
                                              float* y, int64_t ldy, __mmask16 valid) {
  constexpr bool kTwo = MI < 4;
  __m512 acc[MI];
#pragma GCC unroll 8
  for (int ii = 0; ii < MI; ++ii) acc[ii] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + size_t(b) * kPanelBlockBytes;
    __m512i w[8];
#pragma GCC unroll 8
    for (int k4 = 0; k4 < 8; ++k4) w[k4] = _mm512_loadu_si512(pb + 64 + 64 * k4);
    __m512i s[MI], t[MI];
#pragma GCC unroll 8
    for (int ii = 0; ii < MI; ++ii) {
      s[ii] = _mm512_set1_epi32(xc[ii * nb + b]);
      if (kTwo) t[ii] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int k4 = 0; k4 < 8; ++k4)
#pragma GCC unroll 8
      for (int ii = 0; ii < MI; ++ii) {
        const __m512i xb = _mm512_set1_epi32(load_i32(xq + ii * cols + b * 32 + 4 * k4));
        if (kTwo && (k4 & 1))
          t[ii] = _mm512_dpbusd_epi32(t[ii], w[k4], xb);
        else
          s[ii] = _mm512_dpbusd_epi32(s[ii], w[k4], xb);
      }
    const __m512 dw = _mm512_loadu_ps(reinterpret_cast<const float*>(pb));
#pragma GCC unroll 8
    for (int ii = 0; ii < MI; ++ii) {
      const __m512i isum = kTwo ? _mm512_add_epi32(s[ii], t[ii]) : s[ii];
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[ii * nb + b]));
      acc[ii] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[ii]);
    }
  }
#pragma GCC unroll 8
  for (int ii = 0; ii < MI; ++ii) _mm512_mask_storeu_ps(y + ii * ldy, valid, acc[ii]);
}

// MI x rows against two adjacent panels (32 weight rows): each x broadcast
// feeds two vpdpbusd, and the weights are loaded a k4 step at a time (two
// registers), so the loads per vpdpbusd fall from 9/8 to (2 + MI) / (2 MI).
// Every output runs panel_rows' operations.
template <int MI>
[[gnu::always_inline]] inline void panel_pair_rows(const uint8_t* panel0, size_t pstride, int64_t nb,
                                                   int64_t cols, const int8_t* xq, const float* xd,
                                                   const int32_t* xc, float* y, int64_t ldy,
                                                   __mmask16 valid1) {
  __m512 acc[MI][2];
#pragma GCC unroll 8
  for (int ii = 0; ii < MI; ++ii) acc[ii][0] = acc[ii][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb0 = panel0 + size_t(b) * kPanelBlockBytes;
    const uint8_t* pb1 = pb0 + pstride;
    __m512i s[MI][2];
#pragma GCC unroll 8
    for (int ii = 0; ii < MI; ++ii) s[ii][0] = s[ii][1] = _mm512_set1_epi32(xc[ii * nb + b]);
#pragma GCC unroll 8
    for (int k4 = 0; k4 < 8; ++k4) {
      const __m512i w0 = _mm512_loadu_si512(pb0 + 64 + 64 * k4);
      const __m512i w1 = _mm512_loadu_si512(pb1 + 64 + 64 * k4);
#pragma GCC unroll 8
      for (int ii = 0; ii < MI; ++ii) {
        const __m512i xb = _mm512_set1_epi32(load_i32(xq + ii * cols + b * 32 + 4 * k4));
        s[ii][0] = _mm512_dpbusd_epi32(s[ii][0], w0, xb);
        s[ii][1] = _mm512_dpbusd_epi32(s[ii][1], w1, xb);
      }
    }
    const __m512 dw0 = _mm512_loadu_ps(reinterpret_cast<const float*>(pb0));
    const __m512 dw1 = _mm512_loadu_ps(reinterpret_cast<const float*>(pb1));
#pragma GCC unroll 8
    for (int ii = 0; ii < MI; ++ii) {
      const __m512 dx = _mm512_set1_ps(xd[ii * nb + b]);
      acc[ii][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[ii][0]), _mm512_mul_ps(dw0, dx), acc[ii][0]);
      acc[ii][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[ii][1]), _mm512_mul_ps(dw1, dx), acc[ii][1]);
    }
  }
#pragma GCC unroll 8
  for (int ii = 0; ii < MI; ++ii) {
    _mm512_storeu_ps(y + ii * ldy, acc[ii][0]);
    _mm512_mask_storeu_ps(y + ii * ldy + 16, valid1, acc[ii][1]);
  }
}

constexpr int kMR = 8;
constexpr int kMR2 = 6;  // x rows per pass of the two-panel kernel

template <int MI>
void pair_block(const Int8MatmulArgs* a, const uint8_t* panel, int64_t i, int64_t r, __mmask16 valid1) {
  const int64_t nb = a->cols / 32;
  panel_pair_rows<MI>(panel, size_t(nb) * kPanelBlockBytes, nb, a->cols, a->xq + i * a->cols,
                      a->xd + i * nb, a->xc + i * nb, a->y + i * a->rows + r, a->rows, valid1);
}

template <int MI>
void rows_block(const Int8MatmulArgs* a, const uint8_t* panel, int64_t i, int64_t r,
                __mmask16 valid) {
  const int64_t nb = a->cols / 32;
  panel_rows<MI>(panel, nb, a->cols, a->xq + i * a->cols, a->xd + i * nb, a->xc + i * nb,
                 a->y + i * a->rows + r, a->rows, valid);
}

using RowsFn = void (*)(const Int8MatmulArgs*, const uint8_t*, int64_t, int64_t, __mmask16);
constexpr RowsFn kRows[kMR + 1] = {nullptr,        rows_block<1>, rows_block<2>,
                                   rows_block<3>,  rows_block<4>, rows_block<5>,
                                   rows_block<6>,  rows_block<7>, rows_block<8>};
constexpr RowsFn kPairs[kMR2 + 1] = {nullptr,       nullptr,       nullptr,      nullptr,
                                     pair_block<4>, pair_block<5>, pair_block<6>};

}  // namespace

void int8_quantize_rows_avx512(const float* x, int64_t n, int64_t cols, int8_t* xq, float* xd,
                               int32_t* xc) {
  const int64_t nb = cols / 32;
  const __m512 sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * cols + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const __m512 a0 = _mm512_andnot_ps(sign, v0), a1 = _mm512_andnot_ps(sign, v1);
      // Non-finite: |x| is not <= FLT_MAX (NaN compares false).
      const __m512 fmax = _mm512_set1_ps(3.40282347e38f);
      const bool finite = (_mm512_cmp_ps_mask(a0, fmax, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, fmax, _CMP_LE_OQ)) ==
                          0xffff;
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
      const float d = finite ? amax / 127.0f : __builtin_nanf("");
      const float id = finite && d != 0.0f ? 1.0f / d : 0.0f;
      const __m512 vid = _mm512_set1_ps(id);
      __m512i q[2];
      const __m512 vs[2] = {v0, v1};
      for (int h = 0; h < 2; ++h) {
        // roundf: |v| truncated, plus one when the dropped part is >= 1/2
        // (exact: |v| <= 127), the sign put back.
        const __m512 v = _mm512_mul_ps(vs[h], vid);
        const __m512 a = _mm512_andnot_ps(sign, v);
        __m512 t = _mm512_roundscale_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        t = _mm512_mask_add_ps(t, _mm512_cmp_ps_mask(_mm512_sub_ps(a, t), half, _CMP_GE_OQ), t, one);
        q[h] = finite ? _mm512_cvttps_epi32(_mm512_or_ps(t, _mm512_and_ps(v, sign))) : _mm512_setzero_si512();
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * cols + b * 32), _mm512_cvtepi32_epi8(q[0]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * cols + b * 32 + 16), _mm512_cvtepi32_epi8(q[1]));
      xd[i * nb + b] = d;
      xc[i * nb + b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
    }
}

void int8_matmul_avx512vnni(const Int8MatmulArgs* a, int64_t p0, int64_t p1) {
  const int64_t nb = a->cols / 32;
  // x rows per pass, their int8 values within ~256 KiB (L2), so each panel
  // sweeps them from L2; the panels stream once per pass.
  const int64_t xg = int8_rows_per_pass(a->cols, kMR);
  for (int64_t i0 = 0; i0 < a->n; i0 += xg) {
    const int64_t i1 = a->n - i0 < xg ? a->n : i0 + xg;
    for (int64_t p = p0; p < p1;) {
      const uint8_t* panel = a->panels + size_t(p) * size_t(nb) * kPanelBlockBytes;
      const int64_t r = p * kPanelRows;
      if (p + 1 < p1 && i1 - i0 >= 4) {  // two panels, blocks of 4-6 x rows
        const int64_t left = a->rows - r - 16;
        const __mmask16 valid1 = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        int64_t i = i0;
        for (; i1 - i >= 4; i += kMR2) {
          const int64_t mi = i1 - i < kMR2 ? i1 - i : kMR2;
          kPairs[mi](a, panel, i, r, valid1);
        }
        for (int p2 = 0; p2 < 2 && i < i1; ++p2) {  // 1-3 rows left: one panel at a time
          const int64_t left2 = a->rows - r - 16 * p2;
          const __mmask16 v2 = left2 >= 16 ? __mmask16(0xffff) : __mmask16((1u << left2) - 1);
          kRows[i1 - i](a, panel + size_t(p2) * size_t(nb) * kPanelBlockBytes, i, r + 16 * p2, v2);
        }
        p += 2;
        continue;
      }
      const int64_t left = a->rows - r;
      const __mmask16 valid = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      for (int64_t i = i0; i < i1; i += kMR) {
        const int64_t mi = i1 - i < kMR ? i1 - i : kMR;
        kRows[mi](a, panel, i, r, valid);
      }
      ++p;
    }
  }
}

}  // namespace cleave::cpu
