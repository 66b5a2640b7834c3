// KvPoolIndex: the cluster-wide map from a KV block key to the stores
// (holders) that hold it, kept current by each store's put and gone events
// (Mooncake's store metadata, Dynamo's KV indexer). It is eventually
// consistent: a holder named here may have dropped the block since, which
// costs the asker a miss (it then tries another holder or computes), never
// wrong KV, because every block is verified where it lands.
//
// Holders are names (the head gives each store's handle one); a holder that
// goes down is dropped whole, and one that comes back replaces what it had
// with what it announces.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "storage/block.h"

namespace cleave {

class KvPoolIndex {
 public:
  // The holder now holds exactly `keys` (a store that joined or re-joined).
  void reset(const std::string& holder, std::span<const BlockKey> keys);
  void add(const std::string& holder, std::span<const BlockKey> keys);
  void remove(const std::string& holder, std::span<const BlockKey> keys);
  // The holder is gone (its store went down): every block it held leaves.
  void drop(const std::string& holder);

  // How many of `keys`, from the first, the holder holds one after another.
  int32_t leading_run(const std::string& holder, std::span<const BlockKey> keys) const;
  // Every holder with a leading run of `keys` > 0, the longest first (ties:
  // name order, so the answer is deterministic).
  std::vector<std::pair<std::string, int32_t>> leading_runs(std::span<const BlockKey> keys) const;

  size_t blocks() const;                      // distinct keys held anywhere
  size_t held_by(const std::string& holder) const;
  std::vector<std::string> holders() const;   // with at least one block, sorted

 private:
  using Holder = uint32_t;
  Holder id_of(const std::string& holder);  // mu_ held
  void add_locked(Holder h, std::span<const BlockKey> keys);
  void drop_locked(Holder h);

  mutable std::mutex mu_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, Holder> ids_;
  std::vector<size_t> counts_;  // blocks per holder id
  // Few holders per block: a small vector beats a set.
  std::unordered_map<BlockKey, std::vector<Holder>, BlockKeyHash> where_;
};

}  // namespace cleave
