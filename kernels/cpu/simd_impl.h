// The kernels, written once over a SIMD traits struct V and included by each
// ISA file (kern_scalar.cpp, kern_avx2.cpp, kern_avx512.cpp) after it defines
// V. Everything here has internal linkage (anonymous namespace), so an ISA
// file's copies never leak into another.
//
// V provides: vec, W (lanes), MR and np_for(mi) (the matmul microkernel: x
// rows by panels), zero, set1, loadu, storeu, add, sub, mul, div, max, min,
// fmadd(a, b, c) = a*b+c, hsum/hmax (a fixed reduction tree), load_f16,
// load_bf16, load_q8(q, d), f16 (scalar), fmas(a, b, c) (scalar a*b+c, fused
// exactly when fmadd is), pow2n, sqrt1.
//
// Batch invariance: a matmul output is one FMA chain over k in order
// (kernels/cpu/panels.h), whatever microkernel computes it; the other dot
// products (norms, attention) run one accumulator vector over k in W-steps,
// V::hsum, then the scalar tail in k order. Elementwise functions handle a
// ragged end by padding into a full vector, so an element's value never
// depends on where it sits.
#pragma once

#include <type_traits>

#include "kernels/cpu/kern.h"
#include "kernels/cpu/panels.h"
#include "kernels/dtype.h"

namespace {

using cleave::cpu::AttnArgs;

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
  // Attention also steps its prefetch cursor in the score loop over these K
  // rows (measured per type, docs/PERFORMANCE.md: F32 and Q8_0 K faster by
  // 5-21 %, F16 K about 10 % slower).
  static constexpr bool kPrefetchInScores = true;
  static const uint8_t* addr(const uint8_t* row, int64_t k) { return row + 4 * k; }
  static typename V::vec load(const uint8_t* row, int64_t k) {
    return V::loadu(reinterpret_cast<const float*>(row) + k);
  }
  static float at(const uint8_t* row, int64_t k) {
    float f;
    __builtin_memcpy(&f, row + 4 * k, 4);
    return f;
  }
  // Attention's interface (see LQ8): no scale to share.
  struct Scale {};
  static Scale scale(const uint8_t*, int64_t) { return {}; }
  static typename V::vec load(const uint8_t* row, int64_t k, Scale) { return load(row, k); }
};

template <class V>
struct LF16 {
  static constexpr int kBlock = 1;
  static constexpr bool kPrefetchInScores = false;
  static const uint8_t* addr(const uint8_t* row, int64_t k) { return row + 2 * k; }
  static typename V::vec load(const uint8_t* row, int64_t k) { return V::load_f16(row + 2 * k); }
  static float at(const uint8_t* row, int64_t k) { return V::f16(load_u16(row + 2 * k)); }
  struct Scale {};
  static Scale scale(const uint8_t*, int64_t) { return {}; }
  static typename V::vec load(const uint8_t* row, int64_t k, Scale) { return load(row, k); }
};

template <class V>
struct LBF16 {
  static constexpr int kBlock = 1;
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
  static constexpr bool kPrefetchInScores = true;
  // The 32 / W vectors of the block starting at k (k a multiple of 32).
  static void load_block(const uint8_t* row, int64_t k, typename V::vec* out) {
    const uint8_t* blk = row + (k >> 5) * 34;
    const typename V::vec d = V::set1(V::f16(load_u16(blk)));
    for (int v = 0; v < 32 / V::W; ++v)
      out[v] = V::load_q8(reinterpret_cast<const int8_t*>(blk + 2 + v * V::W), d);
  }
  static const uint8_t* addr(const uint8_t* row, int64_t k) { return row + (k >> 5) * 34; }
  // The block's scale, converted and broadcast: attention takes it once for
  // the W-steps of k that share it and passes it to load(row, k, d).
  using Scale = typename V::vec;
  static Scale scale(const uint8_t* row, int64_t k) { return V::set1(V::f16(load_u16(addr(row, k)))); }
  static typename V::vec load(const uint8_t* row, int64_t k, Scale d) {
    return V::load_q8(reinterpret_cast<const int8_t*>(addr(row, k) + 2 + (k & 31)), d);
  }
  static typename V::vec load(const uint8_t* row, int64_t k) { return load(row, k, scale(row, k)); }
  static float at(const uint8_t* row, int64_t k) {
    const uint8_t* blk = addr(row, k);
    return float(int8_t(blk[2 + (k & 31)])) * V::f16(load_u16(blk));
  }
};

// Q4_0 (KV only): 18-byte blocks (fp16 d, 16 bytes: value j in the low
// nibble of byte j, value j + 16 in the high one, each (q - 8) d, exact in
// F32); W divides 16, k is a multiple of W.
template <class V>
struct LQ4 {
  static constexpr int kBlock = 32;
  static constexpr bool kPrefetchInScores = true;
  static const uint8_t* addr(const uint8_t* row, int64_t k) { return row + (k >> 5) * 18; }
  using Scale = typename V::vec;
  static Scale scale(const uint8_t* row, int64_t k) { return V::set1(V::f16(load_u16(addr(row, k)))); }
  static typename V::vec load(const uint8_t* row, int64_t k, Scale d) {
    return V::load_q4(addr(row, k) + 2 + (k & 15), (k & 16) ? 4 : 0, d);
  }
  static typename V::vec load(const uint8_t* row, int64_t k) { return load(row, k, scale(row, k)); }
  static float at(const uint8_t* row, int64_t k) {
    const uint8_t* blk = addr(row, k);
    return float(int((blk[2 + (k & 15)] >> ((k & 16) ? 4 : 0)) & 15) - 8) * V::f16(load_u16(blk));
  }
};

// ---- matmul ----------------------------------------------------------------
// Over 16-row panels (kernels/cpu/panels.h): each output is one FMA chain
// over k in order, in lane r % 16 of a panel's vector(s).

using cleave::cpu::PanelMatmulArgs;

// Panel loaders: the V::W weights of rows [v * W, v * W + W) of a panel at k.
template <class V>
struct PF32 {
  static constexpr int kBlock = 1;
  // How far ahead of its reads a first row block prefetches its panels (and
  // a later block a widened copy): 2 KiB hid the wait on weights from
  // memory or a shared L3 at 32 decode rows where 512 bytes did not (+9 %
  // alone, docs/PERFORMANCE.md).
  static constexpr int kPfBytes = 2048;
  static constexpr int kStep = 64;  // bytes of a panel per k
  static constexpr bool kNarrow = false;  // narrower than F32: worth widening once
  static typename V::vec load(const uint8_t* P, int64_t k, int v) {
    return V::loadu(reinterpret_cast<const float*>(P) + k * 16 + v * V::W);
  }
};
template <class V>
struct PF16 {
  static constexpr int kBlock = 1;
  static constexpr int kPfBytes = PF32<V>::kPfBytes;
  static constexpr int kStep = 32;
  static constexpr bool kNarrow = true;
  static constexpr int kWidenBlocks = 4;  // row blocks in a pass from which widening once pays
  static typename V::vec load(const uint8_t* P, int64_t k, int v) {
    return V::load_f16(P + (k * 16 + v * V::W) * 2);
  }
};
template <class V>
struct PBF16 {
  static constexpr int kBlock = 1;
  static constexpr int kPfBytes = PF32<V>::kPfBytes;
  static constexpr int kStep = 32;
  static constexpr bool kNarrow = true;
  static constexpr int kWidenBlocks = 4;  // as F16's (measured for F16 only; BF16 widens alike)
  static typename V::vec load(const uint8_t* P, int64_t k, int v) {
    return V::load_bf16(P + (k * 16 + v * V::W) * 2);
  }
};
template <class V>
struct PQ8 {
  static constexpr int kBlock = 32;
  // Per 544-byte block, 9 lines a panel: 2 KiB ahead cost batch-1 decode
  // 6 % and gained nothing at 32 rows (measured).
  static constexpr int kPfBytes = 512;
  static constexpr bool kNarrow = true;
  static constexpr int kWidenBlocks = 3;  // its widening costs more (three operations): pays sooner
};

// MI x rows (stride ldx) times NP panels (stride ps bytes) over k in
// [0, cols): y[i * ldy + c] for output column c < valid of the NP * 16.
// pf: the panels are not in L1 (the first x rows to sweep them, or a
// widened copy too large to stay there), so each one is prefetched
// PL::kPfBytes ahead: NP streams crossing a page every few hundred k are
// more than the hardware prefetchers follow alone.
// WIDE: also store each widened weight vector at wide (PF32's layout,
// panel stride cols x 16 floats), for the pass's later row blocks; only a
// first block (pf) widens.
// ahead: in a later block (not pf), the offset from P of a panel of the
// next group to bring into L2 meanwhile, at the pace its own panels are
// read (0: none). A later block reads only cached panels, so the memory is
// idle; the next group's first block then finds its panels near instead of
// waiting on them (at 32 decode rows it ran 1.65x as long as a later block).
// Each kind of block runs its own loop (run below), so none pays for
// another's prefetches or holds a flag in a register the x rows need.
template <class V, class PL, int MI, int NP, bool WIDE = false>
void pk(const float* x, int64_t ldx, const uint8_t* P, size_t ps, int64_t cols, float* y,
        int64_t ldy, int64_t valid, bool pf, float* wide, size_t ahead) {
  using vec = typename V::vec;
  constexpr int VP = 16 / V::W;
  constexpr int NV = NP * VP;
  vec acc[MI][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MI; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[i][j] = V::zero();
  // Three loops, one per kind of block: a first block's (PF), a later
  // block's with a panel ahead (AHEAD), and one with neither prefetch.
  const auto run = [&](auto pf_kind, auto ahead_kind) {
    constexpr bool PF = decltype(pf_kind)::value, AHEAD = decltype(ahead_kind)::value;
    if constexpr (PL::kBlock == 1) {
      for (int64_t k = 0; k < cols; ++k) {
        if constexpr (PF) {
          if ((k * PL::kStep) % 64 == 0)
#pragma GCC unroll 8
            for (int p = 0; p < NP; ++p) V::prefetch(P + p * ps + k * PL::kStep + PL::kPfBytes);
        } else if constexpr (AHEAD) {
          V::prefetch_l2(P + ahead + k * PL::kStep);
        }
        vec w[NV];
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) w[j] = PL::load(P + (j / VP) * ps, k, j % VP);
        if constexpr (WIDE)
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) V::storeu(wide + (j / VP) * cols * 16 + k * 16 + (j % VP) * V::W, w[j]);
#pragma GCC unroll 16
        for (int i = 0; i < MI; ++i) {
          const vec xb = V::set1(x[i * ldx + k]);
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) acc[i][j] = V::fmadd(xb, w[j], acc[i][j]);
        }
      }
    } else {
      // Q8_0: a block's 16 scales widened once; each weight d x q (exact).
      const int64_t nb = cols / 32;
      for (int64_t b = 0; b < nb; ++b) {
        const size_t boff = size_t(b) * cleave::cpu::kQ8PanelBlockBytes;
        vec d[NV];
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) d[j] = V::load_f16(P + (j / VP) * ps + boff + (j % VP) * V::W * 2);
        for (int kk = 0; kk < 32; ++kk) {
          if constexpr (PF) {
            if (kk * 64 < int(cleave::cpu::kQ8PanelBlockBytes))
#pragma GCC unroll 8
              for (int p = 0; p < NP; ++p) V::prefetch(P + p * ps + boff + kk * 64 + PL::kPfBytes);
          } else if constexpr (AHEAD) {
            if (kk * 64 < int(cleave::cpu::kQ8PanelBlockBytes)) V::prefetch_l2(P + ahead + boff + kk * 64);
          }
          const int64_t k = b * 32 + kk;
          vec w[NV];
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j)
            w[j] = V::load_q8(reinterpret_cast<const int8_t*>(P + (j / VP) * ps + boff + 32 + kk * 16 +
                                                              (j % VP) * V::W),
                              d[j]);
          if constexpr (WIDE)
#pragma GCC unroll 16
            for (int j = 0; j < NV; ++j) V::storeu(wide + (j / VP) * cols * 16 + k * 16 + (j % VP) * V::W, w[j]);
#pragma GCC unroll 16
          for (int i = 0; i < MI; ++i) {
            const vec xb = V::set1(x[i * ldx + k]);
#pragma GCC unroll 16
            for (int j = 0; j < NV; ++j) acc[i][j] = V::fmadd(xb, w[j], acc[i][j]);
          }
        }
      }
    }
  };
  if (WIDE || pf)
    run(std::true_type{}, std::false_type{});
  else if constexpr (!WIDE) {
    if (ahead)
      run(std::false_type{}, std::true_type{});
    else
      run(std::false_type{}, std::false_type{});
  }
  if (valid == NP * 16) {
#pragma GCC unroll 16
    for (int i = 0; i < MI; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) V::storeu(y + i * ldy + j * V::W, acc[i][j]);
    return;
  }
  for (int i = 0; i < MI; ++i) {
    float buf[NV * V::W];
    for (int j = 0; j < NV; ++j) V::storeu(buf + j * V::W, acc[i][j]);
    for (int64_t c = 0; c < valid; ++c) y[i * ldy + c] = buf[c];
  }
}

template <class V, class PL, int MI>
void pk_np(int np, const float* x, int64_t ldx, const uint8_t* P, size_t ps, int64_t cols, float* y,
           int64_t ldy, int64_t valid, bool pf, float* wide, size_t ahead) {
  // Widened copies are made by the first block of a pass of several, whose
  // rows are at least MR / 2: at most kWidePanels panels.
  if constexpr (PL::kNarrow && MI * 2 >= V::MR && V::np_for(MI) <= cleave::cpu::kWidePanels) {
    if (wide) {
      switch (np) {
        case 1: pk<V, PL, MI, 1, true>(x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
        case 2: pk<V, PL, MI, (V::np_for(MI) >= 2 ? 2 : 1), true>(x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead);
          return;
        default: __builtin_trap();
      }
    }
  }
  if (wide) __builtin_trap();
  switch (np) {
    case 1: pk<V, PL, MI, 1>(x, ldx, P, ps, cols, y, ldy, valid, pf, nullptr, ahead); return;
    case 2: pk<V, PL, MI, (V::np_for(MI) >= 2 ? 2 : 1)>(x, ldx, P, ps, cols, y, ldy, valid, pf, nullptr, ahead); return;
    case 4: pk<V, PL, MI, (V::np_for(MI) >= 4 ? 4 : 1)>(x, ldx, P, ps, cols, y, ldy, valid, pf, nullptr, ahead); return;
    case 8: pk<V, PL, MI, (V::np_for(MI) >= 8 ? 8 : 1)>(x, ldx, P, ps, cols, y, ldy, valid, pf, nullptr, ahead); return;
    default: __builtin_trap();
  }
}

// wide: pk's WIDE (null: none).
template <class V, class PL>
void pk_any(int mi, int np, const float* x, int64_t ldx, const uint8_t* P, size_t ps, int64_t cols,
            float* y, int64_t ldy, int64_t valid, bool pf, float* wide, size_t ahead) {
  switch (mi) {
    case 1: pk_np<V, PL, 1>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 2: pk_np<V, PL, (V::MR >= 2 ? 2 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 3: pk_np<V, PL, (V::MR >= 3 ? 3 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 4: pk_np<V, PL, (V::MR >= 4 ? 4 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 5: pk_np<V, PL, (V::MR >= 5 ? 5 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 6: pk_np<V, PL, (V::MR >= 6 ? 6 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 7: pk_np<V, PL, (V::MR >= 7 ? 7 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 8: pk_np<V, PL, (V::MR >= 8 ? 8 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 9: pk_np<V, PL, (V::MR >= 9 ? 9 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 10: pk_np<V, PL, (V::MR >= 10 ? 10 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 11: pk_np<V, PL, (V::MR >= 11 ? 11 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    case 12: pk_np<V, PL, (V::MR >= 12 ? 12 : 1)>(np, x, ldx, P, ps, cols, y, ldy, valid, pf, wide, ahead); return;
    default: __builtin_trap();
  }
}

// A widened group up to this size stays in L1 from one row block to the
// next (48 KiB L1 data caches, less what the x rows and outputs take).
constexpr size_t kWideInL1Bytes = 40 * 1024;

// The largest power of two <= n (n >= 1), at most cap.
inline int pow2_at_most(int64_t n, int cap) {
  int g = 1;
  while (g * 2 <= cap && g * 2 <= n) g *= 2;
  return g;
}

// y[i][r] for every x row and the rows of panels [p0, p1): the x rows in
// passes that stay in L2; per pass, groups of panels (as many as the
// microkernel's registers hold at that row count) each swept by every row
// block (at most MR rows) while they sit in L1 / L2, so the weights stream
// from memory once per pass.
template <class V, class PL>
void matmul_p(const PanelMatmulArgs* a, int64_t p0, int64_t p1) {
  static_assert(PF32<V>::kPfBytes <= cleave::cpu::kWideGapFloats * 4, "prefetches stay in a thread's own gap");
  const int64_t cols = a->cols, rows = a->rows, n = a->n;
  const size_t ps = a->stride;
  int64_t xg = (int64_t(512) * 1024) / (cols * 4 > 0 ? cols * 4 : 1);
  xg = xg / V::MR * V::MR;
  if (xg < V::MR) xg = V::MR;
  for (int64_t i0 = 0; i0 < n; i0 += xg) {
    const int64_t i1 = min_of(n, i0 + xg);
    // Blocks as even as MR allows (32 rows: 11 + 11 + 10, not 12 + 12 + 8),
    // so no block runs with fewer accumulators than the first.
    const auto block = [&](int64_t i) {
      const int64_t left = i1 - i, nb = (left + V::MR - 1) / V::MR;
      return int((left + nb - 1) / nb);
    };
    const int gmax = V::np_for(block(i0));
    // Enough blocks over narrow panels: the first widens the group as it
    // goes, the others read the F32 copy (exact: the same bits). Measured
    // on one thread, interleaved (cleave_bench --matmul): F16 lost 3-8 % or
    // nothing at 3 blocks (its group stays in L1 between blocks, the F32
    // copy does not) and gained 3-11 % from 4; Q8_0 gained 8-24 % from 3.
    bool widen = false;
    if constexpr (PL::kNarrow)
      widen = a->wide && (i1 - i0 + V::MR - 1) / V::MR >= PL::kWidenBlocks && gmax <= cleave::cpu::kWidePanels;
    for (int64_t p = p0; p < p1;) {
      const int np = pow2_at_most(p1 - p, gmax);
      const uint8_t* P = a->panels + size_t(p) * ps;
      const int64_t valid = min_of<int64_t>(int64_t(np) * 16, rows - p * 16);
      // The next group's panels, contiguous after this one's: the later
      // blocks bring them into L2 one each (pk's ahead), unless the pass
      // widens (its later blocks read the F32 copy and are many, so the
      // first block's own wait is a small part).
      const int64_t next_np = p + np < p1 && !widen ? pow2_at_most(p1 - p - np, gmax) : 0;
      // A widened group past what L1 keeps between blocks streams from L2:
      // its later blocks prefetch it as a first block does its panels.
      const bool wide_pf = size_t(np) * size_t(cols) * 64 > kWideInL1Bytes;
      // np <= np_for(mi) for every block: the first block is the largest
      // and np_for never grows with mi.
      int64_t b = 0;
      for (int64_t i = i0, mi = 0; i < i1; i += mi, ++b) {
        mi = block(i);
        const size_t ahead = b > 0 && b - 1 < next_np ? size_t(np + b - 1) * ps : 0;
        if (widen && i > i0)
          pk_any<V, PF32<V>>(mi, np, a->x + i * cols, cols, reinterpret_cast<const uint8_t*>(a->wide),
                             size_t(cols) * 64, cols, a->y + i * rows + p * 16, rows, valid, wide_pf, nullptr, 0);
        else
          pk_any<V, PL>(mi, np, a->x + i * cols, cols, P, ps, cols, a->y + i * rows + p * 16, rows, valid,
                        i == i0, widen ? a->wide : nullptr, ahead);
      }
      p += np;
    }
  }
}

template <class V>
void matmul_k(const PanelMatmulArgs* a, int64_t p0, int64_t p1) {
  switch (a->wtype) {
    case cleave::cpu::kWF32: matmul_p<V, PF32<V>>(a, p0, p1); return;
    case cleave::cpu::kWF16: matmul_p<V, PF16<V>>(a, p0, p1); return;
    case cleave::cpu::kWBF16: matmul_p<V, PBF16<V>>(a, p0, p1); return;
    case cleave::cpu::kWQ8: matmul_p<V, PQ8<V>>(a, p0, p1); return;
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

// The KV cache's row writers (same V).
#include "kernels/cpu/simd_kv_rows.h"

// Rotary embedding of n_heads heads of head_dim floats (pairs (2j, 2j+1)),
// with cs = cos duplicated per pair and sn = sin negated in the even lane:
// x' = x cs + swap_pairs(x) sn, which is (x0 c - x1 s, x0 s + x1 c) with the
// scalar rope's bits (a product with -s is the product with s negated, and
// the odd lane's sum is the same two products added). The products are
// held apart so the compiler cannot fuse one into an fma.
template <class V>
void rope_rows_k(float* x, const float* cs, const float* sn, int64_t n_heads, int64_t head_dim) {
  using vec = typename V::vec;
  const int64_t hv = head_dim / V::W * V::W;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t k = 0; k < hv; k += V::W) {
      const vec xv = V::loadu(v + k);
      vec a = V::mul(xv, V::loadu(cs + k));
      vec b = V::mul(V::swap_pairs(xv), V::loadu(sn + k));
      V::keep(a);
      V::keep(b);
      V::storeu(v + k, V::add(a, b));
    }
    for (int64_t k = hv; k < head_dim; k += 2) {
      const float x0 = v[k], x1 = v[k + 1];
      volatile float a = x0 * cs[k], b = x1 * sn[k + 1], c = x0 * sn[k + 1], d = x1 * cs[k];
      v[k] = a - b;
      v[k + 1] = c + d;
    }
  }
}

// One row of a weight table widened to F32 (F32, F16, BF16, Q8_0): the
// value dequantize_row (kernels/dtype.h) gives, bit for bit.
template <class V>
void widen_row_k(int type, const uint8_t* row, int64_t cols, float* out) {
  const int64_t nv = cols / V::W * V::W;
  auto run = [&](auto loader) {
    using L = decltype(loader);
    for (int64_t k = 0; k < nv; k += V::W) V::storeu(out + k, L::load(row, k));
    for (int64_t k = nv; k < cols; ++k) out[k] = L::at(row, k);
  };
  switch (type) {
    case cleave::cpu::kWF32: __builtin_memcpy(out, row, size_t(cols) * 4); return;
    case cleave::cpu::kWF16: run(LF16<V>{}); return;
    case cleave::cpu::kWBF16: run(LBF16<V>{}); return;
    case cleave::cpu::kWQ8: run(LQ8<V>{}); return;  // cols is a multiple of 32
    default: __builtin_trap();
  }
}

// o[d] = o[d] + w y[d]: the product rounded, then added (held apart from
// any fma), so a weighted sum built from these is the scalar loop's.
template <class V>
void axpy_row_k(float* o, float w, const float* y, int64_t n) {
  using vec = typename V::vec;
  const int64_t nv = n / V::W * V::W;
  const vec wv = V::set1(w);
  for (int64_t d = 0; d < nv; d += V::W) {
    vec p = V::mul(wv, V::loadu(y + d));
    V::keep(p);
    V::storeu(o + d, V::add(V::loadu(o + d), p));
  }
  for (int64_t d = nv; d < n; ++d) {
    volatile float p = w * y[d];
    o[d] = o[d] + p;
  }
}

#define CLEAVE_DEFINE_KERNEL_TABLE(name)                                                     \
  const ::cleave::cpu::Kernels name = {V::W,           &matmul_k<V>,    &rmsnorm_row_k<V>,  \
                                       &softmax_row_k<V>, &silu_mul_k<V>, &attn_k<V>,      \
                                       &layer_norm_row_k<V>, &gelu_k<V>, &add_k<V>,     \
                                       &hsums_check<V>, &f16_row_k<V>, &q8_0_row_k<V>,  \
                                       &q4_0_row_k<V>, &rope_rows_k<V>, &widen_row_k<V>, \
                                       &axpy_row_k<V>};
