#include <doctest/doctest.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "storage/checksum_simd.h"
#include "storage/lru_policy.h"
#include "storage/memory_tier.h"

namespace cleave {
namespace {

constexpr uint64_t kModelFp = 0xC1EA7Eull;

KvLayout small_layout() {
  KvLayout l;
  l.tokens_per_block = 4;
  l.n_layers = 1;
  l.n_kv_heads = 1;
  l.head_dim = 8;
  return l;  // 256 bytes per block
}

BlockRecord make_record(uint64_t i, const KvLayout& l = small_layout()) {
  BlockRecord r;
  r.header.key = BlockKey{i * 0x9E37ull + 1, i};
  r.header.model_fingerprint = kModelFp;
  r.header.layout = l;
  r.header.n_tokens = uint32_t(l.tokens_per_block);
  r.bytes.resize(l.block_bytes());
  for (size_t b = 0; b < r.bytes.size(); ++b) r.bytes[b] = uint8_t(i * 31 + b * 7);
  seal(r);
  return r;
}

std::unique_ptr<MemoryTier> tier_of_blocks(size_t n, MemoryKind kind = MemoryKind::host_arena) {
  auto t = MemoryTier::create(kind, n * small_layout().block_bytes(), kModelFp, small_layout());
  REQUIRE(t.ok());
  return std::move(t.value());
}

TEST_CASE("memory tier: zero capacity and bad layout are invalid_argument") {
  auto t = MemoryTier::create(MemoryKind::pinned_host, 0, kModelFp, small_layout());
  CHECK(t.status().code() == Code::invalid_argument);
  KvLayout bad = small_layout();
  bad.head_dim = 0;
  CHECK(MemoryTier::create(MemoryKind::host_arena, 4096, kModelFp, bad).status().code() ==
        Code::invalid_argument);
}

TEST_CASE("memory tier: insert, lookup, capacity, usage, erase") {
  auto t = tier_of_blocks(2, MemoryKind::pinned_host);
  CHECK(std::string(t->name()) == "pinned-host");
  CHECK(t->capacity_bytes() == 512);
  CHECK(t->usage_bytes() == 0);
  REQUIRE(t->insert(make_record(1)).ok());
  CHECK(t->insert(make_record(1)).ok());  // identical: no-op
  CHECK(t->usage_bytes() == 256);
  REQUIRE(t->insert(make_record(2)).ok());
  CHECK(t->usage_bytes() == 512);
  CHECK(t->insert(make_record(3)).code() == Code::out_of_memory);
  auto r = t->lookup(make_record(2).header.key);
  REQUIRE(r.ok());
  CHECK(r->bytes == make_record(2).bytes);
  CHECK(r->header.checksum == make_record(2).header.checksum);
  CHECK(t->contains(make_record(1).header.key));
  CHECK(t->erase(make_record(1).header.key).ok());
  CHECK(t->erase(make_record(1).header.key).code() == Code::not_found);
  CHECK(t->lookup(make_record(1).header.key).status().code() == Code::not_found);
  CHECK(t->usage_bytes() == 256);
  CHECK(t->block_count() == 1);
}

TEST_CASE("memory tier: rejects records that fail verify on insert") {
  auto t = tier_of_blocks(4);
  BlockRecord r = make_record(5);
  r.bytes[3] ^= 1;
  CHECK(t->insert(r).code() == Code::corruption);
  BlockRecord foreign = make_record(6);
  foreign.header.model_fingerprint = 42;
  CHECK(t->insert(foreign).code() == Code::corruption);
  KvLayout other = small_layout();
  other.head_dim = 16;
  CHECK(t->insert(make_record(7, other)).code() == Code::corruption);
  CHECK(t->usage_bytes() == 0);
}

TEST_CASE("memory tier: every flipped bit is detected on lookup and the entry dropped") {
  for (MemoryKind kind : {MemoryKind::host_arena, MemoryKind::pinned_host}) {
    const size_t n = 64;
    auto t = tier_of_blocks(n, kind);
    for (uint64_t i = 0; i < n; ++i) REQUIRE(t->insert(make_record(i)).ok());
    for (uint64_t i = 0; i < n; ++i)
      REQUIRE(t->flip_bit_for_test(make_record(i).header.key, i * 997 + 13).ok());
    for (uint64_t i = 0; i < n; ++i) {
      auto r = t->lookup(make_record(i).header.key);
      CHECK(r.status().code() == Code::corruption);
      CHECK(!t->contains(make_record(i).header.key));
    }
    CHECK(t->corrupt_detected() == n);
    CHECK(t->usage_bytes() == 0);
  }
}

TEST_CASE("checksum: the dispatched XXH3-64 equals libxxhash's for every length and alignment") {
  // Independent reference: the shared library's own XXH3_64bits.
  std::vector<uint8_t> buf(70000 + 64);
  uint64_t x = 88172645463325252ull;
  for (auto& b : buf) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = uint8_t(x);
  }
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 1100; ++n) lengths.push_back(n);  // every XXH3 size class edge
  for (size_t n : {4095, 4096, 4097, 16384, 32768, 65536, 70000}) lengths.push_back(n);
  // The AVX2 build where the CPU has it, and the dispatched one.
  std::vector<const detail::Xxh3Impl*> builds;
  if (__builtin_cpu_supports("avx2")) builds.push_back(&detail::xxh3_avx2);
  for (size_t off : {0, 1, 7, 63})
    for (size_t n : lengths) {
      const uint8_t* p = buf.data() + off;
      const uint64_t want = XXH3_64bits(p, n);
      REQUIRE(checksum_bytes(p, n) == want);
      for (const detail::Xxh3Impl* b : builds) REQUIRE(b->oneshot(p, n) == want);
    }
}

TEST_CASE("checksum: a stream over pieces equals libxxhash's XXH3-64 of the whole") {
  std::vector<uint8_t> buf(300000);
  uint64_t x = 2463534242ull;
  for (auto& b : buf) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = uint8_t(x);
  }
  ChecksumStream stream;
  // Piece sizes across XXH3's internal buffer (256 B) and stripe edges.
  for (size_t piece : {1, 63, 64, 255, 256, 257, 1024, 4097, 131072, 300000}) {
    for (size_t total : {0, 1, 240, 241, 1000, 65536, 300000}) {
      stream.reset();
      for (size_t at = 0; at < total; at += piece)
        stream.update(buf.data() + at, std::min(piece, total - at));
      REQUIRE(stream.digest() == XXH3_64bits(buf.data(), total));
    }
  }
  ChecksumStream moved = std::move(stream);  // the state moves with it
  moved.reset();
  moved.update(buf.data(), 5);
  CHECK(moved.digest() == XXH3_64bits(buf.data(), 5));
}

TEST_CASE("memory tier: erased slabs are reused, bounded by capacity") {
  const size_t n = 8;
  auto t = tier_of_blocks(n);
  for (uint64_t i = 0; i < n; ++i) REQUIRE(t->insert(make_record(i)).ok());
  CHECK(t->free_slabs() == 0);
  for (uint64_t i = 0; i < n; ++i) REQUIRE(t->erase(make_record(i).header.key).ok());
  CHECK(t->free_slabs() == n);  // kept for the next inserts
  for (uint64_t i = 100; i < 100 + n / 2; ++i) REQUIRE(t->insert(make_record(i)).ok());
  CHECK(t->free_slabs() == n / 2);
  CHECK(t->free_slabs() + t->block_count() <= n);
  // A reused slab holds exactly the new record (no leftovers of the old one).
  for (uint64_t i = 100; i < 100 + n / 2; ++i) {
    auto r = t->lookup(make_record(i).header.key);
    REQUIRE(r.ok());
    CHECK(r->bytes == make_record(i).bytes);
  }
  // A rejected insert (bad checksum found after the copy) returns its slab.
  BlockRecord bad = make_record(200);
  bad.bytes[9] ^= 4;
  CHECK(t->insert(bad).code() == Code::corruption);
  CHECK(!t->contains(bad.header.key));
  CHECK(t->free_slabs() == n / 2);
  t->release_free_slabs();
  CHECK(t->free_slabs() == 0);
  CHECK(t->block_count() == n / 2);
}

TEST_CASE("move_block: one hop copies, verifies and erases, a bad source is refused") {
  auto from = tier_of_blocks(4, MemoryKind::pinned_host);
  auto to = tier_of_blocks(2);
  for (uint64_t i = 0; i < 4; ++i) REQUIRE(from->insert(make_record(i)).ok());
  REQUIRE(move_block(*from, *to, make_record(0).header.key).ok());
  CHECK(!from->contains(make_record(0).header.key));
  auto r = to->lookup(make_record(0).header.key);
  REQUIRE(r.ok());
  CHECK(r->bytes == make_record(0).bytes);
  CHECK(r->header.checksum == make_record(0).header.checksum);
  // Every flipped bit in the source is caught by the receiving tier's hash:
  // nothing lands in `to`, the source is left for its owner to drop.
  for (size_t bit : {0, 7, 1000, 2047}) {
    REQUIRE(from->flip_bit_for_test(make_record(1).header.key, bit).ok());
    CHECK(move_block(*from, *to, make_record(1).header.key).code() == Code::corruption);
    CHECK(!to->contains(make_record(1).header.key));
    CHECK(from->contains(make_record(1).header.key));
    REQUIRE(from->flip_bit_for_test(make_record(1).header.key, bit).ok());  // undo
  }
  CHECK(to->usage_bytes() == 256);
  REQUIRE(move_block(*from, *to, make_record(1).header.key).ok());
  // Full destination: out_of_memory, the source keeps the block.
  CHECK(move_block(*from, *to, make_record(2).header.key).code() == Code::out_of_memory);
  CHECK(from->contains(make_record(2).header.key));
  CHECK(move_block(*from, *to, BlockKey{1, 2}).code() == Code::not_found);
}

TEST_CASE("memory tier: threads inserting, moving, reading and erasing the same keys") {
  // Slabs cycle through the free lists of both tiers while readers copy out.
  const uint64_t n_keys = 16;
  auto from = tier_of_blocks(n_keys, MemoryKind::pinned_host);
  auto to = tier_of_blocks(n_keys / 2);
  std::vector<BlockRecord> records;
  for (uint64_t i = 0; i < n_keys; ++i) records.push_back(make_record(i));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (unsigned w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (int round = 0; round < 300; ++round)
        for (uint64_t i = w; i < n_keys; i += 2) {
          const BlockRecord& r = records[i];
          Status st = from->insert(r);
          if (!st.ok() && st.code() != Code::out_of_memory) ++failures;
          st = move_block(*from, *to, r.header.key);
          if (!st.ok() && st.code() != Code::out_of_memory && st.code() != Code::not_found)
            ++failures;
          for (MemoryTier* t : {from.get(), to.get()}) {
            auto got = t->lookup(r.header.key);
            if (got.ok() ? got->bytes != r.bytes : got.status().code() != Code::not_found)
              ++failures;
          }
          if ((round + w) % 3 == 0) (void)to->erase(r.header.key);
        }
    });
  for (auto& t : threads) t.join();
  CHECK(failures.load() == 0);
  CHECK(from->corrupt_detected() + to->corrupt_detected() == 0);
  CHECK(from->free_slabs() + from->block_count() <= n_keys);
  CHECK(to->free_slabs() + to->block_count() <= n_keys / 2);
}

TEST_CASE("lru policy: victims are least recently used, unpinned, enough bytes") {
  LruPolicy p(2);
  auto k = [](uint64_t i) { return BlockKey{i, 0}; };
  for (uint64_t i = 0; i < 4; ++i) p.add(0, k(i), 100);
  p.touch(k(0));  // order now 1 2 3 0
  auto v = p.victims(0, 150);
  REQUIRE(v);
  REQUIRE(v->size() == 2);
  CHECK((*v)[0] == k(1));
  CHECK((*v)[1] == k(2));
  p.pin(k(1));
  v = p.victims(0, 100);
  REQUIRE(v);
  CHECK(v->front() == k(2));
  CHECK(p.victims(0, 0)->empty());
  CHECK(!p.victims(0, 301));  // only 3 unpinned blocks
  for (uint64_t i = 0; i < 4; ++i) p.pin(k(i));
  CHECK(!p.victims(0, 1));
  CHECK(p.pin_count(k(1)) == 2);
  CHECK(p.unpin(k(1)));
  CHECK(p.unpin(k(1)));
  CHECK(!p.unpin(k(1)));
  p.remove(0, k(3));
  CHECK(p.tracked_bytes(0) == 300);
  CHECK(!p.tracked(0, k(3)));
  CHECK(p.order(1).empty());
}

}  // namespace
}  // namespace cleave
