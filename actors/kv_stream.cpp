#include "actors/kv_stream.h"

#include <malloc.h>

#include <algorithm>
#include <cstring>

#include "schema/codec.h"

namespace cleave {

Status validate_kv_stream_options(uint32_t chunk_bytes, int32_t window) {
  if (chunk_bytes < codec::kMinKvChunkBytes || chunk_bytes > codec::kMaxKvChunkBytes)
    return Status(Code::invalid_argument,
                  "kv chunk bytes " + std::to_string(chunk_bytes) + " is outside [" +
                      std::to_string(codec::kMinKvChunkBytes) + ", " +
                      std::to_string(codec::kMaxKvChunkBytes) + "]");
  if (window < 1 || window > codec::kMaxKvWindow)
    return Status(Code::invalid_argument, "kv window " + std::to_string(window) +
                                              " is outside [1, " +
                                              std::to_string(codec::kMaxKvWindow) + "]");
  return Status::Ok();
}

std::string check_stream_headers(const std::vector<BlockHeader>& headers, uint64_t stated_bytes,
                                 uint64_t max_total, uint64_t& total) {
  const KvLayout& layout = headers.front().layout;
  for (const BlockHeader& h : headers)
    if (!(h.layout == layout)) return "blocks of different layouts in one stream";
  if (__builtin_mul_overflow(uint64_t(layout.block_bytes()), uint64_t(headers.size()), &total) || total > max_total)
    return std::to_string(headers.size()) + " blocks exceed the receiver's limit of " + std::to_string(max_total) +
           " bytes";
  if (stated_bytes != total)
    return "stream of " + std::to_string(stated_bytes) + " bytes, the headers describe " + std::to_string(total);
  return "";
}

namespace {

// Walks the layer-major stream position `pos` over n blocks of a layout:
// calls fn(block, byte offset in the block, length) for each contiguous
// piece of [pos, pos + size).
template <class Fn>
void for_each_piece(uint64_t pos, uint64_t size, uint64_t layer_bytes, uint64_t n_blocks, Fn fn) {
  while (size > 0) {
    const uint64_t layer = pos / (layer_bytes * n_blocks);
    const uint64_t in_layer = pos % (layer_bytes * n_blocks);
    const uint64_t block = in_layer / layer_bytes, off = in_layer % layer_bytes;
    const uint64_t len = std::min(size, layer_bytes - off);
    fn(size_t(block), size_t(layer * layer_bytes + off), size_t(len));
    pos += len;
    size -= len;
  }
}

}  // namespace

KvStreamWriter::KvStreamWriter(uint64_t request_id,
                               std::shared_ptr<const std::vector<BlockRecord>> records,
                               int32_t first_block, uint32_t chunk_bytes)
    : request_id_(request_id),
      records_(std::move(records)),
      first_block_(first_block),
      n_blocks_(std::max<int32_t>(0, int32_t(records_->size()) - first_block)),
      chunk_bytes_(std::max<uint32_t>(chunk_bytes, 1)) {
  if (n_blocks_ == 0) return;
  const KvLayout& layout = (*records_)[size_t(first_block_)].header.layout;
  layer_bytes_ = layout.layer_bytes();
  total_ = uint64_t(layout.block_bytes()) * uint64_t(n_blocks_);
  n_chunks_ = uint32_t((total_ + chunk_bytes_ - 1) / chunk_bytes_);
}

msg::KvChunk KvStreamWriter::chunk(uint32_t seq) const {
  std::vector<iovec> pieces;
  msg::KvChunk c = header(seq, pieces);
  size_t size = 0;
  for (const iovec& p : pieces) size += p.iov_len;
  c.data.reserve(size);
  for (const iovec& p : pieces) {
    const uint8_t* from = static_cast<const uint8_t*>(p.iov_base);
    c.data.insert(c.data.end(), from, from + p.iov_len);
  }
  c.checksum = checksum_bytes(c.data.data(), c.data.size());
  return c;
}

msg::KvChunk KvStreamWriter::header(uint32_t seq, std::vector<iovec>& pieces) const {
  msg::KvChunk c;
  c.request_id = request_id_;
  c.seq = seq;
  c.first_block = first_block_;
  c.total_bytes = total_;
  c.offset = uint64_t(seq) * chunk_bytes_;
  const uint64_t size = std::min<uint64_t>(chunk_bytes_, total_ - std::min(total_, c.offset));
  const BlockRecord* blocks = records_->data() + first_block_;
  pieces.clear();
  for_each_piece(c.offset, size, layer_bytes_, uint64_t(n_blocks_),
                 [&](size_t block, size_t at, size_t len) {
                   pieces.push_back(
                       iovec{const_cast<uint8_t*>(blocks[block].bytes.data() + at), len});
                 });
  if (seq == 0)
    for (int32_t b = 0; b < n_blocks_; ++b) c.headers.push_back(blocks[b].header);
  return c;
}

KvStreamAssembler::KvStreamAssembler(uint64_t request_id, int32_t first_block,
                                     uint64_t max_total_bytes, BlockBufferPool* pool)
    : request_id_(request_id),
      first_block_(first_block),
      max_total_(max_total_bytes),
      pool_(pool ? pool : &block_buffer_pool()) {}

KvStreamAssembler::~KvStreamAssembler() { pool_->release(records_); }

std::string KvStreamAssembler::who(uint32_t seq) const {
  return "kv stream of request " + std::to_string(request_id_) + ", chunk " + std::to_string(seq) +
         ": ";
}

Status KvStreamAssembler::check(const msg::KvChunk& c, uint64_t size) {
  auto bad = [&](const std::string& why) {
    return fail(Status(Code::invalid_argument, who(c.seq) + why));
  };
  if (!ok_) return Status(Code::aborted, who(c.seq) + "the stream failed before");
  if (pending_) return bad("the previous chunk was not finished");
  if (c.request_id != request_id_)
    return bad("belongs to request " + std::to_string(c.request_id));
  if (c.seq != next_seq_)
    return bad("out of order, expected chunk " + std::to_string(next_seq_));
  if (c.offset != received_)
    return bad("offset " + std::to_string(c.offset) + ", expected " + std::to_string(received_));
  if (!started_) {
    if (c.headers.empty()) return bad("the first chunk carries no block headers");
    if (c.first_block != first_block_)
      return bad("starts at block " + std::to_string(c.first_block) + ", asked for block " +
                 std::to_string(first_block_));
    const KvLayout& layout = c.headers.front().layout;
    uint64_t total = 0;
    if (std::string why = check_stream_headers(c.headers, c.total_bytes, max_total_, total); !why.empty())
      return bad(why);
    total_ = total;
    layer_bytes_ = layout.layer_bytes();
    records_.resize(c.headers.size());
    block_sums_.resize(c.headers.size());
    for (size_t i = 0; i < c.headers.size(); ++i) {
      records_[i].header = c.headers[i];
      records_[i].bytes = pool_->acquire(layout.block_bytes());
    }
    started_ = true;
  } else if (c.total_bytes != total_ || !c.headers.empty()) {
    return bad("stream size or headers changed mid-stream");
  }
  if (size == 0) return bad("no data");
  if (size > total_ - received_)
    return bad(std::to_string(size) + " bytes, only " + std::to_string(total_ - received_) +
               " left in the stream");
  pieces_.clear();
  piece_blocks_.clear();
  for_each_piece(received_, size, layer_bytes_, records_.size(),
                 [&](size_t block, size_t at, size_t len) {
                   pieces_.push_back(iovec{records_[block].bytes.data() + at, len});
                   piece_blocks_.push_back(block);
                 });
  return Status::Ok();
}

// A block's bytes arrive in order (layer 0's part, then layer 1's, ...), so
// its checksum can follow them piece by piece while they are in cache.
uint64_t KvStreamAssembler::hash_pieces() {
  constexpr size_t kStretch = size_t(16) << 10;  // fits L1 beside the hash states
  chunk_sum_.reset();
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const uint8_t* p = static_cast<const uint8_t*>(pieces_[i].iov_base);
    ChecksumStream& block_sum = block_sums_[piece_blocks_[i]];
    for (size_t at = 0; at < pieces_[i].iov_len; at += kStretch) {
      const size_t n = std::min(kStretch, pieces_[i].iov_len - at);
      chunk_sum_.update(p + at, n);
      block_sum.update(p + at, n);
    }
  }
  return chunk_sum_.digest();
}

Status KvStreamAssembler::add(const msg::KvChunk& c) {
  CLEAVE_RETURN_IF_ERROR(check(c, c.data.size()));
  const uint8_t* in = c.data.data();
  for (const iovec& p : pieces_) {
    std::memcpy(p.iov_base, in, p.iov_len);
    in += p.iov_len;
  }
  // A mismatch fails the stream, so the blocks' checksums may take the bad bytes.
  if (hash_pieces() != c.checksum)
    return fail(Status(Code::corruption, who(c.seq) + "checksum mismatch"));
  received_ += c.data.size();
  ++next_seq_;
  return Status::Ok();
}

Status KvStreamAssembler::begin(const msg::KvChunk& c, uint64_t size) {
  CLEAVE_RETURN_IF_ERROR(check(c, size));
  pending_ = true;
  pending_size_ = size;
  return Status::Ok();
}

Status KvStreamAssembler::end(uint64_t sent_checksum) {
  if (!pending_) return fail(Status(Code::invalid_argument, who(next_seq_) + "no chunk begun"));
  pending_ = false;
  if (hash_pieces() != sent_checksum)
    return fail(Status(Code::corruption, who(next_seq_) + "checksum mismatch"));
  received_ += pending_size_;
  ++next_seq_;
  return Status::Ok();
}

Result<std::vector<BlockRecord>> KvStreamAssembler::take() {
  if (!complete())
    return Status(Code::aborted, "kv stream of request " + std::to_string(request_id_) +
                                     " is not complete (" + std::to_string(received_) + " of " +
                                     std::to_string(total_) + " bytes)");
  for (size_t i = 0; i < records_.size(); ++i) {
    if (block_sums_[i].digest() != records_[i].header.checksum)
      return Status(Code::corruption, "kv stream of request " + std::to_string(request_id_) +
                                          ": block " + std::to_string(first_block_ + int32_t(i)) +
                                          " does not match its checksum");
  }
  ok_ = false;  // taken
  std::vector<BlockRecord> out = std::move(records_);
  records_.clear();
  return out;
}

std::vector<std::pair<std::string, uint64_t>> KvStreamCounters::snapshot() const {
  return {{"kv_transfers_sent", transfers_sent},
          {"kv_transfers_aborted", transfers_aborted},
          {"kv_chunks_sent", chunks_sent},
          {"kv_bytes_sent", bytes_sent},
          {"kv_blocks_sent", blocks_sent},
          {"kv_transfers_received", transfers_received},
          {"kv_transfers_failed", transfers_failed},
          {"kv_chunks_received", chunks_received},
          {"kv_bytes_received", bytes_received},
          {"kv_blocks_received", blocks_received},
          {"kv_blocks_skipped", blocks_skipped},
          {"kv_chunks_rejected", chunks_rejected},
          {"kv_shared_sent", shared_sent},
          {"kv_shared_received", shared_received},
          {"kv_shared_fallbacks", shared_fallbacks},
          {"kv_link_sent", link_sent},
          {"kv_link_received", link_received},
          {"kv_link_fallbacks", link_fallbacks}};
}

Status check_kv_offer(const msg::KvChunk& offer, const msg::KvPull& pull, uint64_t max_total_bytes,
                      const char* what) {
  auto bad = [&](const std::string& why) {
    return Status(Code::invalid_argument,
                  std::string(what) + " for request " + std::to_string(pull.request_id) + ": " + why);
  };
  if (offer.request_id != pull.request_id) return bad("the offer is for request " + std::to_string(offer.request_id));
  if (offer.first_block != pull.first_block)
    return bad("the offer starts at block " + std::to_string(offer.first_block) + ", asked for block " +
               std::to_string(pull.first_block));
  if (offer.headers.empty()) return bad("the offer has no blocks");
  if (Status v = offer.headers.front().layout.validate(); !v.ok()) return bad(v.message());
  uint64_t total = 0;
  if (std::string why = check_stream_headers(offer.headers, offer.total_bytes, max_total_bytes, total); !why.empty())
    return bad(why);
  return Status::Ok();
}

Status kv_offer_mismatch(const msg::KvChunk& offer, size_t i, const char* what) {
  return Status(Code::corruption, std::string(what) + " for request " + std::to_string(offer.request_id) +
                                      ": block " + std::to_string(offer.first_block + int32_t(i)) + " (key " +
                                      offer.headers[i].key.hex() + ") does not match its checksum");
}

void KvOutbox::put(uint64_t request_id, Records records) {
  std::lock_guard<std::mutex> lock(mu_);
  map_[request_id] = Entry{Kept{std::move(records), nullptr}, std::chrono::steady_clock::now()};
}

void KvOutbox::put(uint64_t request_id, Blocks blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  map_[request_id] = Entry{Kept{nullptr, std::move(blocks)}, std::chrono::steady_clock::now()};
}

KvOutbox::Kept KvOutbox::get(uint64_t request_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(request_id);
  return it == map_.end() ? Kept{} : it->second.kept;
}

Result<KvOutbox::Records> KvOutbox::host_records(uint64_t request_id) {
  Kept kept = get(request_id);
  if (!kept) return Status(Code::not_found, "no KV kept for request " + std::to_string(request_id));
  if (kept.records) return kept.records;
  auto records = kept.blocks->to_records();  // outside the lock: the stage puts meanwhile
  if (!records.ok()) return records.status();
  auto shared = std::make_shared<const std::vector<BlockRecord>>(std::move(records.value()));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(request_id);
  if (it != map_.end() && it->second.kept.blocks == kept.blocks) it->second.kept.records = shared;
  return Records(shared);
}

void KvOutbox::erase(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  map_.erase(request_id);
}

size_t KvOutbox::expire(std::chrono::steady_clock::duration ttl) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto limit = std::chrono::steady_clock::now() - ttl;
  return std::erase_if(map_, [&](const auto& kv) { return kv.second.at < limit; });
}

size_t KvOutbox::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.size();
}

void KvInbox::put(uint64_t request_id, Result<std::vector<BlockRecord>> records) {
  if (!records.ok()) return put(request_id, Result<KvReceived>(records.status()));
  put(request_id, Result<KvReceived>(KvReceived{std::move(records.value()), nullptr}));
}

void KvInbox::put(uint64_t request_id, Result<KvReceived> received) {
  std::lock_guard<std::mutex> lock(mu_);
  map_.insert_or_assign(request_id, std::move(received));
}

Result<KvReceived> KvInbox::take_received(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(request_id);
  if (it == map_.end())
    return Status(Code::not_found, "no kv stream for request " + std::to_string(request_id));
  Result<KvReceived> out = std::move(it->second);
  map_.erase(it);
  return out;
}

Result<std::vector<BlockRecord>> KvInbox::take(uint64_t request_id) {
  auto got = take_received(request_id);
  if (!got.ok()) return got.status();
  if (!got->blocks) return std::move(got->records);
  return got->blocks->to_records();
}

void KvInbox::erase(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  map_.erase(request_id);
}

void retain_freed_memory() {
  (void)::mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest: blocks and chunks come from the heap
  (void)::mallopt(M_TRIM_THRESHOLD, 1 << 30);   // and stay there when freed
}

}  // namespace cleave
