#include "storage/device_tier.h"

#include <climits>
#include <cstring>

namespace cleave {

Result<std::unique_ptr<DeviceTier>> DeviceTier::create(Backend& backend, size_t capacity_bytes,
                                                       uint64_t model_fingerprint,
                                                       const KvLayout& layout) {
  CLEAVE_RETURN_IF_ERROR(layout.validate());
  const size_t block_bytes = layout.block_bytes();
  const size_t n_slots = capacity_bytes / block_bytes;
  if (n_slots == 0)
    return Status(Code::invalid_argument, "device tier: capacity of " +
                                              std::to_string(capacity_bytes) +
                                              " bytes holds no block of " +
                                              std::to_string(block_bytes) + " bytes");
  if (n_slots > size_t(INT32_MAX))
    return Status(Code::invalid_argument, "device tier: more than INT32_MAX blocks");
  auto* arena = static_cast<uint8_t*>(backend.alloc(n_slots * block_bytes));
  if (!arena)
    return Status(Code::out_of_memory, "device tier: " + backend.caps().name +
                                           " backend could not allocate " +
                                           std::to_string(n_slots * block_bytes) + " bytes");
  auto* staging = static_cast<uint8_t*>(backend.alloc_pinned_host(block_bytes));
  if (!staging) {
    backend.free(arena);
    return Status(Code::out_of_memory, "device tier: pinned staging buffer of " +
                                           std::to_string(block_bytes) + " bytes failed");
  }
  return std::unique_ptr<DeviceTier>(new DeviceTier(backend, capacity_bytes, model_fingerprint,
                                                    layout, int32_t(n_slots), arena, staging));
}

DeviceTier::DeviceTier(Backend& backend, size_t capacity, uint64_t fp, const KvLayout& layout,
                       int32_t n_slots, uint8_t* arena, uint8_t* staging)
    : backend_(backend),
      capacity_(capacity),
      model_fingerprint_(fp),
      layout_(layout),
      block_bytes_(layout.block_bytes()),
      n_slots_(n_slots),
      arena_(arena),
      staging_(staging) {
  free_slots_.reserve(size_t(n_slots));
  for (int32_t s = n_slots - 1; s >= 0; --s) free_slots_.push_back(s);  // slot 0 first
}

DeviceTier::~DeviceTier() {
  backend_.free_pinned_host(staging_);
  backend_.free(arena_);
}

Status DeviceTier::insert(const BlockRecord& record) {
  return insert(BlockView::of(record, /*verified=*/false));
}

Status DeviceTier::insert(const BlockView& view) {
  const BlockHeader& header = *view.header;
  CLEAVE_RETURN_IF_ERROR(verify_header(header, view.n_bytes, model_fingerprint_, layout_));
  // Checked before the upload: device bytes cannot be hashed where they are.
  if (!view.verified && checksum_bytes(view.bytes, view.n_bytes) != header.checksum)
    return Status(Code::corruption, "device: block " + header.key.hex() + ": checksum mismatch");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(header.key);
  if (it != entries_.end()) {
    if (it->second.header.checksum == header.checksum) return Status::Ok();
    return Status(Code::invalid_argument,
                  "device: block " + header.key.hex() + " is already stored with different bytes");
  }
  if (free_slots_.empty())
    return Status(Code::out_of_memory, "device: no room for " + std::to_string(block_bytes_) +
                                           " bytes (" + std::to_string(n_slots_) +
                                           " blocks of " + std::to_string(capacity_) +
                                           " bytes used)");
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  backend_.upload(slot_ptr(slot), view.bytes, block_bytes_);
  entries_.emplace(header.key, Entry{slot, header});
  return Status::Ok();
}

Status DeviceTier::download_verified(const BlockKey& key, const Entry& e, uint8_t* dst) {
  backend_.download(dst, slot_ptr(e.slot), block_bytes_);
  if (checksum_bytes(dst, block_bytes_) == e.header.checksum) return Status::Ok();
  drop(key);
  ++corrupt_;
  return Status(Code::corruption, "device: dropped block " + key.hex() + ": checksum mismatch");
}

void DeviceTier::drop(const BlockKey& key) {
  auto it = entries_.find(key);
  free_slots_.push_back(it->second.slot);
  entries_.erase(it);
}

Result<BlockRecord> DeviceTier::lookup(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end())
    return Status(Code::not_found, "device: block " + key.hex() + " absent");
  BlockRecord r;
  r.header = it->second.header;
  r.bytes.resize(block_bytes_);
  CLEAVE_RETURN_IF_ERROR(download_verified(key, it->second, r.bytes.data()));
  return r;
}

Status DeviceTier::read(const BlockKey& key, const std::function<Status(const BlockView&)>& fn) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end())
    return Status(Code::not_found, "device: block " + key.hex() + " absent");
  const BlockHeader header = it->second.header;
  // The copy must be hashed anyway after crossing the bus: verify here and
  // tell the receiver it need not hash again.
  CLEAVE_RETURN_IF_ERROR(download_verified(key, it->second, staging_));
  return fn(BlockView{&header, staging_, block_bytes_, /*verified=*/true});
}

bool DeviceTier::contains(const BlockKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.count(key) != 0;
}

Status DeviceTier::erase(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!entries_.count(key))
    return Status(Code::not_found, "device: block " + key.hex() + " absent");
  drop(key);
  return Status::Ok();
}

size_t DeviceTier::usage_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size() * block_bytes_;
}

std::vector<std::pair<BlockKey, size_t>> DeviceTier::list() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<BlockKey, size_t>> out;
  out.reserve(entries_.size());
  for (const auto& [k, e] : entries_) out.emplace_back(k, block_bytes_);
  return out;
}

PagedKv DeviceTier::paged_kv() const {
  PagedKv kv;
  kv.data = static_cast<uint8_t*>(arena_);
  kv.k_type = layout_.k_type;
  kv.v_type = layout_.v_type;
  kv.n_blocks = n_slots_;
  kv.block_size = layout_.tokens_per_block;
  kv.n_layers = layout_.n_layers;
  kv.n_kv_heads = layout_.n_kv_heads;
  kv.head_dim = layout_.head_dim;
  return kv;
}

Result<int32_t> DeviceTier::slot_of(const BlockKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end())
    return Status(Code::not_found, "device: block " + key.hex() + " absent");
  return it->second.slot;
}

size_t DeviceTier::block_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

uint64_t DeviceTier::corrupt_detected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return corrupt_;
}

}  // namespace cleave
