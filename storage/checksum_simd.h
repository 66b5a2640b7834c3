// XXH3-64 builds, chosen at run time (block.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace cleave::detail {

struct Xxh3Impl {
  uint64_t (*oneshot)(const void* data, size_t n);
  void* (*state_new)();  // an XXH3_state_t of this build (nullptr when out of memory)
  void (*state_free)(void* state);
  void (*reset)(void* state);
  void (*update)(void* state, const void* data, size_t n);
  uint64_t (*digest)(const void* state);
};

extern const Xxh3Impl xxh3_avx2;  // checksum_avx2.cpp (-mavx2)

}  // namespace cleave::detail
