// Paged attention and kv_write: against a float64 causal GQA reference, and
// bit-exact whatever the chunking of the prompt, the batch composition or the
// thread count.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "tests/kernels/kernel_test_util.h"

using namespace cleave;

namespace {

using test::isas;
using test::randv;

struct Cache {
  std::vector<uint8_t> mem;
  PagedKv kv;
  Cache(int32_t n_blocks, int32_t bs, int32_t layers, int32_t nkv, int32_t hd,
        DType kt = DType::F32, DType vt = DType::F32) {
    kv.k_type = kt;
    kv.v_type = vt;
    kv.n_blocks = n_blocks;
    kv.block_size = bs;
    kv.n_layers = layers;
    kv.n_kv_heads = nkv;
    kv.head_dim = hd;
    // All ones: NaN as F32, as F16 and as a Q8_0 block's scale, so an
    // unwritten slot poisons any result that reads it.
    mem.assign(kv.block_bytes() * n_blocks, 0xff);
    kv.data = mem.data();
  }
  // The stored row of (position p of s, head h), dequantised.
  std::vector<float> row(const std::vector<int32_t>& table, int32_t layer, int32_t kvsel, int32_t h,
                         int32_t p) const {
    std::vector<float> out(size_t(kv.head_dim));
    dequantize_row(kvsel == 0 ? kv.k_type : kv.v_type,
                   mem.data() + kv.offset(table[p / kv.block_size], layer, kvsel, h, p % kv.block_size),
                   kv.head_dim, out.data());
    return out;
  }
};

// One sequence: its q/k/v for every position and its (shuffled) block table.
struct Seq {
  int32_t len;
  std::vector<int32_t> table;
  std::vector<float> q, k, v;  // len x heads x hd, len x nkv x hd
};

struct Cfg {
  int32_t heads = 6, nkv = 2, hd = 48, bs = 16, layers = 2, layer = 1;
};

// The KV types a head_dim allows (Q8_0 and Q4_0 need a multiple of 32).
std::vector<std::pair<DType, DType>> kv_types(int32_t hd) {
  std::vector<std::pair<DType, DType>> v = {{DType::F32, DType::F32}, {DType::F16, DType::F16},
                                            {DType::F32, DType::F16}};
  if (hd % 32 == 0) {
    v.push_back({DType::Q8_0, DType::Q8_0});
    v.push_back({DType::F16, DType::Q8_0});
    v.push_back({DType::Q4_0, DType::Q4_0});
    v.push_back({DType::Q8_0, DType::Q4_0});  // llama.cpp's usual pair: K is the more sensitive
  }
  return v;
}

std::vector<Seq> make_seqs(const Cfg& c, const std::vector<int32_t>& lens, int32_t n_blocks,
                           uint32_t seed) {
  std::vector<int32_t> pool(static_cast<size_t>(n_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(pool.begin(), pool.end(), rng);
  size_t next = 0;
  std::vector<Seq> seqs;
  for (size_t s = 0; s < lens.size(); ++s) {
    Seq q;
    q.len = lens[s];
    const int32_t nb = (q.len + c.bs - 1) / c.bs;
    for (int32_t b = 0; b < nb; ++b) q.table.push_back(pool.at(next++));
    q.q = randv(size_t(q.len) * c.heads * c.hd, seed + 100 * uint32_t(s) + 1, -2.0f, 2.0f);
    q.k = randv(size_t(q.len) * c.nkv * c.hd, seed + 100 * uint32_t(s) + 2, -2.0f, 2.0f);
    q.v = randv(size_t(q.len) * c.nkv * c.hd, seed + 100 * uint32_t(s) + 3);
    seqs.push_back(std::move(q));
  }
  return seqs;
}

std::vector<AttnRow> rows_of(const Seq& s, int32_t from, int32_t to) {
  std::vector<AttnRow> r;
  for (int32_t p = from; p < to; ++p)
    r.push_back(AttnRow{s.table.data(), int32_t(s.table.size()), p});
  return r;
}

void write_kv(Backend& be, const Cfg& c, Cache& cache, const Seq& s, int32_t from, int32_t to) {
  const auto rows = rows_of(s, from, to);
  const size_t re = size_t(c.nkv) * c.hd;
  be.kv_write(cache.kv, c.layer, s.k.data() + from * re, s.v.data() + from * re, rows.data(),
              to - from);
}

std::vector<float> attend(Backend& be, const Cfg& c, Cache& cache, const Seq& s, int32_t from,
                          int32_t to) {
  const auto rows = rows_of(s, from, to);
  const size_t re = size_t(c.heads) * c.hd;
  std::vector<float> out(size_t(to - from) * re);
  be.attention(cache.kv, c.layer, s.q.data() + from * re, rows.data(), to - from, c.heads,
               1.0f / std::sqrt(float(c.hd)), out.data());
  return out;
}

std::vector<double> reference(const Cfg& c, const Seq& s) {
  const int32_t group = c.heads / c.nkv;
  std::vector<double> out(size_t(s.len) * c.heads * c.hd);
  const double scale = 1.0 / std::sqrt(double(c.hd));
  for (int32_t i = 0; i < s.len; ++i)
    for (int32_t h = 0; h < c.heads; ++h) {
      const int32_t kh = h / group;
      const float* q = s.q.data() + (size_t(i) * c.heads + h) * c.hd;
      std::vector<double> sc(size_t(i + 1));
      double m = -1e300;
      for (int32_t j = 0; j <= i; ++j) {
        const float* k = s.k.data() + (size_t(j) * c.nkv + kh) * c.hd;
        double d = 0;
        for (int32_t e = 0; e < c.hd; ++e) d += double(q[e]) * k[e];
        sc[j] = d * scale;
        m = std::max(m, sc[j]);
      }
      double sum = 0;
      for (int32_t j = 0; j <= i; ++j) sum += sc[j] = std::exp(sc[j] - m);
      double* o = out.data() + (size_t(i) * c.heads + h) * c.hd;
      for (int32_t j = 0; j <= i; ++j) {
        const float* v = s.v.data() + (size_t(j) * c.nkv + kh) * c.hd;
        for (int32_t e = 0; e < c.hd; ++e) o[e] += sc[j] / sum * v[e];
      }
    }
  return out;
}

double norm_err(const std::vector<float>& y, const std::vector<double>& ref) {
  double e = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    e = std::max(e, std::fabs(y[i] - ref[i]));
    m = std::max(m, std::fabs(ref[i]));
  }
  return e / (m + 1e-30);
}

// s with its K and V replaced by what the cache stores for them, dequantised.
Seq as_stored(const Cfg& c, const Cache& cache, const Seq& s) {
  Seq t = s;
  for (int32_t p = 0; p < s.len; ++p)
    for (int32_t h = 0; h < c.nkv; ++h)
      for (int32_t kvsel : {0, 1}) {
        const auto r = cache.row(s.table, c.layer, kvsel, h, p);
        std::copy(r.begin(), r.end(), (kvsel == 0 ? t.k : t.v).begin() + (size_t(p) * c.nkv + h) * c.hd);
      }
  return t;
}

}  // namespace

// What kv_write must store for one row of a type.
std::vector<uint8_t> encoded(DType t, const float* x, int32_t hd) {
  std::vector<uint8_t> out(dtype_row_bytes(t, hd));
  if (t == DType::F32) std::memcpy(out.data(), x, out.size());
  if (t == DType::F16)
    for (int32_t j = 0; j < hd; ++j) {
      const uint16_t h = fp32_to_fp16(x[j]);
      std::memcpy(out.data() + 2 * j, &h, 2);
    }
  if (t == DType::Q8_0) quantize_row_q8_0(x, hd, out.data());
  if (t == DType::Q4_0) quantize_row_q4_0(x, hd, out.data());
  return out;
}

TEST_CASE("kv_write puts each row at block_table of pos / bs - slot pos % bs, in the cache's types") {
  Cfg c;
  c.hd = 64;
  for (auto [kt, vt] : kv_types(c.hd)) {
    for (Isa isa : isas())
    for (int threads : {1, 2}) {  // 40 rows: the rows go to both threads
      auto be = make_cpu_backend(threads, isa);
      Cache cache(8, c.bs, c.layers, c.nkv, c.hd, kt, vt);
      const auto seqs = make_seqs(c, {40}, 8, 5);
      const Seq& s = seqs[0];
      write_kv(*be, c, cache, s, 0, s.len);
      INFO(dtype_name(kt) << "/" << dtype_name(vt) << " " << isa_name(isa) << " threads " << threads);
      for (int32_t p = 0; p < s.len; ++p)
        for (int32_t h = 0; h < c.nkv; ++h) {
          const uint8_t* k = cache.mem.data() + cache.kv.offset(s.table[p / c.bs], c.layer, 0, h, p % c.bs);
          const uint8_t* v = cache.mem.data() + cache.kv.offset(s.table[p / c.bs], c.layer, 1, h, p % c.bs);
          const auto ek = encoded(kt, s.k.data() + (size_t(p) * c.nkv + h) * c.hd, c.hd);
          const auto ev = encoded(vt, s.v.data() + (size_t(p) * c.nkv + h) * c.hd, c.hd);
          CHECK(std::memcmp(k, ek.data(), ek.size()) == 0);
          CHECK(std::memcmp(v, ev.data(), ev.size()) == 0);
        }
      // Layer 0 untouched.
      CHECK(std::isnan(cache.row(s.table, 0, 0, 0, 0)[0]));
      CHECK(std::isnan(cache.row(s.table, 0, 1, 1, 5)[0]));
    }
  }
}

// Head dims with and without a SIMD tail; groups the kernel takes whole (1-4)
// and in chunks of 4 (5, 8); blocks shorter and longer than its 16-position
// score tiles.
std::vector<Cfg> attention_shapes() {
  std::vector<Cfg> v;
  for (int32_t hd : {48, 44}) {
    Cfg c;
    c.hd = hd;
    v.push_back(c);
  }
  Cfg g8;  // group 8, block 32 (two score tiles), head dim 64
  g8.heads = 8, g8.nkv = 1, g8.hd = 64, g8.bs = 32;
  v.push_back(g8);
  Cfg h80;  // head dim 80: one 4-vector pass of V and one vector after it (AVX-512)
  h80.heads = 4, h80.nkv = 2, h80.hd = 80;
  v.push_back(h80);
  Cfg g5;  // group 5, block 5, head dim below one AVX-512 vector
  g5.heads = 10, g5.nkv = 2, g5.hd = 12, g5.bs = 5;
  v.push_back(g5);
  Cfg g1;  // no grouping, block 24 (a full and a partial tile)
  g1.heads = 2, g1.nkv = 2, g1.hd = 32, g1.bs = 24;
  v.push_back(g1);
  return v;
}

TEST_CASE("attention vs float64 causal GQA reference") {
  for (const Cfg& c : attention_shapes()) {
    for (Isa isa : isas()) {
      auto be = make_cpu_backend(2, isa);
      const int32_t blocks = (100 + c.bs - 1) / c.bs;
      Cache cache(blocks, c.bs, c.layers, c.nkv, c.hd);
      const auto seqs = make_seqs(c, {100}, blocks, 9);
      const Seq& s = seqs[0];
      write_kv(*be, c, cache, s, 0, s.len);
      const auto out = attend(*be, c, cache, s, 0, s.len);
      const double err = norm_err(out, reference(c, s));
      INFO(isa_name(isa) << " hd=" << c.hd << " heads=" << c.heads << " nkv=" << c.nkv
                         << " bs=" << c.bs << " err=" << err);
      CHECK(err <= 2e-6);
    }
  }
}

TEST_CASE("attention: chunked prefill and decode equal whole prefill - bit for bit") {
  for (const Cfg& c : attention_shapes()) {
    const int32_t hd = c.hd;
    const int32_t blocks = (100 + c.bs - 1) / c.bs;
    for (auto [kt, vt] : kv_types(hd))
    for (Isa isa : isas()) {
      std::unique_ptr<Backend> be[3] = {make_cpu_backend(1, isa), make_cpu_backend(2, isa),
                                        make_cpu_backend(3, isa)};
      const auto seqs = make_seqs(c, {100}, blocks, 13);
      const Seq& s = seqs[0];
      Cache whole(blocks, c.bs, c.layers, c.nkv, c.hd, kt, vt);
      write_kv(*be[1], c, whole, s, 0, s.len);
      const auto ref = attend(*be[1], c, whole, s, 0, s.len);
      for (int32_t chunk : {1, 7, 32}) {
        for (int ti = 0; ti < 3; ++ti) {
          Cache cache(blocks, c.bs, c.layers, c.nkv, c.hd, kt, vt);
          std::vector<float> out;
          for (int32_t p = 0; p < s.len; p += chunk) {
            const int32_t e = std::min(s.len, p + chunk);
            write_kv(*be[ti], c, cache, s, p, e);
            const auto o = attend(*be[ti], c, cache, s, p, e);
            out.insert(out.end(), o.begin(), o.end());
          }
          INFO(isa_name(isa) << " " << dtype_name(kt) << "/" << dtype_name(vt) << " hd=" << hd << " heads=" << c.heads << " bs=" << c.bs << " chunk=" << chunk << " threads=" << ti + 1);
          CHECK(std::memcmp(out.data(), ref.data(), ref.size() * 4) == 0);
        }
      }
    }
  }
}

TEST_CASE("attention: a decode batch mixing sequences equals each alone") {
  Cfg c;
  c.hd = 64;
  for (auto [kt, vt] : kv_types(c.hd))
  for (Isa isa : isas()) {
    INFO(dtype_name(kt) << "/" << dtype_name(vt));
    auto be1 = make_cpu_backend(1, isa);
    auto be2 = make_cpu_backend(2, isa);
    const std::vector<int32_t> lens = {100, 37, 61, 1, 16, 17};
    const auto seqs = make_seqs(c, lens, 40, 17);
    Cache cache(40, c.bs, c.layers, c.nkv, c.hd, kt, vt);
    for (const Seq& s : seqs) write_kv(*be2, c, cache, s, 0, s.len);
    // Batch: the last position of every sequence (and one middle position).
    std::vector<AttnRow> rows;
    std::vector<float> q;
    const size_t re = size_t(c.heads) * c.hd;
    for (const Seq& s : seqs) {
      for (int32_t p : {s.len - 1, s.len / 2}) {
        rows.push_back(AttnRow{s.table.data(), int32_t(s.table.size()), p});
        q.insert(q.end(), s.q.begin() + p * re, s.q.begin() + (p + 1) * re);
      }
    }
    std::vector<float> out(rows.size() * re);
    be2->attention(cache.kv, c.layer, q.data(), rows.data(), int64_t(rows.size()), c.heads,
                   1.0f / std::sqrt(float(c.hd)), out.data());
    for (size_t i = 0; i < rows.size(); ++i) {
      std::vector<float> one(re);
      be1->attention(cache.kv, c.layer, q.data() + i * re, &rows[i], 1, c.heads,
                     1.0f / std::sqrt(float(c.hd)), one.data());
      INFO(isa_name(isa) << " row " << i);
      CHECK(std::memcmp(one.data(), out.data() + i * re, re * 4) == 0);
    }
    // And against the reference of each sequence (on the values stored).
    for (size_t si = 0; si < seqs.size(); ++si) {
      const auto ref = reference(c, as_stored(c, cache, seqs[si]));
      const int32_t p = seqs[si].len - 1;
      std::vector<double> r(ref.begin() + p * re, ref.begin() + (p + 1) * re);
      std::vector<float> y(out.begin() + 2 * si * re, out.begin() + (2 * si + 1) * re);
      CHECK(norm_err(y, r) <= 2e-6);
    }
  }
}

// F16, Q8_0 and Q4_0 KV. The kernel must be exact on the values stored (as F32 is
// on its own), and the answer must lie within a bound derived from the
// quantisation error of the stored rows against the unquantised reference.
// For one query row and head, with d_t the score error of position t
// (scale x sum_e |q_e| |k'_te - k_te|) and D = max_t |d_t|:
//   p'_t / p_t lies in [e^-2D, e^2D], so |p'_t - p_t| <= p_t (e^2D - 1), and
//   o' - o = sum_t (p'_t - p_t) v'_t + sum_t p_t (v'_t - v_t), so
//   |o' - o|_inf <= (e^2D - 1) max_t |v'_t|_inf + max_t |v'_t - v_t|_inf.
// Each stored element's error is itself bounded: F16 by 2^-11 |x| (normal
// range), Q8_0 by half its block's step, max|x| / 254, Q4_0 by a whole
// step, max|x| / 8 (the element opposite the largest may sit at -8 steps,
// which Q4_0's top, +7, misses by one).
TEST_CASE("attention over F16, Q8_0 and Q4_0 KV: exact on the stored values, within the derived bound") {
  for (const Cfg& c : attention_shapes()) {
    for (auto [kt, vt] : kv_types(c.hd)) {
      if (kt == DType::F32 && vt == DType::F32) continue;
      for (Isa isa : isas()) {
        INFO(isa_name(isa) << " " << dtype_name(kt) << "/" << dtype_name(vt) << " hd=" << c.hd
                           << " heads=" << c.heads << " bs=" << c.bs);
        auto be = make_cpu_backend(2, isa);
        const int32_t blocks = (100 + c.bs - 1) / c.bs;
        Cache cache(blocks, c.bs, c.layers, c.nkv, c.hd, kt, vt);
        const auto seqs = make_seqs(c, {100}, blocks, 9);
        const Seq& s = seqs[0];
        write_kv(*be, c, cache, s, 0, s.len);
        const auto out = attend(*be, c, cache, s, 0, s.len);
        const Seq st = as_stored(c, cache, s);
        CHECK(norm_err(out, reference(c, st)) <= 2e-6);
        // Each stored element within its type's rounding.
        for (auto [orig, got, t] : {std::tuple{&s.k, &st.k, kt}, std::tuple{&s.v, &st.v, vt}}) {
          for (size_t e = 0; e < orig->size(); ++e) {
            const float x = (*orig)[e], y = (*got)[e];
            if (t == DType::F16) REQUIRE(std::fabs(y - x) <= std::ldexp(std::fabs(x), -11));
            if (t == DType::Q8_0) {
              float amax = 0;
              for (size_t j = e / 32 * 32; j < e / 32 * 32 + 32; ++j) amax = std::max(amax, std::fabs((*orig)[j]));
              // Half a step, the step rounded to F16 (relative 2^-11) on top.
              REQUIRE(std::fabs(y - x) <= amax / 254 + amax / 127 * 128 * std::ldexp(1.0f, -11) + 1e-7f);
            }
            if (t == DType::Q4_0) {
              float amax = 0;
              for (size_t j = e / 32 * 32; j < e / 32 * 32 + 32; ++j) amax = std::max(amax, std::fabs((*orig)[j]));
              // At most a step (amax / 8: the top of the range is 7 steps
              // above the middle, the bottom 8), the F16 scale's rounding on top.
              REQUIRE(std::fabs(y - x) <= amax / 8 + amax / 8 * 8 * std::ldexp(1.0f, -11) + 1e-7f);
            }
          }
        }
        // The derived bound against the unquantised reference.
        const auto exact = reference(c, s);
        const int32_t group = c.heads / c.nkv;
        const double scale = 1.0 / std::sqrt(double(c.hd));
        for (int32_t i = 0; i < s.len; ++i)
          for (int32_t h = 0; h < c.heads; ++h) {
            const int32_t kh = h / group;
            const float* q = s.q.data() + (size_t(i) * c.heads + h) * c.hd;
            double D = 0, vmax = 0, dv = 0;
            for (int32_t j = 0; j <= i; ++j) {
              const size_t at = (size_t(j) * c.nkv + kh) * c.hd;
              double d = 0;
              for (int32_t e = 0; e < c.hd; ++e) {
                d += std::fabs(double(q[e])) * std::fabs(double(st.k[at + e]) - s.k[at + e]);
                vmax = std::max(vmax, std::fabs(double(st.v[at + e])));
                dv = std::max(dv, std::fabs(double(st.v[at + e]) - s.v[at + e]));
              }
              D = std::max(D, d * scale);
            }
            const double bound = std::expm1(2 * D) * vmax + dv;
            double err = 0;
            for (int32_t e = 0; e < c.hd; ++e) {
              const size_t at = (size_t(i) * c.heads + h) * c.hd + e;
              err = std::max(err, std::fabs(double(out[at]) - exact[at]));
            }
            // The kernel's own F32 rounding on top (the exact check above: 2e-6 relative).
            CHECK(err <= bound + 4e-6 * (vmax + 1e-30));
          }
      }
    }
  }
}
