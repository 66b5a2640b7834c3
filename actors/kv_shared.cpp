#include "actors/kv_shared.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

namespace cleave {
namespace {

constexpr const char* kWhat = "KV over shared memory";

std::string read_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string link_of(const char* path) {
  char buf[256];
  const ssize_t n = readlink(path, buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

}  // namespace

const std::string& kv_host_identity() {
  static const std::string id = [] {
    const std::string boot = read_line("/proc/sys/kernel/random/boot_id");
    const std::string pid_ns = link_of("/proc/self/ns/pid"), net_ns = link_of("/proc/self/ns/net");
    if (boot.empty() || pid_ns.empty() || net_ns.empty()) return std::string();
    return boot + "/" + pid_ns + "/" + net_ns;
  }();
  return id;
}

KvSharedOffers::~KvSharedOffers() {
  for (auto& [id, e] : regions_) backend_->free_shared(e.region);
  for (const SharedRegion& r : free_) backend_->free_shared(r);
}

void KvSharedOffers::keep(SharedRegion region) {
  if (free_bytes_ + region.bytes > kKeptBytes) return backend_->free_shared(region);
  free_bytes_ += region.bytes;
  free_.push_back(std::move(region));
}

Result<SharedRegion> KvSharedOffers::take(size_t bytes) {
  size_t best = free_.size();
  for (size_t i = 0; i < free_.size(); ++i)
    if (free_[i].bytes >= bytes && (best == free_.size() || free_[i].bytes < free_[best].bytes)) best = i;
  if (best == free_.size()) return backend_->alloc_shared(bytes);
  SharedRegion region = std::move(free_[best]);
  free_bytes_ -= region.bytes;
  free_.erase(free_.begin() + ptrdiff_t(best));
  ++reused_;
  return region;
}

std::string KvSharedOffers::publish(uint64_t request_id, SharedRegion region, std::vector<BlockHeader> headers,
                                    int32_t first_block, size_t block_bytes, int32_t corrupt_block,
                                    msg::KvChunk& offer) {
  const size_t n = headers.size();
  if (corrupt_block >= 0) {
    uint8_t* p = static_cast<uint8_t*>(region.data) + (size_t(corrupt_block) % n) * block_bytes;
    uint8_t byte = 0;
    backend_->download(&byte, p, 1);
    byte ^= 1;
    backend_->upload(p, &byte, 1);
  }
  backend_->sync();
  offer = msg::KvChunk{};
  offer.request_id = request_id;
  offer.first_block = first_block;
  offer.total_bytes = uint64_t(block_bytes) * n;
  offer.headers = std::move(headers);
  std::string handle = region.handle;
  regions_[request_id] = Entry{std::move(region), int32_t(n), uint64_t(block_bytes * n), std::chrono::steady_clock::now()};
  return handle;
}

Result<std::string> KvSharedOffers::offer(uint64_t request_id, const std::vector<BlockRecord>& records,
                                          int32_t first_block, msg::KvChunk& offer, int32_t corrupt_block) {
  if (!backend_ || !backend_->caps().shareable)
    return Status(Code::unsupported, "KV over shared memory: the sender's backend cannot share memory");
  if (first_block < 0 || size_t(first_block) >= records.size())
    return Status(Code::invalid_argument, "KV over shared memory: no blocks from block " +
                                              std::to_string(first_block) + " of " +
                                              std::to_string(records.size()));
  const KvLayout& layout = records[size_t(first_block)].header.layout;
  const size_t block_bytes = layout.block_bytes(), n = records.size() - size_t(first_block);
  for (size_t i = 0; i < n; ++i) {
    const BlockRecord& r = records[size_t(first_block) + i];
    if (!(r.header.layout == layout) || r.bytes.size() != block_bytes)
      return Status(Code::invalid_argument, "KV over shared memory: block " + std::to_string(first_block + i) +
                                                " has another layout or size");
  }
  release(request_id);
  auto region = take(block_bytes * n);
  if (!region.ok()) return region.status();
  std::vector<BlockHeader> headers;
  for (size_t i = 0; i < n; ++i) {
    backend_->upload(static_cast<uint8_t*>(region->data) + i * block_bytes,
                     records[size_t(first_block) + i].bytes.data(), block_bytes);
    headers.push_back(records[size_t(first_block) + i].header);
  }
  return publish(request_id, std::move(region.value()), std::move(headers), first_block, block_bytes,
                 corrupt_block, offer);
}

Result<std::string> KvSharedOffers::offer_from(uint64_t request_id, const void* blocks,
                                               const std::vector<BlockHeader>& headers, int32_t first_block,
                                               msg::KvChunk& offer, int32_t corrupt_block) {
  if (!backend_ || !backend_->caps().shareable)
    return Status(Code::unsupported, "KV over shared memory: the sender's backend cannot share memory");
  if (headers.empty() || !blocks || first_block < 0)
    return Status(Code::invalid_argument, "KV over shared memory: an offer from backend memory needs blocks");
  const KvLayout& layout = headers.front().layout;
  for (size_t i = 0; i < headers.size(); ++i)
    if (!(headers[i].layout == layout))
      return Status(Code::invalid_argument, "KV over shared memory: block " + std::to_string(first_block + i) +
                                                " has another layout");
  const size_t block_bytes = layout.block_bytes(), bytes = block_bytes * headers.size();
  release(request_id);
  auto region = take(bytes);
  if (!region.ok()) return region.status();
  backend_->copy(region->data, blocks, bytes);
  return publish(request_id, std::move(region.value()), headers, first_block, block_bytes, corrupt_block, offer);
}

bool KvSharedOffers::release(uint64_t request_id, int32_t* blocks, uint64_t* bytes) {
  auto it = regions_.find(request_id);
  if (it == regions_.end()) return false;
  if (blocks) *blocks = it->second.blocks;
  if (bytes) *bytes = it->second.used;
  keep(std::move(it->second.region));
  regions_.erase(it);
  return true;
}

size_t KvSharedOffers::expire(std::chrono::steady_clock::duration ttl) {
  const auto now = std::chrono::steady_clock::now();
  size_t n = 0;
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (now - it->second.at > ttl) {
      // Freed, not kept: a receiver that is only late may still read it.
      backend_->free_shared(it->second.region);
      it = regions_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

Result<std::shared_ptr<const void>> KvSharedMappings::map(const std::string& handle, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < lru_.size(); ++i) {
    if (lru_[i].handle != handle) continue;
    Entry e = std::move(lru_[i]);
    lru_.erase(lru_.begin() + ptrdiff_t(i));
    if (e.bytes >= bytes) {
      ++hits_;
      lru_.push_back(std::move(e));
      return lru_.back().data;
    }
    mapped_ -= e.bytes;  // too short: mapped again below
    break;
  }
  auto opened = backend_->open_shared(handle, bytes);
  if (!opened.ok()) return opened.status();
  std::shared_ptr<Backend> backend = backend_;
  std::shared_ptr<const void> data(opened.value(),
                                   [backend, bytes](const void* p) { backend->close_shared(p, bytes); });
  lru_.push_back(Entry{handle, bytes, data});
  mapped_ += bytes;
  while (mapped_ > max_bytes_ && lru_.size() > 1) {
    mapped_ -= lru_.front().bytes;
    lru_.erase(lru_.begin());
  }
  return data;
}

size_t KvSharedMappings::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}

uint64_t KvSharedMappings::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

namespace {

// The offer checked against the pull and its region mapped.
Result<std::shared_ptr<const void>> open_offer(KvSharedMappings& mappings, const std::string& handle,
                                               const msg::KvChunk& offer, const msg::KvPull& pull,
                                               uint64_t max_total_bytes) {
  CLEAVE_RETURN_IF_ERROR(check_kv_offer(offer, pull, max_total_bytes, kWhat));
  if (!mappings.backend().caps().shareable)
    return Status(Code::unsupported, "KV over shared memory: the receiver's backend cannot share memory");
  return mappings.map(handle, size_t(offer.total_bytes));
}

}  // namespace

Result<std::vector<BlockRecord>> fetch_kv_shared(KvSharedMappings& mappings, const std::string& handle,
                                                 const msg::KvChunk& offer, const msg::KvPull& pull,
                                                 uint64_t max_total_bytes, KvStreamCounters& counters,
                                                 BlockBufferPool* pool) {
  auto mapped = open_offer(mappings, handle, offer, pull, max_total_bytes);
  if (!mapped.ok()) return mapped.status();
  Backend& backend = mappings.backend();
  if (!pool) pool = &block_buffer_pool();
  const uint8_t* base = static_cast<const uint8_t*>(mapped.value().get());
  const size_t block_bytes = offer.headers.front().layout.block_bytes(), n = offer.headers.size();
  std::vector<BlockRecord> records(n);
  Status st;
  const bool host = backend.caps().host_memory;
  size_t acquired = 0;
  if (!host) {  // checked where the bytes are, then copied out
    std::vector<uint64_t> sums(n);
    st = backend.checksum_blocks(base, block_bytes, int64_t(n), sums.data());
    for (size_t i = 0; st.ok() && i < n; ++i)
      if (sums[i] != offer.headers[i].checksum) st = kv_offer_mismatch(offer, i, kWhat);
  }
  for (size_t i = 0; st.ok() && i < n; ++i) {
    records[i].header = offer.headers[i];
    records[i].bytes = pool->acquire(block_bytes);
    acquired = i + 1;
    uint8_t* to = records[i].bytes.data();
    const uint8_t* from = base + i * block_bytes;
    if (!host) {
      backend.download(to, from, block_bytes);
    } else {
      // Hash each piece of our copy while it is in cache: what is checked
      // is what we keep, whatever the sender's pages do afterwards.
      constexpr size_t kPiece = size_t(64) << 10;
      ChecksumStream sum;
      for (size_t off = 0; off < block_bytes; off += kPiece) {
        const size_t len = std::min(kPiece, block_bytes - off);
        std::memcpy(to + off, from + off, len);
        sum.update(to + off, len);
      }
      if (sum.digest() != offer.headers[i].checksum) st = kv_offer_mismatch(offer, i, kWhat);
    }
    ++counters.chunks_received;
    counters.bytes_received += block_bytes;
  }
  if (!st.ok()) {
    ++counters.chunks_rejected;
    records.resize(acquired);
    pool->release(records);
    return st;
  }
  return records;
}

Result<std::vector<BlockHeader>> fetch_kv_shared_to(KvSharedMappings& mappings, const std::string& handle,
                                                    const msg::KvChunk& offer, const msg::KvPull& pull,
                                                    uint64_t max_total_bytes, KvStreamCounters& counters,
                                                    void* dst) {
  if (!dst) return Status(Code::invalid_argument, "KV over shared memory: no memory to fetch into");
  auto mapped = open_offer(mappings, handle, offer, pull, max_total_bytes);
  if (!mapped.ok()) return mapped.status();
  Backend& backend = mappings.backend();
  const size_t block_bytes = offer.headers.front().layout.block_bytes(), n = offer.headers.size();
  backend.copy(dst, mapped.value().get(), size_t(offer.total_bytes));
  backend.sync();
  counters.chunks_received += n;
  counters.bytes_received += offer.total_bytes;
  std::vector<uint64_t> sums(n);
  CLEAVE_RETURN_IF_ERROR(checksum_blocks_in_place(backend, dst, block_bytes, int64_t(n), sums.data()));
  for (size_t i = 0; i < n; ++i)
    if (sums[i] != offer.headers[i].checksum) {
      ++counters.chunks_rejected;
      return kv_offer_mismatch(offer, i, kWhat);
    }
  return offer.headers;
}

}  // namespace cleave
