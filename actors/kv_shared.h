// KV handed between two processes on one host through shared memory (no
// CAF): the prefill's kv_sender copies a stream's blocks into a region of a
// shareable backend (Backend::alloc_shared) and answers the region's handle
// with the block headers; the decoder's kv_receiver maps it, copies each
// block out and checks it against its header's checksum, then acknowledges
// so the sender frees the region. On the CPU backend that is two memcpys,
// no socket; on a GPU backend the region is device memory (CUDA IPC) and
// the checksums are taken on the device (Backend::checksum_blocks).
//
// "One host" is what shared memory reaches: the same boot of the same
// machine, seen from the same PID and network namespaces (nodes in network
// namespaces of their own, as the netns tests make, use the socket).
// Anything that fails (no shareable backend, another host, a region gone,
// a checksum that does not match) ends in a typed Status, and the receiver
// falls back to the data socket.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "actors/kv_stream.h"
#include "kernels/backend.h"

namespace cleave {

// This process's host identity ("" when /proc cannot say): boot id, PID
// and network namespace. Two processes may share memory when theirs are
// equal and not empty.
const std::string& kv_host_identity();

// A sender's regions, one per offered stream, until the receiver's ack or
// the time to live. Released regions are kept (up to kKeptBytes) and reused
// by later offers that fit, so a stream's bytes land in pages already
// mapped (fresh memory costs a page fault per 4 KiB). Not thread-safe (one
// kv_sender actor owns it).
class KvSharedOffers {
 public:
  explicit KvSharedOffers(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {}
  ~KvSharedOffers();
  KvSharedOffers(const KvSharedOffers&) = delete;
  KvSharedOffers& operator=(const KvSharedOffers&) = delete;

  // Copies records[first_block..) into a new region (block i at i x
  // block_bytes) and describes it: `offer` gets the request id, first
  // block, total bytes and the block headers (their checksums are the
  // records'); returns the handle. A new offer for the same request
  // replaces the old one. corrupt_block >= 0 (tests) flips a bit in block
  // corrupt_block mod n after the copy. unsupported when the backend does
  // not share memory; invalid_argument for first_block past the records
  // (or none after it), blocks of mixed layouts.
  Result<std::string> offer(uint64_t request_id, const std::vector<BlockRecord>& records, int32_t first_block,
                            msg::KvChunk& offer, int32_t corrupt_block = -1);
  // offer() for blocks already in this offerer's backend memory: headers[i]'s
  // bytes at blocks + i x block_bytes (an engine's export_blocks_to on the
  // same backend, a device's KV), copied into the region by the backend, never
  // through the host. first_block is the pull's (the first header's block).
  // invalid_argument for no headers, headers of mixed layouts, or no
  // memory.
  Result<std::string> offer_from(uint64_t request_id, const void* blocks, const std::vector<BlockHeader>& headers,
                                 int32_t first_block, msg::KvChunk& offer, int32_t corrupt_block = -1);
  // The receiver is done with the region (or failed): it is freed. false
  // when there was none (released or expired before); else *blocks and
  // *bytes (when given) say what it held.
  bool release(uint64_t request_id, int32_t* blocks = nullptr, uint64_t* bytes = nullptr);
  // Frees regions offered longer ago than ttl; returns how many.
  size_t expire(std::chrono::steady_clock::duration ttl);
  size_t size() const { return regions_.size(); }
  // Released regions kept for reuse, and how many offers reused one.
  size_t kept() const { return free_.size(); }
  uint64_t reused() const { return reused_; }
  static constexpr uint64_t kKeptBytes = uint64_t(256) << 20;

 private:
  struct Entry {
    SharedRegion region;
    int32_t blocks = 0;
    uint64_t used = 0;  // bytes of the region the offer fills
    std::chrono::steady_clock::time_point at;
  };
  // Keeps a released region for reuse while under kKeptBytes, else frees it.
  void keep(SharedRegion region);
  // The smallest kept region of at least `bytes`, else a new one.
  Result<SharedRegion> take(size_t bytes);
  // Flips a bit of block corrupt_block mod n (tests), then records the offer.
  std::string publish(uint64_t request_id, SharedRegion region, std::vector<BlockHeader> headers,
                      int32_t first_block, size_t block_bytes, int32_t corrupt_block, msg::KvChunk& offer);
  std::shared_ptr<Backend> backend_;
  std::unordered_map<uint64_t, Entry> regions_;
  std::vector<SharedRegion> free_;
  uint64_t free_bytes_ = 0, reused_ = 0;
};

// A receiver's mappings of senders' regions, kept for their next streams
// (senders reuse their regions): the first pass over a fresh mapping of a
// 64 MiB region took 27-31 ms here, the same copy from one already mapped
// 3.3 ms, MAP_POPULATE or not (measured). LRU, at most max_bytes mapped;
// thread-safe; a mapping a fetch is reading stays valid until it is done,
// whatever the cache drops meanwhile.
class KvSharedMappings {
 public:
  explicit KvSharedMappings(std::shared_ptr<Backend> backend, uint64_t max_bytes = uint64_t(512) << 20)
      : backend_(std::move(backend)), max_bytes_(max_bytes) {}
  Backend& backend() const { return *backend_; }
  // The region `handle` names, mapped over at least its first `bytes`.
  Result<std::shared_ptr<const void>> map(const std::string& handle, size_t bytes);
  size_t size() const;
  uint64_t hits() const;

 private:
  struct Entry {
    std::string handle;
    size_t bytes = 0;
    std::shared_ptr<const void> data;
  };
  std::shared_ptr<Backend> backend_;
  uint64_t max_bytes_;
  mutable std::mutex mu_;
  std::vector<Entry> lru_;  // most recent last
  uint64_t mapped_ = 0, hits_ = 0;
};

// fetch_kv_shared into `dst`, memory of the mappings' backend of at least
// offer.total_bytes (block i at i x block_bytes): the region's blocks copied
// by the backend, never through the host, then checked against their
// headers where they landed (checksum_blocks on a device), so what is
// checked is what is kept. Returns the headers (for
// Engine::import_blocks_from). Errors as fetch_kv_shared's. Counts
// chunks_received (one per block), bytes_received.
Result<std::vector<BlockHeader>> fetch_kv_shared_to(KvSharedMappings& mappings, const std::string& handle,
                                                    const msg::KvChunk& offer, const msg::KvPull& pull,
                                                    uint64_t max_total_bytes, KvStreamCounters& counters,
                                                    void* dst);

// The receiving end: checks `offer` against the pull (request, first block,
// sizes, one valid layout, at most max_total_bytes: invalid_argument
// otherwise), maps the region `handle` names (through `mappings`), copies
// each block into a buffer of `pool` (block_buffer_pool() when null) and
// checks it against its header's checksum (corruption naming the block).
// On a backend whose memory the host does not read, the checksums are taken
// in the region by the backend before the copy out. Counts chunks_received
// (one per block), bytes_received.
Result<std::vector<BlockRecord>> fetch_kv_shared(KvSharedMappings& mappings, const std::string& handle,
                                                 const msg::KvChunk& offer, const msg::KvPull& pull,
                                                 uint64_t max_total_bytes, KvStreamCounters& counters,
                                                 BlockBufferPool* pool = nullptr);

}  // namespace cleave
