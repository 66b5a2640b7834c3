#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <unistd.h>
#include <thread>

#include "storage/memory_tier.h"
#include "storage/rocksdb_tier.h"
#include "storage/tiered_store.h"

namespace cleave {
namespace {

constexpr uint64_t kFp = 0x5EEDull;

KvLayout layout() {
  KvLayout l;
  l.tokens_per_block = 4;
  l.n_layers = 1;
  l.n_kv_heads = 1;
  l.head_dim = 8;
  return l;  // 256 bytes per block
}
constexpr size_t kB = 256;

BlockKey key(uint64_t i) { return BlockKey{i * 0x9E3779B97F4A7C15ull + 7, i}; }

BlockRecord rec(uint64_t i) {
  BlockRecord r;
  r.header.key = key(i);
  r.header.model_fingerprint = kFp;
  r.header.layout = layout();
  r.header.n_tokens = 4;
  r.bytes.resize(kB);
  for (size_t b = 0; b < kB; ++b) r.bytes[b] = uint8_t(i * 131 + b * 3 + (i >> 8));
  seal(r);
  return r;
}

struct Fixture {
  MemoryTier* t0 = nullptr;
  MemoryTier* t1 = nullptr;
  MemoryTier* t2 = nullptr;
  std::unique_ptr<TieredStore> store;

  // Capacities in blocks; three memory tiers (tier 2 stands in for RocksDB).
  Fixture(size_t c0, size_t c1, size_t c2, TieredStoreOptions o = {}) {
    std::vector<std::unique_ptr<Tier>> tiers;
    auto a = MemoryTier::create(MemoryKind::host_arena, c0 * kB, kFp, layout());
    auto b = MemoryTier::create(MemoryKind::pinned_host, c1 * kB, kFp, layout());
    auto c = MemoryTier::create(MemoryKind::pinned_host, c2 * kB, kFp, layout());
    REQUIRE((a.ok() && b.ok() && c.ok()));
    t0 = a->get();
    t1 = b->get();
    t2 = c->get();
    tiers.push_back(std::move(a.value()));
    tiers.push_back(std::move(b.value()));
    tiers.push_back(std::move(c.value()));
    auto s = TieredStore::create(std::move(tiers), kFp, layout(), o);
    REQUIRE(s.ok());
    store = std::move(s.value());
  }
};

TEST_CASE("tiered store: bad construction is invalid_argument") {
  CHECK(TieredStore::create({}, kFp, layout()).status().code() == Code::invalid_argument);
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(nullptr);
  CHECK(TieredStore::create(std::move(tiers), kFp, layout()).status().code() ==
        Code::invalid_argument);
}

TEST_CASE("tiered store: demotion follows LRU order 0 -> 1 -> 2, then drops") {
  Fixture f(2, 2, 2);
  auto& s = *f.store;
  for (uint64_t i = 0; i < 2; ++i) REQUIRE(s.put(rec(i)).ok());
  REQUIRE(s.get(key(0)).ok());  // 0 becomes most recent: 1 is the LRU
  REQUIRE(s.put(rec(2)).ok());
  CHECK(s.tier_of(key(1)) == 1);
  CHECK(s.tier_of(key(0)) == 0);
  CHECK(s.tier_of(key(2)) == 0);
  REQUIRE(s.put(rec(3)).ok());  // demotes 0
  CHECK(s.tier_of(key(0)) == 1);
  REQUIRE(s.put(rec(4)).ok());  // demotes 2; tier 1 full -> 1 (its LRU) to tier 2
  CHECK(s.tier_of(key(2)) == 1);
  CHECK(s.tier_of(key(1)) == 2);
  for (uint64_t i = 5; i < 8; ++i) REQUIRE(s.put(rec(i)).ok());
  // 8 blocks, 6 slots: the two oldest in tier 2 (1 then 0) were dropped.
  CHECK(s.tier_of(key(1)) == -1);
  CHECK(s.tier_of(key(0)) == -1);
  CHECK(f.t0->usage_bytes() == 2 * kB);
  CHECK(f.t1->usage_bytes() == 2 * kB);
  CHECK(f.t2->usage_bytes() == 2 * kB);
  auto c = s.counters();
  CHECK(c.puts == 8);
  CHECK(c.demotions[0] == 6);
  CHECK(c.demotions[1] == 4);
  CHECK(c.drops == 2);
  CHECK(c.hits[0] == 1);
  CHECK(c.misses == 0);
  CHECK(s.get(key(0)).status().code() == Code::not_found);
  CHECK(s.counters().misses == 1);
}

TEST_CASE("tiered store: a hit in tier 2 is promoted 2 -> 1 -> 0 with exact hop counters") {
  Fixture f(2, 2, 4);
  auto& s = *f.store;
  for (uint64_t i = 0; i < 6; ++i) REQUIRE(s.put(rec(i)).ok());
  // tier 0: 4 5, tier 1: 2 3, tier 2: 0 1
  REQUIRE(s.tier_of(key(0)) == 2);
  auto before = s.counters();
  CHECK(before.demotions[0] == 4);
  CHECK(before.demotions[1] == 2);
  auto r = s.get(key(0));
  REQUIRE(r.ok());
  CHECK(r->bytes == rec(0).bytes);
  CHECK(s.tier_of(key(0)) == 0);
  auto c = s.counters();
  CHECK(c.hits[2] == 1);
  CHECK(c.promotions[1] == 1);  // 2 -> 1
  CHECK(c.promotions[0] == 1);  // 1 -> 0
  // Room was made: 2 -> 1 demoted block 2 (1 -> 2); 1 -> 0 demoted block 4
  // (0 -> 1), which in turn demoted block 3 (1 -> 2).
  CHECK(c.demotions[1] == 4);
  CHECK(c.demotions[0] == 5);
  CHECK(s.tier_of(key(2)) == 2);
  CHECK(s.tier_of(key(3)) == 2);
  CHECK(s.tier_of(key(4)) == 1);
  CHECK(s.tier_of(key(5)) == 0);
  CHECK(c.drops == 0);
  // A tier-1 hit: one promotion 1 -> 0, which demotes the LRU of tier 0 (5).
  REQUIRE(s.get(key(4)).ok());
  c = s.counters();
  CHECK(c.hits[1] == 1);
  CHECK(c.promotions[0] == 2);
  CHECK(c.promotions[1] == 1);
  CHECK(c.demotions[0] == 6);
  CHECK(s.tier_of(key(4)) == 0);
  CHECK(s.tier_of(key(5)) == 1);
  size_t total = f.t0->block_count() + f.t1->block_count() + f.t2->block_count();
  CHECK(total == 6);
}

TEST_CASE("tiered store: pinned blocks are never evicted, all pinned -> out_of_memory") {
  Fixture f(2, 1, 1);
  auto& s = *f.store;
  REQUIRE(s.put(rec(0)).ok());
  REQUIRE(s.put(rec(1)).ok());
  s.pin(key(0));
  for (uint64_t i = 2; i < 10; ++i) REQUIRE(s.put(rec(i)).ok());
  CHECK(s.tier_of(key(0)) == 0);
  s.pin(key(9));
  CHECK(s.put(rec(10)).code() == Code::out_of_memory);
  CHECK(s.tier_of(key(0)) == 0);
  CHECK(s.tier_of(key(9)) == 0);
  CHECK(s.unpin(key(9)).ok());
  CHECK(s.unpin(key(9)).code() == Code::invalid_argument);
  CHECK(s.put(rec(10)).ok());
  CHECK(s.tier_of(key(0)) == 0);
  CHECK(s.tier_of(key(9)) == 1);
  // A pinned block in tier 1 is not demoted either.
  s.pin(key(9));
  CHECK(s.put(rec(11)).code() == Code::out_of_memory);  // 10 must go to tier 1: full and pinned
  CHECK(s.tier_of(key(9)) == 1);
}

TEST_CASE("tiered store: duplicate put is a no-op, bad records are rejected") {
  Fixture f(4, 4, 4);
  auto& s = *f.store;
  REQUIRE(s.put(rec(1)).ok());
  const uint64_t v = s.version(key(1));
  CHECK(v > 0);
  REQUIRE(s.put(rec(1)).ok());
  CHECK(s.version(key(1)) == v);
  CHECK(s.counters().put_duplicates == 1);
  CHECK(f.t0->block_count() == 1);
  BlockRecord bad = rec(2);
  bad.bytes[0] ^= 0x80;
  CHECK(s.put(bad).code() == Code::corruption);
  BlockRecord foreign = rec(3);
  foreign.header.model_fingerprint = 1;
  CHECK(s.put(foreign).code() == Code::corruption);
  CHECK(!s.contains(key(2)));
}

TEST_CASE("tiered store: bit flips in tier 0 and tier 1 are 100% detected") {
  const uint64_t n = 32;
  Fixture f(n, n, n);
  auto& s = *f.store;
  for (uint64_t i = 0; i < 2 * n; ++i) REQUIRE(s.put(rec(i)).ok());
  // 0..n-1 in tier 1, n..2n-1 in tier 0.
  for (uint64_t i = 0; i < 2 * n; ++i) {
    MemoryTier* t = s.tier_of(key(i)) == 0 ? f.t0 : f.t1;
    REQUIRE(s.tier_of(key(i)) == (i < n ? 1 : 0));
    REQUIRE(t->flip_bit_for_test(key(i), i * 7919 + 5).ok());
  }
  for (uint64_t i = 0; i < 2 * n; ++i) {
    auto r = s.get(key(i));
    CHECK(r.status().code() == Code::not_found);  // never wrong bytes
    CHECK(!s.contains(key(i)));
  }
  auto c = s.counters();
  CHECK(c.corrupt_detected == 2 * n);
  CHECK(c.misses == 2 * n);
  CHECK(c.hits[0] + c.hits[1] + c.hits[2] == 0);
  CHECK(f.t0->usage_bytes() == 0);
  CHECK(f.t1->usage_bytes() == 0);
  // The caller recomputes and re-puts: good again.
  REQUIRE(s.put(rec(3)).ok());
  auto r = s.get(key(3));
  REQUIRE(r.ok());
  CHECK(r->bytes == rec(3).bytes);
}

TEST_CASE("tiered store: a corrupt block met during demotion is dropped, not propagated") {
  Fixture f(1, 1, 1);
  auto& s = *f.store;
  REQUIRE(s.put(rec(0)).ok());
  REQUIRE(f.t0->flip_bit_for_test(key(0), 3).ok());
  REQUIRE(s.put(rec(1)).ok());  // demotion of 0 detects the flip
  auto c = s.counters();
  CHECK(c.corrupt_detected == 1);
  CHECK(c.demotions[0] == 0);
  CHECK(!s.contains(key(0)));
  CHECK(f.t1->usage_bytes() == 0);
}

TEST_CASE("tiered store: bounded hop budget answers busy") {
  TieredStoreOptions o;
  o.max_sync_hops = 1;
  Fixture f(1, 1, 4, o);
  auto& s = *f.store;
  REQUIRE(s.put(rec(0)).ok());
  REQUIRE(s.put(rec(1)).ok());               // one hop: 0 -> tier 1
  CHECK(s.put(rec(2)).code() == Code::busy);  // needs 0->1 and 1->2
  CHECK(s.counters().budget_exhausted == 1);
}

TEST_CASE("tiered store: background prefetch promotes, full queue drops and counts") {
  TieredStoreOptions o;
  o.background = true;
  o.queue_capacity = 2;
  Fixture f(2, 2, 8, o);
  auto& s = *f.store;
  for (uint64_t i = 0; i < 8; ++i) REQUIRE(s.put(rec(i)).ok());
  REQUIRE(s.tier_of(key(0)) == 2);
  REQUIRE(s.prefetch(key(0)).ok());
  s.drain();
  CHECK(s.tier_of(key(0)) == 0);
  CHECK(s.counters().promotions[0] == 1);
  uint64_t ok = 0, full = 0;
  for (int i = 0; i < 100; ++i) {
    Status st = s.prefetch(key(1 + i % 3));
    (st.ok() ? ok : full)++;
    if (!st.ok()) CHECK(st.code() == Code::busy);
  }
  s.drain();
  CHECK(s.counters().queue_full == full);
  CHECK(ok + full == 100);
  Fixture g(1, 1, 1);
  CHECK(g.store->prefetch(key(0)).code() == Code::unavailable);
}

TEST_CASE("tiered store: concurrent writers racing on one key: one wins, the rest drop their copy") {
  Fixture f(64, 8, 8);
  auto& s = *f.store;
  const unsigned n_threads = 8;
  for (uint64_t round = 0; round < 50; ++round) {
    const BlockRecord r = rec(1000 + round);
    std::atomic<unsigned> ready{0};
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < n_threads; ++t)
      threads.emplace_back([&] {
        ++ready;
        while (ready.load() < n_threads) std::this_thread::yield();
        CHECK(s.put(r).ok());
      });
    for (auto& t : threads) t.join();
  }
  auto c = s.counters();
  CHECK(c.puts == 50 * n_threads);
  CHECK(c.put_duplicates == 50 * (n_threads - 1));
  CHECK(f.t0->block_count() == 50);
  for (uint64_t round = 0; round < 50; ++round) {
    auto r = s.get(key(1000 + round));
    REQUIRE(r.ok());
    CHECK(r->bytes == rec(1000 + round).bytes);
  }
}

TEST_CASE("tiered store: concurrent put/get on overlapping keys never tears or fails verify") {
  TieredStoreOptions o;
  o.background = true;
  o.async_promotion = true;
  o.queue_capacity = 8;
  Fixture f(8, 8, 16, o);  // 32 slots for 48 keys: constant migration and drops
  auto& s = *f.store;
  const uint64_t n_keys = 48;
  std::vector<BlockRecord> records;
  for (uint64_t i = 0; i < n_keys; ++i) records.push_back(rec(i));
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> got{0}, bad{0}, errors{0};
  auto worker = [&](unsigned seed) {
    uint64_t x = seed * 2654435761u + 1;
    while (!stop.load(std::memory_order_relaxed)) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const uint64_t i = (x >> 33) % n_keys;
      if ((x >> 20) & 1) {
        Status st = s.put(records[i]);
        if (!st.ok() && st.code() != Code::out_of_memory && st.code() != Code::busy) ++errors;
      } else {
        auto r = s.get(key(i));
        if (r.ok()) {
          ++got;
          if (!verify(*r, kFp, layout()).ok() || r->bytes != records[i].bytes) ++bad;
        } else if (r.status().code() != Code::not_found) {
          ++errors;
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 6; ++t) threads.emplace_back(worker, t);
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  stop = true;
  for (auto& t : threads) t.join();
  s.drain();
  CHECK(got.load() > 0);
  CHECK(bad.load() == 0);
  CHECK(errors.load() == 0);
  auto c = s.counters();
  CHECK(c.corrupt_detected == 0);
  CHECK(c.put_duplicates > 0);
  // Each published key lives in exactly one tier.
  size_t live = 0;
  for (uint64_t i = 0; i < n_keys; ++i) {
    int where = s.tier_of(key(i));
    int copies = f.t0->contains(key(i)) + f.t1->contains(key(i)) + f.t2->contains(key(i));
    CHECK(copies == (where >= 0 ? 1 : 0));
    live += where >= 0;
  }
  CHECK(live == f.t0->block_count() + f.t1->block_count() + f.t2->block_count());
  MESSAGE("concurrency: gets ok " << got.load() << ", puts " << c.puts << ", dup " << c.put_duplicates
                                  << ", drops " << c.drops << ", queue_full " << c.queue_full);
}

TEST_CASE("tiered store: RocksDB as tier 2 (demote, drop, promote 2 -> 1 -> 0)") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() /
                       ("cleave_tiered_store_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  {
    std::vector<std::unique_ptr<Tier>> tiers;
    auto a = MemoryTier::create(MemoryKind::host_arena, 2 * kB, kFp, layout());
    auto b = MemoryTier::create(MemoryKind::pinned_host, 2 * kB, kFp, layout());
    RocksDbTierOptions ro;
    ro.capacity_bytes = 4 * (kB + kRecordHeaderBytes);  // 4 encoded blocks
    ro.sync = false;
    ro.model_fingerprint = kFp;
    ro.layout = layout();
    auto c = RocksDbTier::open(dir.string(), ro);
    REQUIRE((a.ok() && b.ok()));
    REQUIRE_MESSAGE(c.ok(), c.status().to_string());
    RocksDbTier* disk = c->get();
    tiers.push_back(std::move(a.value()));
    tiers.push_back(std::move(b.value()));
    tiers.push_back(std::move(c.value()));
    auto made = TieredStore::create(std::move(tiers), kFp, layout());
    REQUIRE(made.ok());
    auto& s = *made.value();
    for (uint64_t i = 0; i < 10; ++i) REQUIRE(s.put(rec(i)).ok());
    auto c0 = s.counters();
    CHECK(c0.demotions[0] == 8);
    CHECK(c0.demotions[1] == 6);
    CHECK(c0.drops == 2);
    CHECK(disk->size() == 4);
    CHECK(disk->usage_bytes() <= disk->capacity_bytes());
    REQUIRE(s.tier_of(key(2)) == 2);
    auto r = s.get(key(2));
    REQUIRE(r.ok());
    CHECK(r->bytes == rec(2).bytes);
    CHECK(s.tier_of(key(2)) == 0);
    auto c1 = s.counters();
    CHECK(c1.hits[2] == 1);
    CHECK(c1.promotions[1] == 1);
    CHECK(c1.promotions[0] == 1);
    CHECK(c1.corrupt_detected == 0);
    // While 2 moved up it still held its tier-2 slot, so making room for the
    // cascade (6 -> tier 2) dropped tier 2's LRU (3).
    CHECK(c1.drops == 3);
    CHECK(s.tier_of(key(3)) == -1);
    CHECK(disk->size() + s.tier(0).usage_bytes() / kB + s.tier(1).usage_bytes() / kB == 7);
  }
  fs::remove_all(dir);
}

// A store over fresh memory tiers (2 blocks each) and a RocksDbTier in `dir`
// holding 4 encoded blocks.
std::unique_ptr<TieredStore> disk_store(const std::string& dir, RocksDbTier** disk) {
  std::vector<std::unique_ptr<Tier>> tiers;
  auto a = MemoryTier::create(MemoryKind::host_arena, 2 * kB, kFp, layout());
  auto b = MemoryTier::create(MemoryKind::pinned_host, 2 * kB, kFp, layout());
  RocksDbTierOptions ro;
  ro.capacity_bytes = 4 * (kB + kRecordHeaderBytes);
  ro.sync = false;
  ro.model_fingerprint = kFp;
  ro.layout = layout();
  auto c = RocksDbTier::open(dir, ro);
  REQUIRE((a.ok() && b.ok()));
  REQUIRE_MESSAGE(c.ok(), c.status().to_string());
  *disk = c->get();
  tiers.push_back(std::move(a.value()));
  tiers.push_back(std::move(b.value()));
  tiers.push_back(std::move(c.value()));
  auto made = TieredStore::create(std::move(tiers), kFp, layout());
  REQUIRE(made.ok());
  return std::move(made.value());
}

TEST_CASE("tiered store: a restart adopts the blocks on disk (lookup, promote, evict)") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() /
                       ("cleave_tiered_restart_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  RocksDbTier* disk = nullptr;
  {  // first life: 8 puts leave 0..3 on disk, 4..5 in tier 1, 6..7 in tier 0
    auto s = disk_store(dir.string(), &disk);
    for (uint64_t i = 0; i < 8; ++i) REQUIRE(s->put(rec(i)).ok());
    auto c = s->counters();
    CHECK(c.demotions[0] == 6);
    CHECK(c.demotions[1] == 4);
    CHECK(c.drops == 0);
    for (uint64_t i = 0; i < 4; ++i) CHECK(s->tier_of(key(i)) == 2);
  }
  {  // second life: fresh memory tiers over the same directory
    auto s = disk_store(dir.string(), &disk);
    REQUIRE(disk->size() == 4);
    auto listed = disk->list();
    size_t listed_bytes = 0;
    for (const auto& [k, n] : listed) listed_bytes += n;
    CHECK(listed.size() == 4);
    CHECK(listed_bytes == disk->usage_bytes());
    for (uint64_t i = 0; i < 4; ++i) {
      CHECK(s->contains(key(i)));
      CHECK(s->tier_of(key(i)) == 2);
      CHECK(s->version(key(i)) != 0);
    }
    for (uint64_t i = 4; i < 8; ++i) {  // lived in memory only: gone
      CHECK_FALSE(s->contains(key(i)));
      CHECK(s->tier_of(key(i)) == -1);
    }
    CHECK(s->lru_order(2) == std::vector<BlockKey>{key(0), key(1), key(2), key(3)});  // key order
    CHECK(s->lru_order(0).empty());
    CHECK(s->lru_order(1).empty());

    auto r = s->get(key(1));
    REQUIRE(r.ok());
    CHECK(r->bytes == rec(1).bytes);
    CHECK(s->tier_of(key(1)) == 0);
    auto c1 = s->counters();
    CHECK(c1.hits[2] == 1);
    CHECK(c1.promotions[1] == 1);
    CHECK(c1.promotions[0] == 1);
    CHECK(c1.misses == 0);
    CHECK(disk->size() == 3);

    // New blocks push the cascade into a full tier 2: the adopted blocks are
    // eviction candidates (oldest first: 0, then 2), not out_of_memory.
    for (uint64_t i = 10; i < 16; ++i) REQUIRE_MESSAGE(s->put(rec(i)).ok(), i);
    auto c2 = s->counters();
    CHECK(c2.puts == 6);
    CHECK(c2.put_duplicates == 0);
    CHECK(c2.demotions[0] == 5);
    CHECK(c2.demotions[1] == 3);
    CHECK(c2.drops == 2);
    CHECK(c2.hits[2] == 1);
    CHECK(c2.promotions[1] == 1);
    CHECK(c2.promotions[0] == 1);
    CHECK(c2.misses == 0);
    CHECK(c2.corrupt_detected == 0);
    CHECK(c2.budget_exhausted == 0);
    CHECK(s->tier_of(key(0)) == -1);
    CHECK(s->tier_of(key(2)) == -1);
    CHECK(s->lru_order(2) == std::vector<BlockKey>{key(3), key(1), key(10), key(11)});
    CHECK(s->lru_order(1) == std::vector<BlockKey>{key(12), key(13)});
    CHECK(s->lru_order(0) == std::vector<BlockKey>{key(14), key(15)});
    CHECK(disk->size() == 4);
    CHECK(disk->usage_bytes() <= disk->capacity_bytes());
  }
  {  // third life: what was on disk is adopted again and reads back verified
    auto s = disk_store(dir.string(), &disk);
    CHECK(s->lru_order(2) == std::vector<BlockKey>{key(1), key(3), key(10), key(11)});
    for (uint64_t i : {1, 3, 10, 11}) {
      auto r = s->get(key(i));
      REQUIRE(r.ok());
      CHECK(r->bytes == rec(i).bytes);
      CHECK(r->header.checksum == rec(i).header.checksum);
    }
    auto c = s->counters();
    CHECK(c.hits[2] == 4);
    CHECK(c.promotions[1] == 4);
    CHECK(c.promotions[0] == 4);
    CHECK(c.demotions[0] == 2);
    CHECK(c.demotions[1] == 1);
    CHECK(c.drops == 0);
    CHECK(c.misses == 0);
    CHECK(c.corrupt_detected == 0);
  }
  fs::remove_all(dir);
}

TEST_CASE("tiered store: a key held by two tiers is kept in the faster one on create") {
  std::vector<std::unique_ptr<Tier>> tiers;
  auto a = MemoryTier::create(MemoryKind::host_arena, 2 * kB, kFp, layout());
  auto b = MemoryTier::create(MemoryKind::pinned_host, 2 * kB, kFp, layout());
  REQUIRE((a.ok() && b.ok()));
  MemoryTier* t0 = a->get();
  MemoryTier* t1 = b->get();
  REQUIRE(t0->insert(rec(1)).ok());
  REQUIRE(t1->insert(rec(1)).ok());
  REQUIRE(t1->insert(rec(2)).ok());
  CHECK(t1->list().size() == 2);
  tiers.push_back(std::move(a.value()));
  tiers.push_back(std::move(b.value()));
  auto made = TieredStore::create(std::move(tiers), kFp, layout());
  REQUIRE(made.ok());
  auto& s = *made.value();
  CHECK(s.tier_of(key(1)) == 0);
  CHECK(s.tier_of(key(2)) == 1);
  CHECK_FALSE(t1->contains(key(1)));  // the stale copy is erased
  CHECK(t1->usage_bytes() == kB);
  CHECK(s.lru_order(0) == std::vector<BlockKey>{key(1)});
  CHECK(s.lru_order(1) == std::vector<BlockKey>{key(2)});
}

TEST_CASE("sync tracker: a sequence growing one block per step moves one block per step") {
  SyncTracker sync;
  std::vector<SyncBlock> table;
  size_t total_moved = 0;
  for (uint64_t step = 0; step < 20; ++step) {
    table.push_back(SyncBlock{key(step), rec(step).header.checksum});
    auto p = sync.pending(7, table);
    REQUIRE(p.size() == 1);
    CHECK(p[0] == step);
    total_moved += p.size() * kB;
    sync.mark_synced(7, table);
  }
  CHECK(total_moved == 20 * kB);
  CHECK(sync.synced_blocks(7) == 20);
  CHECK(sync.pending(7, table).empty());
  // Another sequence is independent; a changed block (partial last block
  // filling up) is pending again, untouched ones are not.
  CHECK(sync.pending(8, table).size() == 20);
  table.back().version += 1;
  auto p = sync.pending(7, table);
  REQUIRE(p.size() == 1);
  CHECK(p[0] == 19);
  sync.forget(7);
  CHECK(sync.pending(7, table).size() == 20);
}

TEST_CASE("sync tracker: token-by-token growth moves at most the partial block and a new one") {
  SyncTracker sync;
  std::vector<SyncBlock> table;
  const uint32_t tpb = 4;
  for (uint32_t tok = 1; tok <= 40; ++tok) {
    const size_t n_blocks = (tok + tpb - 1) / tpb;
    table.resize(n_blocks);
    const uint32_t filled = tok - uint32_t(n_blocks - 1) * tpb;
    table.back() = SyncBlock{key(n_blocks - 1), filled};  // version = tokens filled
    auto p = sync.pending(1, table);
    CHECK(p.size() == 1);  // only the block that took the new token
    CHECK(p[0] == n_blocks - 1);
    sync.mark_synced(1, table);
  }
}

}  // namespace
}  // namespace cleave
