// Scalar dtype conversions and Q8_0 / Q4_0 (de)quantisation, bit-exact with ggml.
#include "kernels/dtype.h"

#include <cmath>
#include <cstring>

namespace cleave {

namespace {
inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {  // inf / nan (keep the payload, quiet bit stays where it was)
    return u2f(sign | 0x7f800000u | (mant << 13));
  }
  if (exp == 0) {
    if (mant == 0) return u2f(sign);
    // Subnormal: value = mant * 2^-24, exact in float.
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while ((mant & 0x400u) == 0);
    mant &= 0x3ffu;
    return u2f(sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant << 13));
  }
  return u2f(sign | (exp + (127 - 15)) << 23 | (mant << 13));
}

uint16_t fp32_to_fp16(float f) {
  const uint32_t u = f2u(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    if (abs == 0x7f800000u) return sign | 0x7c00u;
    uint16_t m = static_cast<uint16_t>((abs >> 13) & 0x3ffu);
    return sign | 0x7c00u | (m ? m : 0x200u);  // keep it a nan
  }
  // Largest finite half is 65504; anything rounding past it becomes inf.
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in half: value / 2^-24 rounded to even.
    if (abs < 0x33000000u) return sign;  // < 2^-25: rounds to 0 (2^-25 exactly ties to 0)
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    // value = m * 2^(e-127-23); in units of 2^-24: m * 2^(e-126) -> shift right by (126 - e)
    const uint32_t shift = 126 - e;
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  // Normal: rebias and round mantissa to 10 bits, nearest even (carry may bump exponent).
  uint32_t v = abs - ((127u - 15u) << 23);
  const uint32_t rem = v & 0x1fffu;
  v >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) ++v;
  return sign | static_cast<uint16_t>(v);
}

uint16_t fp32_to_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // nan: keep it a quiet nan
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

void quantize_row_q8_0(const float* x, int64_t cols, void* out) {
  uint8_t* o = static_cast<uint8_t*>(out);
  const int64_t nb = cols / kQ8Block;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kQ8Block;
    float amax = 0.0f;
    for (int j = 0; j < kQ8Block; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = fp32_to_fp16(d);
    uint8_t* ob = o + b * kQ8BlockBytes;
    std::memcpy(ob, &dh, 2);
    for (int j = 0; j < kQ8Block; ++j) {
      const float v = xb[j] * id;
      const int8_t q = static_cast<int8_t>(std::roundf(v));
      std::memcpy(ob + 2 + j, &q, 1);
    }
  }
}

void quantize_row_q4_0(const float* x, int64_t cols, void* out) {
  uint8_t* o = static_cast<uint8_t*>(out);
  const int64_t nb = cols / kQ8Block;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kQ8Block;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQ8Block; ++j)
      if (amax < std::fabs(xb[j])) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = fp32_to_fp16(d);
    uint8_t* ob = o + b * kQ4BlockBytes;
    std::memcpy(ob, &dh, 2);
    // x / d + 8.5 is in [0.5, 16.5] for finite x: truncated, at most 15
    // (ggml's MIN(15, (int8_t)(...))); a NaN stores 0 rather than UB.
    auto q = [&](float v) -> uint8_t {
      float p = v * id;
#if defined(__x86_64__) || defined(__i386__)
      __asm__("" : "+x"(p));  // the product rounded before the add (no fma under -march=native)
#else
      p = *static_cast<volatile float*>(&p);
#endif
      const float t = p + 8.5f;
      return t >= 0.0f ? (t < 16.0f ? uint8_t(t) : uint8_t(15)) : uint8_t(0);
    };
    for (int j = 0; j < kQ8Block / 2; ++j) ob[2 + j] = uint8_t(q(xb[j]) | (q(xb[j + kQ8Block / 2]) << 4));
  }
}

void dequantize_row(DType t, const void* row, int64_t cols, float* out) {
  const uint8_t* p = static_cast<const uint8_t*>(row);
  switch (t) {
    case DType::F32:
      std::memcpy(out, p, static_cast<size_t>(cols) * 4);
      return;
    case DType::F16:
      for (int64_t i = 0; i < cols; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = fp16_to_fp32(h);
      }
      return;
    case DType::BF16:
      for (int64_t i = 0; i < cols; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = bf16_to_fp32(h);
      }
      return;
    case DType::Q8_0: {
      const int64_t nb = cols / kQ8Block;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* pb = p + b * kQ8BlockBytes;
        uint16_t dh;
        std::memcpy(&dh, pb, 2);
        const float d = fp16_to_fp32(dh);
        for (int j = 0; j < kQ8Block; ++j) {
          out[b * kQ8Block + j] = static_cast<float>(static_cast<int8_t>(pb[2 + j])) * d;
        }
      }
      return;
    }
    case DType::Q4_0: {
      const int64_t nb = cols / kQ8Block;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* pb = p + b * kQ4BlockBytes;
        uint16_t dh;
        std::memcpy(&dh, pb, 2);
        const float d = fp16_to_fp32(dh);
        for (int j = 0; j < kQ8Block / 2; ++j) {
          out[b * kQ8Block + j] = static_cast<float>(int(pb[2 + j] & 15) - 8) * d;
          out[b * kQ8Block + j + kQ8Block / 2] = static_cast<float>(int(pb[2 + j] >> 4) - 8) * d;
        }
      }
      return;
    }
  }
}

}  // namespace cleave
