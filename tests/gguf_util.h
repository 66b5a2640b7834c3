#pragma once
// A GGUF metadata value of any scalar type, for tests that write GGUF files
// with types GgufWriter has no setter for (tests/model/test_gguf.cpp,
// tests/fuzz/write_seeds.cpp).
#include <cstdint>

#include "model/gguf.h"

namespace cleave::testing {

inline GgufValue gguf_scalar(GgufType t, uint64_t u, int64_t i = 0, double f = 0) {
  GgufValue v;
  v.type = t;
  v.u = u;
  v.i = i;
  v.f = f;
  return v;
}

}  // namespace cleave::testing
