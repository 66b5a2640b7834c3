// The kernels, written once over a SIMD traits struct V and included by each
// ISA file (kern_scalar.cpp, kern_avx2.cpp, kern_avx512.cpp) after it defines
// V. Everything here has internal linkage (anonymous namespace), so an ISA
// file's copies never leak into another.
//
// V provides: vec, W (lanes), MR/NR (matmul microkernel), zero, set1, loadu,
// storeu, add, sub, mul, div, max, min, fmadd(a, b, c) = a*b+c, hsum/hmax
// (a fixed reduction tree), load_f16, load_bf16, load_q8(q, d), f16 (scalar),
// fmas(a, b, c) (scalar a*b+c, fused exactly when fmadd is), pow2n, sqrt1.
//
// Batch invariance: every dot product y[i][r] runs the same operations in the
// same order in every microkernel: one accumulator vector over k in W-steps,
// V::hsum, then the scalar tail in k order. Elementwise functions handle a
// ragged end by padding into a full vector, so an element's value never
// depends on where it sits.
#pragma once

#include "kernels/cpu/kern.h"

#ifndef CLEAVE_PF_BYTES
#define CLEAVE_PF_BYTES 1024
#endif

namespace {

using cleave::cpu::AttnArgs;
using cleave::cpu::MatmulArgs;

template <class T>
inline T min_of(T a, T b) {
  return a < b ? a : b;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return h;
}

// ---- weight loaders: W weights of one row starting at element k ----------

template <class V>
struct LF32 {
  static constexpr int kBlock = 1;
  static constexpr size_t kDecodePfRows = 2;
  static const uint8_t* addr(const uint8_t* row, int64_t k) { return row + 4 * k; }
  static typename V::vec load(const uint8_t* row, int64_t k) {
    return V::loadu(reinterpret_cast<const float*>(row) + k);
  }
  static float at(const uint8_t* row, int64_t k) {
    float f;
    __builtin_memcpy(&f, row + 4 * k, 4);
    return f;
  }
};

template <class V>
struct LF16 {
  static constexpr int kBlock = 1;
  static constexpr size_t kDecodePfRows = 1;
  static const uint8_t* addr(const uint8_t* row, int64_t k) { return row + 2 * k; }
  static typename V::vec load(const uint8_t* row, int64_t k) { return V::load_f16(row + 2 * k); }
  static float at(const uint8_t* row, int64_t k) { return V::f16(load_u16(row + 2 * k)); }
};

template <class V>
struct LBF16 {
  static constexpr int kBlock = 1;
  static constexpr size_t kDecodePfRows = 1;
  static const uint8_t* addr(const uint8_t* row, int64_t k) { return row + 2 * k; }
  static typename V::vec load(const uint8_t* row, int64_t k) { return V::load_bf16(row + 2 * k); }
  static float at(const uint8_t* row, int64_t k) {
    uint32_t u = uint32_t(load_u16(row + 2 * k)) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
};

// Q8_0: 34-byte blocks (fp16 d, 32 x int8); W divides 32, k is a multiple of W.
template <class V>
struct LQ8 {
  static constexpr int kBlock = 32;
  static constexpr size_t kDecodePfRows = 0;  // uses CLEAVE_PF_BYTES
  // The 32 / W vectors of the block starting at k (k a multiple of 32).
  static void load_block(const uint8_t* row, int64_t k, typename V::vec* out) {
    const uint8_t* blk = row + (k >> 5) * 34;
    const typename V::vec d = V::set1(V::f16(load_u16(blk)));
    for (int v = 0; v < 32 / V::W; ++v)
      out[v] = V::load_q8(reinterpret_cast<const int8_t*>(blk + 2 + v * V::W), d);
  }
  static const uint8_t* addr(const uint8_t* row, int64_t k) { return row + (k >> 5) * 34; }
  static typename V::vec load(const uint8_t* row, int64_t k) {
    const uint8_t* blk = row + (k >> 5) * 34;
    const float d = V::f16(load_u16(blk));
    return V::load_q8(reinterpret_cast<const int8_t*>(blk + 2 + (k & 31)), V::set1(d));
  }
  static float at(const uint8_t* row, int64_t k) {
    const uint8_t* blk = row + (k >> 5) * 34;
    return float(int8_t(blk[2 + (k & 31)])) * V::f16(load_u16(blk));
  }
};

// ---- matmul ----------------------------------------------------------------

// MI x-rows (stride cols) times NR weight rows (stride rs bytes):
// y[i * ldy + j * ys]. pfd > 0 prefetches each weight row pfd bytes ahead.
template <class V, class L, int MI, int NR>
void mk(const float* x, int64_t cols, const uint8_t* w, size_t rs, float* y, int64_t ldy,
        int64_t ys = 1, size_t pfd = 0) {
  using vec = typename V::vec;
  vec acc[MI][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MI; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[i][j] = V::zero();
  const int64_t kv = cols / V::W * V::W;
  int64_t k0 = 0;
  if constexpr (MI > 1 && L::kBlock > V::W) {
    // A few x rows over Q8_0: each weight block widened once for all of
    // them, every accumulator still stepping through k in order. (Decode,
    // below, keeps its x vectors in registers across the weight rows: one
    // loop for both measured a few % slower at batch 1.)
    constexpr int VB = L::kBlock / V::W;
    const int64_t kb = cols / L::kBlock * L::kBlock;
    for (; k0 < kb; k0 += L::kBlock) {
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        if (pfd) V::prefetch(L::addr(w + j * rs, k0) + pfd);
        vec wv[VB];
        L::load_block(w + j * rs, k0, wv);
#pragma GCC unroll 8
        for (int v = 0; v < VB; ++v)
#pragma GCC unroll 8
          for (int i = 0; i < MI; ++i)
            acc[i][j] = V::fmadd(V::loadu(x + i * cols + k0 + v * V::W), wv[v], acc[i][j]);
      }
    }
  }
  if constexpr (MI == 1 && L::kBlock > V::W) {
    // Decode over Q8_0: one scale load per 32-element block, chunks still
    // accumulated in k order (the same operations as the loop below).
    constexpr int VB = L::kBlock / V::W;
    const int64_t kb = cols / L::kBlock * L::kBlock;
    for (; k0 < kb; k0 += L::kBlock) {
      vec xv[VB];
#pragma GCC unroll 8
      for (int v = 0; v < VB; ++v) xv[v] = V::loadu(x + k0 + v * V::W);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        if (pfd) V::prefetch(L::addr(w + j * rs, k0) + pfd);
        vec wv[VB];
        L::load_block(w + j * rs, k0, wv);
#pragma GCC unroll 8
        for (int v = 0; v < VB; ++v) acc[0][j] = V::fmadd(xv[v], wv[v], acc[0][j]);
      }
    }
  }
  for (int64_t k = k0; k < kv; k += V::W) {
    vec xv[MI];
#pragma GCC unroll 8
    for (int i = 0; i < MI; ++i) xv[i] = V::loadu(x + i * cols + k);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      if (pfd) V::prefetch(L::addr(w + j * rs, k) + pfd);
      const vec wv = L::load(w + j * rs, k);
#pragma GCC unroll 8
      for (int i = 0; i < MI; ++i) acc[i][j] = V::fmadd(xv[i], wv, acc[i][j]);
    }
  }
  // V::hsums: each accumulator reduced exactly as V::hsum reduces it.
  float hs[MI * NR];
  V::template hsums<MI * NR>(&acc[0][0], hs);
  for (int i = 0; i < MI; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hs[i * NR + j];
      for (int64_t k = kv; k < cols; ++k) s = V::fmas(x[i * cols + k], L::at(w + j * rs, k), s);
      y[i * ldy + j * ys] = s;
    }
  }
}

// Prefill microkernel over a packed weight panel: NR weight rows' vectors for
// k in [k0, k1) stored k-step-major (P[(k - k0) / W * NR + j], exactly the
// values L::load gives, so the FMAs see the same operands as mk). The same
// per-accumulator sequence as mk: zero at k0 == 0, else resume from accs
// (stored there by the previous chunk, bit-exact); at k1 == kv (the vector
// end of k) V::hsums, the scalar tail from the original rows w, y stored.
template <class V, class L, int MI, int NR>
void mkp(const float* x, int64_t cols, const typename V::vec* P, int64_t k0, int64_t k1,
         typename V::vec* accs, const uint8_t* w, size_t rs, float* y, int64_t ldy) {
  using vec = typename V::vec;
  vec acc[MI][NR];
  if (k0 == 0) {
#pragma GCC unroll 8
    for (int i = 0; i < MI; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[i][j] = V::zero();
  } else {
#pragma GCC unroll 8
    for (int i = 0; i < MI; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[i][j] = accs[i * NR + j];
  }
  const vec* p = P;
  for (int64_t k = k0; k < k1; k += V::W, p += NR) {
    vec xv[MI];
#pragma GCC unroll 8
    for (int i = 0; i < MI; ++i) xv[i] = V::loadu(x + i * cols + k);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const vec wv = p[j];
#pragma GCC unroll 8
      for (int i = 0; i < MI; ++i) acc[i][j] = V::fmadd(xv[i], wv, acc[i][j]);
    }
  }
  const int64_t kv = cols / V::W * V::W;
  if (k1 < kv) {
#pragma GCC unroll 8
    for (int i = 0; i < MI; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) accs[i * NR + j] = acc[i][j];
    return;
  }
  float hs[MI * NR];
  V::template hsums<MI * NR>(&acc[0][0], hs);
  if (kv == cols) {
    for (int i = 0; i < MI; ++i)
      for (int j = 0; j < NR; ++j) y[i * ldy + j] = hs[i * NR + j];
    return;
  }
  for (int i = 0; i < MI; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hs[i * NR + j];
      for (int64_t k = kv; k < cols; ++k) s = V::fmas(x[i * cols + k], L::at(w + j * rs, k), s);
      y[i * ldy + j] = s;
    }
  }
}

template <class V, class L, int MI>
void mk_nr(int nr, const float* x, int64_t cols, const uint8_t* w, size_t rb, float* y,
           int64_t ldy) {
  switch (nr) {
    case 1: mk<V, L, MI, 1>(x, cols, w, rb, y, ldy); return;
    case 2: mk<V, L, MI, (V::NR >= 2 ? 2 : 1)>(x, cols, w, rb, y, ldy); return;
    case 3: mk<V, L, MI, (V::NR >= 3 ? 3 : 1)>(x, cols, w, rb, y, ldy); return;
    case 4: mk<V, L, MI, (V::NR >= 4 ? 4 : 1)>(x, cols, w, rb, y, ldy); return;
    case 5: mk<V, L, MI, (V::NR >= 5 ? 5 : 1)>(x, cols, w, rb, y, ldy); return;
    case 6: mk<V, L, MI, (V::NR >= 6 ? 6 : 1)>(x, cols, w, rb, y, ldy); return;
    case 7: mk<V, L, MI, (V::NR >= 7 ? 7 : 1)>(x, cols, w, rb, y, ldy); return;
    case 8: mk<V, L, MI, (V::NR >= 8 ? 8 : 1)>(x, cols, w, rb, y, ldy); return;
    default: __builtin_trap();
  }
}

template <class V, class L>
void mk_any(int mi, int nr, const float* x, int64_t cols, const uint8_t* w, size_t rb, float* y,
            int64_t ldy) {
  switch (mi) {
    case 1: mk_nr<V, L, 1>(nr, x, cols, w, rb, y, ldy); return;
    case 2: mk_nr<V, L, (V::MR >= 2 ? 2 : 1)>(nr, x, cols, w, rb, y, ldy); return;
    case 3: mk_nr<V, L, (V::MR >= 3 ? 3 : 1)>(nr, x, cols, w, rb, y, ldy); return;
    case 4: mk_nr<V, L, (V::MR >= 4 ? 4 : 1)>(nr, x, cols, w, rb, y, ldy); return;
    default: __builtin_trap();
  }
}

// mk over mi x rows (1..MR) at once, the weight rows as decode streams.
template <class V, class L, int NR>
void mk_stream(int mi, const float* x, int64_t cols, const uint8_t* w, size_t rs, float* y,
               int64_t ldy, int64_t ys, size_t pfd) {
  switch (mi) {
    case 1: mk<V, L, 1, NR>(x, cols, w, rs, y, ldy, ys, pfd); return;
    case 2: mk<V, L, (V::MR >= 2 ? 2 : 1), NR>(x, cols, w, rs, y, ldy, ys, pfd); return;
    case 3: mk<V, L, (V::MR >= 3 ? 3 : 1), NR>(x, cols, w, rs, y, ldy, ys, pfd); return;
    case 4: mk<V, L, (V::MR >= 4 ? 4 : 1), NR>(x, cols, w, rs, y, ldy, ys, pfd); return;
    default: __builtin_trap();
  }
}

template <class V, class L>
void matmul_t(const MatmulArgs* a, int64_t r0, int64_t r1) {
  const int64_t cols = a->cols, rows = a->rows, n = a->n;
  const size_t rb = a->row_bytes;
  if (n <= V::STREAM_N) {
    // Decode and small batches: the range's rows as NR1 long streams (block
    // b takes rows r0 + b + j * S), so each stream reads contiguous memory
    // for the hardware prefetchers; the x rows go through each block of
    // weight rows MR_STREAM at a time while it sits in L1 (read from memory once).
    // Every output still runs mk's operation sequence.
    const int64_t S = (r1 - r0) / V::NR1;
    // Software prefetch L::kDecodePfRows rows ahead in each stream (Q8_0:
    // CLEAVE_PF_BYTES ahead). Measured on Zen 5 (100M and 15M models, 1 and 2
    // threads): F16 best at 1 row (2 rows loses ~7% on 100M, 0 loses on the
    // L3-sized 15M), F32 (3 KiB rows) gains ~15% from 2 rows.
    const size_t pfd = L::kBlock > V::W ? size_t(CLEAVE_PF_BYTES) : L::kDecodePfRows * rb;
    for (int64_t b = 0; b < S; ++b)
      for (int64_t i = 0; i < n; i += V::MR_STREAM)
        mk_stream<V, L, V::NR1>(int(min_of<int64_t>(V::MR_STREAM, n - i)), a->x + i * cols, cols,
                                a->w + size_t(r0 + b) * rb, S * rb, a->y + i * rows + r0 + b, rows, S,
                                i == 0 ? pfd : 0);
    for (int64_t r = r0 + S * V::NR1; r < r1; r += V::NR) {
      const int nr = int(min_of<int64_t>(V::NR, r1 - r));
      for (int64_t i = 0; i < n; i += V::MR)
        mk_any<V, L>(int(min_of<int64_t>(V::MR, n - i)), nr, a->x + i * cols, cols, a->w + size_t(r) * rb, rb,
                     a->y + i * rows + r, rows);
    }
    return;
  }
  // x rows per pass: keep them within ~512 KiB (L2), weights stream once per pass.
  int64_t xg = (int64_t(512) * 1024) / (cols * 4 > 0 ? cols * 4 : 1);
  xg = xg / V::MR * V::MR;
  if (xg < V::MR) xg = V::MR;
  // Full NR-row weight panels are packed, KC elements of k at a time, into an
  // aligned k-step-major buffer (one sequential L1-resident stream, converted
  // once instead of once per x group); the MR-row groups of the pass sweep it,
  // resuming their accumulators from accs between chunks.
  using vec = typename V::vec;
  constexpr int64_t KC = 1024 / V::W * V::W;
  constexpr int64_t kMaxGroups = 32;
  const int64_t kv = cols / V::W * V::W;
  // Rows longer than one chunk whose unpacked panel still fits half of L1
  // (F16 / BF16 up to 2048 wide) measured faster unpacked (no accumulator
  // round trips); both paths give the same bits.
  const bool pack = (L::kBlock <= V::W || KC % L::kBlock == 0) &&
                    (kv <= KC || size_t(V::NR) * rb > size_t(24) * 1024);
  if (kv > KC && xg > kMaxGroups * V::MR) xg = kMaxGroups * V::MR;
  alignas(64) vec P[KC / V::W * V::NR];
  alignas(64) vec accs[kMaxGroups * V::MR * V::NR];
  for (int64_t i0 = 0; i0 < n; i0 += xg) {
    const int64_t i1 = min_of(n, i0 + xg);
    const int64_t ifull = i0 + (i1 - i0) / V::MR * V::MR;
    for (int64_t r = r0; r < r1; r += V::NR) {
      const int nr = int(min_of<int64_t>(V::NR, r1 - r));
      const uint8_t* w = a->w + size_t(r) * rb;
      // Prefetch the next panel's rows (each panel is read once per pass, so
      // it is cold), spread over this panel's x sweep.
      const int64_t nnext = min_of<int64_t>(V::NR, r1 - r - nr);
      const int64_t pf_lines = nnext > 0 ? int64_t(nnext * rb + 63) / 64 : 0;
      const int64_t calls = ((ifull - i0) / V::MR) * ((kv + KC - 1) / KC) + 1;
      const int64_t pf_per = (pf_lines + calls - 1) / calls;
      const uint8_t* pfb = w + size_t(nr) * rb;
      int64_t pf_at = 0;
      if (pack && nr == V::NR && kv > 0 && ifull > i0) {
        for (int64_t k0 = 0; k0 < kv; k0 += KC) {
          const int64_t k1 = min_of(kv, k0 + KC);
          vec* q = P;
          for (int64_t k = k0; k < k1; k += V::W, q += V::NR)
#pragma GCC unroll 16
            for (int j = 0; j < V::NR; ++j) q[j] = L::load(w + j * rb, k);
          for (int64_t i = i0; i < ifull; i += V::MR) {
            for (const int64_t e = pf_at + pf_per; pf_at < e && pf_at < pf_lines; ++pf_at)
              V::prefetch(pfb + pf_at * 64);
            mkp<V, L, V::MR, V::NR>(a->x + i * cols, cols, P, k0, k1,
                                    accs + (i - i0) / V::MR * (V::MR * V::NR), w, rb,
                                    a->y + i * rows + r, rows);
          }
        }
      } else {
        for (int64_t i = i0; i < ifull; i += V::MR) {
          for (const int64_t e = pf_at + pf_per; pf_at < e && pf_at < pf_lines; ++pf_at)
            V::prefetch(pfb + pf_at * 64);
          mk_nr<V, L, V::MR>(nr, a->x + i * cols, cols, w, rb, a->y + i * rows + r, rows);
        }
      }
      if (ifull < i1)
        mk_any<V, L>(int(i1 - ifull), nr, a->x + ifull * cols, cols, w, rb, a->y + ifull * rows + r,
                     rows);
    }
  }
}

template <class V>
void matmul_k(const MatmulArgs* a, int64_t r0, int64_t r1) {
  switch (a->wtype) {
    case cleave::cpu::kWF32: matmul_t<V, LF32<V>>(a, r0, r1); return;
    case cleave::cpu::kWF16: matmul_t<V, LF16<V>>(a, r0, r1); return;
    case cleave::cpu::kWBF16: matmul_t<V, LBF16<V>>(a, r0, r1); return;
    case cleave::cpu::kWQ8: matmul_t<V, LQ8<V>>(a, r0, r1); return;
    default: __builtin_trap();
  }
}

// ---- elementwise helpers ---------------------------------------------------

// exp(x) for x in about [-87, 88] (clamped outside), ~1 ulp (Cephes expf).
template <class V>
typename V::vec vexp(typename V::vec x) {
  using vec = typename V::vec;
  x = V::min(V::max(x, V::set1(-87.0f)), V::set1(88.0f));
  const vec magic = V::set1(12582912.0f);  // 1.5 * 2^23: round to nearest integer
  const vec n = V::sub(V::fmadd(x, V::set1(1.44269504088896341f), magic), magic);
  vec r = V::fmadd(n, V::set1(-0.693359375f), x);
  r = V::fmadd(n, V::set1(2.12194440e-4f), r);
  vec p = V::set1(1.9875691500E-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507E-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073E-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894E-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459E-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201E-1f));
  p = V::fmadd(p, V::mul(r, r), r);
  p = V::add(p, V::set1(1.0f));
  return V::mul(p, V::pow2n(n));
}

template <class V>
float sexp(float x) {
  float buf[V::W];
  V::storeu(buf, vexp<V>(V::set1(x)));
  return buf[0];
}

// Fixed-order dot product: lanes over k, hsum, scalar tail.
template <class V>
float dot(const float* a, const float* b, int64_t n) {
  typename V::vec acc = V::zero();
  const int64_t nv = n / V::W * V::W;
  for (int64_t k = 0; k < nv; k += V::W) acc = V::fmadd(V::loadu(a + k), V::loadu(b + k), acc);
  float s = V::hsum(acc);
  for (int64_t k = nv; k < n; ++k) s = V::fmas(a[k], b[k], s);
  return s;
}

// dot<V> of a with four consecutive rows of b (stride n) at once: each result runs
// exactly the operations dot<V> runs, the four chains just interleave.
template <class V>
void dot4(const float* a, const float* b, int64_t n, float* out) {
  using vec = typename V::vec;
  vec c0 = V::zero(), c1 = V::zero(), c2 = V::zero(), c3 = V::zero();
  const int64_t nv = n / V::W * V::W;
  for (int64_t k = 0; k < nv; k += V::W) {
    const vec av = V::loadu(a + k);
    c0 = V::fmadd(av, V::loadu(b + k), c0);
    c1 = V::fmadd(av, V::loadu(b + n + k), c1);
    c2 = V::fmadd(av, V::loadu(b + 2 * n + k), c2);
    c3 = V::fmadd(av, V::loadu(b + 3 * n + k), c3);
  }
  float s0 = V::hsum(c0), s1 = V::hsum(c1), s2 = V::hsum(c2), s3 = V::hsum(c3);
  for (int64_t k = nv; k < n; ++k) {
    s0 = V::fmas(a[k], b[k], s0);
    s1 = V::fmas(a[k], b[n + k], s1);
    s2 = V::fmas(a[k], b[2 * n + k], s2);
    s3 = V::fmas(a[k], b[3 * n + k], s3);
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

template <class V>
void rmsnorm_row_k(const float* x, const float* w, int64_t dim, float eps, float* y) {
  const float ss = dot<V>(x, x, dim);
  const float mean = ss / float(dim);
  const float scale = 1.0f / V::sqrt1(mean + eps);
  const typename V::vec sv = V::set1(scale);
  const int64_t nv = dim / V::W * V::W;
  for (int64_t k = 0; k < nv; k += V::W)
    V::storeu(y + k, V::mul(V::mul(V::loadu(x + k), sv), V::loadu(w + k)));
  for (int64_t k = nv; k < dim; ++k) {
    const float t = x[k] * scale;
    y[k] = t * w[k];
  }
}

template <class V>
void softmax_row_k(float* x, int64_t len) {
  using vec = typename V::vec;
  const int64_t nv = len / V::W * V::W;
  float m = -__builtin_inff();
  {
    vec mv = V::set1(m);
    for (int64_t k = 0; k < nv; k += V::W) mv = V::max(mv, V::loadu(x + k));
    m = V::hmax(mv);
    for (int64_t k = nv; k < len; ++k) m = x[k] > m ? x[k] : m;
  }
  const vec msv = V::set1(m);
  vec acc = V::zero();
  for (int64_t k = 0; k < nv; k += V::W) {
    const vec e = vexp<V>(V::sub(V::loadu(x + k), msv));
    V::storeu(x + k, e);
    acc = V::add(acc, e);
  }
  float s = V::hsum(acc);
  if (nv < len) {
    float buf[V::W];
    for (int j = 0; j < V::W; ++j) buf[j] = nv + j < len ? x[nv + j] : m;
    V::storeu(buf, vexp<V>(V::sub(V::loadu(buf), msv)));
    for (int64_t k = nv; k < len; ++k) {
      x[k] = buf[k - nv];
      s += x[k];
    }
  }
  const float inv = 1.0f / s;
  const vec iv = V::set1(inv);
  for (int64_t k = 0; k < nv; k += V::W) V::storeu(x + k, V::mul(V::loadu(x + k), iv));
  for (int64_t k = nv; k < len; ++k) x[k] = x[k] * inv;
}

template <class V>
typename V::vec silu_mul_v(typename V::vec g, typename V::vec u) {
  const typename V::vec one = V::set1(1.0f);
  const typename V::vec e = vexp<V>(V::sub(V::zero(), g));
  return V::mul(V::div(g, V::add(one, e)), u);
}

template <class V>
void silu_mul_k(const float* g, const float* u, int64_t count, float* out) {
  const int64_t nv = count / V::W * V::W;
  for (int64_t k = 0; k < nv; k += V::W)
    V::storeu(out + k, silu_mul_v<V>(V::loadu(g + k), V::loadu(u + k)));
  if (nv < count) {
    float gb[V::W], ub[V::W];
    for (int j = 0; j < V::W; ++j) {
      gb[j] = nv + j < count ? g[nv + j] : 0.0f;
      ub[j] = nv + j < count ? u[nv + j] : 0.0f;
    }
    V::storeu(gb, silu_mul_v<V>(V::loadu(gb), V::loadu(ub)));
    for (int64_t k = nv; k < count; ++k) out[k] = gb[k - nv];
  }
}

// Population mean and variance in W-lane sums (hsum, then the scalar tail
// in k order), then (x - mean) * inv * w + b per element.
template <class V>
void layer_norm_row_k(const float* x, const float* w, const float* b, int64_t dim, float eps,
                      float* y) {
  using vec = typename V::vec;
  const int64_t nv = dim / V::W * V::W;
  vec sv = V::zero();
  for (int64_t k = 0; k < nv; k += V::W) sv = V::add(sv, V::loadu(x + k));
  float sum = V::hsum(sv);
  for (int64_t k = nv; k < dim; ++k) sum += x[k];
  const float mean = sum / float(dim);
  const vec mv = V::set1(mean);
  vec qv = V::zero();
  for (int64_t k = 0; k < nv; k += V::W) {
    const vec d = V::sub(V::loadu(x + k), mv);
    qv = V::fmadd(d, d, qv);
  }
  float var = V::hsum(qv);
  for (int64_t k = nv; k < dim; ++k) var = V::fmas(x[k] - mean, x[k] - mean, var);
  var /= float(dim);
  const float inv = 1.0f / V::sqrt1(var + eps);
  const vec iv = V::set1(inv);
  for (int64_t k = 0; k < nv; k += V::W)
    V::storeu(y + k, V::fmadd(V::mul(V::sub(V::loadu(x + k), mv), iv), V::loadu(w + k),
                              V::loadu(b + k)));
  for (int64_t k = nv; k < dim; ++k) y[k] = V::fmas((x[k] - mean) * inv, w[k], b[k]);
}

// gelu(x) = x / (1 + exp(-z)): z = 2 sqrt(2/pi) x (1 + 0.044715 x^2) for the
// tanh form (0.5 (1 + tanh(u)) is sigmoid(2u)), z = 1.702 x for quick. vexp
// clamps its argument, so large |x| gives x or a tiny value, and NaN stays NaN.
template <class V>
typename V::vec gelu_v(typename V::vec x, int kind) {
  using vec = typename V::vec;
  vec z;
  if (kind == 0) {
    const vec t = V::fmadd(V::mul(x, x), V::set1(0.044715f), V::set1(1.0f));
    z = V::mul(V::mul(x, V::set1(-2.0f * 0.79788456080286535588f)), t);
  } else {
    z = V::mul(x, V::set1(-1.702f));
  }
  return V::div(x, V::add(V::set1(1.0f), vexp<V>(z)));
}

template <class V>
void gelu_k(const float* x, int64_t count, int kind, float* y) {
  const int64_t nv = count / V::W * V::W;
  for (int64_t k = 0; k < nv; k += V::W) V::storeu(y + k, gelu_v<V>(V::loadu(x + k), kind));
  if (nv < count) {
    float xb[V::W];
    for (int j = 0; j < V::W; ++j) xb[j] = nv + j < count ? x[nv + j] : 0.0f;
    V::storeu(xb, gelu_v<V>(V::loadu(xb), kind));
    for (int64_t k = nv; k < count; ++k) y[k] = xb[k - nv];
  }
}

template <class V>
void add_k(const float* a, const float* b, int64_t count, float* y) {
  const int64_t nv = count / V::W * V::W;
  for (int64_t k = 0; k < nv; k += V::W) V::storeu(y + k, V::add(V::loadu(a + k), V::loadu(b + k)));
  for (int64_t k = nv; k < count; ++k) y[k] = a[k] + b[k];
}

}  // namespace

// Attention over the paged KV cache (same anonymous namespace, same V).
#include "kernels/cpu/simd_attention.h"

namespace {

// Test hook: combined[j] = hsums and single[j] = hsum of the n (<= 24)
// accumulators in acc (n * W floats).
template <class V, int N>
void hsums_check_n(const float* acc, int n, float* combined, float* single) {
  if (n == N) {
    typename V::vec a[N];
    for (int j = 0; j < N; ++j) a[j] = V::loadu(acc + j * V::W);
    V::template hsums<N>(a, combined);
    for (int j = 0; j < N; ++j) single[j] = V::hsum(a[j]);
  } else if constexpr (N > 1) {
    hsums_check_n<V, N - 1>(acc, n, combined, single);
  }
}

template <class V>
void hsums_check(const float* acc, int n, float* combined, float* single) {
  hsums_check_n<V, 24>(acc, n, combined, single);
}

}  // namespace

#define CLEAVE_DEFINE_KERNEL_TABLE(name)                                                     \
  const ::cleave::cpu::Kernels name = {V::W,          V::MR,           V::NR,              \
                                       V::NR1,        V::STREAM_N,     &matmul_k<V>,    &rmsnorm_row_k<V>,  \
                                       &softmax_row_k<V>, &silu_mul_k<V>, &attn_k<V>,      \
                                       &layer_norm_row_k<V>, &gelu_k<V>, &add_k<V>,     \
                                       &hsums_check<V>};
