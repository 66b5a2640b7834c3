#include "bench/matmul_bench.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <nlohmann/json.hpp>

#include "bench/limits.h"
#include "bench/stats.h"
#include "kernels/backend.h"
#include "kernels/cpu/kern.h"
#include "kernels/cpu/panels.h"
#include "kernels/dtype.h"

namespace cleave::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Shape {
  const char* what;
  int64_t rows, cols;
};
// The 100M GQA model's matrices (dim 768, 4 KV heads of 64, ffn 2048).
constexpr Shape kShapes[] = {{"wq / wo", 768, 768}, {"wk / wv", 256, 768}, {"w1 / w3", 2048, 768},
                             {"w2", 768, 2048}};
constexpr int kCopies = 8;  // 8 copies of a 2048 x 768 F16 matrix: 25 MB

struct Freed {
  void operator()(uint8_t* p) const { std::free(p); }
};

// rows x cols weights of type t (seeded), as rows in the file's layout.
std::vector<uint8_t> make_rows(DType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1, 1);
  const size_t rb = dtype_row_bytes(t, cols);
  std::vector<uint8_t> out(size_t(rows) * rb);
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (float& v : row) v = u(rng);
    uint8_t* dst = out.data() + size_t(r) * rb;
    if (t == DType::Q8_0) {
      quantize_row_q8_0(row.data(), cols, dst);
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t h = fp32_to_fp16(row[size_t(c)]);
        std::memcpy(dst + 2 * c, &h, 2);
      }
    }
  }
  return out;
}

}  // namespace

int run_matmul_section(const MatmulOptions& o) {
  const Isa isa = detect_isa();
  if (isa == Isa::scalar) {
    std::fprintf(stderr, "--matmul: needs AVX2 or AVX-512 (the scalar kernels are a reference)\n");
    return 2;
  }
  const cpu::Kernels& k = cpu_kernels(isa);
  const double peak_before = fma_peak_gflops(isa, 1);
  std::printf("limits, 1 thread: FMA peak (%s) %.1f GFLOP/s\n", isa_name(isa), peak_before);
  std::printf("%-5s %-8s %5s %5s %4s | %-26s %-26s | %6s\n", "type", "matrix", "rows", "cols", "x", "direct GFLOP/s (% peak)",
              "widened GFLOP/s (% peak)", "gain");
  json results = json::array();
  std::mt19937 rng(7);
  bool bits_ok = true;
  for (const std::string& tname : o.types) {
    const DType t = tname == "q8_0" ? DType::Q8_0 : DType::F16;
    const int wtype = static_cast<int>(t);
    for (const Shape& s : kShapes) {
      const auto w = make_rows(t, s.rows, s.cols, rng);
      const size_t ps = cpu::panel_stride(wtype, s.cols);
      const int64_t panels = (s.rows + cpu::kPanel - 1) / cpu::kPanel;
      std::vector<std::unique_ptr<uint8_t, Freed>> copies;
      for (int c = 0; c < kCopies; ++c) {
        copies.emplace_back(static_cast<uint8_t*>(std::aligned_alloc(64, (ps * size_t(panels) + 63) / 64 * 64)));
        cpu::pack_panels(wtype, w.data(), dtype_row_bytes(t, s.cols), s.rows, s.cols, 0, panels,
                         copies.back().get());
      }
      std::vector<float> wide(size_t(cpu::kWidePanels) * cpu::kPanel * size_t(s.cols));
      for (int n : o.rows) {
        std::uniform_real_distribution<float> u(-1, 1);
        std::vector<float> x(size_t(n) * size_t(s.cols)), y[2];
        for (float& v : x) v = u(rng);
        y[0].assign(size_t(n) * size_t(s.rows), 0);
        y[1] = y[0];
        std::vector<double> secs[2];
        for (int r = 0; r < o.runs; ++r)
          for (int mode = 0; mode < 2; ++mode) {
            const auto t0 = Clock::now();
            for (auto& c : copies) {
              cpu::PanelMatmulArgs a{wtype, c.get(), ps, s.rows, s.cols, x.data(), n, y[mode].data()};
              if (mode == 1) a.wide = wide.data();
              k.matmul(&a, 0, panels);
            }
            secs[mode].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
          }
        const bool same = std::memcmp(y[0].data(), y[1].data(), y[0].size() * 4) == 0;
        bits_ok = bits_ok && same;
        const double flops = 2.0 * double(s.rows) * double(s.cols) * n * kCopies;
        double g[2], lo[2], hi[2];
        for (int m = 0; m < 2; ++m) {
          g[m] = flops / median(secs[m]) / 1e9;
          hi[m] = flops / *std::min_element(secs[m].begin(), secs[m].end()) / 1e9;
          lo[m] = flops / *std::max_element(secs[m].begin(), secs[m].end()) / 1e9;
        }
        char d[64], wd[64];
        std::snprintf(d, sizeof d, "%6.1f (%5.1f-%5.1f) %3.0f%%", g[0], lo[0], hi[0], 100 * g[0] / peak_before);
        std::snprintf(wd, sizeof wd, "%6.1f (%5.1f-%5.1f) %3.0f%%", g[1], lo[1], hi[1], 100 * g[1] / peak_before);
        std::printf("%-5s %-8s %5lld %5lld %4d | %-26s %-26s | %+5.1f%%%s\n", tname.c_str(), s.what,
                    static_cast<long long>(s.rows), static_cast<long long>(s.cols), n, d, wd,
                    100 * (g[1] / g[0] - 1), same ? "" : "  BITS DIFFER");
        results.push_back({{"type", tname}, {"rows", s.rows}, {"cols", s.cols}, {"x_rows", n},
                           {"direct_gflops", g[0]}, {"widened_gflops", g[1]}, {"same_bits", same}});
      }
    }
  }
  const double peak_after = fma_peak_gflops(isa, 1);
  std::printf("FMA peak after: %.1f GFLOP/s. Widening applies from 4 blocks of x rows (F16, BF16) or 3 "
              "(Q8_0); below that the kernel ignores the scratch and both columns run the same code.\n",
              peak_after);
  if (!o.out_json.empty()) {
    std::ofstream f(o.out_json);
    f << json{{"fma_peak_gflops", {peak_before, peak_after}}, {"matmul", results}}.dump(2) << "\n";
  }
  if (!bits_ok) std::fprintf(stderr, "--matmul: the widened path changed bits\n");
  return bits_ok ? 0 : 1;
}

}  // namespace cleave::bench
