// KV streaming between a prefill stage and a decoder (no CAF): the chunk
// protocol the kv_sender and kv_receiver actors (kv_stream_actors.cpp) speak, as plain
// classes the tests and the transfer benchmark drive directly.
//
// A stream carries blocks [first_block, n) of one handed-off request, layer
// by layer: layer 0 of every block, then layer 1, ... (KvLayout keeps each
// (block, layer) part contiguous), cut into chunks of chunk_bytes. Chunk 0
// carries the block headers. Each chunk has its XXH3-64 checksum; the
// assembler takes chunks strictly in order, checks request, sequence number,
// offset, sizes and checksum, and copies each one straight into the blocks
// it belongs to, so the records are complete as soon as the last layer
// lands. Each finished record is then verified against its own checksum
// (the engine verifies model and layout again when it imports it).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <sys/uio.h>

#include "common/status.h"
#include "schema/messages.h"
#include "storage/backend_blocks.h"
#include "storage/block.h"

namespace cleave {

// Defaults of the stream options (PipelineOptions, `cleave node`).
constexpr uint32_t kDefaultKvChunkBytes = uint32_t(1) << 20;
constexpr int32_t kDefaultKvWindow = 8;

// How prefill stages move KV to decoders (PipelineOptions, NodeOptions).
struct KvStreamOptions {
  bool direct = true;  // stream prefill -> decode (the store gets a copy); false: store only
  uint32_t chunk_bytes = kDefaultKvChunkBytes;
  int32_t window = kDefaultKvWindow;  // chunks in flight per stream before an ack
  // tests: senders flip a bit in this chunk of each stream (through shared
  // memory: in block fault_corrupt_chunk mod the blocks sent)
  int32_t fault_corrupt_chunk = -1;
  // Between processes on one host (kv_host_identity() equal): blocks go
  // through shared memory (actors/kv_shared.h) rather than the data socket,
  // and between device stages that shared memory does not reach, over a
  // device link (actors/kv_link.h); false: the socket always (`cleave node
  // --kv-transport socket`). A node with false neither asks for nor offers
  // either.
  bool shared_memory = true;
  // New requests on prefill and colocated stages first read the prompt's
  // leading blocks their engine lacks from their kv_store (in a KV pool:
  // from whichever store holds them), then compute the rest.
  bool pool = false;
  // Set by Node: "host:port" where this node's middleman listens, named in
  // hand-offs so decoders on other nodes connect here directly.
  std::string node_address;
};

// invalid_argument naming the bound: chunk bytes and window within what a
// KvPull may ask for (schema/codec.h).
Status validate_kv_stream_options(uint32_t chunk_bytes, int32_t window);

// The block headers a stream (or a shared-memory offer) starts with, against
// the byte count it states: one layout, at most max_total bytes in all. The
// reason when they do not fit (for the caller to put in context), else "";
// total gets their bytes. headers must not be empty.
std::string check_stream_headers(const std::vector<BlockHeader>& headers, uint64_t stated_bytes,
                                 uint64_t max_total, uint64_t& total);

// An offer of a stream's blocks in one piece (shared memory, a device link:
// KvChunk's request, first block, total bytes and headers) against the pull
// it answers: invalid_argument naming what disagrees, prefixed with `what`
// ("KV over shared memory"). kv_offer_mismatch: the corruption error for
// block i of an offer whose bytes do not match its checksum.
Status check_kv_offer(const msg::KvChunk& offer, const msg::KvPull& pull, uint64_t max_total_bytes,
                      const char* what);
Status kv_offer_mismatch(const msg::KvChunk& offer, size_t i, const char* what);

class KvStreamWriter {
 public:
  // Streams (*records)[first_block..]; every record has one layout (the
  // sender's engine made them all).
  KvStreamWriter(uint64_t request_id, std::shared_ptr<const std::vector<BlockRecord>> records,
                 int32_t first_block, uint32_t chunk_bytes);

  uint32_t n_chunks() const { return n_chunks_; }
  uint64_t total_bytes() const { return total_; }
  int32_t n_blocks() const { return n_blocks_; }
  // Chunk seq (< n_chunks()), checksummed.
  msg::KvChunk chunk(uint32_t seq) const;
  // Chunk seq without its data and checksum (headers set): the places in
  // the records its bytes come from, in order, replace `pieces` (the data
  // socket sends them from there, no copy, and the checksum after them,
  // computed as it sends).
  msg::KvChunk header(uint32_t seq, std::vector<iovec>& pieces) const;

 private:
  uint64_t request_id_;
  std::shared_ptr<const std::vector<BlockRecord>> records_;
  int32_t first_block_, n_blocks_;
  uint32_t chunk_bytes_;
  uint64_t total_ = 0, layer_bytes_ = 0;
  uint32_t n_chunks_ = 0;
};

class KvStreamAssembler {
 public:
  // max_total_bytes bounds what chunk 0's headers may make it allocate.
  // Blocks come from pool (block_buffer_pool() when null) and go back to
  // it when the stream is not taken.
  KvStreamAssembler(uint64_t request_id, int32_t first_block, uint64_t max_total_bytes,
                    BlockBufferPool* pool = nullptr);
  ~KvStreamAssembler();
  KvStreamAssembler(const KvStreamAssembler&) = delete;
  KvStreamAssembler& operator=(const KvStreamAssembler&) = delete;

  // The next chunk. invalid_argument for another request, a chunk out of
  // order (sequence or offset), sizes that disagree with the headers, a
  // mixed layout; corruption for a checksum that does not match. After an
  // error the assembler stays failed.
  Status add(const msg::KvChunk& chunk);
  // add() in two halves for the data socket, which reads a chunk's bytes
  // straight into the blocks: begin checks a chunk's fields (its data not
  // read yet: `size` bytes; chunk.data and checksum are ignored) and gives
  // the places its bytes go, in order; once the caller has read them there,
  // end checks them against the sender's checksum.
  Status begin(const msg::KvChunk& chunk, uint64_t size);
  const std::vector<iovec>& pieces() const { return pieces_; }
  Status end(uint64_t sent_checksum);
  bool complete() const { return ok_ && started_ && received_ == total_; }
  uint32_t chunks() const { return next_seq_; }
  uint64_t bytes() const { return received_; }
  // Once complete: the records, each checked against its own checksum
  // (corruption naming the block otherwise; each block's checksum is taken
  // chunk by chunk as its bytes land, not in a pass of its own).
  Result<std::vector<BlockRecord>> take();

 private:
  Status fail(Status st) {
    ok_ = false;
    return st;
  }
  // Checks the chunk's fields against the stream (allocating the blocks at
  // chunk 0) and sets pieces_ to where its `size` bytes go.
  Status check(const msg::KvChunk& chunk, uint64_t size);
  std::string who(uint32_t seq) const;
  uint64_t request_id_;
  int32_t first_block_;
  uint64_t max_total_;
  bool ok_ = true, started_ = false;
  uint32_t next_seq_ = 0;
  uint64_t total_ = 0, received_ = 0, layer_bytes_ = 0;
  // The checksum of the chunk's pieces, taken in one pass with their
  // blocks' checksums (each stretch is read twice while it is in L1).
  uint64_t hash_pieces();
  BlockBufferPool* pool_;
  std::vector<BlockRecord> records_;
  std::vector<ChecksumStream> block_sums_;  // per record, over the bytes landed so far
  ChecksumStream chunk_sum_;
  std::vector<iovec> pieces_;  // of the chunk between begin and end (reused)
  std::vector<size_t> piece_blocks_;  // the record each piece belongs to
  uint64_t pending_size_ = 0;
  bool pending_ = false;
};

// Counters of one stage's KV streams (shared by the stage and its sender
// or receiver actor; read into the stage's Stats).
struct KvStreamCounters {
  std::atomic<uint64_t> transfers_sent{0}, transfers_aborted{0}, chunks_sent{0}, bytes_sent{0},
      blocks_sent{0};
  std::atomic<uint64_t> transfers_received{0}, transfers_failed{0}, chunks_received{0},
      bytes_received{0}, blocks_received{0}, blocks_skipped{0}, chunks_rejected{0};
  // Streams between processes on one host through shared memory
  // (actors/kv_shared.h): acknowledged offers (sender), streams taken
  // (receiver), and tries that failed and went to the data socket.
  std::atomic<uint64_t> shared_sent{0}, shared_received{0}, shared_fallbacks{0};
  // Streams between devices over a device link (actors/kv_link.h), likewise.
  std::atomic<uint64_t> link_sent{0}, link_received{0}, link_fallbacks{0};
  std::vector<std::pair<std::string, uint64_t>> snapshot() const;
};

// A prefill stage's finished KV, kept for its decoder's pull until the
// stream is done or the entry is older than the time to live (the KV store
// holds a copy for re-placements): host records, or (a device prefill's)
// blocks left in its backend memory, which go to a decoder on the same host
// device to device (KvSharedOffers::offer_from) and are downloaded once for
// any other path.
class KvOutbox {
 public:
  using Records = std::shared_ptr<const std::vector<BlockRecord>>;
  using Blocks = std::shared_ptr<const BackendBlocks>;
  struct Kept {
    Records records;
    Blocks blocks;  // set instead of records
    size_t size() const { return blocks ? blocks->size() : records ? records->size() : 0; }
    explicit operator bool() const { return records || blocks; }
  };
  void put(uint64_t request_id, Records records);
  void put(uint64_t request_id, Blocks blocks);
  Kept get(uint64_t request_id) const;  // empty when absent
  // The entry's KV as host records: its records, else its blocks downloaded
  // (once: kept for later pulls). not_found when absent.
  Result<Records> host_records(uint64_t request_id);
  void erase(uint64_t request_id);
  // Drops entries put longer ago than ttl; returns how many.
  size_t expire(std::chrono::steady_clock::duration ttl);
  size_t size() const;

 private:
  struct Entry {
    Kept kept;
    std::chrono::steady_clock::time_point at;
  };
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> map_;
};

// What a finished stream brought: host records, or (fetched through shared
// memory into a device decoder's memory) blocks in its backend's memory.
struct KvReceived {
  std::vector<BlockRecord> records;
  std::shared_ptr<BackendBlocks> blocks;  // set instead of records
  size_t size() const { return blocks ? blocks->size() : records.size(); }
};

// Streams a decoder's receiver finished (or failed), until its stage takes them.
class KvInbox {
 public:
  void put(uint64_t request_id, Result<std::vector<BlockRecord>> records);
  void put(uint64_t request_id, Result<KvReceived> received);
  // not_found when nothing is there for the request.
  Result<KvReceived> take_received(uint64_t request_id);
  // take_received() as host records (backend blocks downloaded).
  Result<std::vector<BlockRecord>> take(uint64_t request_id);
  void erase(uint64_t request_id);

 private:
  std::mutex mu_;
  std::unordered_map<uint64_t, Result<KvReceived>> map_;
};


// The two ends of the KV transfer benchmark (bench/actors/kv_transfer_bench.cpp):
// the real kv_sender and kv_receiver actors over CAF's middleman, each in
// its own actor system. serve_kv_sender publishes a kv_sender holding
// `records` as requests 1..n_streams on host (port 0; on_port gets it) and
// returns once every stream was pulled to its last ack (timed_out after
// timeout_s). pull_kv_streams pulls requests 1..n_streams one after the
// other, times each (fetch to the records in hand) and hands the records to
// sink (then gives their buffers back to block_buffer_pool(), as a
// decoder's scheduler does after importing them).
struct KvPullTiming {
  double seconds = 0;
  uint64_t bytes = 0;
};
// shared_memory: both ends as KvStreamOptions::shared_memory (true: the
// streams go through shared memory, the two processes being on one host).
// device: a stage engine's backend whose memory is not the host's, as the
// stages pass it (the sender offers kv.blocks from there; the receiver
// fetches into it: KvReceived::blocks).
Status serve_kv_sender(KvOutbox::Kept kv, int32_t n_streams, const std::string& host,
                       const std::function<void(uint16_t)>& on_port, double timeout_s, bool shared_memory = false,
                       std::shared_ptr<Backend> device = nullptr);
Result<std::vector<KvPullTiming>> pull_kv_streams(const std::string& host, uint16_t port, int32_t n_streams,
                                                  uint32_t chunk_bytes, int32_t window,
                                                  const std::function<void(const KvReceived&)>& sink,
                                                  bool shared_memory = false,
                                                  std::shared_ptr<Backend> device = nullptr);

// Keeps freed memory in the process instead of returning it to the system
// (malloc trim and mmap thresholds raised): first touch of fresh memory
// costs a page fault per 4 KiB, about 20 us each on the VMs measured here
// (0.2 GB/s), so KV streams that reuse the buffers of the last ones run
// many times faster. Process-wide; `cleave node` and the KV benchmark call
// it at start.
void retain_freed_memory();

}  // namespace cleave
