// XXH3-64 (seed 0, the default secret) as host-and-device code: the CUDA
// backend's checksum_blocks hashes KV blocks where they are, and the value
// must be the one storage computes on the host (libxxhash's XXH3_64bits,
// storage/block.h checksum_bytes). Written from the XXH3 specification;
// tests/kernels/test_xxh3_device.cpp compiles this header for the host and
// compares it with libxxhash at every length class and alignment.
//
// Inputs over 240 bytes run as 8 independent lanes, one per accumulator
// (lane i adds its own key product and the data word of lane i ^ 1), so the
// CUDA kernel gives each lane a thread and merges in lane 0;
// xxh3_64() runs the lanes in turn.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CLEAVE_HD __host__ __device__
#define CLEAVE_XXH3_SECRET __constant__
#else
#define CLEAVE_HD
#define CLEAVE_XXH3_SECRET
#endif

namespace cleave::xxh3 {

CLEAVE_XXH3_SECRET static const uint8_t kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

constexpr uint64_t kP32_1 = 0x9E3779B1u, kP32_2 = 0x85EBCA77u, kP32_3 = 0xC2B2AE3Du;
constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ull, kP64_2 = 0xC2B2AE3D27D4EB4Full,
                   kP64_3 = 0x165667B19E3779F9ull, kP64_4 = 0x85EBCA77C2B2AE63ull,
                   kP64_5 = 0x27D4EB2F165667C5ull;
constexpr size_t kStripe = 64, kBlock = 1024;  // 16 stripes per block with the 192-byte secret

// Little-endian reads (x86 and every CUDA GPU are little-endian).
CLEAVE_HD inline uint64_t r64(const uint8_t* p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}
CLEAVE_HD inline uint32_t r32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
CLEAVE_HD inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
CLEAVE_HD inline uint64_t swap64(uint64_t x) {
  x = ((x & 0x00FF00FF00FF00FFull) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFull);
  x = ((x & 0x0000FFFF0000FFFFull) << 16) | ((x >> 16) & 0x0000FFFF0000FFFFull);
  return (x << 32) | (x >> 32);
}
CLEAVE_HD inline uint64_t fold(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return uint64_t(p) ^ uint64_t(p >> 64);
#endif
}
CLEAVE_HD inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  return h ^ (h >> 32);
}
CLEAVE_HD inline uint64_t avalanche64(uint64_t h) {
  h ^= h >> 33;
  h *= kP64_2;
  h ^= h >> 29;
  h *= kP64_3;
  return h ^ (h >> 32);
}
CLEAVE_HD inline uint64_t mix16(const uint8_t* in, const uint8_t* s) {
  return fold(r64(in) ^ r64(s), r64(in + 8) ^ r64(s + 8));
}

// Inputs of at most 240 bytes.
CLEAVE_HD inline uint64_t short_64(const uint8_t* in, size_t len) {
  const uint8_t* s = kSecret;
  if (len == 0) return avalanche64(r64(s + 56) ^ r64(s + 64));
  if (len <= 3) {
    const uint32_t combined = (uint32_t(in[0]) << 16) | (uint32_t(in[len >> 1]) << 24) | uint32_t(in[len - 1]) |
                              (uint32_t(len) << 8);
    return avalanche64(uint64_t(combined) ^ uint64_t(r32(s) ^ r32(s + 4)));
  }
  if (len <= 8) {
    const uint64_t keyed = (uint64_t(r32(in + len - 4)) + (uint64_t(r32(in)) << 32)) ^ (r64(s + 8) ^ r64(s + 16));
    uint64_t h = keyed ^ rotl(keyed, 49) ^ rotl(keyed, 24);
    h *= 0x9FB21C651E98DF25ull;
    h ^= (h >> 35) + len;
    h *= 0x9FB21C651E98DF25ull;
    return h ^ (h >> 28);
  }
  if (len <= 16) {
    const uint64_t lo = r64(in) ^ (r64(s + 24) ^ r64(s + 32));
    const uint64_t hi = r64(in + len - 8) ^ (r64(s + 40) ^ r64(s + 48));
    return avalanche(len + swap64(lo) + hi + fold(lo, hi));
  }
  uint64_t acc = len * kP64_1;
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) acc += mix16(in + 48, s + 96) + mix16(in + len - 64, s + 112);
        acc += mix16(in + 32, s + 64) + mix16(in + len - 48, s + 80);
      }
      acc += mix16(in + 16, s + 32) + mix16(in + len - 32, s + 48);
    }
    acc += mix16(in, s) + mix16(in + len - 16, s + 16);
    return avalanche(acc);
  }
  for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, s + 16 * i);
  acc = avalanche(acc);
  for (size_t i = 8; i < len / 16; ++i) acc += mix16(in + 16 * i, s + 16 * (i - 8) + 3);
  acc += mix16(in + len - 16, s + 136 - 17);
  return avalanche(acc);
}

// One stripe's step for lane i.
CLEAVE_HD inline uint64_t lane_step(uint64_t acc, const uint8_t* stripe, const uint8_t* s, int i) {
  const uint64_t v = r64(stripe + 8 * i), k = v ^ r64(s + 8 * i);
  return acc + r64(stripe + 8 * (i ^ 1)) + (k & 0xFFFFFFFFull) * (k >> 32);
}

// Accumulator i after every stripe of an input over 240 bytes.
CLEAVE_HD inline uint64_t long_lane(const uint8_t* in, size_t len, int i) {
  const uint64_t init[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};
  const uint8_t* s = kSecret;
  uint64_t acc = init[i];
  const size_t n_blocks = (len - 1) / kBlock;
  for (size_t b = 0; b < n_blocks; ++b) {
    for (size_t st = 0; st < kBlock / kStripe; ++st) acc = lane_step(acc, in + b * kBlock + st * kStripe, s + st * 8, i);
    acc ^= acc >> 47;
    acc ^= r64(s + 192 - kStripe + 8 * i);
    acc *= kP32_1;
  }
  const size_t last = ((len - 1) - kBlock * n_blocks) / kStripe;
  for (size_t st = 0; st < last; ++st) acc = lane_step(acc, in + n_blocks * kBlock + st * kStripe, s + st * 8, i);
  return lane_step(acc, in + len - kStripe, s + 192 - kStripe - 7, i);
}

// The hash of an input over 240 bytes from its 8 accumulators.
CLEAVE_HD inline uint64_t merge(const uint64_t* acc, size_t len) {
  uint64_t r = len * kP64_1;
  for (int i = 0; i < 4; ++i) r += fold(acc[2 * i] ^ r64(kSecret + 11 + 16 * i), acc[2 * i + 1] ^ r64(kSecret + 11 + 16 * i + 8));
  return avalanche(r);
}

CLEAVE_HD inline uint64_t xxh3_64(const uint8_t* in, size_t len) {
  if (len <= 240) return short_64(in, len);
  uint64_t acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = long_lane(in, len, i);
  return merge(acc, len);
}

}  // namespace cleave::xxh3
