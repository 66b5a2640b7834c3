// Element types of weights, with the numeric ids GGUF/ggml use on disk.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cleave {

enum class DType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,  // the KV cache only: no weight of a model is one (dtype_known)
  Q8_0 = 8,
  BF16 = 30,
};

constexpr int64_t kQ8Block = 32;          // elements per Q8_0 block
constexpr int64_t kQ8BlockBytes = 2 + 32;  // fp16 scale + 32 int8
constexpr int64_t kQ4BlockBytes = 2 + 16;  // fp16 scale + 32 4-bit values (ggml's Q4_0)

// The types a model's weights may have (a GGUF tensor, a matmul).
inline bool dtype_known(uint32_t id) {
  return id == 0 || id == 1 || id == 8 || id == 30;
}
// The types a KV cache may store (check_kv_type says which fit a head_dim).
inline bool kv_dtype_known(uint32_t id) { return id == 0 || id == 1 || id == 2 || id == 8; }

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::Q4_0: return "Q4_0";
    case DType::Q8_0: return "Q8_0";
    case DType::BF16: return "BF16";
  }
  return "?";
}

// Elements per storage block (1 for plain types, 32 for Q8_0 and Q4_0).
inline int64_t dtype_block_elems(DType t) { return t == DType::Q8_0 || t == DType::Q4_0 ? kQ8Block : 1; }
inline int64_t dtype_block_bytes(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::Q8_0: return kQ8BlockBytes;
    case DType::Q4_0: return kQ4BlockBytes;
  }
  return 0;
}
// Bytes of one row of `cols` elements; cols must be a multiple of the block size.
inline size_t dtype_row_bytes(DType t, int64_t cols) {
  return static_cast<size_t>(cols / dtype_block_elems(t) * dtype_block_bytes(t));
}

// Scalar conversions (exact, round-to-nearest-even where narrowing).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
inline float bf16_to_fp32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
uint16_t fp32_to_bf16(float f);

// Quantise one row of `cols` floats (multiple of 32) into Q8_0 blocks, as ggml does:
// d = max|x| / 127, q = round(x / d).
void quantize_row_q8_0(const float* x, int64_t cols, void* out);
// The same into Q4_0 blocks, as ggml's quantize_row_q4_0_ref: m = the
// element of largest |x| (the first on ties), d = m / -8, q = min(15,
// trunc(x / d + 8.5)); byte j holds q[j] in its low nibble and q[j + 16] in
// its high one; the value is (q - 8) d.
void quantize_row_q4_0(const float* x, int64_t cols, void* out);
// Dequantise a row of any type into floats.
void dequantize_row(DType t, const void* row, int64_t cols, float* out);

}  // namespace cleave
