#include <doctest/doctest.h>

#include <cstdint>

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
