// One storage tier: device memory, pinned host RAM, or RocksDB on disk.
// A tiered store composes a list of tiers; the LRU migration policy moves
// records between them. Every tier verifies records on the way in and out.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "common/status.h"
#include "storage/block.h"

namespace cleave {

class Tier {
 public:
  virtual ~Tier() = default;
  virtual const char* name() const = 0;

  // out_of_memory ("no room", a value to plan with) when the record does not
  // fit; corruption when the record fails verify(); ok when it was stored or
  // an identical record was already there.
  virtual Status insert(const BlockRecord& record) = 0;
  // not_found when absent; corruption (and the entry is dropped) when the
  // stored bytes no longer match their checksum.
  virtual Result<BlockRecord> lookup(const BlockKey& key) = 0;
  virtual bool contains(const BlockKey& key) const = 0;
  virtual Status erase(const BlockKey& key) = 0;  // not_found when absent
  virtual size_t capacity_bytes() const = 0;
  virtual size_t usage_bytes() const = 0;
  // Every block the tier already holds, with the bytes it charges for it
  // (what usage_bytes() counts), in no particular order. A persistent tier
  // reports what it found on open, so a TieredStore made over it can track
  // (look up, promote, evict) those blocks. Default: nothing (a tier that
  // starts empty).
  virtual std::vector<std::pair<BlockKey, size_t>> list() const { return {}; }
};

}  // namespace cleave
