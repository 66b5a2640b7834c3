// The exact matmul's documented formula (kernels/cpu/panels.h): each output
// one FMA chain over k in order, so AVX2 and AVX-512 give the same bits; a
// prepared view's panels against the per-call packing; and the copy a
// prepared view is multiplied from.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/device_testing.h"
#include "tests/kernels/kernel_test_util.h"

using namespace cleave;
using test::isas;
using test::make_weights;
using test::randv;
using test::Weights;

namespace {

const DType kTypes[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0};

// The formula on the dequantised weights: fused (AVX2 / AVX-512) or the
// portable kernels' product rounded before the add.
std::vector<float> formula(const Weights& w, const float* x, int64_t n, bool fused) {
  std::vector<float> y(size_t(n * w.rows));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < w.rows; ++r) {
      float s = 0.0f;
      for (int64_t c = 0; c < w.cols; ++c) {
        const float a = x[i * w.cols + c], b = w.deq[size_t(r * w.cols + c)];
        if (fused) {
          s = std::fmaf(a, b, s);
        } else {
          volatile float p = a * b;  // rounded, never contracted into an fma
          s = p + s;
        }
      }
      y[size_t(i * w.rows + r)] = s;
    }
  return y;
}

}  // namespace

TEST_CASE("matmul: each output is one multiply-add chain over k in order, on every ISA") {
  for (Isa isa : isas()) {
    for (int threads : {1, 2}) {
      auto be = make_cpu_backend(threads, isa);
      for (DType t : kTypes) {
        const bool q8 = t == DType::Q8_0;
        // Rows past one panel, ragged panels, cols past an x pass's L2 budget,
        // panels too long to stay in L1.
        for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{1, q8 ? 32 : 5}, {17, q8 ? 64 : 33},
                                         {70, q8 ? 288 : 291}, {200, q8 ? 96 : 40}, {20, q8 ? 1056 : 1040}}) {
          const Weights w = make_weights(t, rows, cols, uint32_t(rows * 7 + cols));
          // Every row-block size of the AVX-512 microkernel (1-12 rows), and
          // passes of enough blocks that narrow panels are widened once
          // (from 3 blocks for Q8_0, 4 for F16 and BF16).
          // 100 rows: on 2 threads, split by rows (48 a thread and up) where
          // the work is large enough to thread at all. Each kind of row block
          // runs its own loop (simd_impl.h's pk): a first block, a later one
          // that prefetches the next group of panels (70 and 200 rows at 13
          // to 33 x rows), a later one with nothing ahead, and a widened
          // copy too large for L1 (cols 1040 from 37 x rows).
          for (int64_t n : {1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 24, 33, 40, 60, 100}) {
            const auto x = randv(size_t(n * cols), uint32_t(n * 3 + 1));
            std::vector<float> y(size_t(n * rows), -1.0f);
            be->matmul(w.view(), x.data(), n, y.data());
            const auto ref = formula(w, x.data(), n, isa != Isa::scalar);
            INFO(isa_name(isa) << " " << dtype_name(t) << " rows=" << rows << " cols=" << cols << " n=" << n
                               << " threads=" << threads);
            CHECK(std::memcmp(y.data(), ref.data(), y.size() * 4) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("matmul: a prepared view's panels give the per-call packing's bits, its copy is what is multiplied") {
  for (Isa isa : isas()) {
    for (DType t : kTypes) {
      const int64_t rows = 83, cols = t == DType::Q8_0 ? 160 : 150;
      Weights w = make_weights(t, rows, cols, 41);
      const auto x = randv(size_t(37 * cols), 42);
      auto plain = make_cpu_backend(2, isa);
      auto prep = make_cpu_backend(2, isa);
      auto other = make_cpu_backend(1, isa);
      std::vector<float> want(size_t(37 * rows)), got(want.size());
      plain->matmul(w.view(), x.data(), 37, want.data());
      INFO(isa_name(isa) << " " << dtype_name(t));
      REQUIRE(prep->prepare(w.view()));
      REQUIRE(other->prepare(w.view()));  // the same copy, shared
      for (int64_t n : {1, 5, 37}) {
        std::fill(got.begin(), got.end(), -1.0f);
        prep->matmul(w.view(), x.data(), n, got.data());
        CHECK(std::memcmp(got.data(), want.data(), size_t(n * rows) * 4) == 0);
      }
      // Change the view's bytes: the prepared backends keep multiplying
      // their copy (as prepare() says), the unprepared one sees the change.
      const std::vector<uint8_t> saved = w.data;
      for (size_t i = 0; i < w.data.size(); i += 3) w.data[i] = uint8_t(w.data[i] ^ 0x11);
      std::vector<float> changed(want.size());
      plain->matmul(w.view(), x.data(), 37, changed.data());
      CHECK(std::memcmp(changed.data(), want.data(), want.size() * 4) != 0);
      prep.reset();  // the other holder keeps the shared copy alive
      other->matmul(w.view(), x.data(), 37, got.data());
      CHECK(std::memcmp(got.data(), want.data(), want.size() * 4) == 0);
      w.data = saved;
    }
  }
  // Nothing to keep for an empty view or a type the backend cannot multiply.
  auto be = make_cpu_backend(1, Isa::scalar);
  CHECK_FALSE(be->prepare(WeightView{}));
}

TEST_CASE("matmuls: a group gives every job the bits matmul gives it alone") {
  // Shapes whose panels split unevenly over the threads (a thread's range
  // then spans jobs), several types in one group, rows 0 to 40 (one job
  // empty), prepared views beside one packed for the call, and the int8
  // compute's jobs beside exact ones.
  struct Job {
    DType t;
    int64_t rows, cols, n;
    bool prepare;
  };
  const Job spec[] = {{DType::F16, 288, 96, 40, true},  {DType::F32, 33, 96, 40, true},
                      {DType::Q8_0, 70, 64, 5, true},   {DType::F16, 17, 96, 0, true},
                      {DType::BF16, 100, 40, 13, false}, {DType::F16, 48, 96, 1, true}};
  for (Isa isa : isas()) {
    for (Compute compute : {Compute::exact, Compute::int8}) {
      if (compute == Compute::int8 && isa == Isa::scalar) continue;
      for (int threads : {1, 2, 3}) {
        auto group = make_cpu_backend(threads, isa, compute);
        auto alone = make_cpu_backend(threads, isa, compute);
        std::vector<Weights> ws;
        std::vector<std::vector<float>> xs, want, got;
        for (const Job& j : spec) {
          ws.push_back(make_weights(j.t, j.rows, j.cols, uint32_t(j.rows + j.cols)));
          xs.push_back(randv(size_t(std::max<int64_t>(j.n, 1) * j.cols), uint32_t(j.rows * 3 + j.n)));
          want.emplace_back(size_t(std::max<int64_t>(j.n, 1) * j.rows), -1.0f);
          got.emplace_back(want.back().size(), -2.0f);
        }
        std::vector<WeightView> views;
        for (size_t i = 0; i < ws.size(); ++i) views.push_back(ws[i].view());
        std::vector<MatmulJob> jobs;
        for (size_t i = 0; i < ws.size(); ++i) {
          if (spec[i].prepare) group->prepare(views[i]), alone->prepare(views[i]);
          alone->matmul(views[i], xs[i].data(), spec[i].n, want[i].data());
          jobs.push_back({&views[i], xs[i].data(), spec[i].n, got[i].data()});
        }
        group->matmuls(jobs.data(), int64_t(jobs.size()));
        for (size_t i = 0; i < ws.size(); ++i) {
          INFO(isa_name(isa) << " threads=" << threads << " int8=" << (compute == Compute::int8) << " job " << i);
          if (spec[i].n == 0) {  // nothing written
            CHECK(got[i][0] == -2.0f);
            continue;
          }
          CHECK(std::memcmp(got[i].data(), want[i].data(), got[i].size() * 4) == 0);
        }
      }
    }
  }
}

TEST_CASE("matmul: a prefill's rows split over the threads give the panel split's bits") {
  // From 48 rows a thread, groups of weights up to 1 MiB split their rows;
  // the panel-split backend never does. Rows 96-150 on 2 and 3 threads,
  // each type, a group of three, and one matrix past 1 MiB (panels in both).
  for (Isa isa : isas()) {
    for (int threads : {2, 3}) {
      auto rows = make_cpu_backend(threads, isa);
      auto panels = make_cpu_backend_panel_split(threads, isa);
      for (DType t : kTypes) {
        const int64_t cols = 288;
        const Weights wq = make_weights(t, 288, cols, 5), wk = make_weights(t, 96, cols, 6),
                      wv = make_weights(t, 96, cols, 7);
        const WeightView vq = wq.view(), vk = wk.view(), vv = wv.view();
        for (int64_t n : {96, 100, 143, 150}) {
          const auto x = randv(size_t(n * cols), uint32_t(n));
          std::vector<float> q1(size_t(n * 288)), k1(size_t(n * 96)), v1(k1.size());
          std::vector<float> q2(q1.size()), k2(k1.size()), v2(k1.size());
          const MatmulJob g1[] = {{&vq, x.data(), n, q1.data()}, {&vk, x.data(), n, k1.data()},
                                  {&vv, x.data(), n, v1.data()}};
          const MatmulJob g2[] = {{&vq, x.data(), n, q2.data()}, {&vk, x.data(), n, k2.data()},
                                  {&vv, x.data(), n, v2.data()}};
          rows->matmuls(g1, 3);
          panels->matmuls(g2, 3);
          INFO(isa_name(isa) << " " << dtype_name(t) << " threads=" << threads << " n=" << n);
          CHECK(std::memcmp(q1.data(), q2.data(), q1.size() * 4) == 0);
          CHECK(std::memcmp(k1.data(), k2.data(), k1.size() * 4) == 0);
          CHECK(std::memcmp(v1.data(), v2.data(), v1.size() * 4) == 0);
          const auto ref = formula(wq, x.data(), n, isa != Isa::scalar);
          CHECK(std::memcmp(q1.data(), ref.data(), q1.size() * 4) == 0);
        }
        // Past 1 MiB in every type (Q8_0: 1.13 MB): panels on both.
        const Weights big = make_weights(t, 2560, 416, 8);
        const auto x = randv(size_t(100 * 416), 9);
        std::vector<float> b1(size_t(100 * 2560)), b2(b1.size());
        rows->matmul(big.view(), x.data(), 100, b1.data());
        panels->matmul(big.view(), x.data(), 100, b2.data());
        INFO(isa_name(isa) << " " << dtype_name(t) << " threads=" << threads << " 2560 x 416");
        CHECK(std::memcmp(b1.data(), b2.data(), b1.size() * 4) == 0);
      }
    }
  }
}
