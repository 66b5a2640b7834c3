// TieredStore: a list of tiers (0 fastest) behind one put/get, with LRU
// migration between them, integrity checks on every hop, and counters.
//
// put() inserts into tier 0, demoting least-recently-used unpinned blocks
// 0 -> 1 -> 2 to make room (a demotion inserts into the next tier, then erases
// from the current one); a victim of the last tier is dropped and counted.
// get() looks the tiers up in order; a hit in tier t > 0 is promoted toward
// tier 0 (t -> t-1 -> ... -> 0), making room by demotion. Every record read
// from a tier is verified (checksum, model fingerprint, layout): a failure is
// a miss, counted and logged to stderr, the bad copy erased; the caller
// recomputes. Each hop hashes the block exactly once and copies it once: a
// demotion reads the source tier's bytes in place (Tier::read) and the
// receiving tier hashes its own copy; a promotion copies the record get()
// (or a prefetch) read and verified with lookup(); put() verifies before
// taking the lock and tier 0 only copies. Only demotions read a tier in
// place, so two tiers are locked together only in index order (t, t+1). Pinned blocks (refcount > 0) are never evicted; when nothing
// can be evicted, put answers out_of_memory.
//
// Migration is bounded: the hops triggered by one put/get run synchronously,
// at most Options::max_sync_hops of them (beyond that the call answers busy).
// With Options::background, a worker thread serves prefetch() requests (and,
// with async_promotion, the promotions of get()) from a queue of fixed
// capacity; a request that finds the queue full is dropped and counted.
//
// Restart: create() adopts every block its tiers already hold (Tier::list(),
// e.g. what a RocksDbTier rebuilt from disk on open): each is registered in
// its tier with the LRU policy at the tier's own byte cost, older than
// anything put or read later, in key order (hi, then lo) so the eviction
// order is deterministic. A key held by more than one tier is kept in the
// fastest; the stale copies below it are erased (what an interrupted
// promotion would have left).
//
// Concurrency: one mutex guards the store; record copies in and out are
// complete, so readers never see torn records. Writers verify outside the
// lock and publish optimistically: each block's metadata carries a version;
// a writer that finds the key already published when it commits drops its
// copy (counted in put_duplicates) and answers ok.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "storage/lru_policy.h"
#include "storage/tier.h"

namespace cleave {

struct TieredStoreOptions {
  size_t max_sync_hops = 64;     // tier-to-tier moves (and drops) one put/get may run
  bool background = false;       // start a migration worker thread
  bool async_promotion = false;  // get() queues promotions instead of running them (needs background)
  size_t queue_capacity = 256;   // fixed capacity of the migration queue
};

struct StoreCounters {
  uint64_t puts = 0;            // accepted put() calls (duplicates included)
  uint64_t put_duplicates = 0;  // puts of an already published key: copy dropped
  std::vector<uint64_t> hits;        // per tier
  uint64_t misses = 0;
  std::vector<uint64_t> promotions;  // [t]: hops t+1 -> t
  std::vector<uint64_t> demotions;   // [t]: hops t -> t+1
  uint64_t drops = 0;                // victims of the last tier dropped
  uint64_t corrupt_detected = 0;     // records that failed verification on a hop
  uint64_t queue_full = 0;           // background requests dropped, queue full
  uint64_t budget_exhausted = 0;     // calls that ran out of max_sync_hops
};

class TieredStore {
 public:
  // invalid_argument when there are no tiers, a tier is null, or the layout
  // is invalid.
  static Result<std::unique_ptr<TieredStore>> create(std::vector<std::unique_ptr<Tier>> tiers,
                                                     uint64_t model_fingerprint,
                                                     const KvLayout& layout,
                                                     TieredStoreOptions options = {});
  ~TieredStore();
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  // corruption when the record fails verify(); out_of_memory when tier 0
  // cannot be made room in (everything pinned, or the record is larger than
  // the tier); busy when the hop budget ran out; ok when stored or when the
  // key was already published.
  Status put(const BlockRecord& record);
  // The record, verified; not_found on a miss (absent, or the copy failed
  // verification and was dropped).
  Result<BlockRecord> get(const BlockKey& key);
  bool contains(const BlockKey& key) const;
  // The tier holding `key`, or -1.
  int tier_of(const BlockKey& key) const;
  // Version of the key's metadata (bumped on each publish or move); 0 when absent.
  uint64_t version(const BlockKey& key) const;

  void pin(const BlockKey& key);
  Status unpin(const BlockKey& key);  // invalid_argument when not pinned

  // Queues a promotion of `key` toward tier 0 for the background worker.
  // unavailable without a worker; busy (and queue_full++) when the queue is full.
  Status prefetch(const BlockKey& key);
  // Waits until the background queue is empty and the worker idle.
  void drain();

  // Every key the store holds, in no order (what a restarted store announces).
  std::vector<BlockKey> keys() const;
  // With tracking on, every key that leaves the store (the last tier's LRU
  // victims, corrupt copies, vanished ones) is remembered until take_gone():
  // the kv_store actor tells the cluster's pool index (storage/kv_pool_index.h).
  void track_gone(bool on);
  std::vector<BlockKey> take_gone();

  StoreCounters counters() const;
  uint64_t model_fingerprint() const { return model_fingerprint_; }
  const KvLayout& layout() const { return layout_; }
  size_t n_tiers() const { return tiers_.size(); }
  Tier& tier(size_t i) { return *tiers_.at(i); }
  // Keys of a tier, least recently used first.
  std::vector<BlockKey> lru_order(size_t tier) const;

 private:
  struct Meta {
    size_t tier = 0;
    uint64_t version = 0;
  };
  TieredStore(std::vector<std::unique_ptr<Tier>> tiers, uint64_t fp, const KvLayout& layout,
              TieredStoreOptions options);

  // Registers the blocks the tiers already hold (constructor only).
  void adopt_existing();
  // All below run with mu_ held.
  bool spend_hop();
  Status make_room(size_t tier, size_t bytes);
  Status evict(size_t tier, const BlockKey& key);
  // make_room + `insert` (which inserts `key` into the tier), evicting more
  // when the tier charges more than the payload; records the block in the
  // policy at the tier's own cost.
  Status insert_with_room(size_t tier, const BlockKey& key, const std::function<Status()>& insert);
  // Moves `key` from tier `from` toward tier 0, each hop copying `verified`
  // (the record get() just read and verified) into the next tier; nullptr:
  // reads it from tier `from` with lookup() first.
  void promote(size_t from, const BlockKey& key, const BlockRecord* verified);
  void forget_corrupt(size_t tier, const BlockKey& key, const Status& why);
  // Drops the key's metadata (it left the store), remembered when tracking.
  void forget(std::unordered_map<BlockKey, Meta, BlockKeyHash>::iterator it);
  void forget(const BlockKey& key);
  void worker_loop();

  const std::vector<std::unique_ptr<Tier>> tiers_;
  const uint64_t model_fingerprint_;
  const KvLayout layout_;
  const TieredStoreOptions options_;

  mutable std::mutex mu_;
  LruPolicy policy_;
  std::unordered_map<BlockKey, Meta, BlockKeyHash> meta_;
  uint64_t version_clock_ = 0;
  size_t hops_left_ = 0;
  StoreCounters counters_;
  bool track_gone_ = false;
  std::vector<BlockKey> gone_;

  // Background migration.
  std::condition_variable work_cv_, idle_cv_;
  std::deque<BlockKey> queue_;  // never more than options_.queue_capacity
  bool stop_ = false;
  bool busy_ = false;
  std::thread worker_;
};

// Incremental sync: remembers, per sequence, which blocks (by position, key
// and version) were already persisted or transferred, so a growing sequence
// moves only the new or changed blocks.
struct SyncBlock {
  BlockKey key;
  uint64_t version = 0;  // e.g. the record checksum, or n_tokens of a partial block
  bool operator==(const SyncBlock&) const = default;
};

class SyncTracker {
 public:
  // The positions of `current` that are new or changed since mark_synced().
  std::vector<size_t> pending(uint64_t seq, const std::vector<SyncBlock>& current) const;
  // Records `current` as persisted (the sequence's table becomes `current`).
  void mark_synced(uint64_t seq, const std::vector<SyncBlock>& current);
  void forget(uint64_t seq);
  size_t synced_blocks(uint64_t seq) const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::vector<SyncBlock>> synced_;
};

}  // namespace cleave
