// Backend::full_attention (the vision encoder's non-causal attention) on
// every ISA: against a float64 reference, the same bits as the matmul /
// softmax composition ClipModel ran before it was an op, and the same bits
// for a sequence alone, in a batch, and on 1 or 2 threads.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/backend.h"
#include "tests/kernels/kernel_test_util.h"

using namespace cleave;
using test::isas;
using test::randv;

namespace {

constexpr int64_t kSeq = 3, kT = 37, kHeads = 4, kHd = 24, kLd = kHeads * kHd + 8;

std::vector<double> reference(const std::vector<float>& q, const std::vector<float>& k,
                              const std::vector<float>& v, float scale) {
  std::vector<double> out(size_t(kSeq * kT * kLd), 0.0);
  std::vector<double> p(static_cast<size_t>(kT));
  for (int64_t s = 0; s < kSeq; ++s)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t i = 0; i < kT; ++i) {
        double m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < kT; ++j) {
          double d = 0;
          for (int64_t c = 0; c < kHd; ++c)
            d += double(q[size_t((s * kT + i) * kLd + h * kHd + c)]) * k[size_t((s * kT + j) * kLd + h * kHd + c)];
          p[size_t(j)] = d * double(scale);
          m = std::max(m, p[size_t(j)]);
        }
        for (double& e : p) sum += (e = std::exp(e - m));
        for (int64_t c = 0; c < kHd; ++c) {
          double o = 0;
          for (int64_t j = 0; j < kT; ++j) o += p[size_t(j)] / sum * v[size_t((s * kT + j) * kLd + h * kHd + c)];
          out[size_t((s * kT + i) * kLd + h * kHd + c)] = o;
        }
      }
  return out;
}

// What ClipModel computed with matmul and softmax before the op existed.
std::vector<float> composed(Backend& be, const std::vector<float>& q, const std::vector<float>& k,
                            const std::vector<float>& v, float scale) {
  std::vector<float> out(size_t(kSeq * kT * kLd), -7.0f);
  std::vector<float> scores(size_t(kT * kT)), qh(size_t(kT * kHd)), vt(size_t(kT * kHd)), oh(size_t(kT * kHd));
  for (int64_t s = 0; s < kSeq; ++s)
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t i = 0; i < kT; ++i)
        for (int64_t d = 0; d < kHd; ++d) {
          qh[size_t(i * kHd + d)] = q[size_t((s * kT + i) * kLd + h * kHd + d)];
          vt[size_t(d * kT + i)] = v[size_t((s * kT + i) * kLd + h * kHd + d)];
        }
      const WeightView kv{DType::F32, k.data() + s * kT * kLd + h * kHd, kT, kHd, size_t(kLd) * 4};
      be.matmul(kv, qh.data(), kT, scores.data());
      for (float& e : scores) e *= scale;
      be.softmax(scores.data(), kT, kT);
      const WeightView vv{DType::F32, vt.data(), kHd, kT, size_t(kT) * 4};
      be.matmul(vv, scores.data(), kT, oh.data());
      for (int64_t i = 0; i < kT; ++i)
        for (int64_t d = 0; d < kHd; ++d) out[size_t((s * kT + i) * kLd + h * kHd + d)] = oh[size_t(i * kHd + d)];
    }
  return out;
}

}  // namespace

TEST_CASE("full_attention: float64 reference, the composed ops' bits, batch and thread invariance") {
  const auto q = randv(size_t(kSeq * kT * kLd), 301), k = randv(size_t(kSeq * kT * kLd), 302),
             v = randv(size_t(kSeq * kT * kLd), 303);
  const float scale = 1.0f / std::sqrt(float(kHd));
  const std::vector<double> ref = reference(q, k, v, scale);
  for (Isa isa : isas()) {
    INFO(isa_name(isa));
    auto one = make_cpu_backend(1, isa), two = make_cpu_backend(2, isa);
    std::vector<float> out(q.size(), -7.0f);
    two->full_attention(q.data(), k.data(), v.data(), kSeq, kT, kHeads, kHd, kLd, scale, out.data());
    double err = 0;
    for (int64_t r = 0; r < kSeq * kT; ++r) {
      for (int64_t c = 0; c < kHeads * kHd; ++c)
        err = std::max(err, std::fabs(double(out[size_t(r * kLd + c)]) - ref[size_t(r * kLd + c)]));
      for (int64_t c = kHeads * kHd; c < kLd; ++c) CHECK(out[size_t(r * kLd + c)] == -7.0f);  // untouched
    }
    // Outputs are convex combinations of values in [-1, 1]; float32 scores
    // of 24 terms and a 37-term softmax keep them within 1e-7 (measured).
    CHECK(err < 5e-7);  // measured 8.1e-8 to 8.7e-8
    const std::vector<float> comp = composed(*one, q, k, v, scale);
    CHECK(std::memcmp(comp.data(), out.data(), out.size() * 4) == 0);
    // The middle sequence alone (its rows only) on one thread: the same bits.
    std::vector<float> alone(size_t(kT * kLd), -7.0f);
    const size_t at = size_t(kT * kLd);
    one->full_attention(q.data() + at, k.data() + at, v.data() + at, 1, kT, kHeads, kHd, kLd, scale,
                        alone.data());
    CHECK(std::memcmp(alone.data(), out.data() + at, alone.size() * 4) == 0);
    // copy: bytes, and nothing past them.
    std::vector<float> dst(8, 0.0f);
    one->copy(dst.data(), q.data(), 5 * sizeof(float));
    CHECK(std::memcmp(dst.data(), q.data(), 5 * sizeof(float)) == 0);
    CHECK(dst[5] == 0.0f);
  }
}
