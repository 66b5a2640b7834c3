// LruPolicy: which blocks to move out of a tier under pressure. No I/O and
// no locking: the owner (TieredStore) serializes calls.
//
// Tracks recency per (tier, key) and a reference count per key; blocks with
// a count > 0 (in use) are never chosen as victims, in any tier.
#pragma once

#include <cstddef>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

#include "storage/block.h"

namespace cleave {

class LruPolicy {
 public:
  explicit LruPolicy(size_t n_tiers) : tiers_(n_tiers) {}

  size_t n_tiers() const { return tiers_.size(); }
  // Records `key` (of `bytes`) as the most recently used block of `tier`.
  // Re-adding an already tracked key just touches it.
  void add(size_t tier, const BlockKey& key, size_t bytes);
  // Forgets `key` in `tier`; no-op when not tracked there.
  void remove(size_t tier, const BlockKey& key);
  bool tracked(size_t tier, const BlockKey& key) const;
  // Makes `key` the most recently used block of every tier that tracks it.
  void touch(const BlockKey& key);
  void touch(size_t tier, const BlockKey& key);

  void pin(const BlockKey& key);
  // false when `key` was not pinned.
  bool unpin(const BlockKey& key);
  int pin_count(const BlockKey& key) const;

  // The least recently used unpinned keys of `tier` whose bytes add up to at
  // least `bytes_needed`, oldest first; nullopt when the unpinned blocks of
  // the tier cannot free that much. Empty for bytes_needed == 0.
  std::optional<std::vector<BlockKey>> victims(size_t tier, size_t bytes_needed) const;
  // Keys of `tier`, least recently used first.
  std::vector<BlockKey> order(size_t tier) const;
  size_t tracked_bytes(size_t tier) const { return tiers_.at(tier).bytes; }

 private:
  struct Entry {
    std::list<BlockKey>::iterator pos;
    size_t bytes = 0;
  };
  struct PerTier {
    std::list<BlockKey> lru;  // front = least recently used
    std::unordered_map<BlockKey, Entry, BlockKeyHash> index;
    size_t bytes = 0;
  };
  std::vector<PerTier> tiers_;
  std::unordered_map<BlockKey, int, BlockKeyHash> pins_;
};

}  // namespace cleave
