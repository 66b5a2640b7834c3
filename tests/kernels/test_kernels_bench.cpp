// Quick throughput figures (skipped by default; run with
//   test_kernels -ts="*bench*" --no-skip
// on an idle machine).
#include <doctest/doctest.h>

#include <chrono>
#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "kernels/backend.h"

using namespace cleave;

namespace {
double seconds_best(int reps, const std::function<void()>& fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
}  // namespace

TEST_CASE("bench: matmul throughput" * doctest::skip()) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int threads : {1, 2}) {
    auto be = make_cpu_backend(threads);
    {  // prefill: 768x768 by 128 rows
      for (DType t : {DType::F32, DType::F16, DType::Q8_0}) {
        const int64_t rows = 768, cols = 768, n = 128;
        std::vector<float> wf(rows * cols), x(n * cols), y(n * rows);
        for (auto& v : wf) v = u(rng);
        for (auto& v : x) v = u(rng);
        std::vector<uint8_t> w(dtype_row_bytes(t, cols) * rows);
        for (int64_t r = 0; r < rows; ++r) {
          uint8_t* dst = w.data() + r * dtype_row_bytes(t, cols);
          if (t == DType::F32) std::memcpy(dst, &wf[r * cols], cols * 4);
          if (t == DType::F16)
            for (int64_t c = 0; c < cols; ++c) {
              uint16_t h = fp32_to_fp16(wf[r * cols + c]);
              std::memcpy(dst + 2 * c, &h, 2);
            }
          if (t == DType::Q8_0) quantize_row_q8_0(&wf[r * cols], cols, dst);
        }
        WeightView v{t, w.data(), rows, cols, dtype_row_bytes(t, cols)};
        const double s = seconds_best(20, [&] { be->matmul(v, x.data(), n, y.data()); });
        MESSAGE(be->caps().isa << " threads=" << threads << " prefill " << std::string(dtype_name(t))
                               << " 768x768 n=128: " << 2.0 * rows * cols * n / s / 1e9 << " GFLOP/s");
      }
    }
    {  // decode: F16 2048 x 8192 matvec (32 MiB of weights)
      for (DType t : {DType::F16, DType::Q8_0, DType::F32}) {
        const int64_t rows = 8192, cols = 2048;
        const size_t rb = dtype_row_bytes(t, cols);
        std::vector<uint8_t> w(rb * rows);
        for (size_t i = 0; i < w.size(); ++i) w[i] = uint8_t(rng() & 0x3b);  // finite halves
        std::vector<float> x(cols), y(rows);
        for (auto& v : x) v = u(rng);
        WeightView v{t, w.data(), rows, cols, rb};
        const double s = seconds_best(20, [&] { be->matmul(v, x.data(), 1, y.data()); });
        MESSAGE(be->caps().isa << " threads=" << threads << " decode " << std::string(dtype_name(t))
                               << " 8192x2048 n=1: " << double(w.size()) / s / 1e9 << " GB/s");
      }
    }
  }
}
