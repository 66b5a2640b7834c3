#include "storage/memory_tier.h"

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/backend.h"

namespace cleave {

static_assert(std::is_trivially_copyable_v<BlockHeader>);

Result<std::unique_ptr<MemoryTier>> MemoryTier::create(MemoryKind kind, size_t capacity_bytes,
                                                       uint64_t model_fingerprint,
                                                       const KvLayout& layout,
                                                       Backend* pinned_from) {
  static_assert(sizeof(BlockHeader) <= kPayloadOffset);
  if (capacity_bytes == 0)
    return Status(Code::invalid_argument, "memory tier: capacity must be positive, got 0 bytes");
  CLEAVE_RETURN_IF_ERROR(layout.validate());
  if (pinned_from && kind != MemoryKind::pinned_host)
    return Status(Code::invalid_argument,
                  "memory tier: a backend allocates pinned_host slabs only (use DeviceTier for "
                  "the backend's own memory)");
  return std::unique_ptr<MemoryTier>(
      new MemoryTier(kind, capacity_bytes, model_fingerprint, layout, pinned_from));
}

MemoryTier::MemoryTier(MemoryKind kind, size_t capacity, uint64_t fp, const KvLayout& layout,
                       Backend* pinned_from)
    : kind_(kind),
      capacity_(capacity),
      model_fingerprint_(fp),
      layout_(layout),
      block_bytes_(layout.block_bytes()),
      slab_bytes_((kPayloadOffset + layout.block_bytes() + kPageBytes - 1) / kPageBytes *
                  kPageBytes),
      max_slabs_(capacity / layout.block_bytes()),
      pinned_from_(pinned_from) {}

MemoryTier::~MemoryTier() {
  for (auto& [key, slab] : slabs_) free_slab(slab);
  for (uint8_t* slab : free_) free_slab(slab);
}

const char* MemoryTier::name() const {
  return kind_ == MemoryKind::host_arena ? "host-arena" : "pinned-host";
}

uint8_t* MemoryTier::take_slab() {
  if (!free_.empty()) {
    uint8_t* slab = free_.back();
    free_.pop_back();
    return slab;
  }
  void* p = pinned_from_ ? pinned_from_->alloc_pinned_host(slab_bytes_)
                         : std::aligned_alloc(kPageBytes, slab_bytes_);
  return static_cast<uint8_t*>(p);
}

void MemoryTier::give_back_slab(uint8_t* slab) {
  if (free_.size() + slabs_.size() < max_slabs_)
    free_.push_back(slab);
  else
    free_slab(slab);
}

void MemoryTier::free_slab(uint8_t* slab) {
  if (pinned_from_)
    pinned_from_->free_pinned_host(slab);
  else
    std::free(slab);
}

Status MemoryTier::insert(const BlockRecord& record) {
  return insert(BlockView::of(record, /*verified=*/false));
}

Status MemoryTier::insert(const BlockView& view) {
  const BlockHeader& header = *view.header;
  CLEAVE_RETURN_IF_ERROR(verify_header(header, view.n_bytes, model_fingerprint_, layout_));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slabs_.find(header.key);
  if (it != slabs_.end()) {
    BlockHeader stored;
    std::memcpy(&stored, it->second, sizeof(stored));
    if (stored.checksum == header.checksum) return Status::Ok();  // identical record already there
    return Status(Code::invalid_argument, std::string(name()) + ": block " + header.key.hex() +
                                              " is already stored with different bytes");
  }
  if (usage_ + block_bytes_ > capacity_)
    return Status(Code::out_of_memory, std::string(name()) + ": no room for " +
                                           std::to_string(block_bytes_) + " bytes (" +
                                           std::to_string(usage_) + " of " +
                                           std::to_string(capacity_) + " used)");
  uint8_t* slab = take_slab();
  if (!slab)
    return Status(Code::out_of_memory, std::string(name()) + ": host allocation of " +
                                           std::to_string(slab_bytes_) + " bytes failed");
  std::memcpy(slab, &header, sizeof(BlockHeader));
  std::memcpy(slab + kPayloadOffset, view.bytes, block_bytes_);
  // Hash the copy while it is still in cache: one pass, and it checks what
  // this tier keeps.
  if (!view.verified && checksum_bytes(slab + kPayloadOffset, block_bytes_) != header.checksum) {
    give_back_slab(slab);
    return Status(Code::corruption,
                  std::string(name()) + ": block " + header.key.hex() + ": checksum mismatch");
  }
  slabs_.emplace(header.key, slab);
  usage_ += block_bytes_;
  return Status::Ok();
}

Result<BlockRecord> MemoryTier::lookup(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slabs_.find(key);
  if (it == slabs_.end())
    return Status(Code::not_found, std::string(name()) + ": block " + key.hex() + " absent");
  const uint8_t* slab = it->second;
  BlockRecord r;
  std::memcpy(&r.header, slab, sizeof(BlockHeader));
  r.bytes.assign(slab + kPayloadOffset, slab + kPayloadOffset + block_bytes_);
  Status st = verify(r, model_fingerprint_, layout_);
  if (st.ok() && !(r.header.key == key))
    st = Status(Code::corruption, "stored header names block " + r.header.key.hex());
  if (!st.ok()) {
    usage_ -= block_bytes_;
    slabs_.erase(it);
    give_back_slab(const_cast<uint8_t*>(slab));
    ++corrupt_;
    return Status(Code::corruption,
                  std::string(name()) + ": dropped block " + key.hex() + ": " + st.message());
  }
  return r;
}

Status MemoryTier::read(const BlockKey& key, const std::function<Status(const BlockView&)>& fn) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slabs_.find(key);
  if (it == slabs_.end())
    return Status(Code::not_found, std::string(name()) + ": block " + key.hex() + " absent");
  BlockHeader header;
  std::memcpy(&header, it->second, sizeof(header));
  return fn(BlockView{&header, it->second + kPayloadOffset, block_bytes_, /*verified=*/false});
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
  uint8_t* slab = it->second;
  usage_ -= block_bytes_;
  slabs_.erase(it);
  give_back_slab(slab);
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
  for (const auto& [k, slab] : slabs_) out.emplace_back(k, block_bytes_);
  return out;
}

size_t MemoryTier::block_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slabs_.size();
}

size_t MemoryTier::free_slabs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

void MemoryTier::release_free_slabs() {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint8_t* slab : free_) free_slab(slab);
  free_.clear();
}

uint64_t MemoryTier::corrupt_detected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return corrupt_;
}

Status MemoryTier::flip_bit_for_test(const BlockKey& key, size_t bit) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slabs_.find(key);
  if (it == slabs_.end())
    return Status(Code::not_found, std::string(name()) + ": block " + key.hex() + " absent");
  bit %= block_bytes_ * 8;
  it->second[kPayloadOffset + bit / 8] ^= uint8_t(1u << (bit % 8));
  return Status::Ok();
}

}  // namespace cleave
