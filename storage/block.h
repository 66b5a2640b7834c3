// KV blocks as storage sees them: a layout, a content key, and a record
// (header + bytes) that carries its own checksum and the fingerprint of the
// model and layout that made it (DESIGN.md invariant 2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"

namespace cleave {
namespace detail {
struct Xxh3Impl;  // storage/checksum_simd.h
}

// The tokens_per_block values a user may choose (--block-size, cluster {
// block_size }): vLLM's choices. Any positive value works underneath.
inline constexpr int32_t kKvBlockSizes[] = {8, 16, 32, 64, 128};
inline constexpr const char* kKvBlockSizeList = "8, 16, 32, 64 or 128";
inline bool is_kv_block_size(int64_t n) {
  for (int32_t b : kKvBlockSizes)
    if (n == b) return true;
  return false;
}

// How a block's bytes are laid out; matches kernels' PagedKv:
// [layer][k=0|v=1][kv_head][slot] rows of head_dim elements within one block,
// K rows in k_type and V rows in v_type (F32, F16, Q8_0 or Q4_0). The types are
// part of the fingerprint, so blocks of different types never mix.
struct KvLayout {
  DType k_type = DType::F32, v_type = DType::F32;
  int32_t tokens_per_block = 16;
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;

  size_t k_row_bytes() const { return dtype_row_bytes(k_type, head_dim); }
  size_t v_row_bytes() const { return dtype_row_bytes(v_type, head_dim); }
  size_t layer_bytes() const {
    return size_t(n_kv_heads) * tokens_per_block * (k_row_bytes() + v_row_bytes());
  }
  size_t block_bytes() const { return layer_bytes() * n_layers; }
  // KV bytes of one token position (every layer, K and V).
  size_t bytes_per_token() const { return layer_bytes() * n_layers / size_t(tokens_per_block); }
  // invalid_argument naming the field when a dimension is not positive or a
  // type is not a KV type (check_kv_type).
  Status validate() const;
  uint64_t fingerprint() const;  // XXH3-64 of the fields
  bool operator==(const KvLayout&) const = default;
};
// The two element types in one 32-bit word, as records on disk and the
// wire's dtype field carry them: K in the low 16 bits, V in the high 16
// (F32 and F32 is 0, what layouts were before V could differ).
uint32_t pack_kv_types(const KvLayout& l);
// Sets l's k_type and v_type from such a word (validate() refuses ids that
// name no type).
void unpack_kv_types(uint32_t packed, KvLayout& l);

// Content key of a full block: XXH3-128 over (parent key, the block's token
// ids, model fingerprint, layout fingerprint).
struct BlockKey {
  uint64_t lo = 0, hi = 0;
  bool operator==(const BlockKey&) const = default;
  std::string hex() const;
};
struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const { return size_t(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull)); }
};

// What travels between tiers: header + the block's bytes.
struct BlockHeader {
  BlockKey key;
  uint64_t model_fingerprint = 0;
  KvLayout layout;
  uint64_t checksum = 0;  // XXH3-64 of the bytes
  uint32_t n_tokens = 0;  // tokens filled (== tokens_per_block for a full block)
};

struct BlockRecord {
  BlockHeader header;
  std::vector<uint8_t> bytes;  // layout.block_bytes()
};

// Buffers for KV block bytes that come in from elsewhere (a stream from
// another process), reused: the writer fills every byte before anyone reads
// them, so a reused buffer needs no zero-fill, and fresh memory costs a page
// fault per 4 KiB on first touch (about 20 us on the VMs measured here, 0.2
// GB/s), the largest cost of a received KV stream before this pool. Whoever
// is done with such records gives them back. Bounded: buffers past
// max_bytes are freed. Thread-safe; process-wide: block_buffer_pool().
class BlockBufferPool {
 public:
  explicit BlockBufferPool(uint64_t max_bytes) : max_bytes_(max_bytes) {}
  // n bytes with unspecified contents: a kept buffer of that size, else a
  // fresh one (transparent huge pages asked for: one fault per 2 MiB).
  std::vector<uint8_t> acquire(size_t n);
  // Keeps the records' buffers for later (records is left empty); what
  // exceeds the bound is freed.
  void release(std::vector<BlockRecord>& records);
  uint64_t kept_bytes() const;
  uint64_t reused() const;

 private:
  const uint64_t max_bytes_;
  mutable std::mutex mu_;
  std::unordered_map<size_t, std::vector<std::vector<uint8_t>>> free_;  // by size
  uint64_t kept_ = 0, reused_ = 0;
};
// The process's pool (256 MiB at most).
BlockBufferPool& block_buffer_pool();

uint64_t checksum_bytes(const uint8_t* data, size_t n);
// checksum_bytes of n blocks of block_bytes at `data`, memory of `be`, taken
// where the bytes are: by the host on host memory, by the backend's own op
// (Backend::checksum_blocks) on a device.
Status checksum_blocks_in_place(Backend& be, const void* data, size_t block_bytes, int64_t n, uint64_t* out);
// checksum_bytes over bytes that come in pieces (a socket's reads): digest()
// equals checksum_bytes of the pieces laid end to end. Move-only.
class ChecksumStream {
 public:
  ChecksumStream();
  ~ChecksumStream();
  ChecksumStream(ChecksumStream&& other) noexcept;
  ChecksumStream& operator=(ChecksumStream&& other) noexcept;
  void reset();
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  const detail::Xxh3Impl* impl_;  // the build chosen for this CPU
  void* state_;                   // that build's XXH3_state_t
};
// Fills header.checksum from bytes.
void seal(BlockRecord& record);
// A byte range of a block (offset, length).
struct ByteRange {
  size_t offset = 0, bytes = 0;
};
// Where a block of layout l keeps the slots [filled, tokens_per_block) of
// every (layer, K or V, head): the bytes no token of a partly filled block
// wrote. Exports zero them, so a record's bytes depend on its tokens only
// (not on what the pool's memory held before: another request's KV).
std::vector<ByteRange> unfilled_ranges(const KvLayout& l, int32_t filled);
// corruption (naming the key and what differs) unless the checksum matches
// the bytes and the record's model fingerprint and layout are the expected
// ones and the byte count fits the layout.
Status verify(const BlockRecord& record, uint64_t model_fingerprint, const KvLayout& layout);
// The part of verify() that does not read the bytes: fingerprint, layout and
// byte count (n_bytes). For hops whose bytes are hashed elsewhere.
Status verify_header(const BlockHeader& header, size_t n_bytes, uint64_t model_fingerprint,
                     const KvLayout& layout);

}  // namespace cleave
