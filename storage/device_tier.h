// DeviceTier: tier 0 as the memory the kernels read. One arena of
// capacity / block_bytes block slots, allocated with Backend::alloc (device
// memory with the CUDA backend, the host working arena with the CPU one) and
// laid out exactly as kernels' PagedKv: slot i is PagedKv block i, so
// attention reads a block where the tier stores it (paged_kv(), slot_of()).
//
// Headers stay on the host; only the bytes live in backend memory. Records
// are verified on the way in (verify(), or for an unverified view its
// checksum over the host bytes, before the upload) and on the way out
// (lookup() and read() download, then the checksum is recomputed on the
// downloaded copy: a mismatch drops the block, counts it and answers
// corruption). A slot freed by erase is reused by the next insert; nothing
// is allocated after create().
//
// Thread-safe: one mutex per tier, held across backend calls. The CUDA
// backend is not safe to drive from two threads at once: give the tier its
// own backend, or drive it from the thread that runs the kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"
#include "storage/tier.h"

namespace cleave {

class DeviceTier final : public Tier {
 public:
  // invalid_argument for an invalid layout or a capacity below one block
  // (or above INT32_MAX blocks); out_of_memory when the backend cannot
  // allocate the arena. `backend` must outlive the tier.
  static Result<std::unique_ptr<DeviceTier>> create(Backend& backend, size_t capacity_bytes,
                                                    uint64_t model_fingerprint,
                                                    const KvLayout& layout);
  ~DeviceTier() override;

  const char* name() const override { return "device"; }
  using Tier::insert;
  Status insert(const BlockRecord& record) override;
  Status insert(const BlockView& view) override;
  Result<BlockRecord> lookup(const BlockKey& key) override;
  Status read(const BlockKey& key, const std::function<Status(const BlockView&)>& fn) override;
  bool contains(const BlockKey& key) const override;
  Status erase(const BlockKey& key) override;
  size_t capacity_bytes() const override { return capacity_; }
  size_t usage_bytes() const override;
  std::vector<std::pair<BlockKey, size_t>> list() const override;

  // The arena as the attention kernels address it (n_blocks = slots).
  PagedKv paged_kv() const;
  // The PagedKv block index holding `key`; not_found when absent.
  Result<int32_t> slot_of(const BlockKey& key) const;
  size_t block_count() const;
  uint64_t corrupt_detected() const;

 private:
  struct Entry {
    int32_t slot = 0;
    BlockHeader header;
  };
  DeviceTier(Backend& backend, size_t capacity, uint64_t fp, const KvLayout& layout,
             int32_t n_slots, uint8_t* arena, uint8_t* staging);
  uint8_t* slot_ptr(int32_t slot) const { return arena_ + size_t(slot) * block_bytes_; }
  // With mu_ held: downloads the slot of `e` into `dst` and checks it.
  Status download_verified(const BlockKey& key, const Entry& e, uint8_t* dst);
  void drop(const BlockKey& key);  // with mu_ held

  Backend& backend_;
  const size_t capacity_;
  const uint64_t model_fingerprint_;
  const KvLayout layout_;
  const size_t block_bytes_;
  const int32_t n_slots_;
  uint8_t* const arena_;    // backend memory, n_slots_ * block_bytes_
  uint8_t* const staging_;  // pinned host, block_bytes_: read()'s download target
  mutable std::mutex mu_;
  std::unordered_map<BlockKey, Entry, BlockKeyHash> entries_;
  std::vector<int32_t> free_slots_;
  uint64_t corrupt_ = 0;
};

}  // namespace cleave
