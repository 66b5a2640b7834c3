// KV blocks as storage sees them: a layout, a content key, and a record
// (header + bytes) that carries its own checksum and the fingerprint of the
// model and layout that made it (DESIGN.md invariant 2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"

namespace cleave {

// How a block's bytes are laid out; matches kernels' PagedKv:
// [layer][k=0|v=1][kv_head][slot][head_dim] of F32 within one block.
struct KvLayout {
  uint32_t dtype = 0;  // DType id of the elements (F32 = 0)
  int32_t tokens_per_block = 16;
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;

  size_t elem_bytes() const { return 4; }
  size_t layer_bytes() const {
    return size_t(2) * n_kv_heads * tokens_per_block * head_dim * elem_bytes();
  }
  size_t block_bytes() const { return layer_bytes() * n_layers; }
  // invalid_argument naming the field when a dimension is not positive.
  Status validate() const;
  uint64_t fingerprint() const;  // XXH3-64 of the fields
  bool operator==(const KvLayout&) const = default;
};

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

uint64_t checksum_bytes(const uint8_t* data, size_t n);
// Fills header.checksum from bytes.
void seal(BlockRecord& record);
// corruption (naming the key and what differs) unless the checksum matches
// the bytes and the record's model fingerprint and layout are the expected
// ones and the byte count fits the layout.
Status verify(const BlockRecord& record, uint64_t model_fingerprint, const KvLayout& layout);
// The part of verify() that does not read the bytes: fingerprint, layout and
// byte count (n_bytes). For hops whose bytes are hashed elsewhere.
Status verify_header(const BlockHeader& header, size_t n_bytes, uint64_t model_fingerprint,
                     const KvLayout& layout);

}  // namespace cleave
