#include "kernels/cpu/panels.h"

#include <cstring>

#include "kernels/cpu/kern.h"

namespace cleave::cpu {

namespace {

size_t round64(size_t b) { return (b + 63) / 64 * 64; }

// nrows (<= 16) rows of `esize`-byte elements to k-major (out is zeroed:
// rows past nrows stay zero).
void transpose16(const uint8_t* w, size_t row_bytes, int64_t nrows, int64_t cols, size_t esize,
                 uint8_t* out) {
  for (int64_t j = 0; j < nrows; ++j) {
    const uint8_t* row = w + size_t(j) * row_bytes;
    uint8_t* o = out + size_t(j) * esize;
    if (esize == 2) {
      for (int64_t k = 0; k < cols; ++k) std::memcpy(o + size_t(k) * 32, row + 2 * k, 2);
    } else {
      for (int64_t k = 0; k < cols; ++k) std::memcpy(o + size_t(k) * 64, row + 4 * k, 4);
    }
  }
}

}  // namespace

size_t panel_stride(int wtype, int64_t cols) {
  switch (wtype) {
    case kWF32: return round64(size_t(cols) * 16 * 4);
    case kWF16:
    case kWBF16: return round64(size_t(cols) * 16 * 2);
    case kWQ8: return round64(size_t(cols / 32) * kQ8PanelBlockBytes);
    default: return 0;
  }
}

void pack_panels(int wtype, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols,
                 int64_t p0, int64_t p1, uint8_t* out) {
  const size_t stride = panel_stride(wtype, cols);
  for (int64_t p = p0; p < p1; ++p) {
    uint8_t* o = out + size_t(p - p0) * stride;
    const int64_t r0 = p * kPanel;
    const int64_t nrows = rows - r0 < kPanel ? rows - r0 : kPanel;
    const uint8_t* src = w + size_t(r0) * row_bytes;
    std::memset(o, 0, stride);
    if (wtype == kWQ8) {
      const int64_t nb = cols / 32;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* blk = o + size_t(b) * kQ8PanelBlockBytes;
        for (int64_t j = 0; j < nrows; ++j) {
          const uint8_t* in = src + size_t(j) * row_bytes + size_t(b) * 34;
          std::memcpy(blk + 2 * j, in, 2);
          for (int k = 0; k < 32; ++k) blk[32 + k * 16 + j] = in[2 + k];
        }
      }
    } else {
      transpose16(src, row_bytes, nrows, cols, wtype == kWF32 ? 4 : 2, o);
    }
  }
}

}  // namespace cleave::cpu
