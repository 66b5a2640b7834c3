// MemoryTier: a Tier in host memory with its own byte capacity.
//
// Used as tier 0 (the host working arena, when there is no GPU) and as
// tier 1 ("pinned" host RAM). Every block is copied into one page-aligned
// slab (header + bytes) so a later CUDA variant can register or allocate the
// same slabs with cudaHostAlloc / cudaHostRegister for DMA; this variant uses
// aligned_alloc(4096) and nothing CUDA.
//
// Records are verified on insert (verify()) and on lookup (the checksum is
// recomputed over the stored bytes; a mismatch drops the entry, counts it and
// answers corruption). usage_bytes() counts the block bytes (header and page
// rounding are not charged), so a capacity of N * block_bytes holds N blocks.
// Thread-safe: one mutex per tier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "storage/tier.h"

namespace cleave {

enum class MemoryKind {
  host_arena,   // tier 0 without a GPU: the memory the CPU kernels read
  pinned_host,  // tier 1: page-aligned host RAM (cudaHostAlloc in a CUDA build)
};

class MemoryTier final : public Tier {
 public:
  static constexpr size_t kPageBytes = 4096;

  // invalid_argument for a zero capacity or an invalid layout.
  static Result<std::unique_ptr<MemoryTier>> create(MemoryKind kind, size_t capacity_bytes,
                                                    uint64_t model_fingerprint,
                                                    const KvLayout& layout);
  ~MemoryTier() override;

  const char* name() const override;
  Status insert(const BlockRecord& record) override;
  Result<BlockRecord> lookup(const BlockKey& key) override;
  bool contains(const BlockKey& key) const override;
  Status erase(const BlockKey& key) override;
  size_t capacity_bytes() const override { return capacity_; }
  size_t usage_bytes() const override;
  std::vector<std::pair<BlockKey, size_t>> list() const override;

  MemoryKind kind() const { return kind_; }
  size_t block_count() const;
  uint64_t corrupt_detected() const;
  // Test hook: flips bit `bit` (modulo the payload size in bits) of the
  // stored bytes of `key`, leaving the stored checksum alone. not_found when
  // absent.
  Status flip_bit_for_test(const BlockKey& key, size_t bit);

 private:
  struct SlabFree {
    void operator()(uint8_t* p) const;
  };
  struct Slab {
    std::unique_ptr<uint8_t, SlabFree> mem;  // [BlockHeader][pad][bytes], page aligned
    size_t n_bytes = 0;                      // payload size
  };
  static constexpr size_t kPayloadOffset = 256;  // >= sizeof(BlockHeader), cache-line aligned

  MemoryTier(MemoryKind kind, size_t capacity, uint64_t fp, const KvLayout& layout)
      : kind_(kind), capacity_(capacity), model_fingerprint_(fp), layout_(layout) {}

  const MemoryKind kind_;
  const size_t capacity_;
  const uint64_t model_fingerprint_;
  const KvLayout layout_;
  mutable std::mutex mu_;
  std::unordered_map<BlockKey, Slab, BlockKeyHash> slabs_;
  size_t usage_ = 0;
  uint64_t corrupt_ = 0;
};

}  // namespace cleave
