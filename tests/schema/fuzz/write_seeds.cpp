// Writes one encoded example of every message kind into DIR: the fuzzer's
// seed corpus (scripts/fuzz.sh).
#include <cstdio>
#include <string>

#include "examples.h"
#include "schema/codec.h"

namespace {

bool write(const std::string& path, const cleave::codec::Bytes& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  namespace ex = cleave::examples;
  using cleave::codec::encode;
  const std::string dir = argv[1];
  const std::pair<const char*, cleave::codec::Bytes> seeds[] = {
      {"request", encode(ex::request())},         {"token", encode(ex::token_event())},
      {"finished", encode(ex::finished_event())}, {"failed", encode(ex::failed_event())},
      {"handoff", encode(ex::handoff())},         {"kv_put", encode(ex::kv_put())},
      {"kv_ack", encode(ex::kv_ack())},           {"kv_get", encode(ex::kv_get())},
      {"kv_blocks", encode(ex::kv_blocks())},     {"health", encode(ex::health())},
      {"stats", encode(ex::stats())},             {"kv_pull", encode(ex::kv_pull())},
      {"kv_chunk", encode(ex::kv_chunk())},       {"encode_request", encode(ex::encode_request())},
      {"image_embeddings", encode(ex::image_embeddings())},
      {"expert_batch", encode(ex::expert_batch())},
      {"stage_batch", encode(ex::stage_batch())},
  };
  for (const auto& [name, bytes] : seeds) {
    if (!write(dir + "/seed_" + name, bytes)) {
      std::fprintf(stderr, "cannot write %s/seed_%s\n", dir.c_str(), name);
      return 1;
    }
  }
  std::printf("%zu seeds in %s\n", sizeof(seeds) / sizeof(seeds[0]), dir.c_str());
  return 0;
}
