// Small sealed KV records for the KV stream and data socket tests.
#pragma once

#include <memory>
#include <vector>

#include "storage/block.h"

namespace cleave::test {

inline KvLayout small_layout() {
  KvLayout l;
  l.tokens_per_block = 4;
  l.n_layers = 3;
  l.n_kv_heads = 2;
  l.head_dim = 8;
  return l;
}

// n sealed records with distinct bytes (block b, byte i: a pattern of both).
inline std::shared_ptr<const std::vector<BlockRecord>> make_records(int n) {
  auto out = std::make_shared<std::vector<BlockRecord>>();
  const KvLayout layout = small_layout();
  for (int b = 0; b < n; ++b) {
    BlockRecord r;
    r.header.key = BlockKey{uint64_t(b) + 1, 77};
    r.header.model_fingerprint = 1234;
    r.header.layout = layout;
    r.header.n_tokens = b + 1 == n ? 3 : 4;
    r.bytes.resize(layout.block_bytes());
    for (size_t i = 0; i < r.bytes.size(); ++i) r.bytes[i] = uint8_t((i * 31 + size_t(b) * 7) ^ (i >> 8));
    seal(r);
    out->push_back(std::move(r));
  }
  return out;
}

}  // namespace cleave::test
