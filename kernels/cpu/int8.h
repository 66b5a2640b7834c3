// The opt-in int8 matmul (--compute int8): Q8_0 weights against activations
// quantised per row, 32 values at a time, to int8 with one f32 scale, as
// llama.cpp computes Q8_0. Each 32-element block's dot product is an exact
// integer; the blocks are then summed in float, in block order, one fused
// multiply-add each:
//
//   y[i][r] = 0;  for b in order:  y = fma(float(I_b), dw_b[r] * dx_b[i], y)
//
// where I_b = sum_j qw[r][32b + j] * qx[i][32b + j]. Integer sums are exact
// in any order, so every ISA (scalar, AVX2, AVX-512 VNNI) gives the same bits,
// and a row's result depends on its own values only (batch invariance).
//
// Weights are repacked once into panels of 16 rows, so the 16 outputs of a
// panel are the 16 lanes of one vector and no horizontal sum is needed. Per
// panel, per block b (kPanelBlockBytes):
//   float    d[16]        the rows' Q8_0 scales (0 for rows past the end)
//   uint8_t  q[8][16][4]  q[k4][r][j] = w[r][32b + 4 k4 + j] + 128
// (unsigned, as VNNI's vpdpbusd multiplies unsigned by signed bytes; the
// +128 is taken back with -128 * sum(qx) of the block, kept per x block).
//
// Plain functions on raw pointers only (this header is included by files
// compiled with ISA flags; see kern.h).
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace cleave::cpu {

constexpr int kPanelRows = 16;
constexpr size_t kPanelBlockBytes = 16 * 4 + 8 * 16 * 4;  // 576

// Bytes of the panels of a rows x cols Q8_0 matrix (cols a multiple of 32).
size_t int8_panel_bytes(int64_t rows, int64_t cols);
// Repack rows x cols Q8_0 weights (row r at w + r * row_bytes) into panels.
void int8_pack_q8_0(const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols,
                    uint8_t* panels);

// Activations: row i of x (cols floats) as cols int8 in xq, and per block b
// its scale xd[i * nb + b] (amax / 127, in f32) and xc[i * nb + b] =
// -128 * sum of the block's int8 values. q = roundf(x * (1 / d)), as Q8_0;
// a block holding an infinity or NaN gets d = NaN and q = 0.
// int8_quantize_rows is the reference; the SIMD ones give the same bytes
// (amax, the division, the product and roundf's half-away-from-zero
// rounding are each exact or correctly rounded the same way).
void int8_quantize_rows(const float* x, int64_t n, int64_t cols, int8_t* xq, float* xd,
                        int32_t* xc);
void int8_quantize_rows_avx2(const float* x, int64_t n, int64_t cols, int8_t* xq, float* xd,
                             int32_t* xc);
void int8_quantize_rows_avx512(const float* x, int64_t n, int64_t cols, int8_t* xq, float* xd,
                               int32_t* xc);
using Int8QuantizeFn = void (*)(const float* x, int64_t n, int64_t cols, int8_t* xq, float* xd,
                                int32_t* xc);

struct Int8MatmulArgs {
  const uint8_t* panels;
  int64_t rows, cols;  // the weights' (cols a multiple of 32)
  const int8_t* xq;    // n x cols
  const float* xd;     // n x cols / 32
  const int32_t* xc;   // n x cols / 32
  int64_t n;
  float* y;  // n x rows
};

// x rows a kernel takes per pass over its panels: their int8 values within
// ~256 KiB (so they stay in L2 while every panel sweeps them), a multiple of
// mr, at least mr.
int64_t int8_rows_per_pass(int64_t cols, int64_t mr);

// y[i][r] for every x row i and r in panels [p0, p1).
using Int8MatmulFn = void (*)(const Int8MatmulArgs* a, int64_t p0, int64_t p1);
void int8_matmul_scalar(const Int8MatmulArgs* a, int64_t p0, int64_t p1);
void int8_matmul_avx2(const Int8MatmulArgs* a, int64_t p0, int64_t p1);
void int8_matmul_avx512vnni(const Int8MatmulArgs* a, int64_t p0, int64_t p1);

}  // namespace cleave::cpu
