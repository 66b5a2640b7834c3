#include "storage/backend_blocks.h"

#include <string>

namespace cleave {

Result<std::shared_ptr<BackendBlocks>> BackendBlocks::allocate(std::shared_ptr<Backend> backend, size_t n_blocks,
                                                               size_t block_bytes) {
  if (!backend || n_blocks == 0 || block_bytes == 0)
    return Status(Code::invalid_argument, "backend blocks: a backend and at least one block of some bytes");
  void* data = backend->alloc(n_blocks * block_bytes);
  if (!data)
    return Status(Code::out_of_memory, "backend blocks: no " + backend->caps().name + " memory for " +
                                           std::to_string(n_blocks) + " KV blocks of " +
                                           std::to_string(block_bytes) + " bytes");
  return std::shared_ptr<BackendBlocks>(new BackendBlocks(std::move(backend), data, n_blocks, block_bytes));
}

BackendBlocks::~BackendBlocks() { backend_->free(data_); }

Result<std::vector<BlockRecord>> BackendBlocks::to_records(size_t first, BlockBufferPool* pool) const {
  if (first > headers_.size())
    return Status(Code::invalid_argument, "backend blocks: records from block " + std::to_string(first) + " of " +
                                              std::to_string(headers_.size()));
  BlockBufferPool& buffers = pool ? *pool : block_buffer_pool();
  std::vector<BlockRecord> out;
  out.reserve(headers_.size() - first);
  for (size_t i = first; i < headers_.size(); ++i) {
    BlockRecord r;
    r.header = headers_[i];
    r.bytes = buffers.acquire(block_bytes_);
    backend_->download(r.bytes.data(), block(i), block_bytes_);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace cleave
