// Helpers shared by the kernel tests.
#pragma once

#include <cstring>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/dtype.h"

namespace cleave::test {

// scalar always, plus every SIMD level this CPU runs.
inline std::vector<Isa> isas() {
  std::vector<Isa> out{Isa::scalar};
  const Isa best = detect_isa();
  if (best == Isa::avx2 || best == Isa::avx512) out.push_back(Isa::avx2);
  if (best == Isa::avx512) out.push_back(Isa::avx512);
  return out;
}

// Seeded uniform floats in [lo, hi), never exactly zero.
inline std::vector<float> randv(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) {
    do x = u(rng);
    while (x == 0.0f);
  }
  return v;
}

// A weight matrix in its stored type, built from random floats.
struct Weights {
  DType type;
  int64_t rows, cols;
  size_t row_bytes;
  std::vector<uint8_t> data;
  std::vector<float> deq;  // dequantised, rows x cols
  WeightView view() const { return WeightView{type, data.data(), rows, cols, row_bytes}; }
};

inline Weights make_weights(DType t, int64_t rows, int64_t cols, uint32_t seed, size_t pad = 0) {
  Weights w{t, rows, cols, dtype_row_bytes(t, cols) + pad, {}, {}};
  w.data.assign(w.row_bytes * rows + 64, 0xab);
  const std::vector<float> f = randv(size_t(rows * cols), seed);
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* dst = w.data.data() + r * w.row_bytes;
    const float* src = f.data() + r * cols;
    switch (t) {
      case DType::F32: std::memcpy(dst, src, cols * 4); break;
      case DType::F16:
        for (int64_t c = 0; c < cols; ++c) {
          const uint16_t h = fp32_to_fp16(src[c]);
          std::memcpy(dst + 2 * c, &h, 2);
        }
        break;
      case DType::BF16:
        for (int64_t c = 0; c < cols; ++c) {
          const uint16_t h = fp32_to_bf16(src[c]);
          std::memcpy(dst + 2 * c, &h, 2);
        }
        break;
      case DType::Q8_0: quantize_row_q8_0(src, cols, dst); break;
      case DType::Q4_0: quantize_row_q4_0(src, cols, dst); break;
    }
  }
  w.deq.resize(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row(t, w.data.data() + r * w.row_bytes, cols, w.deq.data() + r * cols);
  return w;
}

}  // namespace cleave::test
