// The exact matmul's weight layout: panels of 16 rows, k-major, in the
// weights' stored type, so the 16 outputs of a panel are the lanes of one
// AVX-512 vector (two AVX2 ones) and each output is one fused multiply-add
// chain over k in order:
//
//   y[i][r] = 0;  for k in order:  y = fma(x[i][k], w[r][k], y)
//
// with w[r][k] widened exactly to f32. Nothing in a row's result depends on
// the other rows of x, the panels' grouping or the thread count (batch
// invariance), and AVX2 and AVX-512 give the same bits (the portable scalar
// kernels round the product before the add).
//
// One panel, per type (rows past the matrix's end are zeros):
//   F32:        K x 16 floats           w[k][r]
//   F16, BF16:  K x 16 halves           w[k][r]
//   Q8_0:       per 32-element block b: uint16_t d[16] (the rows' f16
//               scales), then int8_t q[32][16] (q[k][r]); 544 bytes
// A panel's stride is its size rounded up to 64 bytes.
//
// Plain functions on raw pointers only (included by files compiled with ISA
// flags; see kern.h).
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace cleave::cpu {

constexpr int kPanel = 16;
constexpr size_t kQ8PanelBlockBytes = 16 * 2 + 32 * 16;  // 544

// Bytes from one panel to the next for `wtype` (a WeightCode) and cols.
size_t panel_stride(int wtype, int64_t cols);
// Panels [p0, p1) of rows x cols weights (row r at w + r * row_bytes) into
// out (panel p at out + (p - p0) * panel_stride).
void pack_panels(int wtype, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols,
                 int64_t p0, int64_t p1, uint8_t* out);

struct PanelMatmulArgs {
  int wtype;
  const uint8_t* panels;  // panel 0
  size_t stride;          // panel_stride(wtype, cols)
  int64_t rows, cols;
  const float* x;  // n x cols, dense
  int64_t n;
  float* y;  // n x rows, dense
  // This thread's scratch for panels widened to F32 (kWidePanels x 16 x
  // cols floats), or null: a pass of enough row blocks over F16, BF16 or
  // Q8_0 panels (the type's kWidenBlocks in simd_impl.h: 4, 4 and 3)
  // widens each group of panels once there and runs every block over the
  // F32 copy, where each block would widen them again (exact widening: the
  // same bits either way).
  float* wide = nullptr;
};
// Panels a widened group holds at most (PanelMatmulArgs::wide).
constexpr int kWidePanels = 2;
// Floats to leave between two threads' wide scratch: the matmul prefetches
// a widened group up to 2 KiB past its end, which must not pull in lines
// another thread is writing.
constexpr size_t kWideGapFloats = 1024;

}  // namespace cleave::cpu
