// The opt-in int8 matmul (Compute::int8): its documented formula bit for bit
// on every ISA, its error against float64 inside the bound derived from the
// activations' quantisation, and batch invariance.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/int8.h"
#include "kernels/dtype.h"
#include "tests/kernels/kernel_test_util.h"

using namespace cleave;

namespace {

using test::isas;
using test::make_weights;
using test::randv;
using test::Weights;

// x row quantised as the docs say: per 32 values d = amax / 127 (f32),
// q = roundf(x / d) computed as x * (1 / d).
struct QRow {
  std::vector<int8_t> q;
  std::vector<float> d;
};

QRow quantize(const float* x, int64_t cols) {
  QRow r{std::vector<int8_t>(size_t(cols)), std::vector<float>(size_t(cols / 32))};
  for (int64_t b = 0; b < cols / 32; ++b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b * 32 + j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; ++j) r.q[size_t(b * 32 + j)] = int8_t(std::roundf(x[b * 32 + j] * id));
    r.d[size_t(b)] = d;
  }
  return r;
}

// The formula of kernels/cpu/int8.h, straight from the Q8_0 bytes.
std::vector<float> formula(const Weights& w, const float* x, int64_t n) {
  std::vector<float> y(size_t(n * w.rows));
  for (int64_t i = 0; i < n; ++i) {
    const QRow qx = quantize(x + i * w.cols, w.cols);
    for (int64_t r = 0; r < w.rows; ++r) {
      const uint8_t* row = w.data.data() + r * w.row_bytes;
      float acc = 0.0f;
      for (int64_t b = 0; b < w.cols / 32; ++b) {
        uint16_t h;
        std::memcpy(&h, row + b * 34, 2);
        int32_t isum = 0;
        for (int j = 0; j < 32; ++j) isum += int32_t(int8_t(row[b * 34 + 2 + j])) * qx.q[size_t(b * 32 + j)];
        acc = std::fmaf(float(isum), fp16_to_fp32(h) * qx.d[size_t(b)], acc);
      }
      y[size_t(i * w.rows + r)] = acc;
    }
  }
  return y;
}

bool same_bits(const std::vector<float>& a, const float* b) {
  return std::memcmp(a.data(), b, a.size() * 4) == 0;
}

}  // namespace

TEST_CASE("int8 matmul: the documented formula bit for bit on every ISA and thread count") {
  struct Shape {
    int64_t rows, cols;
  };
  // Rows around the 16-row panels; n around the microkernels' row counts.
  const Shape shapes[] = {{1, 32}, {15, 64}, {16, 96}, {17, 160}, {67, 256}, {40, 512}};
  for (const Shape& s : shapes) {
    const Weights w = make_weights(DType::Q8_0, s.rows, s.cols, uint32_t(s.rows * 7 + s.cols),
                                   s.rows == 17 ? 6 : 0);
    for (int64_t n : {1, 2, 3, 7, 8, 9, 17, 64}) {
      // Activations of mixed scales per block, as a real layer's are.
      auto x = randv(size_t(n * s.cols), uint32_t(n * 3 + 1), -2.0f, 2.0f);
      for (size_t j = 0; j < x.size(); j += 37) x[j] *= 40.0f;
      const std::vector<float> want = formula(w, x.data(), n);
      for (Isa isa : isas())
        for (int threads : {1, 2}) {
          auto be = make_cpu_backend(threads, isa, Compute::int8);
          std::vector<float> y(size_t(n * s.rows), -999.0f);
          be->matmul(w.view(), x.data(), n, y.data());
          INFO(isa_name(isa) << " (" << be->caps().int8_kernel << ") rows=" << s.rows
                             << " cols=" << s.cols << " n=" << n << " threads=" << threads);
          CHECK(same_bits(want, y.data()));
        }
    }
  }
}

TEST_CASE("int8 matmul vs float64: inside the bound of the activations' quantisation") {
  // y - sum_j w_j x_j = -sum_j w_j e_j (e_j = x_j - d q_j, the quantisation
  // error: round to nearest of x / d, itself computed as x * (1 / d) with two
  // roundings, so |e_j| <= d (1/2 + 256 u)) plus float rounding: each
  // block's scale product (one rounding) and nb fused adds, at most
  // (nb + 2) u sum_b |d_w d_x I_b|, u = 2^-24. So
  //   |y - y64| <= sum_b d_x,b (1/2 + 256 u) sum_j |w_j| + (nb + 2) u sum_b |d_w d_x I_b|.
  // The exact path's error (~1e-7 relative) is far below this; the test
  // also checks the int8 result is not just the exact one.
  const int64_t rows = 48, cols = 384, n = 12, nb = cols / 32;
  const Weights w = make_weights(DType::Q8_0, rows, cols, 5);
  auto x = randv(size_t(n * cols), 6, -3.0f, 3.0f);
  auto be = make_cpu_backend(2, detect_isa(), Compute::int8);
  auto exact = make_cpu_backend(2, detect_isa());
  std::vector<float> y(size_t(n * rows)), ye(size_t(n * rows));
  be->matmul(w.view(), x.data(), n, y.data());
  exact->matmul(w.view(), x.data(), n, ye.data());
  const double u = std::ldexp(1.0, -24);
  double worst = 0.0, max_diff_exact = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const QRow qx = quantize(x.data() + i * cols, cols);
    for (int64_t r = 0; r < rows; ++r) {
      const float* wr = w.deq.data() + r * cols;
      const uint8_t* raw = w.data.data() + r * w.row_bytes;
      double y64 = 0.0, quant = 0.0, rounding = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        double absw = 0.0;
        int64_t isum = 0;
        for (int j = 0; j < 32; ++j) {
          const int64_t c = b * 32 + j;
          y64 += double(wr[c]) * double(x[size_t(i * cols + c)]);
          absw += std::fabs(double(wr[c]));
          isum += int64_t(int8_t(raw[b * 34 + 2 + j])) * qx.q[size_t(c)];
        }
        uint16_t h;
        std::memcpy(&h, raw + b * 34, 2);
        quant += double(qx.d[size_t(b)]) * (0.5 + 256.0 * u) * absw;
        rounding += std::fabs(double(fp16_to_fp32(h)) * qx.d[size_t(b)] * double(isum));
      }
      const double bound = quant + double(nb + 2) * u * rounding;
      const double err = std::fabs(double(y[size_t(i * rows + r)]) - y64);
      INFO("i=" << i << " r=" << r << " err=" << err << " bound=" << bound);
      CHECK(err <= bound);
      worst = std::max(worst, err / bound);
      max_diff_exact = std::max(max_diff_exact, std::fabs(double(y[size_t(i * rows + r)] - ye[size_t(i * rows + r)])));
    }
  }
  MESSAGE("int8 error: worst " << worst << " of the bound");
  CHECK(max_diff_exact > 0.0);  // a different computation from exact, as documented
}

TEST_CASE("int8 matmul batch invariance: batch size - row position - thread count") {
  const int64_t rows = 203, cols = 320, total = 70;
  const Weights w = make_weights(DType::Q8_0, rows, cols, 31);
  const auto x = randv(size_t(total * cols), 32);
  for (Isa isa : isas()) {
    std::unique_ptr<Backend> be[3] = {make_cpu_backend(1, isa, Compute::int8),
                                      make_cpu_backend(2, isa, Compute::int8),
                                      make_cpu_backend(3, isa, Compute::int8)};
    std::vector<float> alone(size_t(total * rows));
    for (int64_t i = 0; i < total; ++i)
      be[0]->matmul(w.view(), x.data() + i * cols, 1, alone.data() + i * rows);
    for (int64_t n : {2, 5, 8, 13, 33, 64}) {
      for (int64_t off : {int64_t(0), int64_t(3), total - n}) {
        for (int ti = 0; ti < 3; ++ti) {
          std::vector<float> y(size_t(n * rows));
          be[ti]->matmul(w.view(), x.data() + off * cols, n, y.data());
          INFO(isa_name(isa) << " n=" << n << " off=" << off << " threads=" << ti + 1);
          CHECK(std::memcmp(y.data(), alone.data() + off * rows, y.size() * 4) == 0);
        }
      }
    }
  }
}

TEST_CASE("int8 compute: other weight types stay exact, caps name the kernel") {
  auto be = make_cpu_backend(2, detect_isa(), Compute::int8);
  auto exact = make_cpu_backend(2, detect_isa());
  CHECK(be->caps().compute == Compute::int8);
  CHECK(exact->caps().compute == Compute::exact);
  CHECK(exact->caps().int8_kernel.empty());
  const std::string k = be->caps().int8_kernel;
  CHECK((k == "avx512vnni" || k == "avx2" || k == "scalar"));
  CHECK((k == "avx512vnni") == cpu_has_avx512_vnni());
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    const Weights w = make_weights(t, 37, 96, 8);
    const auto x = randv(size_t(5 * 96), 9);
    std::vector<float> y1(5 * 37), y2(5 * 37);
    be->matmul(w.view(), x.data(), 5, y1.data());
    exact->matmul(w.view(), x.data(), 5, y2.data());
    INFO(dtype_name(t));
    CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * 4) == 0);
  }
}

TEST_CASE("int8 matmul: a non-finite activation reaches its own row's outputs only") {
  const Weights w = make_weights(DType::Q8_0, 20, 64, 12);
  auto x = randv(3 * 64, 13);
  x[64 + 40] = std::numeric_limits<float>::quiet_NaN();
  auto be = make_cpu_backend(1, detect_isa(), Compute::int8);
  std::vector<float> y(3 * 20);
  be->matmul(w.view(), x.data(), 3, y.data());
  for (int r = 0; r < 20; ++r) {
    CHECK(std::isfinite(y[r]));
    CHECK(std::isnan(y[20 + r]));
    CHECK(std::isfinite(y[40 + r]));
  }
}

TEST_CASE("int8 matmul: a second shape at the same address is repacked") {
  // Expert tables are views into one tensor: the panels are keyed by address
  // and shape, never by address alone.
  const Weights w = make_weights(DType::Q8_0, 40, 128, 14);
  const auto x = randv(2 * 128, 15);
  auto be = make_cpu_backend(1, detect_isa(), Compute::int8);
  for (int64_t rows : {int64_t(40), int64_t(9), int64_t(40)}) {
    Weights part = w;
    part.rows = rows;
    std::vector<float> y(size_t(2 * rows));
    be->matmul(part.view(), x.data(), 2, y.data());
    CHECK(same_bits(formula(part, x.data(), 2), y.data()));
  }
}

TEST_CASE("int8 activation quantisers: every ISA's bytes equal the reference's, ties and specials included") {
  // Block 0: amax 127 so d = 1 and x * (1/d) = x: halves must round away
  // from zero as roundf does. Block 1: random. Block 2: zeros. Block 3: an
  // infinity (the scale becomes NaN).
  std::vector<float> x(4 * 32);
  const float ties[] = {0.5f, -0.5f, 1.5f, -1.5f, 2.5f, -2.5f, 126.5f, -126.5f, 0.49999997f, -0.49999997f,
                        3.4999998f, 127.0f, -127.0f, 0.0f, -0.0f, 64.5f};
  for (int j = 0; j < 32; ++j) x[size_t(j)] = ties[j % 16] * (j < 16 ? 1.0f : -1.0f);
  const auto r = randv(32, 77, -5.0f, 5.0f);
  std::copy(r.begin(), r.end(), x.begin() + 32);
  x[96 + 5] = std::numeric_limits<float>::infinity();
  const int64_t n = 1, cols = 128, nb = 4;
  std::vector<int8_t> q0(cols), q1(cols);
  std::vector<float> d0(nb), d1(nb);
  std::vector<int32_t> c0(nb), c1(nb);
  cpu::int8_quantize_rows(x.data(), n, cols, q0.data(), d0.data(), c0.data());
  CHECK(q0[0] == 1);    // 0.5 away from zero
  CHECK(q0[1] == -1);
  CHECK(q0[4] == 3);    // 2.5
  CHECK(q0[6] == 127);  // 126.5
  CHECK(q0[8] == 0);    // just below a half
  CHECK(d0[0] == 1.0f);
  CHECK(d0[2] == 0.0f);
  CHECK(std::isnan(d0[3]));
  std::vector<cpu::Int8QuantizeFn> fns;
  if (detect_isa() != Isa::scalar) fns.push_back(cpu::int8_quantize_rows_avx2);
  if (detect_isa() == Isa::avx512) fns.push_back(cpu::int8_quantize_rows_avx512);
  for (size_t f = 0; f < fns.size(); ++f) {
    CAPTURE(f);
    fns[f](x.data(), n, cols, q1.data(), d1.data(), c1.data());
    CHECK(q1 == q0);
    CHECK(c1 == c0);
    for (int64_t b = 0; b < nb; ++b)
      CHECK((std::memcmp(&d0[size_t(b)], &d1[size_t(b)], 4) == 0 || (std::isnan(d0[size_t(b)]) && std::isnan(d1[size_t(b)]))));
  }
}
