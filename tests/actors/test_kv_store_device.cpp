// The kv_store's tiers on a device node (make_kv_store with a backend):
// tier 0 in the backend's memory (DeviceTier), tier 1 page-locked host
// memory from it, LRU demotion between them, every block back with its
// bytes, and no host access to device memory (tests/fenced_backend.h stands
// in for the GPU). Also kv_store_backend()'s answers.
#include <doctest/doctest.h>

#include "actors/hosted.h"
#include "tests/fenced_backend.h"

using namespace cleave;
using cleave::testing::FencedBackend;

namespace {

constexpr uint64_t kFp = 0xD3u;

KvLayout layout() {
  KvLayout l;
  l.tokens_per_block = 16;
  l.n_layers = 2;
  l.n_kv_heads = 2;
  l.head_dim = 64;
  return l;  // 32 KiB a block
}

BlockRecord record(uint64_t i) {
  BlockRecord r;
  r.header.key = BlockKey{i * 0x9E37ull + 1, i};
  r.header.model_fingerprint = kFp;
  r.header.layout = layout();
  r.header.n_tokens = 16;
  r.bytes.resize(layout().block_bytes());
  for (size_t b = 0; b < r.bytes.size(); ++b) r.bytes[b] = uint8_t(i * 31 + b * 7);
  seal(r);
  return r;
}

}  // namespace

TEST_CASE("kv_store on a device: device and pinned host tiers, LRU between them, bytes intact") {
  auto fenced = std::make_shared<FencedBackend>(make_cpu_backend(1));
  const auto log = fenced->log();
  const size_t bb = layout().block_bytes();
  auto store = make_kv_store(4 * bb, 8 * bb, "", kFp, layout(), false, 0, fenced);
  REQUIRE_MESSAGE(store.ok(), store.status().to_string());
  TieredStore& s = **store;
  REQUIRE(s.n_tiers() == 2);
  CHECK(std::string(s.tier(0).name()) == "device");
  CHECK(std::string(s.tier(1).name()) == "pinned-host");
  for (uint64_t i = 0; i < 10; ++i) REQUIRE(s.put(record(i)).ok());
  // The four most recent in device memory, the six before them demoted.
  for (uint64_t i = 0; i < 10; ++i) {
    CAPTURE(i);
    CHECK(s.tier_of(record(i).header.key) == (i >= 6 ? 0 : 1));
  }
  CHECK(log->traffic.upload_bytes >= 10 * bb);  // every put went up first
  for (uint64_t i = 0; i < 10; ++i) {
    auto got = s.get(record(i).header.key);
    REQUIRE(got.ok());
    CHECK(got->bytes == record(i).bytes);
  }
  CHECK_MESSAGE(log->violations.empty(), log->violations.size());
  fenced.reset();
  store->reset();  // the store held the backend: it goes with the store
  CHECK(log->live_allocations == 0);
}

TEST_CASE("kv_store_backend: none for cpu, the reason for a missing GPU, bad names refused") {
  auto cpu = kv_store_backend("cpu");
  REQUIRE(cpu.ok());
  CHECK(*cpu == nullptr);
  auto bad = kv_store_backend("gpu0");
  CHECK(bad.status().code() == Code::invalid_argument);
  if (!make_cuda_backend(0).ok()) {
    auto none = kv_store_backend("cuda:0");
    CHECK(none.status().code() == Code::unavailable);
    CHECK(none.status().message().rfind("kv_store on cuda:0: cuda backend: ", 0) == 0);
  }
  auto fenced = std::make_shared<FencedBackend>(make_cpu_backend(1));
  auto durable = make_kv_store(0, 0, "/tmp/unused-kv-dir", kFp, layout(), true, 0, fenced);
  CHECK(durable.status().code() == Code::invalid_argument);
}
