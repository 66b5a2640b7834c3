#include "storage/tiered_store.h"

#include <utility>

#include <algorithm>
#include <cstdio>

namespace cleave {

Result<std::unique_ptr<TieredStore>> TieredStore::create(std::vector<std::unique_ptr<Tier>> tiers,
                                                         uint64_t model_fingerprint,
                                                         const KvLayout& layout,
                                                         TieredStoreOptions options) {
  if (tiers.empty()) return Status(Code::invalid_argument, "tiered store: no tiers");
  for (size_t i = 0; i < tiers.size(); ++i)
    if (!tiers[i])
      return Status(Code::invalid_argument, "tiered store: tier " + std::to_string(i) + " is null");
  CLEAVE_RETURN_IF_ERROR(layout.validate());
  if (options.background && options.queue_capacity == 0)
    return Status(Code::invalid_argument, "tiered store: queue_capacity must be positive");
  return std::unique_ptr<TieredStore>(
      new TieredStore(std::move(tiers), model_fingerprint, layout, options));
}

TieredStore::TieredStore(std::vector<std::unique_ptr<Tier>> tiers, uint64_t fp,
                         const KvLayout& layout, TieredStoreOptions options)
    : tiers_(std::move(tiers)),
      model_fingerprint_(fp),
      layout_(layout),
      options_(options),
      policy_(tiers_.size()) {
  counters_.hits.assign(tiers_.size(), 0);
  counters_.promotions.assign(tiers_.size(), 0);
  counters_.demotions.assign(tiers_.size(), 0);
  adopt_existing();
  if (options_.background) worker_ = std::thread([this] { worker_loop(); });
}

void TieredStore::adopt_existing() {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t t = 0; t < tiers_.size(); ++t) {
    std::vector<std::pair<BlockKey, size_t>> held = tiers_[t]->list();
    std::sort(held.begin(), held.end(), [](const auto& a, const auto& b) {
      return a.first.hi != b.first.hi ? a.first.hi < b.first.hi : a.first.lo < b.first.lo;
    });
    for (const auto& [key, bytes] : held) {
      if (meta_.count(key)) {  // a faster tier holds it: this copy is stale
        (void)tiers_[t]->erase(key);
        continue;
      }
      meta_[key] = Meta{t, ++version_clock_};
      policy_.add(t, key, bytes);
    }
  }
}

TieredStore::~TieredStore() {
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    worker_.join();
  }
}

bool TieredStore::spend_hop() {
  if (hops_left_ == 0) return false;
  --hops_left_;
  return true;
}

void TieredStore::forget_corrupt(size_t tier, const BlockKey& key, const Status& why) {
  ++counters_.corrupt_detected;
  std::fprintf(stderr, "cleave storage: tier %zu (%s): block %s failed verification, dropped: %s\n",
               tier, tiers_[tier]->name(), key.hex().c_str(), why.to_string().c_str());
  (void)tiers_[tier]->erase(key);  // the tier may have dropped it already
  policy_.remove(tier, key);
  auto it = meta_.find(key);
  if (it != meta_.end() && it->second.tier == tier) forget(it);
}

void TieredStore::forget(std::unordered_map<BlockKey, Meta, BlockKeyHash>::iterator it) {
  if (track_gone_) gone_.push_back(it->first);
  meta_.erase(it);
}

void TieredStore::forget(const BlockKey& key) {
  auto it = meta_.find(key);
  if (it != meta_.end()) forget(it);
}

std::vector<BlockKey> TieredStore::keys() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<BlockKey> out;
  out.reserve(meta_.size());
  for (const auto& [key, meta] : meta_) out.push_back(key);
  return out;
}

void TieredStore::track_gone(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  track_gone_ = on;
  if (!on) gone_.clear();
}

std::vector<BlockKey> TieredStore::take_gone() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(gone_, {});
}

Status TieredStore::make_room(size_t t, size_t bytes) {
  Tier& tier = *tiers_[t];
  if (bytes > tier.capacity_bytes())
    return Status(Code::out_of_memory, std::string("tier ") + tier.name() + ": a block of " +
                                           std::to_string(bytes) + " bytes exceeds capacity " +
                                           std::to_string(tier.capacity_bytes()));
  while (tier.usage_bytes() + bytes > tier.capacity_bytes()) {
    const size_t before = tier.usage_bytes();
    const size_t tracked_before = policy_.tracked_bytes(t);
    const size_t need = before + bytes - tier.capacity_bytes();
    auto victims = policy_.victims(t, need);
    if (!victims)
      return Status(Code::out_of_memory,
                    std::string("tier ") + tier.name() + ": no room for " + std::to_string(bytes) +
                        " bytes and too few unpinned blocks to evict (" + std::to_string(before) +
                        " of " + std::to_string(tier.capacity_bytes()) + " used)");
    for (const BlockKey& v : *victims) CLEAVE_RETURN_IF_ERROR(evict(t, v));
    if (tier.usage_bytes() >= before && policy_.tracked_bytes(t) >= tracked_before)
      return Status(Code::out_of_memory, std::string("tier ") + tier.name() +
                                             ": eviction freed no space (usage accounting "
                                             "differs from the policy's)");
  }
  return Status::Ok();
}

Status TieredStore::insert_with_room(size_t t, const BlockKey& key,
                                     const std::function<Status()>& insert) {
  Tier& tier = *tiers_[t];
  const size_t bytes = layout_.block_bytes();
  CLEAVE_RETURN_IF_ERROR(make_room(t, bytes));
  for (;;) {
    const size_t before = tier.usage_bytes();
    Status st = insert();
    if (st.ok()) {
      // Charge what the tier actually counted (e.g. an encoded header on disk).
      const size_t after = tier.usage_bytes();
      policy_.add(t, key, after > before ? after - before : bytes);
      return st;
    }
    if (st.code() != Code::out_of_memory) return st;
    // The tier charges more than the payload: evict one more block and retry
    // (bounded by the hop budget).
    auto victims = policy_.victims(t, 1);
    if (!victims || victims->empty()) return st;
    CLEAVE_RETURN_IF_ERROR(evict(t, victims->front()));
  }
}

Status TieredStore::evict(size_t t, const BlockKey& key) {
  if (!spend_hop()) {
    ++counters_.budget_exhausted;
    return Status(Code::busy, "tiered store: migration budget of " +
                                  std::to_string(options_.max_sync_hops) + " hops exhausted");
  }
  Tier& from = *tiers_[t];
  if (t + 1 == tiers_.size()) {
    (void)from.erase(key);
    policy_.remove(t, key);
    forget(key);
    ++counters_.drops;
    return Status::Ok();
  }
  // One copy from tier t's memory into tier t+1, hashed once by the receiver.
  Tier& to = *tiers_[t + 1];
  policy_.pin(key);
  Status st = insert_with_room(t + 1, key, [&] {
    return from.read(key, [&](const BlockView& v) { return to.insert(v); });
  });
  policy_.unpin(key);
  if (st.code() == Code::corruption) {  // the bytes in tier t are bad
    forget_corrupt(t, key, st);
    return Status::Ok();  // the space is free either way
  }
  if (st.code() == Code::not_found && !from.contains(key)) {
    policy_.remove(t, key);  // vanished from under us: forget it
    forget(key);
    return Status::Ok();
  }
  CLEAVE_RETURN_IF_ERROR(st);
  (void)from.erase(key);
  policy_.remove(t, key);
  Meta& m = meta_[key];
  m.tier = t + 1;
  m.version = ++version_clock_;
  ++counters_.demotions[t];
  return Status::Ok();
}

void TieredStore::promote(size_t from, const BlockKey& key, const BlockRecord* verified) {
  // A prefetch has no record yet: read one verified copy first. Hops upward
  // always copy a record, never read a tier in place, so two tiers are only
  // ever locked together in index order (a demotion's read, then insert).
  Result<BlockRecord> read = Status(Code::not_found, "");
  if (!verified) {
    read = tiers_[from]->lookup(key);
    if (!read.ok()) {
      if (read.status().code() == Code::corruption) forget_corrupt(from, key, read.status());
      return;
    }
    verified = &*read;
  }
  policy_.pin(key);  // never pick the block being promoted as a victim
  for (size_t s = from; s > 0; --s) {
    if (!spend_hop()) {
      ++counters_.budget_exhausted;
      break;
    }
    if (!make_room(s - 1, layout_.block_bytes()).ok()) break;  // stays where it is: still a hit
    Tier& to = *tiers_[s - 1];
    Status st = insert_with_room(
        s - 1, key, [&] { return to.insert(BlockView::of(*verified, /*verified=*/true)); });
    if (!st.ok()) break;  // no room after all: stays where it is
    (void)tiers_[s]->erase(key);
    policy_.remove(s, key);
    Meta& m = meta_[key];
    m.tier = s - 1;
    m.version = ++version_clock_;
    ++counters_.promotions[s - 1];
  }
  policy_.unpin(key);
}

Status TieredStore::put(const BlockRecord& record) {
  const BlockKey& key = record.header.key;
  {  // fast path: already published, nothing to verify or copy
    std::lock_guard<std::mutex> lock(mu_);
    if (meta_.count(key)) {
      ++counters_.puts;
      ++counters_.put_duplicates;
      policy_.touch(key);
      return Status::Ok();
    }
  }
  // Verify outside the lock (the checksum pass is the expensive part); tier 0
  // then only copies ...
  CLEAVE_RETURN_IF_ERROR(verify(record, model_fingerprint_, layout_));
  // ... then publish only if nobody else did meanwhile.
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.puts;
  if (meta_.count(key)) {
    ++counters_.put_duplicates;  // lost the race: our copy is dropped
    policy_.touch(key);
    return Status::Ok();
  }
  hops_left_ = options_.max_sync_hops;
  Tier& t0 = *tiers_[0];
  CLEAVE_RETURN_IF_ERROR(
      insert_with_room(0, key, [&] { return t0.insert(BlockView::of(record, /*verified=*/true)); }));
  meta_[key] = Meta{0, ++version_clock_};
  return Status::Ok();
}

Result<BlockRecord> TieredStore::get(const BlockKey& key) {
  bool queue_it = false;
  Result<BlockRecord> out = Status(Code::not_found, "block " + key.hex() + " is not stored");
  {
    std::lock_guard<std::mutex> lock(mu_);
    hops_left_ = options_.max_sync_hops;
    for (size_t t = 0; t < tiers_.size(); ++t) {
      if (!tiers_[t]->contains(key)) continue;
      // lookup() verifies (checksum, fingerprint, layout) as it reads.
      Result<BlockRecord> rec = tiers_[t]->lookup(key);
      Status st = rec.status();
      if (st.ok() && !(rec->header.key == key))
        st = Status(Code::corruption, "header names block " + rec->header.key.hex());
      if (!st.ok()) {
        if (st.code() == Code::corruption) forget_corrupt(t, key, st);
        continue;
      }
      ++counters_.hits[t];
      auto it = meta_.find(key);
      if (it == meta_.end() || it->second.tier != t) {  // adopt (e.g. found on disk after restart)
        if (it != meta_.end()) policy_.remove(it->second.tier, key);
        meta_[key] = Meta{t, ++version_clock_};
        policy_.add(t, key, rec->bytes.size());
      }
      policy_.touch(t, key);
      if (t > 0) {
        if (options_.async_promotion && worker_.joinable())
          queue_it = true;
        else
          promote(t, key, &*rec);
      }
      out = std::move(rec);
      break;
    }
    if (!out.ok()) ++counters_.misses;
  }
  if (queue_it) (void)prefetch(key);
  return out;
}

bool TieredStore::contains(const BlockKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return meta_.count(key) != 0;
}

int TieredStore::tier_of(const BlockKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = meta_.find(key);
  return it == meta_.end() ? -1 : int(it->second.tier);
}

uint64_t TieredStore::version(const BlockKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = meta_.find(key);
  return it == meta_.end() ? 0 : it->second.version;
}

void TieredStore::pin(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  policy_.pin(key);
}

Status TieredStore::unpin(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!policy_.unpin(key))
    return Status(Code::invalid_argument, "block " + key.hex() + " is not pinned");
  return Status::Ok();
}

Status TieredStore::prefetch(const BlockKey& key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!worker_.joinable())
      return Status(Code::unavailable, "tiered store: no background worker");
    if (queue_.size() >= options_.queue_capacity) {
      ++counters_.queue_full;
      return Status(Code::busy, "tiered store: migration queue full (" +
                                    std::to_string(options_.queue_capacity) + "), request dropped");
    }
    queue_.push_back(key);
  }
  work_cv_.notify_one();
  return Status::Ok();
}

void TieredStore::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return stop_ || (queue_.empty() && !busy_); });
}

void TieredStore::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) break;
    busy_ = true;
    const BlockKey key = queue_.front();
    queue_.pop_front();
    auto it = meta_.find(key);
    if (it != meta_.end() && it->second.tier > 0) {
      hops_left_ = options_.max_sync_hops;
      promote(it->second.tier, key, nullptr);
    }
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
  idle_cv_.notify_all();
}

StoreCounters TieredStore::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

std::vector<BlockKey> TieredStore::lru_order(size_t tier) const {
  std::lock_guard<std::mutex> lock(mu_);
  return policy_.order(tier);
}

// --- SyncTracker ---

std::vector<size_t> SyncTracker::pending(uint64_t seq, const std::vector<SyncBlock>& current) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<size_t> out;
  auto it = synced_.find(seq);
  const std::vector<SyncBlock>* done = it == synced_.end() ? nullptr : &it->second;
  for (size_t i = 0; i < current.size(); ++i)
    if (!done || i >= done->size() || !((*done)[i] == current[i])) out.push_back(i);
  return out;
}

void SyncTracker::mark_synced(uint64_t seq, const std::vector<SyncBlock>& current) {
  std::lock_guard<std::mutex> lock(mu_);
  synced_[seq] = current;
}

void SyncTracker::forget(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  synced_.erase(seq);
}

size_t SyncTracker::synced_blocks(uint64_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = synced_.find(seq);
  return it == synced_.end() ? 0 : it->second.size();
}

}  // namespace cleave
