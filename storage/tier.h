// One storage tier: device memory, pinned host RAM, or RocksDB on disk.
// A tiered store composes a list of tiers; the LRU migration policy moves
// records between them. Every tier verifies records on the way in and out.
#pragma once

#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

#include "common/status.h"
#include "storage/block.h"

namespace cleave {

// A record's bytes where they already are (another tier's memory, a caller's
// BlockRecord): the input of a hop, so a block moves with one copy.
struct BlockView {
  const BlockHeader* header = nullptr;
  const uint8_t* bytes = nullptr;
  size_t n_bytes = 0;
  // True when the bytes were verified by this hop already (e.g. a record just
  // read with lookup()); the receiving tier then only copies. False: the
  // receiver verifies, so each hop hashes the block exactly once.
  bool verified = false;

  static BlockView of(const BlockRecord& r, bool verified) {
    return BlockView{&r.header, r.bytes.data(), r.bytes.size(), verified};
  }
};

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

  // --- the hop path (TieredStore moves blocks with these two) ---
  // insert() from a view: the same answers. Unless view.verified, the tier
  // verifies the bytes (memory tiers hash their own copy after copying it
  // in, so what they keep is what was checked). Default: copies the view
  // into a BlockRecord and calls insert() (which verifies).
  virtual Status insert(const BlockView& view);
  // Calls `fn` with the stored record as it is, unverified (the receiver of
  // a hop verifies it), valid only during the call; the tier's lock may be
  // held, so `fn` must not call back into this tier. Answers not_found when
  // absent, else what `fn` answers. Default: lookup() (which verifies) and a
  // view of that copy.
  virtual Status read(const BlockKey& key, const std::function<Status(const BlockView&)>& fn);
};

// One verified hop of `key` from `from` into `to` (the block hashed once, by
// `to`), then erased from `from`. The insert's status on failure (corruption:
// the bytes in `from` are bad; out_of_memory: `to` is full), `from` unchanged.
// Holds `from`'s lock while taking `to`'s: callers must keep one direction
// between two tiers (TieredStore moves in place only downward, t -> t+1).
Status move_block(Tier& from, Tier& to, const BlockKey& key);

}  // namespace cleave
