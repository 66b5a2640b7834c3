// The tensor-core matmul's arithmetic and fragment layout
// (kernels/cuda/mma_tf32.cuh), compiled here for the host:
// - the TF32 rounding against a float64 reference, ties and edges included;
// - the split x = hi + lo within 2^-22 |x|;
// - each lane's A, B and C registers against the layout CuTe publishes for
//   PTX's mma.m16n8k8 .tf32 (SM80_16x8x8_F32TF32TF32F32_TN: A
//   ((4,8),(2,2)):((16,1),(8,64)), B ((4,8),2):((8,1),32), C
//   ((4,8),(2,2)):((32,1),(16,8)), thread and value to column-major index),
//   written here from those strides, not from the header's formulas;
// - the kernel's data flow (each lane's 8 columns per chunk, the 4 steps'
//   column map) on an emulated mma: exact on small integers, and within the
//   3xTF32 bound of the float64 product on random F32, F16-exact and Q8_0
//   weights.
// The kernel itself needs a GPU: test_cuda runs it (scripts/gpu_check.sh).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda/mma_tf32.cuh"

namespace mma = cleave::cuda::mma;

namespace {

// Nearest TF32 value, ties away from zero, in float64.
double tf32_reference(float x) {
  if (x == 0.0f || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(static_cast<double>(x), &e);  // |x| in [2^(e-1), 2^e)
  int ulp_exp = (e - 1) - 10;
  if (ulp_exp < -136) ulp_exp = -136;  // subnormals: the fixed quantum 2^-126 * 2^-10
  const double ulp = std::ldexp(1.0, ulp_exp);
  const double mag = std::fabs(static_cast<double>(x)) / ulp;
  const double r = std::floor(mag + 0.5) * ulp;
  return x < 0 ? -r : r;
}

uint32_t low13(float f) { return mma::float_bits(f) & 0x1fffu; }

// Where CuTe's layouts put lane l's register v: (row, col) of the operand,
// A and C as rows x k / rows x tokens, B as k x tokens.
struct Coord {
  int row, col;
};
Coord cute_a(int lane, int reg) {
  const int idx = 16 * (lane % 4) + (lane / 4) + 8 * (reg % 2) + 64 * (reg / 2);
  return {idx % 16, idx / 16};  // (m, k), column-major 16 x 8
}
Coord cute_b(int lane, int reg) {
  const int idx = 8 * (lane % 4) + (lane / 4) + 32 * reg;
  return {idx / 8, idx % 8};  // (k, n) from column-major (n, k) 8 x 8
}
Coord cute_c(int lane, int reg) {
  const int idx = 32 * (lane % 4) + (lane / 4) + 16 * (reg % 2) + 8 * (reg / 2);
  return {idx % 16, idx / 16};  // (m, n), column-major 16 x 8
}

// One mma.m16n8k8 on the registers of 32 lanes, placed by CuTe's layouts;
// products exact (TF32 x TF32 fits a double), sum in double, then rounded
// to float: a model of the hardware's F32 accumulation.
void emulated_mma(float (&d)[32][4], const uint32_t (&a)[32][4], const uint32_t (&b)[32][2]) {
  double A[16][8] = {}, B[8][8] = {};
  for (int l = 0; l < 32; ++l) {
    for (int r = 0; r < 4; ++r) A[cute_a(l, r).row][cute_a(l, r).col] = mma::bits_float(a[l][r]);
    for (int r = 0; r < 2; ++r) B[cute_b(l, r).row][cute_b(l, r).col] = mma::bits_float(b[l][r]);
  }
  float out[32][4];
  for (int l = 0; l < 32; ++l)
    for (int r = 0; r < 4; ++r) {
      const Coord c = cute_c(l, r);
      double s = d[l][r];
      for (int k = 0; k < 8; ++k) s += A[c.row][k] * B[k][c.col];
      out[l][r] = static_cast<float>(s);
    }
  for (int l = 0; l < 32; ++l)
    for (int r = 0; r < 4; ++r) d[l][r] = out[l][r];
}

enum class W { f32, exact, q8 };

// The kernel's arithmetic for one 16-row x 8-token tile over all chunks in
// order (the split of the chunks over warps and their sum in warp order is
// left out: it only regroups the same F32 additions). w: 16 x K, x: 8 x K
// row-major, K % 32 == 0; q8: w holds q values and d one scale per row and
// block. Returns y[token][row].
std::vector<float> emulated_tile(W kind, const std::vector<float>& w, const std::vector<float>& d,
                                 const std::vector<float>& x, int K) {
  float acc[32][4] = {};
  for (int ch = 0; ch < K / mma::kChunk; ++ch) {
    uint32_t whi[32][2][8], wlo[32][2][8], xhi[32][8], xlo[32][8];
    for (int l = 0; l < 32; ++l) {
      const int c0 = ch * mma::kChunk + mma::kLaneCols * (l & 3);
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 8; ++e) {
          const float v = w[size_t(mma::a_row(l, h)) * K + c0 + e];
          const mma::Split s = mma::split_tf32(v);
          whi[l][h][e] = mma::float_bits(kind == W::f32 ? s.hi : v);
          wlo[l][h][e] = mma::float_bits(s.lo);
        }
      for (int e = 0; e < 8; ++e) {
        const mma::Split s = mma::split_tf32(x[size_t(mma::b_token(l)) * K + c0 + e]);
        xhi[l][e] = mma::float_bits(s.hi);
        xlo[l][e] = mma::float_bits(s.lo);
      }
    }
    float sum[32][4] = {};
    float(&target)[32][4] = kind == W::q8 ? sum : acc;
    for (int j = 0; j < mma::kSteps; ++j) {
      uint32_t ah[32][4], al[32][4], bh[32][2], bl[32][2];
      for (int l = 0; l < 32; ++l) {
        for (int r = 0; r < 4; ++r) {
          ah[l][r] = whi[l][r & 1][mma::lane_a_offset(r, j)];
          al[l][r] = wlo[l][r & 1][mma::lane_a_offset(r, j)];
        }
        for (int r = 0; r < 2; ++r) {
          bh[l][r] = xhi[l][mma::lane_b_offset(r, j)];
          bl[l][r] = xlo[l][mma::lane_b_offset(r, j)];
        }
      }
      if (kind == W::f32) emulated_mma(target, al, bh);
      emulated_mma(target, ah, bl);
      emulated_mma(target, ah, bh);
    }
    if (kind == W::q8)
      for (int l = 0; l < 32; ++l)
        for (int r = 0; r < 4; ++r)
          acc[l][r] = std::fma(d[size_t(mma::c_row(l, r)) * (K / 32) + ch], sum[l][r], acc[l][r]);
  }
  std::vector<float> y(8 * 16);
  for (int l = 0; l < 32; ++l)
    for (int r = 0; r < 4; ++r) y[size_t(mma::c_token(l, r)) * 16 + mma::c_row(l, r)] = acc[l][r];
  return y;
}

}  // namespace

TEST_CASE("tf32: rounding to nearest, ties away, against float64") {
  std::mt19937 rng(20261206);
  std::uniform_int_distribution<uint32_t> bits;
  int bad = 0;
  for (int i = 0; i < 200000; ++i) {
    float x = mma::bits_float(bits(rng));
    if (!std::isfinite(x)) continue;
    const float t = mma::to_tf32(x);
    const double ref = tf32_reference(x);
    if (std::isinf(t) ? std::fabs(ref) < 3.4028234663852886e38 : double(t) != ref) ++bad;
    if (low13(t) != 0) ++bad;
  }
  CHECK(bad == 0);
  // A tie rounds away from zero, either sign; one below it rounds down.
  const float tie = mma::bits_float(0x3f801000u);  // 1 + 2^-11
  CHECK(mma::to_tf32(tie) == 1.0f + std::ldexp(1.0f, -10));
  CHECK(mma::to_tf32(-tie) == -(1.0f + std::ldexp(1.0f, -10)));
  CHECK(mma::to_tf32(mma::bits_float(0x3f800fffu)) == 1.0f);
  // A carry through the mantissa moves the exponent.
  CHECK(mma::to_tf32(mma::bits_float(0x3ffff000u)) == 2.0f);
  CHECK(std::isinf(mma::to_tf32(3.4028234e38f)));
  CHECK(mma::to_tf32(0.0f) == 0.0f);
  CHECK(std::signbit(mma::to_tf32(-0.0f)));
  CHECK(mma::to_tf32(INFINITY) == INFINITY);
  CHECK(mma::to_tf32(-INFINITY) == -INFINITY);
  CHECK(std::isnan(mma::to_tf32(NAN)));
  CHECK(std::isnan(mma::to_tf32(mma::bits_float(0x7f800001u))));  // a NaN's low bits only
  // F16 and BF16 values, and int8 values, are TF32 already.
  for (float v : {65504.0f, 6.1035156e-05f, 5.9604645e-08f, -127.0f, 3.3895314e38f})
    CHECK(mma::to_tf32(v) == v);
}

TEST_CASE("tf32: the split x = hi + lo is within 2^-22 |x|") {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  double worst = 0;
  for (int i = 0; i < 100000; ++i) {
    const float x = nd(rng) * std::ldexp(1.0f, int(i % 60) - 30);
    const mma::Split s = mma::split_tf32(x);
    CHECK(low13(s.hi) == 0);
    CHECK(low13(s.lo) == 0);
    const double r = std::fabs(double(x) - double(s.hi) - double(s.lo));
    if (x != 0) worst = std::max(worst, r / std::fabs(double(x)));
  }
  CHECK(worst <= std::ldexp(1.0, -22));
  CHECK(worst > 0);  // the bound is not vacuous: some x need a third term
  const mma::Split inf = mma::split_tf32(INFINITY);
  CHECK(inf.hi == INFINITY);
  CHECK(inf.lo == 0.0f);
}

TEST_CASE("mma fragments: every lane's registers where CuTe's layouts put them") {
  int bad = 0;
  for (int l = 0; l < 32; ++l) {
    for (int r = 0; r < 4; ++r) {
      const Coord a = cute_a(l, r), c = cute_c(l, r);
      bad += a.row != mma::a_row(l, r) || a.col != mma::a_k(l, r);
      bad += c.row != mma::c_row(l, r) || c.col != mma::c_token(l, r);
    }
    for (int r = 0; r < 2; ++r) {
      const Coord b = cute_b(l, r);
      bad += b.row != mma::b_k(l, r) || b.col != mma::b_token(l);
    }
  }
  CHECK(bad == 0);
  // The step map covers a chunk's 32 columns once, and a lane's registers
  // fall on its own 8 columns at the offsets the kernel reads.
  std::vector<int> seen(mma::kChunk, 0);
  for (int j = 0; j < mma::kSteps; ++j)
    for (int kk = 0; kk < 8; ++kk) ++seen[size_t(mma::chunk_col(kk, j))];
  for (int s : seen) CHECK(s == 1);
  for (int l = 0; l < 32; ++l)
    for (int j = 0; j < mma::kSteps; ++j) {
      const int first = mma::kLaneCols * (l & 3);
      for (int r = 0; r < 4; ++r)
        bad += mma::chunk_col(mma::a_k(l, r), j) != first + mma::lane_a_offset(r, j);
      for (int r = 0; r < 2; ++r)
        bad += mma::chunk_col(mma::b_k(l, r), j) != first + mma::lane_b_offset(r, j);
    }
  CHECK(bad == 0);
}

TEST_CASE("mma data flow: exact on integers, within the 3xTF32 bound on floats") {
  const int K = 256;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> small(-8, 8);
  std::vector<float> w(16 * K), x(8 * K), d(16 * (K / 32));
  for (auto& v : w) v = float(small(rng));
  for (auto& v : x) v = float(small(rng));
  auto exact = [&](int i, int r) {
    double s = 0;
    for (int k = 0; k < K; ++k) s += double(w[size_t(r) * K + k]) * x[size_t(i) * K + k];
    return s;
  };
  for (W kind : {W::f32, W::exact}) {
    const auto y = emulated_tile(kind, w, d, x, K);
    int bad = 0;
    for (int i = 0; i < 8; ++i)
      for (int r = 0; r < 16; ++r) bad += double(y[size_t(i) * 16 + r]) != exact(i, r);
    CHECK(bad == 0);
  }

  // Random floats: |y - exact| <= (2^-21 + (K/8 * 3 + 2) * 2^-24) * sum |w x|:
  // the split drops at most 2^-22 of each product per operand split, and
  // each of the K/8 * 3 accumulations (plus the Q8_0 scale's fma) rounds
  // once in F32.
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> q(-127, 127);
  for (W kind : {W::f32, W::exact, W::q8}) {
    CAPTURE(int(kind));
    for (auto& v : x) v = nd(rng);
    for (auto& v : w) {
      const float g = nd(rng);
      v = kind == W::f32 ? g : kind == W::exact ? mma::to_tf32(g) : float(q(rng));
    }
    for (auto& v : d) v = std::fabs(nd(rng)) * 0.01f;
    const auto y = emulated_tile(kind, w, d, x, K);
    double worst = 0;
    for (int i = 0; i < 8; ++i)
      for (int r = 0; r < 16; ++r) {
        double s = 0, mag = 0;
        for (int k = 0; k < K; ++k) {
          const double scale = kind == W::q8 ? double(d[size_t(r) * (K / 32) + k / 32]) : 1.0;
          const double p = double(w[size_t(r) * K + k]) * scale * x[size_t(i) * K + k];
          s += p;
          mag += std::fabs(p);
        }
        worst = std::max(worst, std::fabs(double(y[size_t(i) * 16 + r]) - s) / mag);
      }
    const double bound = std::ldexp(1.0, -21) + (K / 8 * 3 + 2) * std::ldexp(1.0, -24);
    MESSAGE("worst error / sum|w x|: " << worst << " (bound " << bound << ")");
    CHECK(worst <= bound);
    CHECK(worst > 0);
  }
}
