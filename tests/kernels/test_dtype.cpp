// dtype conversions and Q8_0 quantisation.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/dtype.h"

using namespace cleave;

namespace {
uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
}  // namespace

TEST_CASE("dtype: fp16 special values") {
  CHECK(fp32_to_fp16(0.0f) == 0x0000);
  CHECK(fp32_to_fp16(-0.0f) == 0x8000);
  CHECK(fp32_to_fp16(1.0f) == 0x3c00);
  CHECK(fp32_to_fp16(-2.0f) == 0xc000);
  CHECK(fp32_to_fp16(65504.0f) == 0x7bff);
  CHECK(fp32_to_fp16(65519.0f) == 0x7bff);
  CHECK(fp32_to_fp16(65520.0f) == 0x7c00);  // rounds to inf
  CHECK(fp32_to_fp16(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(fp32_to_fp16(-std::numeric_limits<float>::infinity()) == 0xfc00);
  CHECK((fp32_to_fp16(std::nanf("")) & 0x7c00) == 0x7c00);
  CHECK((fp32_to_fp16(std::nanf("")) & 0x03ff) != 0);
  CHECK(fp32_to_fp16(std::ldexp(1.0f, -24)) == 0x0001);      // smallest subnormal
  CHECK(fp32_to_fp16(std::ldexp(1.0f, -25)) == 0x0000);      // tie to even -> 0
  CHECK(fp32_to_fp16(std::ldexp(1.5f, -25)) == 0x0001);      // above the tie
  CHECK(fp32_to_fp16(std::ldexp(3.0f, -25)) == 0x0002);      // 1.5 ulp ties to even (2)
  CHECK(fp32_to_fp16(std::ldexp(1.0f, -14)) == 0x0400);      // smallest normal
  CHECK(fp32_to_fp16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);  // tie -> even
  CHECK(fp32_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);  // tie -> even (up)

  CHECK(fp16_to_fp32(0x3c00) == 1.0f);
  CHECK(fp16_to_fp32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(fp16_to_fp32(0x03ff) == std::ldexp(1023.0f, -24));
  CHECK(fp16_to_fp32(0x7bff) == 65504.0f);
  CHECK(std::isinf(fp16_to_fp32(0x7c00)));
  CHECK(std::isnan(fp16_to_fp32(0x7e00)));
  CHECK(bits(fp16_to_fp32(0x8000)) == 0x80000000u);
}

TEST_CASE("dtype: fp16 round trip of every half value") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = fp16_to_fp32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      CHECK(std::isnan(fp16_to_fp32(fp32_to_fp16(f))));
      continue;
    }
    REQUIRE(fp32_to_fp16(f) == h);
  }
}

TEST_CASE("dtype: fp32 -> fp16 rounds to nearest (vs double)") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mag(-20.0f, 15.0f);
  for (int i = 0; i < 20000; ++i) {
    const float f = std::ldexp(1.0f + (rng() & 0xffffff) / float(1 << 24), int(mag(rng))) *
                    ((rng() & 1) ? 1.0f : -1.0f);
    const uint16_t h = fp32_to_fp16(f);
    if ((h & 0x7fff) == 0x7c00) {  // overflow: only from 65520 (half-way past 65504) up
      CHECK(std::fabs(f) >= 65520.0f);
      continue;
    }
    CHECK(std::fabs(f) < 65520.0f);
    const double got = fp16_to_fp32(h);
    // No other half is strictly closer.
    const double up = fp16_to_fp32(static_cast<uint16_t>(h + 1));
    const double dn = fp16_to_fp32(static_cast<uint16_t>(h - 1));
    const double err = std::fabs(got - f);
    INFO("f=" << f << " h=" << h << " got=" << got << " up=" << up << " dn=" << dn);
    if ((h & 0x7fff) != 0x7bff && (h & 0x7fff) != 0) CHECK(err <= std::fabs(up - f));
    if ((h & 0x7fff) != 0) CHECK(err <= std::fabs(dn - f));
  }
}

TEST_CASE("dtype: bf16 round trip and rounding") {
  CHECK(fp32_to_bf16(1.0f) == 0x3f80);
  CHECK(fp32_to_bf16(-0.0f) == 0x8000);
  CHECK(fp32_to_bf16(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(std::isnan(bf16_to_fp32(fp32_to_bf16(std::nanf("")))));
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1).
  CHECK(fp32_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);
  CHECK(fp32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  CHECK(fp32_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)) == 0x3f81);
  // Max float rounds to inf.
  CHECK(fp32_to_bf16(std::numeric_limits<float>::max()) == 0x7f80);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_fp32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(fp32_to_bf16(f) == h);
  }
}

TEST_CASE("dtype: quantize_row_q8_0 matches a hand-computed block") {
  std::vector<float> x(64);
  for (int j = 0; j < 32; ++j) x[j] = (j - 16) * 0.25f;  // amax = 4 (j = 0)
  for (int j = 0; j < 32; ++j) x[32 + j] = 0.0f;           // all-zero block
  std::vector<uint8_t> q(2 * kQ8BlockBytes);
  quantize_row_q8_0(x.data(), 64, q.data());
  uint16_t dh;
  std::memcpy(&dh, q.data(), 2);
  const float d = 4.0f / 127.0f;
  CHECK(dh == fp32_to_fp16(d));
  const float id = 1.0f / d;
  for (int j = 0; j < 32; ++j) {
    const int expect = static_cast<int>(std::roundf(x[j] * id));
    CHECK(static_cast<int8_t>(q[2 + j]) == expect);
  }
  CHECK(static_cast<int8_t>(q[2]) == -127);
  CHECK(static_cast<int8_t>(q[2 + 16]) == 0);
  CHECK(static_cast<int8_t>(q[2 + 20]) == 32);  // 1.0 * 31.75 = 31.75 -> 32
  CHECK(static_cast<int8_t>(q[2 + 18]) == 16);  // 0.5 * 31.75 = 15.875 -> 16
  std::memcpy(&dh, q.data() + kQ8BlockBytes, 2);
  CHECK(dh == 0);
  for (int j = 0; j < 32; ++j) CHECK(q[kQ8BlockBytes + 2 + j] == 0);

  std::vector<float> back(64);
  dequantize_row(DType::Q8_0, q.data(), 64, back.data());
  for (int j = 0; j < 32; ++j) {
    CHECK(back[j] == static_cast<float>(static_cast<int8_t>(q[2 + j])) * fp16_to_fp32(fp32_to_fp16(d)));
    CHECK(std::fabs(back[j] - x[j]) <= 0.5f * d * 1.01f);
  }
  for (int j = 32; j < 64; ++j) CHECK(back[j] == 0.0f);
}

TEST_CASE("dtype: quantize_row_q4_0 matches hand-computed blocks (ggml's quantize_row_q4_0_ref)") {
  std::vector<float> x(96, 0.0f);
  for (int j = 0; j < 32; ++j) x[j] = (j - 16) * 0.25f;  // the largest |x| is -4 (j = 0): d = 0.5
  x[32] = 2.0f, x[33] = -2.0f, x[34] = 1.0f;             // the largest is +2: d = -0.25
  // x[64..95] all zero: d = -0 (0 / -8), every q 8.
  std::vector<uint8_t> q(3 * kQ4BlockBytes);
  quantize_row_q4_0(x.data(), 96, q.data());
  CHECK(dtype_row_bytes(DType::Q4_0, 96) == 3 * 18);
  uint16_t dh;
  std::memcpy(&dh, q.data(), 2);
  CHECK(dh == fp32_to_fp16(0.5f));
  // q = trunc(x / d + 8.5), at most 15: value j in the low nibble of byte
  // j, value j + 16 in the high one.
  for (int j = 0; j < 16; ++j) {
    const int lo = (j + 1) / 2, hi = std::min(15, 8 + (j + 1) / 2);
    CHECK(q[2 + j] == (lo | (hi << 4)));
  }
  std::memcpy(&dh, q.data() + 18, 2);
  CHECK(dh == fp32_to_fp16(-0.25f));
  CHECK((q[18 + 2] & 15) == 0);   // 2 / -0.25 + 8.5 = 0.5
  CHECK((q[18 + 3] & 15) == 15);  // -2 / -0.25 + 8.5 = 16.5: 16, clamped to 15
  CHECK((q[18 + 4] & 15) == 4);   // 4.5
  CHECK((q[18 + 5] & 15) == 8);
  std::memcpy(&dh, q.data() + 36, 2);
  CHECK(dh == fp32_to_fp16(-0.0f));
  for (int j = 0; j < 16; ++j) CHECK(q[36 + 2 + j] == 0x88);

  std::vector<float> back(96);
  dequantize_row(DType::Q4_0, q.data(), 96, back.data());
  CHECK(back[0] == -4.0f);
  CHECK(back[31] == 3.5f);   // 3.75 clamped to the top step, half a step off
  CHECK(back[17] == 0.5f);   // 0.25: half a step, rounded up
  CHECK(back[32] == 2.0f);
  CHECK(back[33] == -1.75f);  // -2 is a full step off: the other end of the range has 7 steps, not 8
  CHECK(back[34] == 1.0f);
  for (int j = 64; j < 96; ++j) CHECK(back[j] == 0.0f);
}

TEST_CASE("dtype: Q4_0 values within half a step of x, a whole one at the clamped end") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  const int64_t cols = 256;
  std::vector<float> x(cols), y(cols);
  for (auto& v : x) v = u(rng);
  std::vector<uint8_t> buf(dtype_row_bytes(DType::Q4_0, cols));
  quantize_row_q4_0(x.data(), cols, buf.data());
  dequantize_row(DType::Q4_0, buf.data(), cols, y.data());
  int clamped = 0;
  for (int64_t b = 0; b < cols / 32; ++b) {
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j)
      if (std::fabs(x[b * 32 + j]) > amax) amax = std::fabs(x[b * 32 + j]), max = x[b * 32 + j];
    const float d = max / -8;  // a step; the values are (q - 8) d for q in 0..15
    for (int j = 0; j < 32; ++j) {
      // x / d in [-8, 8]: up to 7.5 it rounds to the nearest step; above,
      // q = 15 is the top, r - 7 steps off (at most one).
      const double r = double(x[b * 32 + j]) / d;
      const double steps = r <= 7.499 ? 0.5 : r - 7;
      clamped += r > 7.499;
      // The F16 scale: (q - 8) steps of relative 2^-11 on top.
      CHECK(std::fabs(y[b * 32 + j] - x[b * 32 + j]) <= std::fabs(d) * (steps * 1.0001 + 8 * std::ldexp(1.0, -11)) + 1e-6);
    }
  }
  CHECK(clamped >= 1);  // the seed reaches the clamped end
}

TEST_CASE("dtype: dequantize_row for every type") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  const int64_t cols = 96;
  std::vector<float> x(cols), y(cols);
  for (auto& v : x) v = u(rng);
  std::vector<uint8_t> buf(cols * 4);
  dequantize_row(DType::F32, x.data(), cols, y.data());
  CHECK(std::memcmp(x.data(), y.data(), cols * 4) == 0);
  std::vector<uint16_t> h(cols);
  for (int64_t i = 0; i < cols; ++i) h[i] = fp32_to_fp16(x[i]);
  dequantize_row(DType::F16, h.data(), cols, y.data());
  for (int64_t i = 0; i < cols; ++i) CHECK(y[i] == fp16_to_fp32(h[i]));
  for (int64_t i = 0; i < cols; ++i) h[i] = fp32_to_bf16(x[i]);
  dequantize_row(DType::BF16, h.data(), cols, y.data());
  for (int64_t i = 0; i < cols; ++i) {
    CHECK(y[i] == bf16_to_fp32(h[i]));
    CHECK(std::fabs(y[i] - x[i]) <= std::fabs(x[i]) * (1.0f / 256));
  }
  quantize_row_q8_0(x.data(), cols, buf.data());
  dequantize_row(DType::Q8_0, buf.data(), cols, y.data());
  for (int64_t b = 0; b < cols / 32; ++b) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[b * 32 + j]));
    for (int j = 0; j < 32; ++j) CHECK(std::fabs(y[b * 32 + j] - x[b * 32 + j]) <= amax / 127 * 0.51f);
  }
  CHECK(dtype_row_bytes(DType::Q8_0, 96) == 3 * 34);
}
