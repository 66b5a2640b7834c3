// A fixed set of KV block ids with reference counts, and per-sequence block
// tables on top of it. Storage hands out ids only: the KV bytes live where the
// engine put them (PagedKv), so copy-on-write reports (src, dst) and the
// caller copies. Thread-compatible (no locking): one owner, or external sync.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "common/status.h"

namespace cleave {

class BlockPool {
 public:
  // invalid_argument when n_blocks or tokens_per_block is not positive.
  static Result<std::unique_ptr<BlockPool>> create(int32_t n_blocks, int32_t tokens_per_block);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  int32_t capacity() const { return int32_t(refs_.size()); }
  int32_t tokens_per_block() const { return tokens_per_block_; }
  int32_t free_count() const { return int32_t(free_.size()); }
  bool can_allocate(int32_t n) const { return n <= free_count(); }

  // A free block with refcount 1; nullopt when none is free ("no room" is a
  // value the scheduler plans with, not an error).
  std::optional<int32_t> allocate();
  // n blocks, all or nothing: nullopt (and nothing taken) when fewer are free.
  std::optional<std::vector<int32_t>> allocate_n(int32_t n);

  // invalid_argument for an id outside [0, capacity) or a free block.
  Status retain(int32_t id);
  // Back on the free list when the count reaches 0. invalid_argument as retain.
  Status release(int32_t id);
  // 0 for a free block; invalid_argument for an id outside [0, capacity).
  Result<int32_t> refcount(int32_t id) const;
  bool is_allocated(int32_t id) const { return valid(id) && refs_[size_t(id)] > 0; }

 private:
  BlockPool(int32_t n_blocks, int32_t tokens_per_block);
  bool valid(int32_t id) const { return id >= 0 && id < capacity(); }
  Status check_allocated(int32_t id, const char* op) const;

  int32_t tokens_per_block_;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;  // stack; allocation hands out low ids first
};

// Copy-on-write: the caller copies block src's bytes into dst before writing.
struct BlockCopy {
  int32_t src = -1;
  int32_t dst = -1;
  bool operator==(const BlockCopy&) const = default;
};

// What a growth or write-access request did. When no_room is set nothing
// changed (no block taken, no token added): free blocks and retry.
struct BlockGrant {
  bool no_room = false;
  int32_t blocks_needed = 0;      // free blocks the request needed (or took)
  std::optional<BlockCopy> copy;  // set when a shared block was replaced
};

// One sequence's block table: block ids in token order and the token count.
// Holds one reference on each of its blocks and releases them on clear() or
// destruction; the pool must outlive it. Move-only.
class SequenceBlocks {
 public:
  explicit SequenceBlocks(BlockPool& pool) : pool_(&pool) {}
  // A sequence starting on blocks someone else holds (a cached prefix): takes
  // a reference on each. invalid_argument unless every id is allocated and
  // ids.size() == ceil(n_tokens / tokens_per_block); nothing retained then.
  static Result<SequenceBlocks> from_shared(BlockPool& pool, const std::vector<int32_t>& ids,
                                            int32_t n_tokens);
  ~SequenceBlocks() { clear(); }
  SequenceBlocks(SequenceBlocks&& other) noexcept;
  SequenceBlocks& operator=(SequenceBlocks&& other) noexcept;
  SequenceBlocks(const SequenceBlocks&) = delete;
  SequenceBlocks& operator=(const SequenceBlocks&) = delete;

  const std::vector<int32_t>& blocks() const { return blocks_; }
  int32_t n_tokens() const { return n_tokens_; }
  int32_t n_blocks() const { return int32_t(blocks_.size()); }
  BlockPool& pool() const { return *pool_; }

  // Free blocks append_tokens(n) needs: new blocks, plus one when the last
  // block is partly filled and shared (it is copied before it is written).
  int32_t blocks_needed(int32_t n) const;
  // Makes room for n more tokens, all or nothing. When the partly filled last
  // block is shared it is replaced first (grant.copy says which bytes to
  // copy). invalid_argument for n < 0.
  Result<BlockGrant> append_tokens(int32_t n);
  // Before writing into blocks()[index]: when its refcount > 1, a fresh block
  // replaces it in this table, the shared one is released and grant.copy
  // says (src, dst). Exclusive block: nothing happens. invalid_argument for an
  // index outside [0, n_blocks()).
  Result<BlockGrant> ensure_writable(int32_t index);
  // A second table sharing every block (each refcount + 1). Cannot fail.
  SequenceBlocks fork() const;
  // Releases every block; the sequence is empty afterwards.
  void clear();

 private:
  bool last_partial_shared() const;

  BlockPool* pool_;
  std::vector<int32_t> blocks_;
  int32_t n_tokens_ = 0;
};

}  // namespace cleave
