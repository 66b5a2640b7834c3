#include "storage/block.h"

#include <sys/mman.h>
#include <xxhash.h>

#include <cstdio>
#include <new>
#include <utility>

#include "storage/checksum_simd.h"

namespace cleave {

Status KvLayout::validate() const {
  auto positive = [](const char* name, int32_t v) {
    return v > 0 ? Status::Ok()
                 : Status(Code::invalid_argument,
                          std::string("kv layout: ") + name + " = " + std::to_string(v) +
                              " must be positive");
  };
  CLEAVE_RETURN_IF_ERROR(positive("tokens_per_block", tokens_per_block));
  CLEAVE_RETURN_IF_ERROR(positive("n_layers", n_layers));
  CLEAVE_RETURN_IF_ERROR(positive("n_kv_heads", n_kv_heads));
  CLEAVE_RETURN_IF_ERROR(positive("head_dim", head_dim));
  for (auto [t, what] : {std::pair{k_type, "kv layout: k_type"}, std::pair{v_type, "kv layout: v_type"}}) {
    if (!dtype_known(uint32_t(t)) && !kv_dtype_known(uint32_t(t)))  // no type at all; check_kv_type names the rest
      return Status(Code::invalid_argument, std::string(what) + " " + std::to_string(uint32_t(t)) +
                                                " is not a type id");
    CLEAVE_RETURN_IF_ERROR(check_kv_type(t, head_dim, what));
  }
  return Status::Ok();
}

uint64_t KvLayout::fingerprint() const {
  const int64_t fields[6] = {int64_t(k_type), tokens_per_block, n_layers, n_kv_heads, head_dim,
                             int64_t(v_type)};
  // F32 / F32 hashes the five fields layouts had before V's type was one,
  // so the keys of F32 blocks already stored stay what they were.
  const size_t n = v_type == DType::F32 ? 5 : 6;
  return XXH3_64bits(fields, n * sizeof(int64_t));
}

uint32_t pack_kv_types(const KvLayout& l) { return uint32_t(l.k_type) | (uint32_t(l.v_type) << 16); }

void unpack_kv_types(uint32_t packed, KvLayout& l) {
  l.k_type = DType(packed & 0xffff);
  l.v_type = DType(packed >> 16);
}

std::string BlockKey::hex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", (unsigned long long)hi, (unsigned long long)lo);
  return buf;
}

namespace {
// libxxhash's own build (SSE2 in Debian's), for CPUs without AVX2.
void* lib_state_new() { return XXH3_createState(); }
void lib_state_free(void* s) { XXH3_freeState(static_cast<XXH3_state_t*>(s)); }
void lib_reset(void* s) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(s)); }
void lib_update(void* s, const void* data, size_t n) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(s), data, n);
}
uint64_t lib_digest(const void* s) { return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(s)); }
const detail::Xxh3Impl xxh3_lib = {XXH3_64bits, lib_state_new, lib_state_free,
                                   lib_reset,   lib_update,    lib_digest};

// XXH3-64 is one function whatever the vector width: the AVX2 build is
// only faster (tests compare it with libxxhash bit for bit).
const detail::Xxh3Impl& xxh3() {
  static const detail::Xxh3Impl& impl =
      __builtin_cpu_supports("avx2") ? detail::xxh3_avx2 : xxh3_lib;
  return impl;
}
}  // namespace

uint64_t checksum_bytes(const uint8_t* data, size_t n) { return xxh3().oneshot(data, n); }

ChecksumStream::ChecksumStream() : impl_(&xxh3()), state_(impl_->state_new()) {
  if (!state_) throw std::bad_alloc();
  reset();
}

ChecksumStream::~ChecksumStream() {
  if (state_) impl_->state_free(state_);
}

ChecksumStream::ChecksumStream(ChecksumStream&& other) noexcept
    : impl_(other.impl_), state_(std::exchange(other.state_, nullptr)) {}

ChecksumStream& ChecksumStream::operator=(ChecksumStream&& other) noexcept {
  std::swap(impl_, other.impl_);
  std::swap(state_, other.state_);
  return *this;
}

void ChecksumStream::reset() { impl_->reset(state_); }
void ChecksumStream::update(const void* data, size_t n) { impl_->update(state_, data, n); }
uint64_t ChecksumStream::digest() const { return impl_->digest(state_); }

std::vector<uint8_t> BlockBufferPool::acquire(size_t n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(n);
    if (it != free_.end() && !it->second.empty()) {
      std::vector<uint8_t> v = std::move(it->second.back());
      it->second.pop_back();
      kept_ -= n;
      ++reused_;
      return v;
    }
  }
  std::vector<uint8_t> v;
  v.reserve(n);
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  const uintptr_t begin = (p + kHuge - 1) & ~(kHuge - 1), end = (p + n) & ~(kHuge - 1);
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  v.resize(n);
  return v;
}

void BlockBufferPool::release(std::vector<BlockRecord>& records) {
  std::lock_guard<std::mutex> lock(mu_);
  for (BlockRecord& r : records) {
    const size_t n = r.bytes.size();
    if (n == 0 || kept_ + n > max_bytes_) continue;  // freed with the records
    kept_ += n;
    free_[n].push_back(std::move(r.bytes));
  }
  records.clear();
}

uint64_t BlockBufferPool::kept_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_;
}

uint64_t BlockBufferPool::reused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reused_;
}

BlockBufferPool& block_buffer_pool() {
  static BlockBufferPool pool(uint64_t(256) << 20);
  return pool;
}

Status checksum_blocks_in_place(Backend& be, const void* data, size_t block_bytes, int64_t n, uint64_t* out) {
  if (!be.caps().host_memory) return be.checksum_blocks(data, block_bytes, n, out);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  for (int64_t i = 0; i < n; ++i) out[i] = checksum_bytes(p + size_t(i) * block_bytes, block_bytes);
  return Status::Ok();
}

void seal(BlockRecord& record) {
  record.header.checksum = checksum_bytes(record.bytes.data(), record.bytes.size());
}

std::vector<ByteRange> unfilled_ranges(const KvLayout& l, int32_t filled) {
  std::vector<ByteRange> out;
  if (filled < 0 || filled >= l.tokens_per_block) return out;
  const size_t k_head = size_t(l.tokens_per_block) * l.k_row_bytes();
  const size_t v_head = size_t(l.tokens_per_block) * l.v_row_bytes();
  const size_t left = size_t(l.tokens_per_block - filled);
  for (int32_t layer = 0; layer < l.n_layers; ++layer) {
    const size_t base = size_t(layer) * l.layer_bytes();
    for (int32_t h = 0; h < l.n_kv_heads; ++h)
      out.push_back({base + size_t(h) * k_head + size_t(filled) * l.k_row_bytes(), left * l.k_row_bytes()});
    for (int32_t h = 0; h < l.n_kv_heads; ++h)
      out.push_back({base + size_t(l.n_kv_heads) * k_head + size_t(h) * v_head + size_t(filled) * l.v_row_bytes(),
                     left * l.v_row_bytes()});
  }
  return out;
}

Status verify_header(const BlockHeader& h, size_t n_bytes, uint64_t model_fingerprint,
                     const KvLayout& layout) {
  if (h.model_fingerprint != model_fingerprint)
    return Status(Code::corruption, "block " + h.key.hex() + ": model fingerprint " +
                                        std::to_string(h.model_fingerprint) +
                                        " differs from the expected " +
                                        std::to_string(model_fingerprint));
  if (!(h.layout == layout))
    return Status(Code::corruption, "block " + h.key.hex() + ": layout differs from the expected one");
  if (n_bytes != layout.block_bytes())
    return Status(Code::corruption, "block " + h.key.hex() + ": " + std::to_string(n_bytes) +
                                        " bytes, the layout needs " +
                                        std::to_string(layout.block_bytes()));
  return Status::Ok();
}

Status verify(const BlockRecord& r, uint64_t model_fingerprint, const KvLayout& layout) {
  CLEAVE_RETURN_IF_ERROR(verify_header(r.header, r.bytes.size(), model_fingerprint, layout));
  if (checksum_bytes(r.bytes.data(), r.bytes.size()) != r.header.checksum)
    return Status(Code::corruption, "block " + r.header.key.hex() + ": checksum mismatch");
  return Status::Ok();
}

}  // namespace cleave
