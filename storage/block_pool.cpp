#include "storage/block_pool.h"

#include <string>
#include <utility>

namespace cleave {

Result<std::unique_ptr<BlockPool>> BlockPool::create(int32_t n_blocks, int32_t tokens_per_block) {
  if (n_blocks <= 0)
    return Status(Code::invalid_argument,
                  "block pool: capacity " + std::to_string(n_blocks) + " must be positive");
  if (tokens_per_block <= 0)
    return Status(
        Code::invalid_argument,
        "block pool: tokens_per_block " + std::to_string(tokens_per_block) + " must be positive");
  return std::unique_ptr<BlockPool>(new BlockPool(n_blocks, tokens_per_block));
}

BlockPool::BlockPool(int32_t n_blocks, int32_t tokens_per_block)
    : tokens_per_block_(tokens_per_block), refs_(size_t(n_blocks), 0) {
  free_.reserve(size_t(n_blocks));
  for (int32_t id = n_blocks - 1; id >= 0; --id) free_.push_back(id);
}

std::optional<int32_t> BlockPool::allocate() {
  if (free_.empty()) return std::nullopt;
  const int32_t id = free_.back();
  free_.pop_back();
  refs_[size_t(id)] = 1;
  return id;
}

std::optional<std::vector<int32_t>> BlockPool::allocate_n(int32_t n) {
  if (n < 0 || !can_allocate(n)) return std::nullopt;
  std::vector<int32_t> ids;
  ids.reserve(size_t(n));
  for (int32_t i = 0; i < n; ++i) ids.push_back(*allocate());
  return ids;
}

Status BlockPool::check_allocated(int32_t id, const char* op) const {
  if (!valid(id))
    return Status(Code::invalid_argument, std::string("block pool: ") + op + " of block " +
                                              std::to_string(id) + " outside [0, " +
                                              std::to_string(capacity()) + ")");
  if (refs_[size_t(id)] == 0)
    return Status(Code::invalid_argument, std::string("block pool: ") + op + " of block " +
                                              std::to_string(id) + ", which is free");
  return Status::Ok();
}

Status BlockPool::retain(int32_t id) {
  CLEAVE_RETURN_IF_ERROR(check_allocated(id, "retain"));
  ++refs_[size_t(id)];
  return Status::Ok();
}

Status BlockPool::release(int32_t id) {
  CLEAVE_RETURN_IF_ERROR(check_allocated(id, "release"));
  if (--refs_[size_t(id)] == 0) free_.push_back(id);
  return Status::Ok();
}

Result<int32_t> BlockPool::refcount(int32_t id) const {
  if (!valid(id))
    return Status(Code::invalid_argument, "block pool: refcount of block " + std::to_string(id) +
                                              " outside [0, " + std::to_string(capacity()) + ")");
  return refs_[size_t(id)];
}

// ---------------------------------------------------------------------------

Result<SequenceBlocks> SequenceBlocks::from_shared(BlockPool& pool, const std::vector<int32_t>& ids,
                                                   int32_t n_tokens) {
  const int64_t tpb = pool.tokens_per_block();
  if (n_tokens < 0 || int64_t(ids.size()) != (int64_t(n_tokens) + tpb - 1) / tpb)
    return Status(Code::invalid_argument, "sequence blocks: " + std::to_string(ids.size()) +
                                              " blocks cannot hold " + std::to_string(n_tokens) +
                                              " tokens at " + std::to_string(tpb) +
                                              " tokens per block");
  for (int32_t id : ids)
    if (!pool.is_allocated(id))
      return Status(Code::invalid_argument,
                    "sequence blocks: shared block " + std::to_string(id) + " is not allocated");
  SequenceBlocks seq(pool);
  for (int32_t id : ids) CLEAVE_CHECK(pool.retain(id).ok());
  seq.blocks_ = ids;
  seq.n_tokens_ = n_tokens;
  return seq;
}

SequenceBlocks::SequenceBlocks(SequenceBlocks&& other) noexcept
    : pool_(other.pool_), blocks_(std::move(other.blocks_)), n_tokens_(other.n_tokens_) {
  other.blocks_.clear();
  other.n_tokens_ = 0;
}

SequenceBlocks& SequenceBlocks::operator=(SequenceBlocks&& other) noexcept {
  if (this != &other) {
    clear();
    pool_ = other.pool_;
    blocks_ = std::move(other.blocks_);
    n_tokens_ = other.n_tokens_;
    other.blocks_.clear();
    other.n_tokens_ = 0;
  }
  return *this;
}

bool SequenceBlocks::last_partial_shared() const {
  if (blocks_.empty() || n_tokens_ % pool_->tokens_per_block() == 0) return false;
  auto r = pool_->refcount(blocks_.back());
  return r.ok() && *r > 1;
}

int32_t SequenceBlocks::blocks_needed(int32_t n) const {
  if (n <= 0) return 0;
  const int64_t tpb = pool_->tokens_per_block();
  const int64_t total = (int64_t(n_tokens_) + n + tpb - 1) / tpb;
  return int32_t(total - n_blocks()) + (last_partial_shared() ? 1 : 0);
}

Result<BlockGrant> SequenceBlocks::append_tokens(int32_t n) {
  if (n < 0)
    return Status(Code::invalid_argument,
                  "sequence blocks: cannot append " + std::to_string(n) + " tokens");
  if (int64_t(n_tokens_) + n > INT32_MAX)
    return Status(Code::out_of_range, "sequence blocks: " + std::to_string(n_tokens_) + " + " +
                                          std::to_string(n) + " tokens overflow");
  BlockGrant grant;
  grant.blocks_needed = blocks_needed(n);
  if (n == 0) return grant;
  const bool cow = last_partial_shared();
  auto ids = pool_->allocate_n(grant.blocks_needed);
  if (!ids) {
    grant.no_room = true;
    return grant;
  }
  size_t next = 0;
  if (cow) {
    const int32_t src = blocks_.back();
    const int32_t dst = (*ids)[next++];
    blocks_.back() = dst;
    CLEAVE_CHECK(pool_->release(src).ok());
    grant.copy = BlockCopy{src, dst};
  }
  for (; next < ids->size(); ++next) blocks_.push_back((*ids)[next]);
  n_tokens_ += n;
  return grant;
}

Result<BlockGrant> SequenceBlocks::ensure_writable(int32_t index) {
  if (index < 0 || index >= n_blocks())
    return Status(Code::invalid_argument, "sequence blocks: block index " + std::to_string(index) +
                                              " outside [0, " + std::to_string(n_blocks()) + ")");
  BlockGrant grant;
  const int32_t src = blocks_[size_t(index)];
  auto refs = pool_->refcount(src);
  if (!refs.ok()) return refs.status();
  if (*refs <= 1) return grant;
  grant.blocks_needed = 1;
  auto dst = pool_->allocate();
  if (!dst) {
    grant.no_room = true;
    return grant;
  }
  blocks_[size_t(index)] = *dst;
  CLEAVE_CHECK(pool_->release(src).ok());
  grant.copy = BlockCopy{src, *dst};
  return grant;
}

SequenceBlocks SequenceBlocks::fork() const {
  SequenceBlocks copy(*pool_);
  for (int32_t id : blocks_) CLEAVE_CHECK(pool_->retain(id).ok());
  copy.blocks_ = blocks_;
  copy.n_tokens_ = n_tokens_;
  return copy;
}

void SequenceBlocks::clear() {
  for (int32_t id : blocks_) CLEAVE_CHECK(pool_->release(id).ok());
  blocks_.clear();
  n_tokens_ = 0;
}

}  // namespace cleave
