// MemoryTier: a Tier in host memory with its own byte capacity.
//
// Used as tier 0 without a GPU (the host working arena) and as tier 1
// (pinned host RAM). Every block lives in one page-aligned slab
// ([BlockHeader][pad][bytes]). Slabs come from aligned_alloc(4096), or, for
// the pinned kind given a Backend, from Backend::alloc_pinned_host
// (cudaHostAlloc with CUDA), so the device can DMA from them.
//
// Slabs are recycled: all blocks of a tier share one layout, hence one slab
// size, and an erased block's slab goes to a free list that the next insert
// takes from. Slabs in use plus free never exceed capacity / block bytes, so
// the tier never holds more memory than its capacity (plus page rounding);
// release_free_slabs() returns the free ones.
//
// Verification: insert(record) and an unverified insert(view) copy the bytes
// into the slab and hash that copy (one copy, one hash: what is kept is what
// was checked); a view marked verified is only copied. lookup() copies out
// and hashes the copy; a mismatch drops the entry, counts it and answers
// corruption. read() hands out the stored bytes unverified (the receiver of
// the hop verifies). usage_bytes() counts block bytes only (header and page
// rounding are not charged), so a capacity of N * block_bytes holds N blocks.
// Thread-safe: one mutex per tier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "storage/tier.h"

namespace cleave {

class Backend;

enum class MemoryKind {
  host_arena,   // tier 0 without a GPU: the memory the CPU kernels read
  pinned_host,  // tier 1: page-aligned (with a Backend: page-locked) host RAM
};

class MemoryTier final : public Tier {
 public:
  static constexpr size_t kPageBytes = 4096;

  // invalid_argument for a zero capacity, an invalid layout, or a backend
  // given for the host_arena kind (a backend's own memory is DeviceTier's).
  // `pinned_from`, when given, allocates the slabs and must outlive the tier.
  static Result<std::unique_ptr<MemoryTier>> create(MemoryKind kind, size_t capacity_bytes,
                                                    uint64_t model_fingerprint,
                                                    const KvLayout& layout,
                                                    Backend* pinned_from = nullptr);
  ~MemoryTier() override;

  const char* name() const override;
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

  MemoryKind kind() const { return kind_; }
  size_t block_count() const;
  size_t free_slabs() const;
  void release_free_slabs();
  uint64_t corrupt_detected() const;
  // Test hook: flips bit `bit` (modulo the payload size in bits) of the
  // stored bytes of `key`, leaving the stored checksum alone. not_found when
  // absent.
  Status flip_bit_for_test(const BlockKey& key, size_t bit);

 private:
  static constexpr size_t kPayloadOffset = 256;  // >= sizeof(BlockHeader), cache-line aligned

  MemoryTier(MemoryKind kind, size_t capacity, uint64_t fp, const KvLayout& layout,
             Backend* pinned_from);
  // With mu_ held. nullptr when the allocation failed.
  uint8_t* take_slab();
  void give_back_slab(uint8_t* slab);
  void free_slab(uint8_t* slab);

  const MemoryKind kind_;
  const size_t capacity_;
  const uint64_t model_fingerprint_;
  const KvLayout layout_;
  const size_t block_bytes_;
  const size_t slab_bytes_;  // kPayloadOffset + block bytes, rounded up to pages
  const size_t max_slabs_;   // capacity / block bytes
  Backend* const pinned_from_;
  mutable std::mutex mu_;
  std::unordered_map<BlockKey, uint8_t*, BlockKeyHash> slabs_;
  std::vector<uint8_t*> free_;  // recycled slabs, never more than max_slabs_ - slabs_.size()
  size_t usage_ = 0;
  uint64_t corrupt_ = 0;
};

}  // namespace cleave
