#include "storage/memory_tier.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

namespace cleave {

static_assert(std::is_trivially_copyable_v<BlockHeader>);

void MemoryTier::SlabFree::operator()(uint8_t* p) const { std::free(p); }

Result<std::unique_ptr<MemoryTier>> MemoryTier::create(MemoryKind kind, size_t capacity_bytes,
                                                       uint64_t model_fingerprint,
                                                       const KvLayout& layout) {
  static_assert(sizeof(BlockHeader) <= kPayloadOffset);
  if (capacity_bytes == 0)
    return Status(Code::invalid_argument, "memory tier: capacity must be positive, got 0 bytes");
  CLEAVE_RETURN_IF_ERROR(layout.validate());
  return std::unique_ptr<MemoryTier>(
      new MemoryTier(kind, capacity_bytes, model_fingerprint, layout));
}

MemoryTier::~MemoryTier() = default;

const char* MemoryTier::name() const {
  return kind_ == MemoryKind::host_arena ? "host-arena" : "pinned-host";
}

Status MemoryTier::insert(const BlockRecord& record) {
  CLEAVE_RETURN_IF_ERROR(verify(record, model_fingerprint_, layout_));
  const size_t n = record.bytes.size();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slabs_.find(record.header.key);
  if (it != slabs_.end()) {
    BlockHeader stored;
    std::memcpy(&stored, it->second.mem.get(), sizeof(stored));
    if (stored.checksum == record.header.checksum && it->second.n_bytes == n)
      return Status::Ok();  // identical record already there
    return Status(Code::invalid_argument, std::string(name()) + ": block " +
                                              record.header.key.hex() +
                                              " is already stored with different bytes");
  }
  if (usage_ + n > capacity_)
    return Status(Code::out_of_memory, std::string(name()) + ": no room for " +
                                           std::to_string(n) + " bytes (" +
                                           std::to_string(usage_) + " of " +
                                           std::to_string(capacity_) + " used)");
  const size_t alloc = (kPayloadOffset + n + kPageBytes - 1) / kPageBytes * kPageBytes;
  auto* mem = static_cast<uint8_t*>(std::aligned_alloc(kPageBytes, alloc));
  if (!mem)
    return Status(Code::out_of_memory, std::string(name()) + ": host allocation of " +
                                           std::to_string(alloc) + " bytes failed");
  std::memcpy(mem, &record.header, sizeof(BlockHeader));
  std::memcpy(mem + kPayloadOffset, record.bytes.data(), n);
  Slab slab;
  slab.mem.reset(mem);
  slab.n_bytes = n;
  slabs_.emplace(record.header.key, std::move(slab));
  usage_ += n;
  return Status::Ok();
}

Result<BlockRecord> MemoryTier::lookup(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slabs_.find(key);
  if (it == slabs_.end())
    return Status(Code::not_found, std::string(name()) + ": block " + key.hex() + " absent");
  const Slab& slab = it->second;
  BlockRecord r;
  std::memcpy(&r.header, slab.mem.get(), sizeof(BlockHeader));
  r.bytes.assign(slab.mem.get() + kPayloadOffset, slab.mem.get() + kPayloadOffset + slab.n_bytes);
  Status st = verify(r, model_fingerprint_, layout_);
  if (st.ok() && !(r.header.key == key))
    st = Status(Code::corruption, "stored header names block " + r.header.key.hex());
  if (!st.ok()) {
    usage_ -= slab.n_bytes;
    slabs_.erase(it);
    ++corrupt_;
    return Status(Code::corruption,
                  std::string(name()) + ": dropped block " + key.hex() + ": " + st.message());
  }
  return r;
}

bool MemoryTier::contains(const BlockKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return slabs_.count(key) != 0;
}

Status MemoryTier::erase(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slabs_.find(key);
  if (it == slabs_.end())
    return Status(Code::not_found, std::string(name()) + ": block " + key.hex() + " absent");
  usage_ -= it->second.n_bytes;
  slabs_.erase(it);
  return Status::Ok();
}

size_t MemoryTier::usage_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return usage_;
}

std::vector<std::pair<BlockKey, size_t>> MemoryTier::list() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<BlockKey, size_t>> out;
  out.reserve(slabs_.size());
  for (const auto& [k, slab] : slabs_) out.emplace_back(k, slab.n_bytes);
  return out;
}

size_t MemoryTier::block_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slabs_.size();
}

uint64_t MemoryTier::corrupt_detected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return corrupt_;
}

Status MemoryTier::flip_bit_for_test(const BlockKey& key, size_t bit) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slabs_.find(key);
  if (it == slabs_.end() || it->second.n_bytes == 0)
    return Status(Code::not_found, std::string(name()) + ": block " + key.hex() + " absent");
  bit %= it->second.n_bytes * 8;
  it->second.mem.get()[kPayloadOffset + bit / 8] ^= uint8_t(1u << (bit % 8));
  return Status::Ok();
}

}  // namespace cleave
