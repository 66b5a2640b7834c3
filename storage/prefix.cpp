#include "storage/prefix.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace cleave {

BlockKey block_key(const BlockKey& parent, const int32_t* tokens, int n, uint64_t model_fp,
                   const KvLayout& layout) {
  const size_t n_tok = n > 0 ? size_t(n) : 0;
  // Small fixed buffer for the usual block sizes; heap only past 256 tokens.
  constexpr size_t kInline = 2 * 8 + 256 * 4 + 2 * 8;
  const size_t bytes = 2 * 8 + n_tok * 4 + 2 * 8;
  uint8_t inline_buf[kInline];
  std::vector<uint8_t> heap;
  uint8_t* buf = inline_buf;
  if (bytes > kInline) {
    heap.resize(bytes);
    buf = heap.data();
  }
  uint8_t* p = buf;
  auto put = [&p](const void* src, size_t len) {
    if (len) std::memcpy(p, src, len);
    p += len;
  };
  const uint64_t layout_fp = layout.fingerprint();
  put(&parent.lo, 8);
  put(&parent.hi, 8);
  put(tokens, n_tok * 4);
  put(&model_fp, 8);
  put(&layout_fp, 8);
  const XXH128_hash_t h = XXH3_128bits(buf, bytes);
  return BlockKey{h.low64, h.high64};
}

BlockKey block_key(const BlockKey& parent, const int32_t* tokens, int n, uint64_t model_fp,
                   const KvLayout& layout, int32_t first, std::span<const KeySpan> spans) {
  const BlockKey plain = block_key(parent, tokens, n, model_fp, layout);
  std::vector<uint8_t> buf;
  auto put = [&buf](const void* src, size_t len) {
    const auto* b = static_cast<const uint8_t*>(src);
    buf.insert(buf.end(), b, b + len);
  };
  const int64_t end = int64_t(first) + std::max(n, 0);
  for (const KeySpan& s : spans) {
    if (s.position >= end || int64_t(s.position) + s.n_tokens <= first) continue;
    if (buf.empty()) {
      put(&plain.lo, 8);
      put(&plain.hi, 8);
    }
    put(&s.content.lo, 8);
    put(&s.content.hi, 8);
    put(&s.position, 4);
    put(&s.n_tokens, 4);
  }
  if (buf.empty()) return plain;
  const XXH128_hash_t h = XXH3_128bits(buf.data(), buf.size());
  return BlockKey{h.low64, h.high64};
}

std::vector<BlockKey> chain_keys(const int32_t* tokens, int32_t n_tokens, uint64_t model_fp,
                                 const KvLayout& layout, std::span<const KeySpan> spans) {
  std::vector<BlockKey> keys;
  const int32_t tpb = layout.tokens_per_block;
  if (tpb <= 0 || n_tokens <= 0) return keys;
  const int32_t n_full = n_tokens / tpb;
  keys.reserve(size_t(n_full));
  BlockKey parent{0, 0};
  for (int32_t b = 0; b < n_full; ++b) {
    parent = block_key(parent, tokens + size_t(b) * size_t(tpb), tpb, model_fp, layout, b * tpb,
                       spans);
    keys.push_back(parent);
  }
  return keys;
}

int32_t PrefixMatch::usable_tokens(int32_t prompt_len) const {
  return std::max<int32_t>(0, std::min<int32_t>(n_tokens, prompt_len - 1));
}

Result<std::unique_ptr<PrefixIndex>> PrefixIndex::create(BlockPool& pool, uint64_t model_fp,
                                                         const KvLayout& layout) {
  CLEAVE_RETURN_IF_ERROR(layout.validate());
  if (layout.tokens_per_block != pool.tokens_per_block())
    return Status(Code::invalid_argument, "prefix index: layout tokens_per_block " +
                                              std::to_string(layout.tokens_per_block) +
                                              " differs from the pool's " +
                                              std::to_string(pool.tokens_per_block()));
  return std::unique_ptr<PrefixIndex>(new PrefixIndex(pool, model_fp, layout));
}

PrefixIndex::~PrefixIndex() {
  for (const auto& [key, id] : map_) CLEAVE_CHECK(pool_->release(id).ok());
}

PrefixMatch PrefixIndex::longest_prefix(const int32_t* tokens, int32_t n_tokens,
                                        std::span<const KeySpan> spans) const {
  PrefixMatch m;
  const int32_t tpb = layout_.tokens_per_block;
  const int32_t n_full = n_tokens > 0 ? n_tokens / tpb : 0;
  BlockKey parent{0, 0};
  // Keys are computed one block at a time, so a miss early stops the hashing.
  for (int32_t b = 0; b < n_full; ++b) {
    parent = block_key(parent, tokens + size_t(b) * size_t(tpb), tpb, model_fp_, layout_, b * tpb,
                       spans);
    auto it = map_.find(parent);
    if (it == map_.end()) break;
    m.block_ids.push_back(it->second);
    m.keys.push_back(parent);
  }
  m.n_blocks = int32_t(m.block_ids.size());
  m.n_tokens = m.n_blocks * tpb;
  return m;
}

std::optional<int32_t> PrefixIndex::find(const BlockKey& key) const {
  auto it = map_.find(key);
  if (it == map_.end()) return std::nullopt;
  return it->second;
}

Result<int32_t> PrefixIndex::insert(const BlockKey& key, int32_t block_id) {
  if (!pool_->is_allocated(block_id))
    return Status(Code::invalid_argument, "prefix index: block " + std::to_string(block_id) +
                                              " for key " + key.hex() + " is not allocated");
  auto it = map_.find(key);
  if (it != map_.end()) return it->second;
  CLEAVE_RETURN_IF_ERROR(pool_->retain(block_id));
  map_.emplace(key, block_id);
  return block_id;
}

Result<int32_t> PrefixIndex::publish(const int32_t* tokens, const SequenceBlocks& seq) {
  if (&seq.pool() != pool_)
    return Status(Code::invalid_argument, "prefix index: sequence belongs to another pool");
  const auto keys = chain_keys(tokens, seq.n_tokens(), model_fp_, layout_);
  int32_t added = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const bool had = contains(keys[i]);
    auto r = insert(keys[i], seq.blocks()[i]);
    if (!r.ok()) return r.status();
    if (!had) ++added;
  }
  return added;
}

Status PrefixIndex::erase(const BlockKey& key) {
  auto it = map_.find(key);
  if (it == map_.end())
    return Status(Code::not_found, "prefix index: no block for key " + key.hex());
  const int32_t id = it->second;
  map_.erase(it);
  return pool_->release(id);
}

}  // namespace cleave
