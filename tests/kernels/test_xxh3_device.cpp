// The CUDA backend's checksum (kernels/cuda/xxh3.cuh), compiled here for
// the host, against libxxhash's XXH3_64bits: the value storage gives a
// block. Every length from 0 to 2,200 (each length class, the 1,024-byte
// block edges) at two alignments, and sizes of real KV blocks.
#include <doctest/doctest.h>

#include <xxhash.h>

#include <random>
#include <vector>

#include "kernels/cuda/xxh3.cuh"

TEST_CASE("device xxh3: equals libxxhash at every length class and alignment") {
  std::mt19937_64 rng(20261205);
  std::vector<uint8_t> buf(300000 + 8);
  for (auto& b : buf) b = uint8_t(rng());
  int bad = 0;
  for (size_t off : {size_t(0), size_t(3)})
    for (size_t len = 0; len <= 2200; ++len)
      if (cleave::xxh3::xxh3_64(buf.data() + off, len) != XXH3_64bits(buf.data() + off, len)) ++bad;
  CHECK(bad == 0);
  for (size_t len : {size_t(1536), size_t(4096), size_t(65536), size_t(139264), size_t(300000)})
    CHECK(cleave::xxh3::xxh3_64(buf.data(), len) == XXH3_64bits(buf.data(), len));
}

TEST_CASE("device xxh3: a flipped bit anywhere changes the hash") {
  std::vector<uint8_t> buf(5000, 0x5a);
  const uint64_t h = cleave::xxh3::xxh3_64(buf.data(), buf.size());
  for (size_t at : {size_t(0), size_t(1023), size_t(1024), size_t(4999)}) {
    buf[at] ^= 0x10;
    CHECK(cleave::xxh3::xxh3_64(buf.data(), buf.size()) != h);
    buf[at] ^= 0x10;
  }
}
