// The KV cache's row writers (Kernels::f16_row, q8_0_row, q4_0_row),
// written once over the SIMD traits struct V. Included only by
// kernels/cpu/simd_impl.h, inside its translation unit's anonymous
// namespace rules (see simd_impl.h and kern.h).
#pragma once

namespace {

// count floats to f16 (kernels/dtype.h's fp32_to_fp16, bit for bit: the
// hardware's round to nearest even, with NaN lanes redone by the formula).
template <class V>
void f16_row_k(const float* x, int64_t count, uint8_t* out) {
  int64_t i = 0;
  for (; i + V::W <= count; i += V::W)
    if (V::store_f16(x + i, out + 2 * i))
      for (int j = 0; j < V::W; ++j) {
        const uint16_t h = cleave::fp32_to_fp16(x[i + j]);
        __builtin_memcpy(out + 2 * (i + j), &h, 2);
      }
  for (; i < count; ++i) {
    const uint16_t h = cleave::fp32_to_fp16(x[i]);
    __builtin_memcpy(out + 2 * i, &h, 2);
  }
}

// Rows into 32-value blocks of block_bytes each, a block at a time:
// block(xb, amax, ob) stores it from its largest |x| and answers false to
// leave it to `formula` (the scalar reference), as do blocks holding a NaN
// or an infinity.
template <class V, class Block>
void block_rows(const float* x, int64_t cols, uint8_t* out, int64_t block_bytes,
                void (*formula)(const float*, int64_t, void*), Block block) {
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + b * 32;
    uint8_t* ob = out + b * block_bytes;
    float amax = 0.0f;
    if (!V::amax32(xb, &amax) || !block(xb, amax, ob)) formula(xb, 32, ob);
  }
}

// quantize_row_q8_0 (kernels/dtype.h) bit for bit: the same amax, d = amax
// / 127, id = 1 / d and roundf(x id); a block whose 1 / d overflows goes
// through the formula.
template <class V>
void q8_0_row_k(const float* x, int64_t cols, uint8_t* out) {
  block_rows<V>(x, cols, out, 34, cleave::quantize_row_q8_0, [](const float* xb, float amax, uint8_t* ob) {
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    if (!(id <= 3.40282347e+38f)) return false;  // d subnormal: x id is out of int8's range, which each ISA converts its own way
    const uint16_t dh = cleave::fp32_to_fp16(d);
    __builtin_memcpy(ob, &dh, 2);
    V::round_q8_32(xb, id, reinterpret_cast<int8_t*>(ob + 2));
    return true;
  });
}

// quantize_row_q4_0 (kernels/dtype.h) bit for bit: the first element of
// the largest |x|, d = it / -8, id = 1 / d and min(15, trunc(x id + 8.5));
// a block whose 1 / d overflows goes through the formula.
template <class V>
void q4_0_row_k(const float* x, int64_t cols, uint8_t* out) {
  block_rows<V>(x, cols, out, 18, cleave::quantize_row_q4_0, [](const float* xb, float amax, uint8_t* ob) {
    int first = 0;
    while (first < 31 && !(__builtin_fabsf(xb[first]) == amax)) ++first;
    // A block of zeros keeps the formula's +0 (its -0s are never "larger").
    const float d = (amax == 0.0f ? 0.0f : xb[first]) / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    if (!(__builtin_fabsf(id) <= 3.40282347e+38f)) return false;  // d subnormal: x id overflows
    const uint16_t dh = cleave::fp32_to_fp16(d);
    __builtin_memcpy(ob, &dh, 2);
    V::round_q4_32(xb, id, ob + 2);
    return true;
  });
}

}  // namespace
