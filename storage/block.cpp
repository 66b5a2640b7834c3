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

uint64_t checksum_bytes(const uint8_t* data, size_t n) { return XXH3_64bits(data, n); }

void seal(BlockRecord& record) {
  record.header.checksum = checksum_bytes(record.bytes.data(), record.bytes.size());
}

Status verify(const BlockRecord& r, uint64_t model_fingerprint, const KvLayout& layout) {
  const std::string who = "block " + r.header.key.hex() + ": ";
  if (r.header.model_fingerprint != model_fingerprint)
    return Status(Code::corruption, who + "model fingerprint " +
                                        std::to_string(r.header.model_fingerprint) +
                                        " differs from the expected " +
                                        std::to_string(model_fingerprint));
  if (!(r.header.layout == layout))
    return Status(Code::corruption, who + "layout differs from the expected one");
  if (r.bytes.size() != layout.block_bytes())
    return Status(Code::corruption, who + std::to_string(r.bytes.size()) +
                                        " bytes, the layout needs " +
                                        std::to_string(layout.block_bytes()));
  if (checksum_bytes(r.bytes.data(), r.bytes.size()) != r.header.checksum)
    return Status(Code::corruption, who + "checksum mismatch");
  return Status::Ok();
}

}  // namespace cleave
