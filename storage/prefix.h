// Prefix reuse: content keys for full KV blocks and an index from key to the
// pool block that holds it.
//
// A full block's key is a hash chain: XXH3-128 over (parent key, the block's
// token ids, model fingerprint, layout fingerprint); the first block's parent
// is {0, 0}. Equal keys mean equal KV bytes for the same model and layout, so
// a block can be shared by every sequence whose prompt starts with the same
// tokens. A partly filled last block has no key: it is never shared or cached.
//
// Positions whose KV depends on more than their token id (an image's
// embeddings sit at placeholder ids) are named by KeySpans: every block a
// span overlaps hashes the span's content key too, so equal placeholder ids
// with different content never share a key, and the same content does.
// Blocks that no span touches keep exactly the plain key.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "storage/block.h"
#include "storage/block_pool.h"

namespace cleave {

// XXH3_128bits (seed 0) over the bytes, in native (little-endian) order, of:
// parent.lo, parent.hi (u64 each), tokens[0..n) (i32 each), model_fp (u64),
// layout.fingerprint() (u64).
BlockKey block_key(const BlockKey& parent, const int32_t* tokens, int n, uint64_t model_fp,
                   const KvLayout& layout);

// Positions [position, position + n_tokens) of a sequence whose rows come
// from `content` (e.g. an image's content hash), not from their token ids.
struct KeySpan {
  int32_t position = 0;
  int32_t n_tokens = 0;
  BlockKey content;
  bool operator==(const KeySpan&) const = default;
};

// The key of the block holding positions [first, first + n) of a sequence
// with spans (sorted by position, not overlapping): block_key() when no span
// overlaps the block; else XXH3_128bits over block_key()'s lo, hi (u64 each)
// followed by, for each overlapping span in order, content.lo, content.hi
// (u64), position, n_tokens (i32).
BlockKey block_key(const BlockKey& parent, const int32_t* tokens, int n, uint64_t model_fp,
                   const KvLayout& layout, int32_t first, std::span<const KeySpan> spans);

// Keys of the full blocks of tokens[0..n_tokens), in order, blocks of
// layout.tokens_per_block tokens (the layout fingerprint covers the block
// size, so it is taken from the layout rather than passed separately).
// 40 tokens at 16 per block give 2 keys; the last 8 tokens have none.
// With spans, each block is keyed by the spanned block_key().
std::vector<BlockKey> chain_keys(const int32_t* tokens, int32_t n_tokens, uint64_t model_fp,
                                 const KvLayout& layout, std::span<const KeySpan> spans = {});

// The longest cached prefix of a token sequence.
struct PrefixMatch {
  int32_t n_blocks = 0;            // full blocks matched, from the start
  int32_t n_tokens = 0;            // n_blocks * tokens_per_block: the raw match
  std::vector<int32_t> block_ids;  // pool ids of the matched blocks, in order
  std::vector<BlockKey> keys;      // their keys

  // Tokens of a prompt of prompt_len tokens whose KV can be taken from the
  // cache: the raw match capped at prompt_len - 1. A prompt that is entirely
  // cached (e.g. 48 tokens, 3 full blocks matched) still has to run its last
  // token through the model, because the cache holds KV, not the logits the
  // next token is sampled from. So 48 matched -> 47 usable; the caller builds
  // the sequence on the matched blocks with 47 tokens
  // (SequenceBlocks::from_shared(pool, block_ids, 47)) and appends the last
  // token, which copies the shared last block before it is written
  // (append_tokens reports the copy). Never negative.
  int32_t usable_tokens(int32_t prompt_len) const;
};

// Key -> pool block. The index holds one reference on every block it maps
// (BlockPool::retain on insert, release on erase), so a cached block stays
// allocated until it is evicted, even when no sequence uses it. A block whose
// refcount is 1 is held by the index alone: evicting it frees it.
// Thread-compatible, like BlockPool.
class PrefixIndex {
 public:
  // invalid_argument when the layout is invalid or its tokens_per_block
  // differs from the pool's. The pool must outlive the index.
  static Result<std::unique_ptr<PrefixIndex>> create(BlockPool& pool, uint64_t model_fp,
                                                     const KvLayout& layout);
  ~PrefixIndex();
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  uint64_t model_fingerprint() const { return model_fp_; }
  const KvLayout& layout() const { return layout_; }
  size_t size() const { return map_.size(); }

  // Walks the key chain of tokens[0..n_tokens) (keyed with spans, see
  // chain_keys) and stops at the first miss.
  PrefixMatch longest_prefix(const int32_t* tokens, int32_t n_tokens,
                             std::span<const KeySpan> spans = {}) const;
  std::optional<int32_t> find(const BlockKey& key) const;
  bool contains(const BlockKey& key) const { return map_.count(key) != 0; }

  // Publishes block_id under key and returns the block now indexed under it:
  // block_id, or the block already there when another writer published the
  // same content first (the first one wins; the caller may switch to the
  // returned block and release its own copy). invalid_argument when block_id
  // is not allocated in the pool.
  Result<int32_t> insert(const BlockKey& key, int32_t block_id);
  // Publishes every full block of a sequence whose tokens are
  // tokens[0..seq.n_tokens()); returns how many keys were new.
  // invalid_argument when seq belongs to another pool.
  Result<int32_t> publish(const int32_t* tokens, const SequenceBlocks& seq);
  // Eviction: drops the key and releases the index's reference (the block is
  // freed when no sequence holds it). not_found when absent.
  Status erase(const BlockKey& key);

 private:
  PrefixIndex(BlockPool& pool, uint64_t model_fp, const KvLayout& layout)
      : pool_(&pool), model_fp_(model_fp), layout_(layout) {}

  BlockPool* pool_;
  uint64_t model_fp_;
  KvLayout layout_;
  std::unordered_map<BlockKey, int32_t, BlockKeyHash> map_;
};

}  // namespace cleave
