#include "storage/block.h"

#include <xxhash.h>

#include <cstdio>

namespace cleave {

Status KvLayout::validate() const {
  auto positive = [](const char* name, int32_t v) {
    return v > 0 ? Status::Ok()
                 : Status(Code::invalid_argument,
                          std::string("kv layout: ") + name + " = " + std::to_string(v) +
                              " must be positive");
  };
  if (dtype != uint32_t(DType::F32))
    return Status(Code::unsupported, "kv layout: element type " + std::to_string(dtype) +
                                         " is not supported (F32 only)");
  CLEAVE_RETURN_IF_ERROR(positive("tokens_per_block", tokens_per_block));
  CLEAVE_RETURN_IF_ERROR(positive("n_layers", n_layers));
  CLEAVE_RETURN_IF_ERROR(positive("n_kv_heads", n_kv_heads));
  return positive("head_dim", head_dim);
}

uint64_t KvLayout::fingerprint() const {
  const int64_t fields[5] = {int64_t(dtype), tokens_per_block, n_layers, n_kv_heads, head_dim};
  return XXH3_64bits(fields, sizeof(fields));
}

std::string BlockKey::hex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", (unsigned long long)hi, (unsigned long long)lo);
  return buf;
}

namespace detail {
uint64_t xxh3_64_avx2(const void* data, size_t n);  // checksum_avx2.cpp
}

// XXH3-64 is one function whatever the vector width: the AVX2 build is only
// faster (tests compare it with libxxhash bit for bit).
uint64_t checksum_bytes(const uint8_t* data, size_t n) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2 ? detail::xxh3_64_avx2(data, n) : XXH3_64bits(data, n);
}

void seal(BlockRecord& record) {
  record.header.checksum = checksum_bytes(record.bytes.data(), record.bytes.size());
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
