// The CPU attention kernels, written once over the SIMD traits struct V.
// Included only by kernels/cpu/simd_impl.h, after the helpers it uses (V,
// min_of, vexp, sexp, the LF32 / LF16 / LQ8 / LQ4 loaders) are defined in the same
// translation unit's anonymous namespace; the same linkage rules hold (see
// simd_impl.h and kern.h).
#pragma once

namespace {

using cleave::cpu::AttnArgs;
using cleave::cpu::AttnNext;

// ---- attention ---------------------------------------------------------------

// Lines of a later block to prefetch, a few at a time, while the current one
// is computed: one burst per block left most of the lines waiting behind the
// fill buffers, and scattered 16 KiB runs then read at a third of streaming
// (measured); prefetches spread over the work keep a steady number in flight.
// Up to two ranges (a part's K rows, then its V rows).
template <class V>
struct PrefetchCursor {
  const uint8_t* p[2] = {nullptr, nullptr};
  const uint8_t* e[2] = {nullptr, nullptr};
  int32_t per_step = 0;  // lines per step()
  void step() {
    int32_t n = per_step;
    for (int r = 0; r < 2 && n > 0; ++r)
      for (; p[r] < e[r] && n > 0; p[r] += 64, --n) V::prefetch(p[r]);
  }
  void rest() {
    for (int r = 0; r < 2; ++r)
      for (; p[r] < e[r]; p[r] += 64) V::prefetch(p[r]);
  }
};

// The queries one attn_block call runs, each with its own query row, output
// (head_dim floats), online-softmax state (running max m, sum l) and count
// of the block's positions it attends (len: the whole block, or up to its
// own position in its last block): query heads of one row that read one kv
// head, or that head of several rows of a sequence.
template <int GG>
struct Queries {
  const float* q[GG];
  float* out[GG];
  float* m[GG];
  float* l[GG];
  int32_t len[GG];
};

// One block of attention for GG queries that read one kv head: K and Vb
// point at that head's rows of the block; query g attends its first
// qs.len[g] positions. The online softmax's state (m, l, the unnormalised
// out) is carried per query from block to block, and each query's
// operations do not depend on which queries share the call (nor on their
// lengths: a score past a query's length is computed for the others and
// never read for it). Per block:
// - scores: position t's q.k runs dot<V>'s operations (one accumulator over
//   k in W-steps, hsum, scalar tail); V::hsums reduces 16 positions'
//   accumulators at once with exactly hsum's additions;
// - the block's probabilities are summed in W-lane vectors (lane = position
//   mod W), then hsum, and added to the running sum scaled by alpha;
// - out += p[t] v[t] for t in order, per element, the heads interleaved so
//   their chains run side by side.
template <class V, class LK, class LV, int GG>
void attn_block(const AttnArgs* a, const Queries<GG>& qs, const uint8_t* K, const uint8_t* Vb,
                float* s, PrefetchCursor<V>& pf_io) {
  using vec = typename V::vec;
  // The cursor in locals for the block (it steps once per position; through
  // the reference every step reloaded and stored it).
  PrefetchCursor<V> pf = pf_io;
  const int64_t hd = a->head_dim;
  const int64_t hv = hd / V::W * V::W;
  const size_t sstride = size_t(a->block_size) + 32;  // GG rows of scores, each padded by 32
  int32_t lmax = qs.len[0], lmin = qs.len[0];  // the longest and the shortest query
  for (int g = 1; g < GG; ++g) {
    lmax = qs.len[g] > lmax ? qs.len[g] : lmax;
    lmin = qs.len[g] < lmin ? qs.len[g] : lmin;
  }
  vec acc[GG][16];
  // W-steps of k that share one scale of the K rows (Q8_0: a 32-element
  // block; F32 and F16 have none): the scale is converted once for them.
  // Q8_0 K rows have head_dim a multiple of 32, so hv is a multiple of KS * W.
  constexpr int KS = LK::kBlock > V::W ? LK::kBlock / V::W : 1;
  // Scores, 16 positions at a time.
  for (int32_t t0 = 0; t0 < lmax; t0 += 16) {
    const int32_t c = min_of<int32_t>(16, lmax - t0);
    int32_t t = 0;
    // Four positions at a time, so 4 x GG independent chains hide the FMA
    // latency; each chain still runs over k in order.
    for (; t + 4 <= c; t += 4) {
      if constexpr (LK::kPrefetchInScores) pf.step();
      const uint8_t* kt = K + size_t(t0 + t) * a->k_row_bytes;
      vec x[GG][4];
#pragma GCC unroll 8
      for (int g = 0; g < GG; ++g)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) x[g][u] = V::zero();
      for (int64_t k0 = 0; k0 < hv; k0 += KS * V::W) {
        typename LK::Scale d[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) d[u] = LK::scale(kt + size_t(u) * a->k_row_bytes, k0);
#pragma GCC unroll 4
        for (int v = 0; v < KS; ++v) {
          const int64_t k = k0 + v * V::W;
          vec kv[4];
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) kv[u] = LK::load(kt + size_t(u) * a->k_row_bytes, k, d[u]);
#pragma GCC unroll 8
          for (int g = 0; g < GG; ++g) {
            const vec qv = V::loadu(qs.q[g] + k);
#pragma GCC unroll 4
            for (int u = 0; u < 4; ++u) x[g][u] = V::fmadd(qv, kv[u], x[g][u]);
          }
        }
      }
#pragma GCC unroll 8
      for (int g = 0; g < GG; ++g)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[g][t + u] = x[g][u];
    }
    for (; t < c; ++t) {
      const uint8_t* kt = K + size_t(t0 + t) * a->k_row_bytes;
      vec x[GG];
#pragma GCC unroll 8
      for (int g = 0; g < GG; ++g) x[g] = V::zero();
      for (int64_t k0 = 0; k0 < hv; k0 += KS * V::W) {
        const typename LK::Scale d = LK::scale(kt, k0);
#pragma GCC unroll 4
        for (int v = 0; v < KS; ++v) {
          const int64_t k = k0 + v * V::W;
          const vec kv = LK::load(kt, k, d);
#pragma GCC unroll 8
          for (int g = 0; g < GG; ++g) x[g] = V::fmadd(V::loadu(qs.q[g] + k), kv, x[g]);
        }
      }
#pragma GCC unroll 8
      for (int g = 0; g < GG; ++g) acc[g][t] = x[g];
    }
    for (int g = 0; g < GG; ++g) {
      for (int32_t t = c; t < 16; ++t) acc[g][t] = V::zero();
      float* sg = s + size_t(g) * sstride + t0;
      V::template hsums<16>(acc[g], sg);
      if (hv < hd)
        for (int32_t t = 0; t < c; ++t) {
          const uint8_t* kt = K + size_t(t0 + t) * a->k_row_bytes;
          float x = sg[t];
          for (int64_t k = hv; k < hd; ++k) x = V::fmas(qs.q[g][k], LK::at(kt, k), x);
          sg[t] = x;
        }
    }
  }
  // Online softmax over the block, per query over its own positions. Each
  // step runs for every query before the next step, so the queries' chains
  // (max, exp, sum: each a long latency) overlap instead of running one
  // query after another; a query's operations and their order are the same
  // either way. The GG rescale factors come from one vexp (lane g: query
  // g's), which is lane-wise: each lane is sexp's value for that argument.
  static_assert(GG <= V::W, "one lane of the rescale vector per query");
  float alpha[GG], m_new[GG], mg[GG];
  int32_t lenp[GG];
  const vec sc = V::set1(a->scale);
#pragma GCC unroll 8
  for (int g = 0; g < GG; ++g) {
    const int32_t len = qs.len[g];
    lenp[g] = (len + V::W - 1) / V::W * V::W;
    float* sg = s + size_t(g) * sstride;
    vec mx = V::set1(-__builtin_inff());
    for (int32_t t = 0; t < lenp[g]; t += V::W) {
      if (t + V::W > len)
        for (int32_t u = len; u < t + V::W; ++u) sg[u] = -__builtin_inff();
      const vec x = V::mul(V::loadu(sg + t), sc);
      V::storeu(sg + t, x);
      mx = V::max(mx, x);
    }
    const float tmax = V::hmax(mx);
    mg[g] = *qs.m[g];
    m_new[g] = mg[g] > tmax ? mg[g] : tmax;
  }
  {
    float d[V::W] = {};
#pragma GCC unroll 8
    for (int g = 0; g < GG; ++g) d[g] = mg[g] - m_new[g];
    float e[V::W];
    V::storeu(e, vexp<V>(V::loadu(d)));
#pragma GCC unroll 8
    for (int g = 0; g < GG; ++g) alpha[g] = mg[g] == -__builtin_inff() ? 0.0f : e[g];
  }
#pragma GCC unroll 8
  for (int g = 0; g < GG; ++g) {
    float* sg = s + size_t(g) * sstride;
    const vec mv = V::set1(m_new[g]);
    for (int32_t t = 0; t < lenp[g]; t += V::W) V::storeu(sg + t, vexp<V>(V::sub(V::loadu(sg + t), mv)));
  }
#pragma GCC unroll 8
  for (int g = 0; g < GG; ++g) {
    float* sg = s + size_t(g) * sstride;
    // Padding lanes held -inf; vexp clamps its argument (exp(-87), not 0),
    // so they are zeroed before the sum.
    for (int32_t u = qs.len[g]; u < lenp[g]; ++u) sg[u] = 0.0f;
    vec sum = V::zero();
    for (int32_t t = 0; t < lenp[g]; t += V::W) sum = V::add(sum, V::loadu(sg + t));
    *qs.l[g] = *qs.l[g] * alpha[g] + V::hsum(sum);
    *qs.m[g] = m_new[g];
  }
  // out = out * alpha + sum_t p[t] v[t], per element in t order, C
  // W-chunks of every query per pass (up to VC: AVX-512 has the registers
  // for 4), so C x GG chains run side by side; grouping chunks does not
  // change an element's operations.
  auto pv = [&](auto chunks, int64_t k) {
    constexpr int C = decltype(chunks)::value;
    vec o[GG][C];
#pragma GCC unroll 8
    for (int g = 0; g < GG; ++g) {
      const vec av = V::set1(alpha[g]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) o[g][c] = V::mul(V::loadu(qs.out[g] + k + c * V::W), av);
    }
    // Position t into every query that attends it: all of them up to the
    // shortest query (ragged false), then each up to its own length.
    auto step = [&](int32_t t, auto ragged) {
      // One cursor step per position of V (attn_t counts them so): in the
      // first pass over the positions only, when head_dim takes several.
      if (k == 0) pf.step();
      const uint8_t* vt = Vb + size_t(t) * a->v_row_bytes;
      vec vv[C];
      // A Q8_0 block's scale once for the chunks in it.
      typename LV::Scale d{};
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const int64_t kc = k + c * V::W;
        if (c == 0 || kc % LV::kBlock == 0) d = LV::scale(vt, kc);
        vv[c] = LV::load(vt, kc, d);
      }
#pragma GCC unroll 8
      for (int g = 0; g < GG; ++g) {
        if (decltype(ragged)::value && t >= qs.len[g]) continue;
        const vec pv = V::set1(s[size_t(g) * sstride + t]);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) o[g][c] = V::fmadd(pv, vv[c], o[g][c]);
      }
    };
    int32_t t = 0;
    for (; t < lmin; ++t) step(t, std::false_type{});
    for (; t < lmax; ++t) step(t, std::true_type{});
#pragma GCC unroll 8
    for (int g = 0; g < GG; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) V::storeu(qs.out[g] + k + c * V::W, o[g][c]);
  };
  // AVX2 has 16 registers: 3 chunks for up to 3 queries (9 chains, 3 V
  // vectors and a broadcast), 2 for 4 queries.
  constexpr int VC = V::W >= 16 ? 4 : GG <= 3 ? 3 : 2;
  int64_t k = 0;
  for (; k + VC * V::W <= hv; k += VC * V::W) pv(std::integral_constant<int, VC>{}, k);
  switch ((hv - k) / V::W) {
    case 3: pv(std::integral_constant<int, 3>{}, k); break;
    case 2: pv(std::integral_constant<int, 2>{}, k); break;
    case 1: pv(std::integral_constant<int, 1>{}, k); break;
    default: break;
  }
  for (k = hv; k < hd; ++k) {
    for (int g = 0; g < GG; ++g) {
      float o = qs.out[g][k] * alpha[g];
      for (int32_t t = 0; t < qs.len[g]; ++t)
        o = V::fmas(s[size_t(g) * sstride + t], LV::at(Vb + size_t(t) * a->v_row_bytes, k), o);
      qs.out[g][k] = o;
    }
  }
  pf_io = pf;
}

// The rows' queries that read one kv head: `count` of them, query j's
// pointers and length from at(j), run in chunks of up to 4 (queries are
// independent, so the chunking does not change any query's bits).
template <class V, class LK, class LV, class At>
void attn_queries(const AttnArgs* a, int32_t count, At at, const uint8_t* K, const uint8_t* Vb,
                  float* s, PrefetchCursor<V>& pf) {
  auto run = [&](auto n, int32_t j0) {
    constexpr int C = decltype(n)::value;
    Queries<C> qs;
    for (int c = 0; c < C; ++c) at(j0 + c, qs.q[c], qs.out[c], qs.m[c], qs.l[c], qs.len[c]);
    attn_block<V, LK, LV, C>(a, qs, K, Vb, s, pf);
  };
  for (int32_t j = 0; j < count;) {
    switch (count - j >= 4 ? 4 : count - j) {
      case 4: run(std::integral_constant<int, 4>{}, j); j += 4; break;
      case 3: run(std::integral_constant<int, 3>{}, j); j += 3; break;
      case 2: run(std::integral_constant<int, 2>{}, j); j += 2; break;
      default: run(std::integral_constant<int, 1>{}, j); j += 1; break;
    }
  }
}

// R query rows of one sequence whose last positions fall in one block
// (pos[r] / block_size equal), each against kv heads [kv_head, kv_head +
// n_kv) over its positions [0, pos[r]]: row r's query at q + r * row_stride
// (n_kv * group * head_dim floats), its output at out + r * row_stride.
// Blocks go in order, every head's block before the next block: the heads'
// K rows of a (block, layer) part are one contiguous run, and so are their V
// rows, so the rows read their KV in a few long runs. The R x group queries
// of a kv head share each block's loads (4 at a time): the blocks before the
// last are whole for every row, and in the last each query stops at its own
// row's position. Each query's operations are attn_block's in
// block order whatever R and n_kv are, so a row's bits do not depend on
// which rows or heads share the call. Everything depends only on the row's
// query and the KV of its positions, cut at absolute block boundaries: the
// same bits for a token whether its prompt ran whole, chunked or one token
// at a time, alone or in a batch.
template <class V, class LK, class LV>
void attn_t(const AttnArgs* a, const float* q, int64_t row_stride, int32_t kv_head, int32_t n_kv,
            const int32_t* block_table, const int32_t* pos, int32_t R, float* out, float* scratch,
            const AttnNext* next) {
  using vec = typename V::vec;
  const int64_t hd = a->head_dim;
  const int64_t hv = hd / V::W * V::W;
  const int32_t bs = a->block_size;
  const int32_t group = a->group;
  const int32_t nh = n_kv * group;  // query heads per row
  float* s = scratch;
  float* m = scratch + 4 * (size_t(bs) + 32);  // R x nh, row-major
  float* l = m + size_t(R) * nh;
  for (int32_t h = 0; h < R * nh; ++h) {
    m[h] = -__builtin_inff();
    l[h] = 0.0f;
  }
  for (int32_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < nh * hd; ++k) out[r * row_stride + k] = 0.0f;
  const int32_t nb = pos[0] / bs + 1;
  int32_t max_pos = pos[0];
  for (int32_t r = 1; r < R; ++r) max_pos = pos[r] > max_pos ? pos[r] : max_pos;
  // The rows of kv heads [h0, h0 + hn) of block b's part of a sequence
  // (its table bt, highest position mp): its K rows are one run, its V rows
  // another.
  auto ranges = [&](const int32_t* bt, int32_t h0, int32_t hn, int32_t mp, int32_t b, PrefetchCursor<V>& c) {
    const uint8_t* np = a->layer_base + size_t(bt[b]) * a->block_bytes;
    const size_t rows_n = size_t(b == mp / bs ? mp - b * bs + 1 : bs);
    c.p[0] = np + size_t(h0) * a->k_head_bytes;
    c.e[0] = c.p[0] + size_t(hn - 1) * a->k_head_bytes + rows_n * a->k_row_bytes;
    c.p[1] = np + a->v_offset + size_t(h0) * a->v_head_bytes;
    c.e[1] = c.p[1] + size_t(hn - 1) * a->v_head_bytes + rows_n * a->v_row_bytes;
  };
  // Query j of kv head h in block b: row j / group, head h * group + j %
  // group; it attends the whole block, or its last up to its row's position.
  auto at_head = [&](int32_t h, int32_t b) {
    const bool last = b == nb - 1;
    return [=](int32_t j, const float*& qp, float*& op, float*& mp, float*& lp, int32_t& len) {
      const int32_t r = j / group, hq = h * group + j % group;
      qp = q + r * row_stride + hq * hd;
      op = out + r * row_stride + hq * hd;
      mp = m + size_t(r) * nh + hq;
      lp = l + size_t(r) * nh + hq;
      len = last ? pos[r] - b * bs + 1 : bs;
    };
  };
  // The next blocks' K and V are somewhere else in the pool (runs a
  // hardware prefetcher finds late): block 1 is asked for at once, and
  // block b + 2 a few lines at a time while block b is computed (ahead 1
  // or 3 and twice the lines per step measured no better, F16 KV 1.4x
  // faster than one burst per block). Past this call's last block the
  // cursor goes on into the next call's first blocks, so that call starts
  // on KV already asked for.
  constexpr int32_t kAhead = 2;
  const int32_t next_nb = next ? next->max_pos / bs + 1 : 0;
  PrefetchCursor<V> pf;
  for (int32_t b = 1; b < nb && b < kAhead; ++b) {
    ranges(block_table, kv_head, n_kv, max_pos, b, pf);
    pf.rest();
  }
  for (int32_t b = 0; b < nb; ++b) {
    const uint8_t* part = a->layer_base + size_t(block_table[b]) * a->block_bytes;
    pf = PrefetchCursor<V>{};
    // The next call's block, when >= 0 (its block 0 follows this call's
    // last, even when this call has fewer than kAhead blocks).
    const int32_t j = b + (nb < kAhead ? nb : kAhead) - nb;
    if (j < 0)
      ranges(block_table, kv_head, n_kv, max_pos, b + kAhead, pf);
    else if (j < next_nb)
      ranges(next->block_table, next->kv_head, next->n_kv, next->max_pos, j, pf);
    if (pf.p[0]) {
      const size_t lines = size_t((pf.e[0] - pf.p[0]) + (pf.e[1] - pf.p[1]) + 63) / 64;
      // Steps: one per position of V (and one per four positions of scores).
      const size_t steps =
          size_t(n_kv) * size_t(bs + (LK::kPrefetchInScores ? bs / 4 : 0)) * size_t((R * group + 3) / 4);
      pf.per_step = int32_t((lines + steps - 1) / steps);
    }
    for (int32_t h = 0; h < n_kv; ++h) {
      const uint8_t* K = part + size_t(kv_head + h) * a->k_head_bytes;
      const uint8_t* Vb = part + a->v_offset + size_t(kv_head + h) * a->v_head_bytes;
      attn_queries<V, LK, LV>(a, R * group, at_head(h, b), K, Vb, s, pf);
    }
    pf.rest();
  }
  for (int32_t r = 0; r < R; ++r)
    for (int32_t h = 0; h < nh; ++h) {
      const float inv = 1.0f / l[size_t(r) * nh + h];
      float* og = out + r * row_stride + h * hd;
      const vec iv = V::set1(inv);
      for (int64_t k = 0; k < hv; k += V::W) V::storeu(og + k, V::mul(V::loadu(og + k), iv));
      for (int64_t k = hv; k < hd; ++k) og[k] = og[k] * inv;
    }
}

// A KV row of any cache type, the type read at run time (set by attn_k
// for the call): the scalar table's one loader for every K and V pair, and
// the AVX tables' for the pairs without typed loaders (attn_k). It loads
// the same values as the typed loaders (each conversion is exact) a W-step
// at a time, each with its own scale, so a query's operations are theirs.
template <class V, int Which>  // 0: K rows, 1: V rows
struct LAnyKv {
  static inline thread_local int type = cleave::cpu::kWF32;
  static constexpr int kBlock = 1;
  static constexpr bool kPrefetchInScores = true;
  struct Scale {};
  static Scale scale(const uint8_t*, int64_t) { return {}; }
  static typename V::vec load(const uint8_t* row, int64_t k, Scale = {}) {
    switch (type) {
      case cleave::cpu::kWF16: return LF16<V>::load(row, k);
      case cleave::cpu::kWQ8: return LQ8<V>::load(row, k);
      case cleave::cpu::kWQ4: return LQ4<V>::load(row, k);
      default: return LF32<V>::load(row, k);
    }
  }
  static float at(const uint8_t* row, int64_t k) {
    switch (type) {
      case cleave::cpu::kWF16: return LF16<V>::at(row, k);
      case cleave::cpu::kWQ8: return LQ8<V>::at(row, k);
      case cleave::cpu::kWQ4: return LQ4<V>::at(row, k);
      default: return LF32<V>::at(row, k);
    }
  }
};

template <class V>
void attn_k(const AttnArgs* a, const float* q, int64_t row_stride, int32_t kv_head, int32_t n_kv,
            const int32_t* block_table, const int32_t* pos, int32_t R, float* out, float* scratch,
            const AttnNext* next) {
  auto run = [&](auto lk, auto lv) {
    attn_t<V, decltype(lk), decltype(lv)>(a, q, row_stride, kv_head, n_kv, block_table, pos, R, out, scratch,
                                          next);
  };
  const int kt = a->k_type, vt = a->v_type;
  if constexpr (!V::kOneKvLoader) {
    // Typed loaders for one type in K and V, and for llama.cpp's usual
    // Q8_0 K with Q4_0 V; each pair is an instantiation of the whole kernel,
    // so the other pairs share the runtime-typed one.
    if (kt == vt) {
      switch (kt) {
        case cleave::cpu::kWF32: return run(LF32<V>{}, LF32<V>{});
        case cleave::cpu::kWF16: return run(LF16<V>{}, LF16<V>{});
        case cleave::cpu::kWQ8: return run(LQ8<V>{}, LQ8<V>{});
        case cleave::cpu::kWQ4: return run(LQ4<V>{}, LQ4<V>{});
        default: __builtin_trap();
      }
    }
    if (kt == cleave::cpu::kWQ8 && vt == cleave::cpu::kWQ4) return run(LQ8<V>{}, LQ4<V>{});
  }
  LAnyKv<V, 0>::type = kt;
  LAnyKv<V, 1>::type = vt;
  run(LAnyKv<V, 0>{}, LAnyKv<V, 1>{});
}

}  // namespace
