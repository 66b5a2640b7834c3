// Helpers shared by the kernel tests.
#pragma once

#include <random>
#include <vector>

#include "kernels/backend.h"

namespace cleave::test {

// scalar always, plus every SIMD level this CPU runs.
inline std::vector<Isa> isas() {
  std::vector<Isa> out{Isa::scalar};
  const Isa best = detect_isa();
  if (best == Isa::avx2 || best == Isa::avx512) out.push_back(Isa::avx2);
  if (best == Isa::avx512) out.push_back(Isa::avx512);
  return out;
}

// Seeded uniform floats in [lo, hi), never exactly zero.
inline std::vector<float> randv(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) {
    do x = u(rng);
    while (x == 0.0f);
  }
  return v;
}

}  // namespace cleave::test
