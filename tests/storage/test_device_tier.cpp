// DeviceTier (tier 0 in backend memory) and pinned MemoryTier slabs from a
// Backend, driven through the CPU backend, whose "device" memory is host
// memory the test can corrupt directly.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <set>

#include "kernels/backend.h"
#include "kernels/forwarding_backend.h"
#include "storage/device_tier.h"
#include "storage/memory_tier.h"
#include "storage/tiered_store.h"

namespace cleave {
namespace {

constexpr uint64_t kFp = 0xDE71CEull;

KvLayout layout() {
  KvLayout l;
  l.tokens_per_block = 4;
  l.n_layers = 2;
  l.n_kv_heads = 2;
  l.head_dim = 8;
  return l;  // 2 * 2 * 2 * 4 * 8 * 4 = 1024 bytes per block
}
constexpr size_t kB = 1024;

BlockKey key(uint64_t i) { return BlockKey{i * 0x9E3779B97F4A7C15ull + 3, i}; }

BlockRecord rec(uint64_t i) {
  BlockRecord r;
  r.header.key = key(i);
  r.header.model_fingerprint = kFp;
  r.header.layout = layout();
  r.header.n_tokens = 4;
  r.bytes.resize(kB);
  auto* f = reinterpret_cast<float*>(r.bytes.data());
  for (size_t e = 0; e < kB / 4; ++e) f[e] = float(i * 1000 + e) * 0.5f;
  seal(r);
  return r;
}

// The CPU backend, counting pinned host allocations.
class CountingBackend final : public ForwardingBackend {
 public:
  CountingBackend() : ForwardingBackend(make_cpu_backend(1)) {}
  int pinned_allocs = 0, pinned_frees = 0;

  void* alloc_pinned_host(size_t bytes) override {
    ++pinned_allocs;
    return ForwardingBackend::alloc_pinned_host(bytes);
  }
  void free_pinned_host(void* p) override {
    ++pinned_frees;
    ForwardingBackend::free_pinned_host(p);
  }
};

std::unique_ptr<DeviceTier> device_tier(Backend& b, size_t blocks) {
  auto t = DeviceTier::create(b, blocks * kB, kFp, layout());
  REQUIRE(t.ok());
  return std::move(t.value());
}

TEST_CASE("device tier: bad capacity and layout are typed errors") {
  auto cpu = make_cpu_backend(1);
  CHECK(DeviceTier::create(*cpu, 0, kFp, layout()).status().code() == Code::invalid_argument);
  CHECK(DeviceTier::create(*cpu, kB - 1, kFp, layout()).status().code() ==
        Code::invalid_argument);
  KvLayout bad = layout();
  bad.n_layers = 0;
  CHECK(DeviceTier::create(*cpu, 4 * kB, kFp, bad).status().code() == Code::invalid_argument);
}

TEST_CASE("device tier: round trip, capacity, slot reuse, verify on the way in") {
  auto cpu = make_cpu_backend(1);
  auto t = device_tier(*cpu, 3);
  CHECK(t->capacity_bytes() == 3 * kB);
  for (uint64_t i = 0; i < 3; ++i) REQUIRE(t->insert(rec(i)).ok());
  CHECK(t->insert(rec(0)).ok());  // identical: no-op
  CHECK(t->usage_bytes() == 3 * kB);
  CHECK(t->insert(rec(3)).code() == Code::out_of_memory);
  std::set<int32_t> slots;
  for (uint64_t i = 0; i < 3; ++i) slots.insert(*t->slot_of(key(i)));
  CHECK(slots == std::set<int32_t>{0, 1, 2});
  const int32_t freed = *t->slot_of(key(1));
  REQUIRE(t->erase(key(1)).ok());
  CHECK(t->erase(key(1)).code() == Code::not_found);
  CHECK(t->slot_of(key(1)).status().code() == Code::not_found);
  REQUIRE(t->insert(rec(3)).ok());
  CHECK(*t->slot_of(key(3)) == freed);
  for (uint64_t i : {0, 2, 3}) {
    auto r = t->lookup(key(i));
    REQUIRE(r.ok());
    CHECK(r->bytes == rec(i).bytes);
    CHECK(r->header.checksum == rec(i).header.checksum);
  }
  BlockRecord bad = rec(9);
  bad.bytes[5] ^= 1;
  REQUIRE(t->erase(key(0)).ok());
  CHECK(t->insert(bad).code() == Code::corruption);
  BlockRecord foreign = rec(9);
  foreign.header.model_fingerprint = 1;
  CHECK(t->insert(foreign).code() == Code::corruption);
  CHECK(t->block_count() == 2);
}

TEST_CASE("device tier: blocks sit where the attention kernels address them (PagedKv)") {
  auto cpu = make_cpu_backend(1);
  auto t = device_tier(*cpu, 4);
  for (uint64_t i = 0; i < 4; ++i) REQUIRE(t->insert(rec(i)).ok());
  const PagedKv kv = t->paged_kv();
  CHECK(kv.n_blocks == 4);
  CHECK(kv.block_bytes() == kB);
  for (uint64_t i = 0; i < 4; ++i) {
    const int32_t slot = *t->slot_of(key(i));
    CHECK(std::memcmp(kv.data + kv.offset(slot, 0, 0, 0, 0), rec(i).bytes.data(), kB) == 0);
    // Element [layer 1][v][head 1][token 2][dim 5] of the record, by the
    // KvLayout order, is the kernels' offset() of the same coordinates.
    const size_t e = ((((1 * 2 + 1) * 2 + 1) * 4 + 2) * 8 + 5);
    CHECK(std::memcmp(kv.data + kv.offset(slot, 1, 1, 1, 2) + 5 * 4, rec(i).bytes.data() + e * 4, 4) == 0);
  }
}

TEST_CASE("device tier: every bit flipped in backend memory is detected on lookup and read") {
  auto cpu = make_cpu_backend(1);
  const size_t n = 64;
  auto t = device_tier(*cpu, n);
  for (uint64_t i = 0; i < n; ++i) REQUIRE(t->insert(rec(i)).ok());
  // The CPU backend's memory is host memory: corrupt it behind the tier's back.
  auto* arena = reinterpret_cast<uint8_t*>(t->paged_kv().data);
  for (uint64_t i = 0; i < n; ++i) {
    const size_t bit = (i * 997 + 13) % (kB * 8);
    arena[size_t(*t->slot_of(key(i))) * kB + bit / 8] ^= uint8_t(1u << (bit % 8));
  }
  for (uint64_t i = 0; i < n; ++i) {
    Status st = i % 2 ? t->lookup(key(i)).status()
                      : t->read(key(i), [](const BlockView&) { return Status::Ok(); });
    CHECK(st.code() == Code::corruption);
    CHECK(!t->contains(key(i)));
  }
  CHECK(t->corrupt_detected() == n);
  CHECK(t->usage_bytes() == 0);
}

TEST_CASE("pinned memory tier: slabs come from the backend's pinned host allocator") {
  CountingBackend b;
  CHECK(MemoryTier::create(MemoryKind::host_arena, 4 * kB, kFp, layout(), &b).status().code() ==
        Code::invalid_argument);
  {
    auto t = MemoryTier::create(MemoryKind::pinned_host, 4 * kB, kFp, layout(), &b);
    REQUIRE(t.ok());
    MemoryTier& tier = **t;
    for (uint64_t i = 0; i < 4; ++i) REQUIRE(tier.insert(rec(i)).ok());
    CHECK(b.pinned_allocs == 4);
    for (uint64_t i = 0; i < 4; ++i) REQUIRE(tier.erase(key(i)).ok());
    for (uint64_t i = 4; i < 8; ++i) REQUIRE(tier.insert(rec(i)).ok());
    CHECK(b.pinned_allocs == 4);  // recycled, not reallocated
    auto r = tier.lookup(key(5));
    REQUIRE(r.ok());
    CHECK(r->bytes == rec(5).bytes);
    CHECK(b.pinned_frees == 0);
  }
  CHECK(b.pinned_frees == 4);  // the destructor returns every slab
}

TEST_CASE("tiered store: device tier 0 over the CPU backend, pinned tier 1, verified hops") {
  CountingBackend b;
  std::vector<std::unique_ptr<Tier>> tiers;
  auto t0 = DeviceTier::create(b, 2 * kB, kFp, layout());
  auto t1 = MemoryTier::create(MemoryKind::pinned_host, 2 * kB, kFp, layout(), &b);
  auto t2 = MemoryTier::create(MemoryKind::host_arena, 8 * kB, kFp, layout());
  REQUIRE((t0.ok() && t1.ok() && t2.ok()));
  DeviceTier* dev = t0->get();
  tiers.push_back(std::move(t0.value()));
  tiers.push_back(std::move(t1.value()));
  tiers.push_back(std::move(t2.value()));
  auto made = TieredStore::create(std::move(tiers), kFp, layout());
  REQUIRE(made.ok());
  TieredStore& s = **made;
  for (uint64_t i = 0; i < 6; ++i) REQUIRE(s.put(rec(i)).ok());
  CHECK(s.tier_of(key(5)) == 0);
  CHECK(s.tier_of(key(3)) == 1);
  CHECK(s.tier_of(key(0)) == 2);
  auto c = s.counters();
  CHECK(c.demotions[0] == 4);  // 0..3 left the device
  CHECK(c.demotions[1] == 2);  // 0..1 went on to tier 2
  auto r = s.get(key(0));  // promoted 2 -> 1 -> 0, two victims demoted
  REQUIRE(r.ok());
  CHECK(r->bytes == rec(0).bytes);
  CHECK(s.tier_of(key(0)) == 0);
  c = s.counters();
  CHECK(c.promotions[1] == 1);
  CHECK(c.promotions[0] == 1);
  // A block demoted from the device is checked after the download: a flip in
  // device memory never reaches tier 1.
  const int32_t slot = *dev->slot_of(key(5));
  reinterpret_cast<uint8_t*>(dev->paged_kv().data)[size_t(slot) * kB + 17] ^= 0x20;
  for (uint64_t i = 6; i < 8; ++i) REQUIRE(s.put(rec(i)).ok());  // pushes 5 and 0 off the device
  c = s.counters();
  CHECK(c.corrupt_detected == 1);
  CHECK(!s.contains(key(5)));
  for (uint64_t i : {0, 1, 2, 3, 4, 6, 7}) {
    auto g = s.get(key(i));
    REQUIRE(g.ok());
    CHECK(g->bytes == rec(i).bytes);
  }
  CHECK(s.counters().corrupt_detected == 1);
}

}  // namespace
}  // namespace cleave
