// The CUDA backend against the CPU backend, op by op and dtype by dtype, plus
// batch invariance on the GPU (bit for bit) and a small benchmark. Without a
// GPU (no device, no driver, or a build without nvcc) every case prints one
// "SKIPPED: no GPU" line and is skipped; any other CUDA start-up error fails.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/device_testing.h"
#include "kernels/dtype.h"
#include "tests/cuda/gpu.h"

#ifdef CLEAVE_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/matmul.h"
#endif

namespace {

using namespace cleave;
using gpu_test::gpu_or_skip;

// Random values in +-[0.05, 1]: never zero.
struct Rng {
  std::mt19937 gen;
  explicit Rng(uint32_t seed) : gen(seed) {}
  float value() {
    std::uniform_real_distribution<float> mag(0.05f, 1.0f);
    float v = mag(gen);
    return (gen() & 1) ? v : -v;
  }
  std::vector<float> vec(size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto& e : v) e = value() * scale;
    return v;
  }
  int32_t below(int32_t n) { return int32_t(gen() % uint32_t(n)); }
};

// A buffer on one backend, freed with it.
struct Buf {
  Backend* be = nullptr;
  void* p = nullptr;
  size_t bytes = 0;
  Buf(Backend& b, size_t n) : be(&b), bytes(n) {
    p = be->alloc(n);
    REQUIRE(p != nullptr);
  }
  template <class T>
  Buf(Backend& b, const std::vector<T>& v) : Buf(b, v.size() * sizeof(T)) {
    be->upload(p, v.data(), bytes);
  }
  ~Buf() { be->free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  float* f() const { return static_cast<float*>(p); }
  int32_t* i() const { return static_cast<int32_t*>(p); }
  const AttnRow* rows() const { return static_cast<const AttnRow*>(p); }
  template <class T = float>
  std::vector<T> get() const {
    std::vector<T> v(bytes / sizeof(T));
    be->download(v.data(), p, bytes);
    return v;
  }
};

// max |a - ref| / max |ref| (0 when both are all zero).
double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  REQUIRE(a.size() == ref.size());
  double md = 0, mr = 0;
  for (size_t k = 0; k < a.size(); ++k) {
    if (std::isnan(a[k]) || std::isnan(ref[k])) return INFINITY;
    md = std::max(md, std::fabs(double(a[k]) - double(ref[k])));
    mr = std::max(mr, std::fabs(double(ref[k])));
  }
  return mr > 0 ? md / mr : md;
}

bool same_bits(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

// Weight bytes of type t for a rows x cols float matrix.
std::vector<uint8_t> encode(DType t, const std::vector<float>& w, int64_t rows, int64_t cols) {
  const size_t rb = dtype_row_bytes(t, cols);
  std::vector<uint8_t> out(rb * size_t(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = w.data() + r * cols;
    uint8_t* dst = out.data() + size_t(r) * rb;
    switch (t) {
      case DType::F32: std::memcpy(dst, src, rb); break;
      case DType::F16:
        for (int64_t c = 0; c < cols; ++c) {
          uint16_t h = fp32_to_fp16(src[c]);
          std::memcpy(dst + 2 * c, &h, 2);
        }
        break;
      case DType::BF16:
        for (int64_t c = 0; c < cols; ++c) {
          uint16_t h = fp32_to_bf16(src[c]);
          std::memcpy(dst + 2 * c, &h, 2);
        }
        break;
      case DType::Q8_0: quantize_row_q8_0(src, cols, dst); break;
      case DType::Q4_0: quantize_row_q4_0(src, cols, dst); break;
    }
  }
  return out;
}

WeightView view(DType t, const Buf& b, int64_t rows, int64_t cols) {
  return WeightView{t, b.p, rows, cols, dtype_row_bytes(t, cols)};
}

const DType kTypes[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0};

}  // namespace

TEST_CASE("cuda backend: caps, supports, memory round trip") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  Caps caps = gpu->caps();
  CHECK(caps.name == "cuda");
  CHECK(caps.isa.rfind("sm_", 0) == 0);
  CHECK(caps.threads > 0);
  MESSAGE("cuda caps: " << caps.isa << ", " << caps.threads << " SMs");
  for (Op op : {Op::matmul, Op::rmsnorm, Op::rope, Op::softmax, Op::silu_mul, Op::embed,
                Op::topk_gating, Op::layer_norm, Op::gelu, Op::add})
    for (DType t : kTypes) CHECK(gpu->supports(op, t));
  // KV caches: the CPU backend's types (no BF16).
  for (Op op : {Op::kv_write, Op::attention})
    for (DType t : kTypes) CHECK(gpu->supports(op, t) == (t != DType::BF16));
  Rng rng(1);
  auto v = rng.vec(12345);
  Buf b(*gpu, v);
  gpu->sync();
  CHECK(b.get() == v);
}

namespace {

// The CUDA backend with the tensor-core matmul (fma = false; the default on
// sm_80+) or the FMA one (device_testing.h's seam).
std::unique_ptr<Backend> gpu_with_matmul(bool fma) {
  set_cuda_fma_matmul(fma);
  auto made = make_cuda_backend(0);
  set_cuda_fma_matmul(false);
  REQUIRE(made.ok());
  return std::move(made).value();
}

// Every dtype and shape against the CPU backend, each n's rows equal to the
// same rows computed one at a time, and the aligned (vector) path equal to
// the misaligned (scalar) one. n up to 40 covers the tensor kernel's tiles
// of 8, 16 and 32 x rows.
void check_matmul_against_cpu(Backend* gpu) {
  auto cpu = make_cpu_backend(2);
  Rng rng(2);
  struct Shape {
    int64_t rows, cols;
  };
  // Q8_0 needs cols % 32 == 0; the others also get ragged cols.
  const Shape q8_shapes[] = {{1, 32}, {7, 96}, {33, 160}, {130, 1024}, {64, 4096}, {9, 4128}};
  const Shape ragged[] = {{5, 37}, {17, 100}, {9, 3}, {3, 1}, {11, 4100}};
  const int64_t ns[] = {1, 3, 5, 8, 13, 40};
  for (DType t : kTypes) {
    std::vector<Shape> shapes(std::begin(q8_shapes), std::end(q8_shapes));
    if (t != DType::Q8_0) shapes.insert(shapes.end(), std::begin(ragged), std::end(ragged));
    for (const Shape& s : shapes) {
      CAPTURE(dtype_name(t));
      CAPTURE(s.rows);
      CAPTURE(s.cols);
      const auto wf = rng.vec(size_t(s.rows * s.cols));
      const auto wb = encode(t, wf, s.rows, s.cols);
      Buf wc(*cpu, wb), wg(*gpu, wb);
      const int64_t nmax = 40;
      // One spare float in front: x at +1 is misaligned for the scalar path.
      const auto xv = rng.vec(size_t(nmax * s.cols + 1));
      Buf xc(*cpu, xv), xg(*gpu, xv);
      Buf yc(*cpu, size_t(nmax * s.rows) * 4), yg(*gpu, size_t(nmax * s.rows) * 4);
      // Reference rows, one at a time on the GPU (n = 1).
      Buf y1(*gpu, size_t(nmax * s.rows) * 4);
      for (int64_t i = 0; i < nmax; ++i)
        gpu->matmul(view(t, wg, s.rows, s.cols), xg.f() + 1 + i * s.cols, 1,
                    y1.f() + i * s.rows);
      gpu->sync();
      const auto single = y1.get();
      for (int64_t n : ns) {
        CAPTURE(n);
        cpu->matmul(view(t, wc, s.rows, s.cols), xc.f() + 1, n, yc.f());
        gpu->matmul(view(t, wg, s.rows, s.cols), xg.f() + 1, n, yg.f());
        gpu->sync();
        auto rc = yc.get(), rg = yg.get();
        rc.resize(size_t(n * s.rows));
        rg.resize(size_t(n * s.rows));
        const double tol = 2e-5;
        CHECK(rel_err(rg, rc) <= tol);
        CHECK(same_bits(rg.data(), single.data(), rg.size()));
      }
      // Aligned x (vector path where the shape allows) gives the same bits
      // as the misaligned scalar path: the per-lane order is the same.
      if (s.cols % 8 == 0) {
        Buf xa(*gpu, std::vector<float>(xv.begin() + 1, xv.end()));
        gpu->matmul(view(t, wg, s.rows, s.cols), xa.f(), nmax, yg.f());
        gpu->sync();
        auto rg = yg.get();
        CHECK(same_bits(rg.data(), single.data(), rg.size()));
      }
    }
  }
}

}  // namespace

TEST_CASE("cuda matmul: all dtypes against cpu, batch invariant, both paths") {
  if (!gpu_or_skip()) return;
  for (bool fma : {false, true}) {
    CAPTURE(fma);
    auto gpu = gpu_with_matmul(fma);
    check_matmul_against_cpu(gpu.get());
  }
}

TEST_CASE("cuda rmsnorm, softmax, silu_mul against cpu, batch invariant") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend(2);
  Rng rng(3);
  for (int64_t dim : {1, 7, 256, 4096, 5003}) {
    CAPTURE(dim);
    const int64_t n = 5;
    const auto x = rng.vec(size_t(n * dim), 3.0f);
    const auto w = rng.vec(size_t(dim));
    Buf xc(*cpu, x), xg(*gpu, x), wc(*cpu, w), wg(*gpu, w);
    Buf yc(*cpu, x.size() * 4), yg(*gpu, x.size() * 4), y1(*gpu, x.size() * 4);
    cpu->rmsnorm(xc.f(), wc.f(), n, dim, 1e-5f, yc.f());
    gpu->rmsnorm(xg.f(), wg.f(), n, dim, 1e-5f, yg.f());
    for (int64_t i = 0; i < n; ++i)
      gpu->rmsnorm(xg.f() + i * dim, wg.f(), 1, dim, 1e-5f, y1.f() + i * dim);
    gpu->sync();
    auto rg = yg.get();
    CHECK(rel_err(rg, yc.get()) <= 1e-5);
    CHECK(same_bits(rg.data(), y1.get().data(), rg.size()));

    // softmax, in place
    Buf sc(*cpu, x), sg(*gpu, x), s1(*gpu, x);
    cpu->softmax(sc.f(), n, dim);
    gpu->softmax(sg.f(), n, dim);
    for (int64_t i = 0; i < n; ++i) gpu->softmax(s1.f() + i * dim, 1, dim);
    gpu->sync();
    rg = sg.get();
    CHECK(rel_err(rg, sc.get()) <= 2e-5);
    CHECK(same_bits(rg.data(), s1.get().data(), rg.size()));
  }
  for (int64_t count : {1, 1000, 100003}) {
    CAPTURE(count);
    const auto g = rng.vec(size_t(count), 6.0f), u = rng.vec(size_t(count));
    Buf gc(*cpu, g), gg(*gpu, g), uc(*cpu, u), ug(*gpu, u);
    Buf oc(*cpu, g.size() * 4), og(*gpu, g.size() * 4);
    cpu->silu_mul(gc.f(), uc.f(), count, oc.f());
    gpu->silu_mul(gg.f(), ug.f(), count, og.f());
    gpu->sync();
    CHECK(rel_err(og.get(), oc.get()) <= 1e-5);
  }
}

TEST_CASE("cuda layer_norm, gelu, add (the vision encoder's ops) against cpu, batch invariant") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend(2);
  Rng rng(5);
  for (int64_t dim : {1, 7, 384, 1536, 5003}) {
    CAPTURE(dim);
    const int64_t n = 5;
    auto x = rng.vec(size_t(n * dim), 3.0f);
    for (float& e : x) e += 20.0f;  // an offset mean, as activations have
    const auto w = rng.vec(size_t(dim)), b = rng.vec(size_t(dim));
    Buf xc(*cpu, x), xg(*gpu, x), wc(*cpu, w), wg(*gpu, w), bc(*cpu, b), bg(*gpu, b);
    Buf yc(*cpu, x.size() * 4), yg(*gpu, x.size() * 4), y1(*gpu, x.size() * 4);
    cpu->layer_norm(xc.f(), wc.f(), bc.f(), n, dim, 1e-6f, yc.f());
    gpu->layer_norm(xg.f(), wg.f(), bg.f(), n, dim, 1e-6f, yg.f());
    for (int64_t i = 0; i < n; ++i)
      gpu->layer_norm(xg.f() + i * dim, wg.f(), bg.f(), 1, dim, 1e-6f, y1.f() + i * dim);
    gpu->sync();
    auto rg = yg.get();
    CHECK(rel_err(rg, yc.get()) <= 2e-5);
    CHECK(same_bits(rg.data(), y1.get().data(), rg.size()));
    // A bias on every row, in place.
    Buf ac(*cpu, x), ag(*gpu, x);
    cpu->add(ac.f(), bc.f(), n * dim, dim, ac.f());
    gpu->add(ag.f(), bg.f(), n * dim, dim, ag.f());
    gpu->sync();
    CHECK(ag.get() == ac.get());
  }
  for (int64_t count : {1, 1000, 100003}) {
    CAPTURE(count);
    const auto x = rng.vec(size_t(count), 8.0f);
    for (Gelu kind : {Gelu::tanh, Gelu::quick}) {
      Buf xc(*cpu, x), xg(*gpu, x), oc(*cpu, x.size() * 4), og(*gpu, x.size() * 4);
      cpu->gelu(xc.f(), count, kind, oc.f());
      gpu->gelu(xg.f(), count, kind, og.f());
      gpu->sync();
      CHECK(rel_err(og.get(), oc.get()) <= 1e-5);
    }
  }
}

TEST_CASE("cuda full_attention against cpu, batch invariant, copy, moe_combine") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend(2);
  Rng rng(12);
  for (int64_t T : {1, 37, 577}) {  // 577: ViT-L/14 at 336 px
    CAPTURE(T);
    const int64_t seqs = 3, heads = 4, hd = 64, ld = heads * hd;
    const auto q = rng.vec(size_t(seqs * T * ld)), k = rng.vec(size_t(seqs * T * ld)),
               v = rng.vec(size_t(seqs * T * ld));
    const float scale = 1.0f / std::sqrt(float(hd));
    Buf qc(*cpu, q), kc(*cpu, k), vc(*cpu, v), oc(*cpu, q.size() * 4);
    Buf qg(*gpu, q), kg(*gpu, k), vg(*gpu, v), og(*gpu, q.size() * 4), o1(*gpu, q.size() * 4);
    cpu->full_attention(qc.f(), kc.f(), vc.f(), seqs, T, heads, hd, ld, scale, oc.f());
    gpu->full_attention(qg.f(), kg.f(), vg.f(), seqs, T, heads, hd, ld, scale, og.f());
    for (int64_t s = 0; s < seqs; ++s)  // each sequence alone
      gpu->full_attention(qg.f() + s * T * ld, kg.f() + s * T * ld, vg.f() + s * T * ld, 1, T, heads, hd,
                          ld, scale, o1.f() + s * T * ld);
    gpu->sync();
    auto rg = og.get();
    CHECK(rel_err(rg, oc.get()) <= 1e-5);
    CHECK(same_bits(rg.data(), o1.get().data(), rg.size()));
  }
  const auto x = rng.vec(1000);
  Buf a(*gpu, x), b(*gpu, x.size() * 4);
  gpu->copy(b.p, a.p, x.size() * 4);
  gpu->sync();
  CHECK(b.get() == x);
  // moe_combine: products rounded, then added in order, on both: equal bits.
  const int64_t n = 7, k = 2, dim = 300;
  const auto y = rng.vec(size_t(n * k * dim)), w = rng.vec(size_t(n * k));
  std::vector<int32_t> rows(size_t(n * k));
  for (int64_t i = 0; i < n * k; ++i) rows[size_t(i)] = int32_t((i * 5) % (n * k));
  Buf yc(*cpu, y), wc(*cpu, w), rc(*cpu, rows), oc(*cpu, size_t(n * dim) * 4);
  Buf yg(*gpu, y), wg(*gpu, w), rg(*gpu, rows), og(*gpu, size_t(n * dim) * 4);
  cpu->moe_combine(yc.f(), rc.i(), wc.f(), n, k, dim, oc.f());
  gpu->moe_combine(yg.f(), rg.i(), wg.f(), n, k, dim, og.f());
  gpu->sync();
  CHECK(og.get() == oc.get());
}

TEST_CASE("cuda rope against cpu, batch invariant") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend(2);
  Rng rng(4);
  for (int64_t hd : {2, 64, 128}) {
    CAPTURE(hd);
    const int64_t n = 6, heads = 3;
    const auto x = rng.vec(size_t(n * heads * hd));
    std::vector<int32_t> pos = {0, 1, 7, 100, 511, 1000};
    Buf xc(*cpu, x), xg(*gpu, x), x1(*gpu, x), pc(*cpu, pos), pg(*gpu, pos);
    cpu->rope(xc.f(), n, heads, hd, pc.i(), 10000.0f);
    gpu->rope(xg.f(), n, heads, hd, pg.i(), 10000.0f);
    for (int64_t i = 0; i < n; ++i)
      gpu->rope(x1.f() + i * heads * hd, 1, heads, hd, pg.i() + i, 10000.0f);
    gpu->sync();
    auto rg = xg.get();
    CHECK(rel_err(rg, xc.get()) <= 1e-4);
    CHECK(same_bits(rg.data(), x1.get().data(), rg.size()));
  }
}

TEST_CASE("cuda embed: all dtypes, exact against cpu") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend(2);
  Rng rng(5);
  for (DType t : kTypes) {
    for (int64_t cols : {32, 96, 4096}) {
      CAPTURE(dtype_name(t));
      CAPTURE(cols);
      const int64_t vocab = 50;
      const auto wb = encode(t, rng.vec(size_t(vocab * cols)), vocab, cols);
      std::vector<int32_t> ids = {0, 49, 3, 3, 17, 22, 8};
      const int64_t n = int64_t(ids.size());
      Buf tc(*cpu, wb), tg(*gpu, wb), ic(*cpu, ids), ig(*gpu, ids);
      Buf oc(*cpu, size_t(n * cols) * 4), og(*gpu, size_t(n * cols) * 4);
      cpu->embed(view(t, tc, vocab, cols), ic.i(), n, oc.f());
      gpu->embed(view(t, tg, vocab, cols), ig.i(), n, og.f());
      gpu->sync();
      auto rg = og.get(), rc = oc.get();
      CHECK(same_bits(rg.data(), rc.data(), rg.size()));
    }
  }
}

TEST_CASE("cuda topk_gating against cpu") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend(2);
  Rng rng(6);
  for (int64_t ne : {8, 64, 160}) {
    for (int64_t k : {1, 2, 6}) {
      CAPTURE(ne);
      CAPTURE(k);
      const int64_t n = 9;
      auto logits = rng.vec(size_t(n * ne), 4.0f);
      // Ties: row 0 has its two largest equal; row 1 is all equal.
      logits[3] = logits[5] = 9.0f;
      for (int64_t e = 0; e < ne; ++e) logits[size_t(ne + e)] = 0.5f;
      Buf lc(*cpu, logits), lg(*gpu, logits);
      Buf ic(*cpu, size_t(n * k) * 4), ig(*gpu, size_t(n * k) * 4);
      Buf wc(*cpu, size_t(n * k) * 4), wg(*gpu, size_t(n * k) * 4);
      cpu->topk_gating(lc.f(), n, ne, k, ic.i(), wc.f());
      gpu->topk_gating(lg.f(), n, ne, k, ig.i(), wg.f());
      gpu->sync();
      const auto gi = ig.get<int32_t>();
      CHECK(gi == ic.get<int32_t>());
      CHECK(rel_err(wg.get(), wc.get()) <= 1e-5);
      CHECK(gi[0] == 3);
      if (k >= 2) CHECK(gi[1] == 5);
      for (int64_t j = 0; j < k; ++j) CHECK(gi[size_t(k + j)] == j);
    }
  }
}

namespace {

struct AttnCase {
  int32_t block_size, n_kv_heads, n_heads, head_dim, seq;
  DType k_type = DType::F32, v_type = DType::F32;
};

// Fills a KV cache on `be` with the same random garbage, runs kv_write for
// rows [a, b) of a sequence, then attention for the same rows.
struct KvFixture {
  Backend& be;
  PagedKv kv;
  std::unique_ptr<Buf> data, table;
  KvFixture(Backend& b, const AttnCase& c, const std::vector<float>& garbage,
            const std::vector<int32_t>& blocks)
      : be(b) {
    kv.n_blocks = int32_t(blocks.size()) + 2;
    kv.block_size = c.block_size;
    kv.n_layers = 2;
    kv.n_kv_heads = c.n_kv_heads;
    kv.head_dim = c.head_dim;
    kv.k_type = c.k_type;
    kv.v_type = c.v_type;
    // The garbage's bytes, whatever the KV types (kv_write must overwrite
    // exactly the rows it stores, as the CPU does).
    std::vector<uint8_t> g(kv.block_bytes() * size_t(kv.n_blocks));
    for (size_t k = 0; k < g.size(); ++k) {
      const float f = garbage[(k / 4) % garbage.size()];
      g[k] = reinterpret_cast<const uint8_t*>(&f)[k % 4];
    }
    data = std::make_unique<Buf>(be, g);
    kv.data = reinterpret_cast<uint8_t*>(data->f());
    table = std::make_unique<Buf>(be, blocks);
  }
  std::vector<AttnRow> rows(int32_t a, int32_t b) const {
    std::vector<AttnRow> r;
    const int32_t nb = int32_t(table->bytes / 4);
    for (int32_t p = a; p < b; ++p) r.push_back(AttnRow{table->i(), nb, p});
    return r;
  }
};

}  // namespace

TEST_CASE("cuda kv_write + attention against cpu - chunked prefill and batching bit-exact") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend(2);
  Rng rng(7);
  const AttnCase cases[] = {
      {16, 2, 4, 64, 50},   // GQA group 2, partial last block
      {16, 4, 4, 128, 33},  // MHA
      {32, 1, 8, 128, 70},  // MQA
      {7, 2, 6, 80, 20},    // odd block size and head_dim
      // The other KV types (the stored bytes must be the CPU's)
      {16, 2, 4, 64, 50, DType::F16, DType::F16},
      {16, 2, 4, 64, 50, DType::Q8_0, DType::Q8_0},
      {32, 1, 8, 128, 70, DType::Q8_0, DType::F16},
      {7, 1, 2, 32, 20, DType::Q8_0, DType::F32},  // F32 V rows off a 4-byte boundary
      {16, 2, 4, 64, 50, DType::Q4_0, DType::Q4_0},
      {32, 1, 8, 128, 70, DType::Q8_0, DType::Q4_0},
      {7, 1, 2, 32, 20, DType::Q4_0, DType::F32},  // F32 V rows off a 4-byte boundary
  };
  for (const AttnCase& c : cases) {
    CAPTURE(int(c.k_type));
    CAPTURE(int(c.v_type));
    CAPTURE(c.block_size);
    CAPTURE(c.head_dim);
    CAPTURE(c.n_heads);
    const int32_t nblk = (c.seq + c.block_size - 1) / c.block_size;
    std::vector<int32_t> blocks(static_cast<size_t>(nblk));
    std::iota(blocks.begin(), blocks.end(), 2);
    std::shuffle(blocks.begin(), blocks.end(), rng.gen);  // out-of-order physical blocks
    const auto garbage = rng.vec(997, 5.0f);
    const size_t kvn = size_t(c.seq) * c.n_kv_heads * c.head_dim;
    const size_t qn = size_t(c.seq) * c.n_heads * c.head_dim;
    const auto k = rng.vec(kvn), v = rng.vec(kvn), q = rng.vec(qn);
    const float scale = 1.0f / std::sqrt(float(c.head_dim));
    const int32_t layer = 1;

    // Whole prefill on both backends.
    KvFixture fc(*cpu, c, garbage, blocks), fg(*gpu, c, garbage, blocks);
    Buf kc(*cpu, k), vc(*cpu, v), qc(*cpu, q), kg(*gpu, k), vg(*gpu, v), qg(*gpu, q);
    Buf oc(*cpu, qn * 4), og(*gpu, qn * 4);
    // The CPU's rows in host memory, the GPU's in device memory (the contract).
    auto rc = fc.rows(0, c.seq);
    Buf rg(*gpu, fg.rows(0, c.seq));
    cpu->kv_write(fc.kv, layer, kc.f(), vc.f(), rc.data(), c.seq);
    cpu->attention(fc.kv, layer, qc.f(), rc.data(), c.seq, c.n_heads, scale, oc.f());
    gpu->kv_write(fg.kv, layer, kg.f(), vg.f(), rg.rows(), c.seq);
    gpu->attention(fg.kv, layer, qg.f(), rg.rows(), c.seq, c.n_heads, scale, og.f());
    gpu->sync();
    const auto whole = og.get();
    CHECK(fg.data->get<uint8_t>() == fc.data->get<uint8_t>());  // the CPU's stored bytes
    CHECK(rel_err(whole, oc.get()) <= 5e-5);

    // Chunked prefill on a fresh GPU cache: chunks of 1, 13, rest.
    KvFixture f2(*gpu, c, garbage, blocks);
    Buf o2(*gpu, qn * 4);
    const size_t qrow = size_t(c.n_heads) * c.head_dim, kvrow = size_t(c.n_kv_heads) * c.head_dim;
    const int32_t cuts[] = {0, 1, 14, c.seq};
    for (int ci = 0; ci + 1 < 4; ++ci) {
      const int32_t a = cuts[ci], b = cuts[ci + 1];
      Buf r(*gpu, f2.rows(a, b));
      gpu->kv_write(f2.kv, layer, kg.f() + a * kvrow, vg.f() + a * kvrow, r.rows(), b - a);
      gpu->attention(f2.kv, layer, qg.f() + a * qrow, r.rows(), b - a, c.n_heads, scale,
                     o2.f() + a * qrow);
    }
    gpu->sync();
    const auto chunked = o2.get();
    CHECK(same_bits(chunked.data(), whole.data(), whole.size()));

    // Decode-style batch: rows in a shuffled order, one call.
    std::vector<int32_t> order(static_cast<size_t>(c.seq));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng.gen);
    std::vector<float> qs(qn);
    std::vector<AttnRow> rs;
    for (size_t j = 0; j < order.size(); ++j) {
      std::memcpy(qs.data() + j * qrow, q.data() + size_t(order[j]) * qrow, qrow * 4);
      rs.push_back(AttnRow{fg.table->i(), nblk, order[j]});
    }
    Buf qsg(*gpu, qs), o3(*gpu, qn * 4), rsg(*gpu, rs);
    gpu->attention(fg.kv, layer, qsg.f(), rsg.rows(), c.seq, c.n_heads, scale, o3.f());
    gpu->sync();
    const auto shuffled = o3.get();
    bool same = true;
    for (size_t j = 0; j < order.size(); ++j)
      same = same && same_bits(shuffled.data() + j * qrow,
                               whole.data() + size_t(order[j]) * qrow, qrow);
    CHECK(same);
  }
}

TEST_CASE("cuda benchmark") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
#ifdef CLEAVE_HAVE_CUDA
  auto check = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) FAIL(what << ": " << cudaGetErrorString(e));
  };
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  // Milliseconds per call of fn, best of `reps` timed on the legacy stream
  // (the backend's stream is a blocking one, so events order with it).
  auto time_ms = [&](auto&& fn, int reps) {
    fn();
    gpu->sync();
    float best = 1e30f;
    for (int r = 0; r < reps; ++r) {
      check(cudaEventRecord(e0, 0), "cudaEventRecord");
      fn();
      check(cudaEventRecord(e1, 0), "cudaEventRecord");
      check(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
      best = std::min(best, ms);
    }
    return double(best);
  };

  int dev = 0, clock_khz = 0, bus_bits = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  double peak_gbs = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) == cudaSuccess)
    peak_gbs = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
  cudaGetLastError();

  // Device-to-device copy: the practical limit (read + write bytes).
  const size_t copy_bytes = size_t(1) << 30;
  Buf ca(*gpu, copy_bytes), cb(*gpu, copy_bytes);
  const double copy_ms = time_ms(
      [&] { check(cudaMemcpy(cb.p, ca.p, copy_bytes, cudaMemcpyDeviceToDevice), "memcpy"); }, 10);
  const double copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;

  std::printf("\ncuda benchmark on %s (%s, %d SMs)\n", prop.name, gpu->caps().isa.c_str(),
              prop.multiProcessorCount);
  std::printf("  theoretical DRAM bandwidth   %8.0f GB/s (attr clock %d kHz x %d bit x 2)\n",
              peak_gbs, clock_khz, bus_bits);
  std::printf("  d2d memcpy (read+write)      %8.0f GB/s  %.3f ms per GiB\n", copy_gbs, copy_ms);

  Rng rng(8);
  std::vector<float> pattern = rng.vec(1 << 16);
  // The TF32 tensor-core rate: the limit of the tensor-core matmul.
  const double mma_peak = cuda::measure_tf32_mma_peak(prop.multiProcessorCount, 0);
  std::printf("  TF32 mma.sync peak (registers) %8.0f GFLOP/s\n", mma_peak / 1e9);
  auto fma_gpu = gpu_with_matmul(true);
  struct Path {
    const char* name;
    Backend* backend;
  };
  const Path paths[] = {{"tensor", gpu.get()}, {"fma", fma_gpu.get()}};
  auto matvec = [&](DType t, int64_t rows, int64_t cols) {
    std::vector<float> wf(size_t(rows * cols));
    for (size_t k = 0; k < wf.size(); ++k) wf[k] = pattern[(k * 7 + k / 65536) % pattern.size()];
    const auto wb = encode(t, wf, rows, cols);
    for (const Path& p : paths) {
      Buf w(*p.backend, wb), x(*p.backend, rng.vec(size_t(cols))), y(*p.backend, size_t(rows) * 4);
      const WeightView wv = view(t, w, rows, cols);
      const double ms = time_ms([&] { p.backend->matmul(wv, x.f(), 1, y.f()); }, 20);
      const double gbs = double(wb.size()) / (ms * 1e-3) / 1e9;
      std::printf("  matvec %-6s %-4s %6lld x %-6lld %8.0f GB/s  %.1f%% of d2d, %.1f%% of peak, %.1f us\n",
                  p.name, dtype_name(t), (long long)rows, (long long)cols, gbs, 100.0 * gbs / copy_gbs,
                  peak_gbs > 0 ? 100.0 * gbs / peak_gbs : 0.0, ms * 1e3);
    }
  };
  matvec(DType::F16, 4096, 14336);
  matvec(DType::F16, 14336, 4096);
  matvec(DType::BF16, 14336, 4096);
  matvec(DType::Q8_0, 14336, 4096);
  matvec(DType::F32, 14336, 4096);

  // Prefill-shaped matmuls: 4096 x 4096 weights against 128 and 512 rows.
  for (DType t : {DType::F32, DType::F16, DType::Q8_0})
    for (int64_t n : {int64_t(128), int64_t(512)}) {
      const int64_t d = 4096;
      const auto wb = encode(t, rng.vec(size_t(d * d)), d, d);
      const auto xv = rng.vec(size_t(n * d));
      for (const Path& p : paths) {
        Buf w(*p.backend, wb), x(*p.backend, xv), y(*p.backend, size_t(n * d) * 4);
        const WeightView wv = view(t, w, d, d);
        const double ms = time_ms([&] { p.backend->matmul(wv, x.f(), n, y.f()); }, 10);
        const double flops = 2.0 * d * d * n / (ms * 1e-3);
        std::printf("  matmul %-6s %-4s 4096x4096 x %3lld rows %8.0f GFLOP/s  %.1f%% of TF32 mma peak  %.3f ms\n",
                    p.name, dtype_name(t), (long long)n, flops / 1e9, 100.0 * flops / mma_peak, ms);
      }
    }
  {
    // Decode attention: 64 sequences x 2048 tokens, 32 heads / 8 kv heads, hd 128.
    AttnCase c{16, 8, 32, 128, 2048};
    const int32_t seqs = 64, nblk = c.seq / c.block_size;
    PagedKv kv;
    kv.n_blocks = seqs * nblk;
    kv.block_size = c.block_size;
    kv.n_layers = 1;
    kv.n_kv_heads = c.n_kv_heads;
    kv.head_dim = c.head_dim;
    Buf data(*gpu, kv.block_bytes() * size_t(kv.n_blocks));
    check(cudaMemset(data.p, 0, data.bytes), "cudaMemset");
    kv.data = reinterpret_cast<uint8_t*>(data.f());
    std::vector<int32_t> tab(size_t(kv.n_blocks));
    std::iota(tab.begin(), tab.end(), 0);
    Buf tg(*gpu, tab), q(*gpu, rng.vec(size_t(seqs) * c.n_heads * c.head_dim)),
        o(*gpu, size_t(seqs) * c.n_heads * c.head_dim * 4);
    std::vector<AttnRow> rows;
    for (int32_t s = 0; s < seqs; ++s) rows.push_back(AttnRow{tg.i() + s * nblk, nblk, c.seq - 1});
    Buf rows_g(*gpu, rows);
    const double ms = time_ms(
        [&] { gpu->attention(kv, 0, q.f(), rows_g.rows(), seqs, c.n_heads, 0.088f, o.f()); }, 10);
    const double bytes = double(data.bytes);
    std::printf("  attention decode 64 x 2048 tok %8.0f GB/s of KV  %.3f ms\n",
                bytes / (ms * 1e-3) / 1e9, ms);
  }
  std::fflush(stdout);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
#endif
}
