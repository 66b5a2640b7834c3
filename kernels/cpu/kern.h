// The CPU backend's per-ISA kernel tables. Each ISA file (kern_scalar.cpp,
// kern_avx2.cpp, kern_avx512.cpp) defines one table of plain functions on raw
// pointers; cpu_backend.cpp picks a table at run time and does the threading.
//
// This header is included by files compiled with AVX-512 flags: it must stay
// free of anything with vague linkage (no STL, no inline functions, no
// templates), or an AVX-512 copy could be picked for a caller on another CPU.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace cleave::cpu {

// Weight type codes (the DType values).
enum WeightCode : int { kWF32 = 0, kWF16 = 1, kWQ4 = 2, kWQ8 = 8, kWBF16 = 30 };  // kWQ4: KV only

struct PanelMatmulArgs;  // kernels/cpu/panels.h

// Attention over one layer of the paged KV cache (byte addresses: K and V
// rows may be F32, F16 or Q8_0, each widened exactly to F32 as it is read).
struct AttnArgs {
  const uint8_t* layer_base;  // kv.data + layer * layer_bytes (block 0 of that layer)
  size_t block_bytes;         // bytes per block (all layers)
  size_t k_head_bytes;        // one head's K rows in a (block, layer) part
  size_t v_head_bytes;
  size_t v_offset;            // bytes from a (block, layer) part's start to its V rows
  size_t k_row_bytes, v_row_bytes;
  int k_type, v_type;         // WeightCode values
  int32_t block_size;
  int32_t head_dim;
  int32_t group;  // query heads per kv head
  float scale;
};

// The call a thread runs after this one, whose first blocks the kernel
// prefetches while its own last blocks run (so a call does not start on
// KV that nobody asked for): its block table, kv heads and highest position.
struct AttnNext {
  const int32_t* block_table;
  int32_t kv_head, n_kv;
  int32_t max_pos;
};

// Floats of scratch the attention kernel needs (per thread) for a call over
// `heads` query heads (rows x n_kv kv heads x group).
#define CLEAVE_ATTN_SCRATCH(block_size, heads) (4 * (size_t(block_size) + 32) + 2 * size_t(heads) + 64)

struct Kernels {
  int lanes;  // SIMD width of the reductions
  // y[i][r] for every i < n and the rows of panels [p0, p1).
  void (*matmul)(const PanelMatmulArgs* a, int64_t p0, int64_t p1);
  void (*rmsnorm_row)(const float* x, const float* w, int64_t dim, float eps, float* y);
  void (*softmax_row)(float* x, int64_t len);
  // out = silu(g) * u, elementwise; each element computed the same way
  // wherever it sits.
  void (*silu_mul)(const float* g, const float* u, int64_t count, float* out);
  // R query rows of one sequence (one block table) whose positions pos[r]
  // fall in one block, against kv heads [kv_head, kv_head + n_kv) and the
  // `group` query heads that read each: row r's q and out at r *
  // row_stride, n_kv * group * head_dim floats each. The rows share the
  // loads of the blocks before their last. A row's bits do not depend on R
  // or n_kv. scratch: CLEAVE_ATTN_SCRATCH(block_size, R * n_kv * group)
  // floats. next: the thread's next call (null: none), prefetched only.
  void (*attn)(const AttnArgs* a, const float* q, int64_t row_stride, int32_t kv_head,
               int32_t n_kv, const int32_t* block_table, const int32_t* pos, int32_t R,
               float* out, float* scratch, const AttnNext* next);
  // LayerNorm of one row (w, b: dim floats); y may be x.
  void (*layer_norm_row)(const float* x, const float* w, const float* b, int64_t dim, float eps,
                         float* y);
  // y = gelu(x), kind 0 = tanh, 1 = quick; each element computed the same
  // way wherever it sits; y may be x.
  void (*gelu)(const float* x, int64_t count, int kind, float* y);
  // y = a + b elementwise; y may be a.
  void (*add)(const float* a, const float* b, int64_t count, float* y);
  // Test hook: attention's combined horizontal sums (combined) against
  // per-accumulator hsum (single) for n <= 24 accumulators of `lanes` floats.
  void (*hsums_check)(const float* acc, int n, float* combined, float* single);
  // count floats to F16 bytes, fp32_to_fp16 (kernels/dtype.h) bit for bit.
  void (*f16_row)(const float* x, int64_t count, uint8_t* out);
  // cols (a multiple of 32) floats to Q8_0 blocks, quantize_row_q8_0 (kernels/dtype.h) bit for bit.
  void (*q8_0_row)(const float* x, int64_t cols, uint8_t* out);
  // The same into Q4_0 blocks (the KV cache's), quantize_row_q4_0 bit for bit.
  void (*q4_0_row)(const float* x, int64_t cols, uint8_t* out);
  // Rotary embedding of one row's n_heads heads in place: pair (2j, 2j+1)
  // of each head becomes (x0 c - x1 s, x0 s + x1 c), from cs = (c0, c0, c1,
  // c1, ...) and sn = (-s0, s0, -s1, s1, ...) of head_dim floats each; the
  // bits of those scalar products and sums.
  void (*rope_rows)(float* x, const float* cs, const float* sn, int64_t n_heads, int64_t head_dim);
  // One row of cols values of weight type `type` (F32, F16, BF16, Q8_0)
  // widened to F32, dequantize_row (kernels/dtype.h) bit for bit.
  void (*widen_row)(int type, const uint8_t* row, int64_t cols, float* out);
  // o[d] = o[d] + w * y[d] for d < n, each product rounded before the add.
  void (*axpy_row)(float* o, float w, const float* y, int64_t n);
};

extern const Kernels kKernelsScalar;
extern const Kernels kKernelsAvx2;
extern const Kernels kKernelsAvx512;

}  // namespace cleave::cpu
