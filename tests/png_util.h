#pragma once
// PNG chunk fields for tests that build or damage PNGs (tests/model/
// test_clip.cpp, tests/fuzz/fuzz_image.cpp): big-endian 32-bit values and the
// chunk CRC (CRC-32 over type and data, as model/image.cpp checks it).
#include <cstddef>
#include <cstdint>

namespace cleave::testing {

inline uint32_t be32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

inline void put_be32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v >> 24);
  p[1] = uint8_t(v >> 16);
  p[2] = uint8_t(v >> 8);
  p[3] = uint8_t(v);
}

inline uint32_t png_crc32(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return c ^ 0xFFFFFFFFu;
}

}  // namespace cleave::testing
