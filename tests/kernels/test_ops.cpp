// Every CPU op on every ISA this machine runs, against float64 references,
// and batch invariance bit for bit (batch size, position, thread count).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tests/kernels/kernel_test_util.h"
#include "kernels/cpu/host_memory.h"
#include "kernels/cpu/kern.h"
#include "kernels/dtype.h"

using namespace cleave;

namespace {

using test::isas;
using test::make_weights;
using test::randv;
using test::Weights;

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// max |y - ref| / (max |ref| + tiny)
double norm_err(const float* y, const std::vector<double>& ref) {
  double e = 0;
  for (size_t i = 0; i < ref.size(); ++i) e = std::max(e, std::fabs(double(y[i]) - ref[i]));
  return e / (max_abs(ref) + 1e-30);
}

std::vector<double> ref_matmul(const Weights& w, const float* x, int64_t n) {
  std::vector<double> y(size_t(n * w.rows));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < w.rows; ++r) {
      double s = 0;
      for (int64_t c = 0; c < w.cols; ++c) s += double(x[i * w.cols + c]) * w.deq[r * w.cols + c];
      y[i * w.rows + r] = s;
    }
  return y;
}

const DType kTypes[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0};

}  // namespace

TEST_CASE("cpu backend: caps - isa and memory") {
  const Isa best = detect_isa();
  MESSAGE("detected isa: " << std::string(isa_name(best)));
  for (Isa isa : isas()) {
    auto be = make_cpu_backend(2, isa);
    const Caps c = be->caps();
    CHECK(c.name == "cpu");
    CHECK(c.isa == isa_name(isa));
    CHECK(c.threads == 2);
    for (DType t : kTypes) CHECK(be->supports(Op::matmul, t));
    void* p = be->alloc(1000);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0);
    std::vector<uint8_t> a(1000, 7), b(1000, 0);
    be->upload(p, a.data(), 1000);
    be->sync();
    be->download(b.data(), p, 1000);
    CHECK(a == b);
    be->free(p);
  }
  CHECK(std::string(isa_name(Isa::scalar)) == "scalar");
}

TEST_CASE("matmul vs float64 reference - every dtype and isa") {
  struct Shape {
    int64_t rows, cols;
  };
  for (Isa isa : isas()) {
    for (int threads : {1, 2}) {
      auto be = make_cpu_backend(threads, isa);
      for (DType t : kTypes) {
        const bool q8 = t == DType::Q8_0;
        const Shape shapes[] = {{1, q8 ? 32 : 7},    {7, q8 ? 64 : 37},   {13, q8 ? 96 : 45},
                                {25, q8 ? 160 : 100}, {67, q8 ? 256 : 203}, {6, q8 ? 32 : 16}};
        for (const Shape& s : shapes) {
          const Weights w = make_weights(t, s.rows, s.cols, uint32_t(s.rows * 131 + s.cols), s.rows == 13 ? 6 : 0);
          for (int64_t n : {1, 3, 17, 128}) {
            const auto x = randv(size_t(n * s.cols), uint32_t(n + 5));
            std::vector<float> y(size_t(n * s.rows), -999.0f);
            be->matmul(w.view(), x.data(), n, y.data());
            const double err = norm_err(y.data(), ref_matmul(w, x.data(), n));
            INFO(isa_name(isa) << " " << dtype_name(t) << " rows=" << s.rows << " cols=" << s.cols
                               << " n=" << n << " threads=" << threads << " err=" << err);
            CHECK(err <= 2e-6 * std::sqrt(double(s.cols)));
          }
        }
      }
    }
  }
}

TEST_CASE("matmul: quantised weights give the same bits as their dequantised F32") {
  // Conversions are exact and every kernel runs the same FMA sequence, so
  // F16/BF16/Q8_0 equal F32 on the dequantised matrix, bit for bit.
  for (Isa isa : isas()) {
    auto be = make_cpu_backend(2, isa);
    for (DType t : {DType::F16, DType::BF16, DType::Q8_0}) {
      const int64_t rows = 29, cols = t == DType::Q8_0 ? 224 : 211, n = 9;
      const Weights w = make_weights(t, rows, cols, 11);
      const auto x = randv(size_t(n * cols), 12);
      std::vector<float> y1(size_t(n * rows)), y2(size_t(n * rows));
      be->matmul(w.view(), x.data(), n, y1.data());
      WeightView f32{DType::F32, w.deq.data(), rows, cols, size_t(cols) * 4};
      be->matmul(f32, x.data(), n, y2.data());
      INFO(isa_name(isa) << " " << dtype_name(t));
      CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * 4) == 0);
    }
  }
}

TEST_CASE("matmul batch invariance: batch size - row position - thread count") {
  for (Isa isa : isas()) {
    std::unique_ptr<Backend> be[3] = {make_cpu_backend(1, isa), make_cpu_backend(2, isa),
                                      make_cpu_backend(3, isa)};
    for (DType t : kTypes) {
      const int64_t rows = 401, cols = t == DType::Q8_0 ? 192 : 167;
      const Weights w = make_weights(t, rows, cols, 21);
      const int64_t total = 128 + 7;
      const auto x = randv(size_t(total * cols), 22);
      // Reference: every row alone, one thread.
      std::vector<float> alone(size_t(total * rows));
      for (int64_t i = 0; i < total; ++i)
        be[0]->matmul(w.view(), x.data() + i * cols, 1, alone.data() + i * rows);
      for (int64_t n : {1, 2, 5, 16, 17, 33, 128}) {
        for (int64_t off : {int64_t(0), int64_t(3), total - n}) {
          for (int ti = 0; ti < 3; ++ti) {
            std::vector<float> y(size_t(n * rows));
            be[ti]->matmul(w.view(), x.data() + off * cols, n, y.data());
            INFO(isa_name(isa) << " " << dtype_name(t) << " n=" << n << " off=" << off
                               << " threads=" << ti + 1);
            CHECK(std::memcmp(y.data(), alone.data() + off * rows, y.size() * 4) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("rmsnorm vs reference and batch invariance") {
  for (Isa isa : isas()) {
    auto be1 = make_cpu_backend(1, isa);
    auto be3 = make_cpu_backend(3, isa);
    for (int64_t dim : {int64_t(7), int64_t(64), int64_t(203), int64_t(1000)}) {
      const int64_t n = 80;
      const auto x = randv(size_t(n * dim), 31, -3.0f, 3.0f);
      const auto w = randv(size_t(dim), 32, 0.5f, 1.5f);
      const float eps = 1e-5f;
      std::vector<float> y(size_t(n * dim));
      be3->rmsnorm(x.data(), w.data(), n, dim, eps, y.data());
      std::vector<double> ref(size_t(n * dim));
      for (int64_t i = 0; i < n; ++i) {
        double ss = 0;
        for (int64_t k = 0; k < dim; ++k) ss += double(x[i * dim + k]) * x[i * dim + k];
        const double sc = 1.0 / std::sqrt(ss / dim + eps);
        for (int64_t k = 0; k < dim; ++k) ref[i * dim + k] = x[i * dim + k] * sc * w[k];
      }
      INFO(isa_name(isa) << " dim=" << dim);
      CHECK(norm_err(y.data(), ref) <= 2e-6);
      for (int64_t i : {int64_t(0), int64_t(17), n - 1}) {
        std::vector<float> one(static_cast<size_t>(dim));
        be1->rmsnorm(x.data() + i * dim, w.data(), 1, dim, eps, one.data());
        CHECK(std::memcmp(one.data(), y.data() + i * dim, dim * 4) == 0);
      }
    }
  }
}

TEST_CASE("rope vs reference and batch invariance") {
  for (Isa isa : isas()) {
    auto be1 = make_cpu_backend(1, isa);
    auto be2 = make_cpu_backend(2, isa);
    const int64_t n = 50, heads = 6, hd = 48;
    const float base = 10000.0f;
    const auto x = randv(size_t(n * heads * hd), 41);
    std::vector<int32_t> pos(n);
    for (int64_t i = 0; i < n; ++i) pos[i] = int32_t(i * 97 % 4099);
    std::vector<float> y = x;
    be2->rope(y.data(), n, heads, hd, pos.data(), base);
    std::vector<double> ref(x.size());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < hd / 2; ++j) {
          const double th = pos[i] * std::pow(double(base), -2.0 * j / hd);
          const size_t o = size_t((i * heads + h) * hd + 2 * j);
          ref[o] = x[o] * std::cos(th) - x[o + 1] * std::sin(th);
          ref[o + 1] = x[o] * std::sin(th) + x[o + 1] * std::cos(th);
        }
    INFO(isa_name(isa));
    CHECK(norm_err(y.data(), ref) <= 1e-6);
    for (int64_t i : {int64_t(0), int64_t(9), n - 1}) {
      std::vector<float> one(x.begin() + i * heads * hd, x.begin() + (i + 1) * heads * hd);
      be1->rope(one.data(), 1, heads, hd, &pos[i], base);
      CHECK(std::memcmp(one.data(), y.data() + i * heads * hd, one.size() * 4) == 0);
    }
    // Another base on the same backend recomputes the frequencies.
    std::vector<float> z = x;
    be2->rope(z.data(), n, heads, hd, pos.data(), 500000.0f);
    CHECK(std::memcmp(z.data(), y.data(), z.size() * 4) != 0);
  }
}

TEST_CASE("rope: kept and computed angles give the documented bits, at any position") {
  // Each position's cos and sin are float(cos(p * f_j)) in double, kept per
  // position below 4096 and computed per row past it; either way a rotated
  // pair is (x0 c - x1 s, x0 s + x1 c), each product rounded.
  // Head sizes with and without a tail past the vectors (20 = 16 + 4, 8 + 8 + 4).
  for (const int64_t hd : {int64_t(64), int64_t(20), int64_t(6)}) {
  const int64_t heads = 2;
  const float base = 10000.0f;
  const std::vector<int32_t> pos = {0, 1, 77, 4095, 4096, 9999, 70000, 3};
  const auto x = randv(size_t(int64_t(pos.size()) * heads * hd), 43);
  for (Isa isa : isas()) {
    auto be = make_cpu_backend(2, isa);
    for (int pass = 0; pass < 2; ++pass) {  // the second finds the angles kept
      std::vector<float> y = x;
      be->rope(y.data(), int64_t(pos.size()), heads, hd, pos.data(), base);
      for (size_t i = 0; i < pos.size(); ++i)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t j = 0; j < hd / 2; ++j) {
            const double th = double(pos[i]) * std::pow(double(base), -2.0 * double(j) / double(hd));
            const float c = float(std::cos(th)), sn = float(std::sin(th));
            const size_t o = (i * size_t(heads) + size_t(h)) * size_t(hd) + size_t(2 * j);
            const float a = x[o] * c, b = x[o + 1] * sn, d = x[o] * sn, e = x[o + 1] * c;
            const float want[2] = {a - b, d + e};
            INFO(isa_name(isa) << " head_dim " << hd << " pass " << pass << " position " << pos[i] << " j " << j);
            REQUIRE(std::memcmp(&y[o], want, sizeof want) == 0);
          }
    }
  }
  }
}

TEST_CASE("softmax vs reference and batch invariance") {
  for (Isa isa : isas()) {
    auto be1 = make_cpu_backend(1, isa);
    auto be3 = make_cpu_backend(3, isa);
    for (int64_t len : {int64_t(1), int64_t(5), int64_t(33), int64_t(1000)}) {
      const int64_t n = 70;
      const auto x = randv(size_t(n * len), 51, -20.0f, 20.0f);
      std::vector<float> y = x;
      be3->softmax(y.data(), n, len);
      std::vector<double> ref(x.size());
      for (int64_t i = 0; i < n; ++i) {
        double m = -1e300, s = 0;
        for (int64_t k = 0; k < len; ++k) m = std::max(m, double(x[i * len + k]));
        for (int64_t k = 0; k < len; ++k) s += std::exp(double(x[i * len + k]) - m);
        for (int64_t k = 0; k < len; ++k) ref[i * len + k] = std::exp(double(x[i * len + k]) - m) / s;
      }
      INFO(isa_name(isa) << " len=" << len);
      // Per element relative error (the small probabilities matter too).
      double rel = 0;
      for (size_t k = 0; k < ref.size(); ++k)
        rel = std::max(rel, std::fabs(y[k] - ref[k]) / std::max(ref[k], 1e-30));
      INFO("rel=" << rel);
      CHECK(rel <= 1e-5);
      for (int64_t i : {int64_t(0), int64_t(33), n - 1}) {
        std::vector<float> one(x.begin() + i * len, x.begin() + (i + 1) * len);
        be1->softmax(one.data(), 1, len);
        CHECK(std::memcmp(one.data(), y.data() + i * len, len * 4) == 0);
      }
    }
  }
}

TEST_CASE("silu_mul vs reference and position invariance") {
  for (Isa isa : isas()) {
    auto be1 = make_cpu_backend(1, isa);
    auto be2 = make_cpu_backend(2, isa);
    const int64_t count = 100003;
    const auto g = randv(size_t(count), 61, -12.0f, 12.0f);
    const auto u = randv(size_t(count), 62, -2.0f, 2.0f);
    std::vector<float> y(static_cast<size_t>(count));
    be2->silu_mul(g.data(), u.data(), count, y.data());
    std::vector<double> ref(static_cast<size_t>(count));
    for (int64_t k = 0; k < count; ++k) ref[k] = g[k] / (1.0 + std::exp(-double(g[k]))) * u[k];
    INFO(isa_name(isa));
    double rel = 0;
    for (int64_t k = 0; k < count; ++k)
      rel = std::max(rel, std::fabs(y[k] - ref[k]) / std::max(std::fabs(ref[k]), 1e-3));
    CHECK(rel <= 2e-6);
    for (int64_t off : {int64_t(1), int64_t(3), int64_t(1021)}) {
      for (int64_t len : {int64_t(1), int64_t(13), int64_t(3000)}) {
        std::vector<float> z(static_cast<size_t>(len));
        be1->silu_mul(g.data() + off, u.data() + off, len, z.data());
        CHECK(std::memcmp(z.data(), y.data() + off, len * 4) == 0);
      }
    }
  }
}

// The vision encoder's element-wise ops. LayerNorm's float sums (W lanes,
// then hsum) against the float64 mean and variance; an image's rows must
// give the same bits whatever batch, row position or thread count.
TEST_CASE("layer_norm vs float64 reference and batch invariance") {
  for (Isa isa : isas()) {
    auto be1 = make_cpu_backend(1, isa);
    auto be3 = make_cpu_backend(3, isa);
    for (int64_t dim : {int64_t(5), int64_t(64), int64_t(203), int64_t(1536)}) {
      const int64_t n = 70;
      // An offset mean (as activations have) so a one-pass E[x^2] - E[x]^2
      // variance would lose its digits.
      const auto x = randv(size_t(n * dim), 71, 20.0f, 26.0f);
      const auto w = randv(size_t(dim), 72, 0.5f, 1.5f);
      const auto b = randv(size_t(dim), 73, -0.5f, 0.5f);
      const float eps = 1e-6f;
      std::vector<float> y(size_t(n * dim));
      be3->layer_norm(x.data(), w.data(), b.data(), n, dim, eps, y.data());
      std::vector<double> ref(size_t(n * dim));
      for (int64_t i = 0; i < n; ++i) {
        double mean = 0, var = 0;
        for (int64_t k = 0; k < dim; ++k) mean += x[i * dim + k];
        mean /= double(dim);
        for (int64_t k = 0; k < dim; ++k) var += (x[i * dim + k] - mean) * (x[i * dim + k] - mean);
        const double inv = 1.0 / std::sqrt(var / double(dim) + eps);
        for (int64_t k = 0; k < dim; ++k) ref[i * dim + k] = (x[i * dim + k] - mean) * inv * w[k] + b[k];
      }
      INFO(isa_name(isa) << " dim=" << dim);
      CHECK(norm_err(y.data(), ref) <= 5e-6);  // measured up to 1.8e-6
      for (int64_t i : {int64_t(0), int64_t(17), n - 1}) {
        std::vector<float> one(static_cast<size_t>(dim));
        be1->layer_norm(x.data() + i * dim, w.data(), b.data(), 1, dim, eps, one.data());
        CHECK(std::memcmp(one.data(), y.data() + i * dim, dim * 4) == 0);
      }
      // In place gives the same bits.
      std::vector<float> inplace(x.begin(), x.begin() + 3 * dim);
      be1->layer_norm(inplace.data(), w.data(), b.data(), 3, dim, eps, inplace.data());
      CHECK(std::memcmp(inplace.data(), y.data(), 3 * dim * 4) == 0);
    }
  }
}

TEST_CASE("gelu (tanh and quick) vs float64 reference, specials and position invariance") {
  const double k = std::sqrt(2.0 / 3.14159265358979323846);
  auto gelu_tanh = [&](double x) { return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x))); };
  auto gelu_quick = [](double x) { return x / (1.0 + std::exp(-1.702 * x)); };
  for (Isa isa : isas()) {
    auto be1 = make_cpu_backend(1, isa);
    auto be2 = make_cpu_backend(2, isa);
    for (Gelu kind : {Gelu::tanh, Gelu::quick}) {
      const int64_t count = 100003;
      auto x = randv(size_t(count), 81, -12.0f, 12.0f);
      std::vector<float> y(static_cast<size_t>(count));
      be2->gelu(x.data(), count, kind, y.data());
      INFO(isa_name(isa) << (kind == Gelu::tanh ? " tanh" : " quick"));
      // Relative to max(|ref|, 1e-3), as silu_mul: near the tail where
      // gelu -> 0 the value is tiny and only its absolute error matters.
      double rel = 0;
      for (int64_t i = 0; i < count; ++i) {
        const double r = kind == Gelu::tanh ? gelu_tanh(x[i]) : gelu_quick(x[i]);
        rel = std::max(rel, std::fabs(y[i] - r) / std::max(std::fabs(r), 1e-3));
      }
      CHECK(rel <= 2.5e-6);  // measured up to 1.3e-6
      for (int64_t off : {int64_t(1), int64_t(3), int64_t(1021)}) {
        for (int64_t len : {int64_t(1), int64_t(13), int64_t(3000)}) {
          std::vector<float> z(static_cast<size_t>(len));
          be1->gelu(x.data() + off, len, kind, z.data());
          CHECK(std::memcmp(z.data(), y.data() + off, len * 4) == 0);
        }
      }
      // Specials: large inputs saturate to x and to (-)0-ish, NaN stays NaN,
      // infinities keep their limit.
      const float big[] = {100.0f, -100.0f, 1e30f, -1e30f, std::nanf(""), INFINITY, 0.0f};
      float out[7];
      be1->gelu(big, 7, kind, out);
      CHECK(out[0] == 100.0f);
      CHECK(std::fabs(out[1]) < 1e-30f);
      CHECK(out[2] == 1e30f);
      CHECK(std::fabs(out[3]) < 1e-6f);
      CHECK(std::isnan(out[4]));
      CHECK(out[5] == INFINITY);
      CHECK(out[6] == 0.0f);
      // In place.
      std::vector<float> inplace(x.begin(), x.begin() + 1000);
      be1->gelu(inplace.data(), 1000, kind, inplace.data());
      CHECK(std::memcmp(inplace.data(), y.data(), 1000 * 4) == 0);
    }
  }
}

TEST_CASE("add: two arrays and a bias per row, exact") {
  for (Isa isa : isas()) {
    auto be2 = make_cpu_backend(2, isa);
    const int64_t dim = 203, rows = 90;
    const auto a = randv(size_t(rows * dim), 91);
    const auto b = randv(size_t(rows * dim), 92);
    std::vector<float> y(a.size());
    be2->add(a.data(), b.data(), rows * dim, rows * dim, y.data());
    for (size_t i = 0; i < y.size(); ++i) REQUIRE(y[i] == a[i] + b[i]);
    std::vector<float> x = a;  // in place, b's first row as a bias
    be2->add(x.data(), b.data(), rows * dim, dim, x.data());
    INFO(isa_name(isa));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < dim; ++c) REQUIRE(x[r * dim + c] == a[r * dim + c] + b[c]);
  }
}

TEST_CASE("embed: dequantised rows - every dtype") {
  // A few ids, and a prompt's worth that the threads split; rows of 40
  // values end past the vectors (Q8_0 rows are whole blocks).
  for (Isa isa : isas()) {
    for (int threads : {1, 2}) {
      auto be = make_cpu_backend(threads, isa);
      for (DType t : kTypes) {
        for (const int64_t cols : {int64_t(96), int64_t(40)}) {
          if (t == DType::Q8_0 && cols % 32) continue;
          const int64_t rows = 50;
          const Weights w = make_weights(t, rows, cols, 71);
          for (const size_t n : {size_t(5), size_t(300)}) {
            std::vector<int32_t> ids = {3, 0, 49, 3, 17};
            for (size_t i = ids.size(); i < n; ++i) ids.push_back(int32_t(i * 31 % rows));
            ids.resize(n);
            std::vector<float> out(ids.size() * cols);
            be->embed(w.view(), ids.data(), int64_t(ids.size()), out.data());
            INFO(isa_name(isa) << " threads " << threads << " " << dtype_name(t) << " cols " << cols << " ids " << n);
            for (size_t i = 0; i < ids.size(); ++i)
              REQUIRE(std::memcmp(out.data() + i * cols, w.deq.data() + ids[i] * cols, cols * 4) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("topk_gating vs reference - ties and batch invariance") {
  for (Isa isa : isas()) {
    auto be1 = make_cpu_backend(1, isa);
    auto be2 = make_cpu_backend(2, isa);
    for (int64_t ne : {int64_t(8), int64_t(60)}) {
      for (int64_t k : {int64_t(1), int64_t(2), int64_t(6)}) {
        const int64_t n = 300;
        const auto x = randv(size_t(n * ne), uint32_t(81 + ne + k), -4.0f, 4.0f);
        std::vector<int32_t> ids(size_t(n * k));
        std::vector<float> w(size_t(n * k));
        be2->topk_gating(x.data(), n, ne, k, ids.data(), w.data());
        for (int64_t i = 0; i < n; ++i) {
          std::vector<double> p(static_cast<size_t>(ne));
          double m = -1e300, s = 0;
          for (int64_t e = 0; e < ne; ++e) m = std::max(m, double(x[i * ne + e]));
          for (int64_t e = 0; e < ne; ++e) s += p[e] = std::exp(x[i * ne + e] - m);
          std::vector<int32_t> order(static_cast<size_t>(ne));
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
          double ws = 0;
          for (int64_t j = 0; j < k; ++j) ws += p[order[j]];
          for (int64_t j = 0; j < k; ++j) {
            REQUIRE(ids[i * k + j] == order[j]);
            CHECK(std::fabs(w[i * k + j] - p[order[j]] / ws) <= 2e-6);
          }
        }
        for (int64_t i : {int64_t(0), int64_t(150), n - 1}) {
          std::vector<int32_t> id1(static_cast<size_t>(k));
          std::vector<float> w1(static_cast<size_t>(k));
          be1->topk_gating(x.data() + i * ne, 1, ne, k, id1.data(), w1.data());
          CHECK(std::memcmp(id1.data(), ids.data() + i * k, k * 4) == 0);
          CHECK(std::memcmp(w1.data(), w.data() + i * k, k * 4) == 0);
        }
      }
    }
    // Ties: lower index first.
    const float tied[8] = {0.5f, 2.0f, 1.0f, 2.0f, 2.0f, -1.0f, 1.0f, 0.0f};
    int32_t ids[4];
    float w[4];
    be1->topk_gating(tied, 1, 8, 4, ids, w);
    CHECK(ids[0] == 1);
    CHECK(ids[1] == 3);
    CHECK(ids[2] == 4);
    CHECK(ids[3] == 2);
    CHECK(w[0] == w[1]);
    CHECK(std::fabs(w[0] + w[1] + w[2] + w[3] - 1.0f) <= 1e-6f);
  }
}

namespace {
// The kernel table an ISA runs.
const cpu::Kernels& kernels_of(Isa isa) {
  return isa == Isa::avx512 ? cpu::kKernelsAvx512 : isa == Isa::avx2 ? cpu::kKernelsAvx2 : cpu::kKernelsScalar;
}
}  // namespace

TEST_CASE("combined horizontal sums equal hsum bit for bit") {
  // Attention reduces many positions' accumulators at once; each must get
  // exactly V::hsum's additions, so a score's bits match whatever the block.
  for (Isa isa : isas()) {
    const cpu::Kernels& k = kernels_of(isa);
    for (int n = 1; n <= 24; ++n) {
      for (uint32_t seed = 0; seed < 20; ++seed) {
        // Mixed magnitudes so that a different addition order shows up.
        std::vector<float> acc = randv(size_t(n) * k.lanes, 1000 + seed * 31 + n);
        std::mt19937 rng(seed);
        for (auto& v : acc) v = std::ldexp(v, int(rng() % 40) - 20);
        std::vector<float> c(size_t(n), -1.0f), s(size_t(n), -2.0f);
        k.hsums_check(acc.data(), n, c.data(), s.data());
        INFO(isa_name(isa) << " n=" << n << " seed=" << seed);
        CHECK(std::memcmp(c.data(), s.data(), size_t(n) * 4) == 0);
      }
    }
  }
}

TEST_CASE("f16_row stores fp32_to_fp16's bits on every ISA, NaN payloads, ties and subnormals included") {
  // The F16 KV cache's rows go through the hardware conversion; a row's
  // bytes must not depend on the ISA (the topology invariant crosses hosts).
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  std::vector<float> x = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e9f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          bits(0x7fc00000u), bits(0x7f800001u), bits(0xff812345u), bits(0x7fa00000u),
                          bits(0x7f802000u),                      // signalling, payload in the kept bits
                          6.1035156e-05f, 6.0975552e-05f,         // smallest normal half, a subnormal
                          5.9604645e-08f, 2.9802322e-08f,         // smallest subnormal half, its half (tie to 0)
                          4.4703484e-08f, 1e-40f, -1e-40f,        // 1.5 x smallest (tie to even), f32 denormals
                          1.00048828125f, 1.00146484375f, 2049.0f, 2051.0f};  // ties to even
  std::mt19937 rng(7);
  for (int i = 0; i < 4000; ++i) {
    uint32_t u = rng();
    if (i % 3 == 0) u = (u & 0x807fffffu) | (uint32_t(101 + rng() % 50) << 23);  // near the half range
    x.push_back(bits(u));
  }
  std::vector<uint8_t> want(x.size() * 2);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t h = fp32_to_fp16(x[i]);
    std::memcpy(want.data() + 2 * i, &h, 2);
  }
  for (Isa isa : isas()) {
    const cpu::Kernels& k = kernels_of(isa);
    for (size_t count : {x.size(), x.size() - 5, size_t(7), size_t(1)}) {
      std::vector<uint8_t> got(count * 2, 0xAB);
      k.f16_row(x.data(), int64_t(count), got.data());
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < count; ++i)
        if (std::memcmp(got.data() + 2 * i, want.data() + 2 * i, 2) != 0 && bad++ == 0) first = i;
      INFO(std::string(isa_name(isa)) << " count " << count << ": " << bad << " differ, the first at " << first);
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("q8_0_row stores quantize_row_q8_0's bytes on every ISA: ties, zeros, non-finite blocks") {
  // The Q8_0 KV cache's rows; a row's bytes must not depend on the ISA.
  std::vector<float> x;
  std::mt19937 rng(11);
  auto block = [&](auto gen) {
    for (int j = 0; j < 32; ++j) x.push_back(gen(j));
  };
  // amax 127: d = 1, id = 1, so x itself rounds: halves tie away from zero.
  block([](int j) { return j == 0 ? 127.0f : float(j - 16) + (j % 2 ? 0.5f : -0.5f); });
  block([](int j) { return j == 5 ? -127.0f : -float(j) * 0.5f; });
  block([](int) { return 0.0f; });
  block([](int j) { return j % 2 ? -0.0f : 0.0f; });
  block([](int j) { return j == 3 ? std::numeric_limits<float>::quiet_NaN() : float(j); });
  block([](int j) { return j == 7 ? -std::numeric_limits<float>::infinity() : float(j); });
  block([](int j) { return j == 9 ? std::numeric_limits<float>::max() : 1.0f; });
  block([](int j) { return float(j) * 1e-42f; });  // f32 denormals
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int b = 0; b < 200; ++b) {
    const float scale = std::ldexp(1.0f, int(rng() % 40) - 20);
    block([&](int) { return u(rng) * scale; });
  }
  const int64_t cols = int64_t(x.size());
  std::vector<uint8_t> want(size_t(cols / 32) * 34);
  quantize_row_q8_0(x.data(), cols, want.data());
  for (Isa isa : isas()) {
    const cpu::Kernels& k = kernels_of(isa);
    std::vector<uint8_t> got(want.size(), 0xAB);
    k.q8_0_row(x.data(), cols, got.data());
    size_t bad = 0, first = 0;
    for (size_t b = 0; b < want.size() / 34; ++b)
      if (std::memcmp(got.data() + b * 34, want.data() + b * 34, 34) != 0 && bad++ == 0) first = b;
    INFO(std::string(isa_name(isa)) << ": " << bad << " blocks differ, the first " << first);
    CHECK(bad == 0);
  }
}

TEST_CASE("q4_0_row stores quantize_row_q4_0's bytes on every ISA: ties, the clamp, zeros, non-finite blocks") {
  std::vector<float> x;
  std::mt19937 rng(13);
  auto block = [&](auto gen) {
    for (int j = 0; j < 32; ++j) x.push_back(gen(j));
  };
  // Largest -8 (d = 1, id = 1): x + 8.5 at every half step, then +8 (16.5,
  // clamped to 15) and values equal in |x| to the largest (the first wins).
  block([](int j) { return j == 0 ? -8.0f : float(j % 17 - 8) + (j % 2 ? 0.5f : 0.0f); });
  block([](int j) { return j == 4 ? 8.0f : j == 9 ? -8.0f : j == 2 ? 8.0f : float(j) * 0.25f - 4.0f; });
  block([](int j) { return j == 31 ? -3.0f : 3.0f * float(j) / 31.0f; });  // the last is the first largest
  block([](int) { return 0.0f; });
  block([](int j) { return j % 2 ? -0.0f : 0.0f; });
  block([](int j) { return j % 2 ? 0.0f : -0.0f; });  // -0 first: d is still 0 / -8
  block([](int j) { return j == 3 ? std::numeric_limits<float>::quiet_NaN() : float(j); });
  block([](int j) { return j == 7 ? -std::numeric_limits<float>::infinity() : float(j); });
  block([](int j) { return j == 9 ? std::numeric_limits<float>::max() : 1.0f; });
  block([](int j) { return float(j) * 1e-42f; });  // f32 denormals: d subnormal
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int b = 0; b < 200; ++b) {
    const float scale = std::ldexp(1.0f, int(rng() % 40) - 20);
    block([&](int) { return u(rng) * scale; });
  }
  const int64_t cols = int64_t(x.size());
  std::vector<uint8_t> want(size_t(cols / 32) * 18);
  quantize_row_q4_0(x.data(), cols, want.data());
  for (Isa isa : isas()) {
    const cpu::Kernels& k = kernels_of(isa);
    std::vector<uint8_t> got(want.size(), 0xAB);
    k.q4_0_row(x.data(), cols, got.data());
    size_t bad = 0, first = 0;
    for (size_t b = 0; b < want.size() / 18; ++b)
      if (std::memcmp(got.data() + b * 18, want.data() + b * 18, 18) != 0 && bad++ == 0) first = b;
    INFO(std::string(isa_name(isa)) << ": " << bad << " blocks differ, the first " << first);
    CHECK(bad == 0);
  }
}

TEST_CASE("matmul batch invariance: long rows (x rows in several passes)") {
  // cols past 1024 and n past what one x pass keeps in L2, ragged cols.
  for (Isa isa : isas()) {
    std::unique_ptr<Backend> be[2] = {make_cpu_backend(1, isa), make_cpu_backend(2, isa)};
    for (DType t : kTypes) {
      const int64_t rows = 37, cols = t == DType::Q8_0 ? 2112 : 2083;
      const Weights w = make_weights(t, rows, cols, 31);
      const int64_t total = 133;
      const auto x = randv(size_t(total * cols), 32);
      std::vector<float> alone(size_t(total * rows));
      for (int64_t i = 0; i < total; ++i)
        be[0]->matmul(w.view(), x.data() + i * cols, 1, alone.data() + i * rows);
      for (int64_t n : {int64_t(6), int64_t(128), total}) {
        for (int ti = 0; ti < 2; ++ti) {
          std::vector<float> y(size_t(n * rows));
          be[ti]->matmul(w.view(), x.data() + (total - n) * cols, n, y.data());
          INFO(isa_name(isa) << " " << dtype_name(t) << " n=" << n << " threads=" << ti + 1);
          CHECK(std::memcmp(y.data(), alone.data() + (total - n) * rows, y.size() * 4) == 0);
        }
      }
    }
  }
}

TEST_CASE("moe_combine: each row's experts weighted and summed in gating order") {
  const int64_t n = 5, k = 3, dim = 37, gathered = n * k;
  const auto y = randv(size_t(gathered * dim), 501);
  const auto w = randv(size_t(n * k), 502, 0.0f, 1.0f);
  std::vector<int32_t> rows(size_t(n * k));
  for (int64_t i = 0; i < n * k; ++i) rows[size_t(i)] = int32_t((i * 7) % gathered);  // a permutation
  for (Isa isa : isas()) {
    INFO(isa_name(isa));
    for (int threads : {1, 2}) {
      auto be = make_cpu_backend(threads, isa);
      std::vector<float> out(size_t(n * dim));
      be->moe_combine(y.data(), rows.data(), w.data(), n, k, dim, out.data());
      for (int64_t r = 0; r < n; ++r)
        for (int64_t d = 0; d < dim; ++d) {
          float acc = 0.f;  // the order the op promises: products rounded, added from j = 0
          for (int64_t j = 0; j < k; ++j) {
            const float p = w[size_t(r * k + j)] * y[size_t(rows[size_t(r * k + j)] * dim + d)];
            acc = acc + p;
          }
          REQUIRE(out[size_t(r * dim + d)] == acc);
        }
    }
  }
}

TEST_CASE("CPU backend memory: large buffers on 2 MiB lines with the huge-page advice, small ones from the heap") {
  auto be = make_cpu_backend(1);
  void* small = be->alloc(1000);
  void* large = be->alloc(cpu::kHostLargeBytes + 12345);
  REQUIRE(small != nullptr);
  REQUIRE(large != nullptr);
  CHECK(reinterpret_cast<uintptr_t>(small) % 64 == 0);
  CHECK(reinterpret_cast<uintptr_t>(large) % (size_t(2) << 20) == 0);
  CHECK_FALSE(cpu::host_is_mapped(small));
  CHECK(cpu::host_is_mapped(large));
  std::memset(large, 7, cpu::kHostLargeBytes + 12345);  // every byte is ours
  // The advice shows in the mapping's THPeligible unless THP is off here.
  std::string mode;
  if (std::FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    char buf[128] = {};
    if (std::fgets(buf, sizeof buf, f)) mode = buf;
    std::fclose(f);
  }
  if (!mode.empty() && mode.find("[never]") == std::string::npos) {
    std::FILE* f = std::fopen("/proc/self/smaps", "r");
    REQUIRE(f != nullptr);
    char line[512];
    bool in_vma = false, eligible = false;
    const uintptr_t at = reinterpret_cast<uintptr_t>(large);
    while (std::fgets(line, sizeof line, f)) {
      unsigned long lo = 0, hi = 0;
      if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && std::strchr(line, '-') < std::strchr(line, ' ')) {
        in_vma = at >= lo && at < hi;
        continue;
      }
      if (in_vma && std::strncmp(line, "THPeligible:", 12) == 0) eligible = std::atoi(line + 12) == 1;
    }
    std::fclose(f);
    INFO("transparent_hugepage: " << mode);
    CHECK(eligible);
  }
  be->free(large);
  be->free(small);
  CHECK_FALSE(cpu::host_is_mapped(large));
  be->free(nullptr);
}
