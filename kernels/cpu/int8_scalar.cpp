// The int8 matmul's portable parts: weight repacking, activation
// quantisation (one implementation for every ISA, so the int8 values agree
// bit for bit), and the scalar kernel every SIMD kernel must match.
#include <cmath>
#include <cstring>

#include "kernels/cpu/int8.h"
#include "kernels/dtype.h"

namespace cleave::cpu {

size_t int8_panel_bytes(int64_t rows, int64_t cols) {
  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows;
  return size_t(panels) * size_t(cols / 32) * kPanelBlockBytes;
}

int64_t int8_rows_per_pass(int64_t cols, int64_t mr) {
  const int64_t rows = (int64_t(256) * 1024 / (cols > 0 ? cols : 1)) / mr * mr;
  return rows < mr ? mr : rows;
}

void int8_pack_q8_0(const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols,
                    uint8_t* panels) {
  const int64_t nb = cols / 32;
  const int64_t np = (rows + kPanelRows - 1) / kPanelRows;
  for (int64_t p = 0; p < np; ++p) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* out = panels + (size_t(p) * size_t(nb) + size_t(b)) * kPanelBlockBytes;
      float d[kPanelRows];
      for (int rr = 0; rr < kPanelRows; ++rr) {
        const int64_t r = p * kPanelRows + rr;
        const uint8_t* blk = r < rows ? w + size_t(r) * row_bytes + size_t(b) * kQ8BlockBytes : nullptr;
        uint16_t h = 0;
        if (blk) std::memcpy(&h, blk, 2);
        d[rr] = blk ? fp16_to_fp32(h) : 0.0f;
        for (int k4 = 0; k4 < 8; ++k4)
          for (int j = 0; j < 4; ++j) {
            const int8_t q = blk ? int8_t(blk[2 + 4 * k4 + j]) : int8_t(0);
            out[64 + (k4 * kPanelRows + rr) * 4 + j] = uint8_t(int(q) + 128);
          }
      }
      std::memcpy(out, d, sizeof d);
    }
  }
}

void int8_quantize_rows(const float* x, int64_t n, int64_t cols, int8_t* xq, float* xd,
                        int32_t* xc) {
  const int64_t nb = cols / 32;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * cols + b * 32;
      int8_t* q = xq + i * cols + b * 32;
      float amax = 0.0f;
      bool finite = true;
      for (int j = 0; j < 32; ++j) {
        finite = finite && std::isfinite(xb[j]);
        amax = std::fmax(amax, std::fabs(xb[j]));
      }
      // A non-finite value makes the block's scale NaN (its values 0), so it
      // reaches the output as the exact path would carry it (never a silent
      // zero).
      const float d = finite ? amax / 127.0f : NAN;
      const float id = finite && d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      for (int j = 0; j < 32; ++j) {
        q[j] = finite ? static_cast<int8_t>(std::roundf(xb[j] * id)) : int8_t(0);
        sum += q[j];
      }
      xd[i * nb + b] = d;
      xc[i * nb + b] = -128 * sum;
    }
  }
}

void int8_matmul_scalar(const Int8MatmulArgs* a, int64_t p0, int64_t p1) {
  const int64_t nb = a->cols / 32;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = a->panels + size_t(p) * size_t(nb) * kPanelBlockBytes;
    for (int64_t i = 0; i < a->n; ++i) {
      const int8_t* xq = a->xq + i * a->cols;
      for (int rr = 0; rr < kPanelRows && p * kPanelRows + rr < a->rows; ++rr) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* pb = panel + size_t(b) * kPanelBlockBytes;
          int32_t isum = a->xc[i * nb + b];
          for (int k4 = 0; k4 < 8; ++k4)
            for (int j = 0; j < 4; ++j)
              isum += int32_t(pb[64 + (k4 * kPanelRows + rr) * 4 + j]) * xq[b * 32 + 4 * k4 + j];
          float dw;
          std::memcpy(&dw, pb + 4 * rr, 4);
          const float s = dw * a->xd[i * nb + b];
          acc = std::fmaf(float(isum), s, acc);
        }
        a->y[i * a->rows + p * kPanelRows + rr] = acc;
      }
    }
  }
}

}  // namespace cleave::cpu
