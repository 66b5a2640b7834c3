// KV blocks held in a backend's memory (a GPU's): what a device prefill
// hands off and a device decoder imports, moved between processes by the
// backend (actors/kv_shared.h: offer_from, fetch_kv_shared_to), never
// through the host. headers()[i]'s bytes lie at data() + i x block_bytes().
// The memory is freed with the last reference; the backend is kept alive by
// it, so the blocks may outlive the engine that made them (a kv_sender's
// outbox). A backend whose memory these are must take alloc, copy,
// download and free from any thread (CUDA's and the CPU's do).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "common/status.h"
#include "storage/block.h"

namespace cleave {

class BackendBlocks {
 public:
  // Memory for n_blocks of block_bytes on backend, headers empty (whoever
  // fills the memory sets them). out_of_memory naming the size when the
  // backend has no room; invalid_argument for no backend or no blocks.
  static Result<std::shared_ptr<BackendBlocks>> allocate(std::shared_ptr<Backend> backend, size_t n_blocks,
                                                         size_t block_bytes);
  ~BackendBlocks();
  BackendBlocks(const BackendBlocks&) = delete;
  BackendBlocks& operator=(const BackendBlocks&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  // Block i's bytes (i < capacity()).
  const void* block(size_t i) const { return static_cast<const uint8_t*>(data_) + i * block_bytes_; }
  size_t block_bytes() const { return block_bytes_; }
  size_t capacity() const { return capacity_; }
  std::vector<BlockHeader>& headers() { return headers_; }
  const std::vector<BlockHeader>& headers() const { return headers_; }
  size_t size() const { return headers_.size(); }
  Backend& backend() const { return *backend_; }

  // Host records of blocks [first, size()) (the socket path, the store's
  // copy): each block downloaded into a buffer of `pool` (block_buffer_pool()
  // when null) with its header; the checksums are the headers' (taken where
  // the bytes were). invalid_argument for first past size().
  Result<std::vector<BlockRecord>> to_records(size_t first = 0, BlockBufferPool* pool = nullptr) const;

 private:
  BackendBlocks(std::shared_ptr<Backend> backend, void* data, size_t n, size_t block_bytes)
      : backend_(std::move(backend)), data_(data), capacity_(n), block_bytes_(block_bytes) {}
  std::shared_ptr<Backend> backend_;
  void* data_ = nullptr;
  size_t capacity_ = 0, block_bytes_ = 0;
  std::vector<BlockHeader> headers_;
};

}  // namespace cleave
