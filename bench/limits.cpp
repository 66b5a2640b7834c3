#include "bench/limits.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/host_memory.h"

namespace cleave::bench {
namespace {

using Clock = std::chrono::steady_clock;
double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

// Runs fn(thread_index) on `threads` threads started together.
template <class Fn>
void on_threads(int threads, Fn fn) {
  std::vector<std::thread> ts;
  for (int t = 1; t < threads; ++t) ts.emplace_back(fn, t);
  fn(0);
  for (auto& t : ts) t.join();
}

// STREAM-like read: sum 64-byte lines with AVX2 loads (every byte is read).
__attribute__((target("avx2"))) uint64_t read_sum_avx2(const uint64_t* p, size_t n) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i + 16 <= n; i += 16) {
    a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i*)(p + i)));
    b = _mm256_add_epi64(b, _mm256_load_si256((const __m256i*)(p + i + 4)));
    c = _mm256_add_epi64(c, _mm256_load_si256((const __m256i*)(p + i + 8)));
    d = _mm256_add_epi64(d, _mm256_load_si256((const __m256i*)(p + i + 12)));
  }
  a = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
  alignas(32) uint64_t out[4];
  _mm256_store_si256((__m256i*)out, a);
  return out[0] + out[1] + out[2] + out[3];
}

// Peak FP32 FMA throughput: 12 independent accumulators per thread, named
// so they stay in registers (an array of vectors spills to the stack).
#define CLEAVE_FMA12(FMA, x)                                                   \
  x##0 = FMA(x##0, m, a); x##1 = FMA(x##1, m, a); x##2 = FMA(x##2, m, a);      \
  x##3 = FMA(x##3, m, a); x##4 = FMA(x##4, m, a); x##5 = FMA(x##5, m, a);      \
  x##6 = FMA(x##6, m, a); x##7 = FMA(x##7, m, a); x##8 = FMA(x##8, m, a);      \
  x##9 = FMA(x##9, m, a); x##10 = FMA(x##10, m, a); x##11 = FMA(x##11, m, a)
__attribute__((target("avx512f"))) double fma_loop_512(int64_t iters) {
  const __m512 m = _mm512_set1_ps(0.999999f), a = _mm512_set1_ps(1e-7f);
  // Distinct starting values: identical chains would be merged by the compiler.
  __m512 c0 = _mm512_set1_ps(1.00f), c1 = _mm512_set1_ps(1.01f), c2 = _mm512_set1_ps(1.02f),
         c3 = _mm512_set1_ps(1.03f), c4 = _mm512_set1_ps(1.04f), c5 = _mm512_set1_ps(1.05f),
         c6 = _mm512_set1_ps(1.06f), c7 = _mm512_set1_ps(1.07f), c8 = _mm512_set1_ps(1.08f),
         c9 = _mm512_set1_ps(1.09f), c10 = _mm512_set1_ps(1.10f), c11 = _mm512_set1_ps(1.11f);
  for (int64_t i = 0; i < iters; ++i) {
    CLEAVE_FMA12(_mm512_fmadd_ps, c);
  }
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                           _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
  s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
  alignas(64) float o[16];
  _mm512_store_ps(o, s);
  return o[0];
}
__attribute__((target("avx2,fma"))) double fma_loop_256(int64_t iters) {
  const __m256 m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-7f);
  __m256 c0 = _mm256_set1_ps(1.00f), c1 = _mm256_set1_ps(1.01f), c2 = _mm256_set1_ps(1.02f),
         c3 = _mm256_set1_ps(1.03f), c4 = _mm256_set1_ps(1.04f), c5 = _mm256_set1_ps(1.05f),
         c6 = _mm256_set1_ps(1.06f), c7 = _mm256_set1_ps(1.07f), c8 = _mm256_set1_ps(1.08f),
         c9 = _mm256_set1_ps(1.09f), c10 = _mm256_set1_ps(1.10f), c11 = _mm256_set1_ps(1.11f);
  for (int64_t i = 0; i < iters; ++i) {
    CLEAVE_FMA12(_mm256_fmadd_ps, c);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                           _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
  s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
  alignas(32) float o[8];
  _mm256_store_ps(o, s);
  return o[0];
}

__attribute__((target("avx512f,avx512vnni"))) double vnni_loop_512(int64_t iters) {
  const __m512i m = _mm512_set1_epi8(3), a = _mm512_set1_epi8(-1);
  __m512i c0 = _mm512_set1_epi32(0), c1 = _mm512_set1_epi32(1), c2 = _mm512_set1_epi32(2),
          c3 = _mm512_set1_epi32(3), c4 = _mm512_set1_epi32(4), c5 = _mm512_set1_epi32(5),
          c6 = _mm512_set1_epi32(6), c7 = _mm512_set1_epi32(7), c8 = _mm512_set1_epi32(8),
          c9 = _mm512_set1_epi32(9), c10 = _mm512_set1_epi32(10), c11 = _mm512_set1_epi32(11);
  for (int64_t i = 0; i < iters; ++i) {
    CLEAVE_FMA12(_mm512_dpbusd_epi32, c);
  }
  __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                               _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
  s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
  alignas(64) int32_t o[16];
  _mm512_store_si512(o, s);
  return double(o[0]);
}

}  // namespace

double int8_peak_gops(int threads) {
  if (!cpu_has_avx512_vnni()) return 0;
  const int64_t iters = 20'000'000;
  double best = 1e30;
  std::atomic<double> sink{0};
  for (int r = 0; r < 3; ++r) {
    double t0 = now_s();
    on_threads(threads, [&](int) { sink = sink + vnni_loop_512(iters); });
    best = std::min(best, now_s() - t0);
  }
  // 64 byte pairs per instruction, a multiply and an add each.
  return 2.0 * 64 * 12 * iters * threads / best / 1e9;
}

// The buffers come from the CPU backend's allocator, on huge pages where the
// kernel gives them, like the weights and KV pools these limits stand beside
// (on 4 KiB pages scattered runs also pay a TLB miss each).
double read_bandwidth(size_t bytes, int threads, int reps) {
  size_t n = bytes / 8;
  auto* buf = static_cast<uint64_t*>(cpu::host_alloc(n * 8));
  if (!buf) throw std::bad_alloc();
  for (size_t i = 0; i < n; ++i) buf[i] = i;
  std::atomic<uint64_t> sink{0};
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    double t0 = now_s();
    on_threads(threads, [&](int t) {
      size_t lo = n / threads * t, hi = t + 1 == threads ? n : n / threads * (t + 1);
      sink += read_sum_avx2(buf + lo, hi - lo);
    });
    best = std::min(best, now_s() - t0);
  }
  cpu::host_free(buf);
  return bytes / best / 1e9;
}

double scattered_read_bandwidth(size_t bytes, size_t run_bytes, int threads, int reps) {
  run_bytes = std::max<size_t>(128, run_bytes / 128 * 128);  // read_sum_avx2 reads 128 B a step
  const size_t runs = std::max<size_t>(1, bytes / run_bytes);
  auto* buf = static_cast<uint64_t*>(cpu::host_alloc(runs * run_bytes));
  if (!buf) throw std::bad_alloc();
  for (size_t i = 0; i < runs * run_bytes / 8; ++i) buf[i] = i;
  std::vector<uint32_t> order(runs);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  std::atomic<uint64_t> sink{0};
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    double t0 = now_s();
    on_threads(threads, [&](int t) {
      uint64_t s = 0;
      for (size_t i = size_t(t); i < runs; i += size_t(threads))
        s += read_sum_avx2(buf + size_t(order[i]) * (run_bytes / 8), run_bytes / 8);
      sink += s;
    });
    best = std::min(best, now_s() - t0);
  }
  cpu::host_free(buf);
  return double(runs * run_bytes) / best / 1e9;
}

double fma_peak_gflops(Isa isa, int threads) {
  const int64_t iters = 20'000'000;
  const int lanes = isa == Isa::avx512 ? 16 : 8;
  double best = 1e30;
  std::atomic<double> sink{0};
  for (int r = 0; r < 3; ++r) {
    double t0 = now_s();
    on_threads(threads, [&](int) {
      double v = isa == Isa::avx512 ? fma_loop_512(iters) : fma_loop_256(iters);
      sink = sink + v;
    });
    best = std::min(best, now_s() - t0);
  }
  return 2.0 * lanes * 12 * iters * threads / best / 1e9;
}

}  // namespace cleave::bench
