// The kv_store's tiers on a GPU (storage/device_tier.h over the CUDA
// backend, tier 1 page-locked host memory from it): blocks demoted from
// device memory to pinned host and read back bit for bit, with the moves'
// throughput beside the host-device copy bandwidth measured in the same run
// (pinned cudaMemcpy of the same bytes each way). Skipped without a GPU.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/backend.h"
#include "storage/device_tier.h"
#include "storage/memory_tier.h"
#include "storage/tiered_store.h"
#include "tests/cuda/gpu.h"

namespace {

using namespace cleave;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kFp = 0xC0DAu;

KvLayout layout() {  // a llama-8B-like block: 32 layers, 8 KV heads of 128, 16 tokens, F16: 2 MiB
  KvLayout l;
  l.k_type = l.v_type = DType::F16;
  l.tokens_per_block = 16;
  l.n_layers = 32;
  l.n_kv_heads = 8;
  l.head_dim = 128;
  return l;
}

BlockRecord record(uint64_t i) {
  BlockRecord r;
  r.header.key = BlockKey{i * 0x9E3779B97F4A7C15ull + 1, i};
  r.header.model_fingerprint = kFp;
  r.header.layout = layout();
  r.header.n_tokens = 16;
  r.bytes.resize(layout().block_bytes());
  for (size_t b = 0; b < r.bytes.size(); b += 8) {
    const uint64_t v = (i + 1) * 0x100000001B3ull ^ b;
    std::memcpy(r.bytes.data() + b, &v, 8);
  }
  seal(r);
  return r;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

TEST_CASE("cuda kv tiers: device blocks demoted to pinned host and back, bit for bit, beside the copy bandwidth") {
  auto gpu = gpu_test::gpu_or_skip();
  if (!gpu) return;
  const size_t bb = layout().block_bytes();
  constexpr uint64_t kDevice = 64, kHost = 192, kBlocks = kDevice + kHost;
  std::vector<std::unique_ptr<Tier>> tiers;
  auto dev = DeviceTier::create(*gpu, kDevice * bb, kFp, layout());
  REQUIRE_MESSAGE(dev.ok(), dev.status().to_string());
  auto host = MemoryTier::create(MemoryKind::pinned_host, kHost * bb, kFp, layout(), gpu.get());
  REQUIRE_MESSAGE(host.ok(), host.status().to_string());
  tiers.push_back(std::move(dev.value()));
  tiers.push_back(std::move(host.value()));
  auto store = TieredStore::create(std::move(tiers), kFp, layout());
  REQUIRE(store.ok());
  TieredStore& s = **store;

  std::vector<BlockRecord> records;
  for (uint64_t i = 0; i < kBlocks; ++i) records.push_back(record(i));
  auto t0 = Clock::now();
  for (const BlockRecord& r : records) REQUIRE(s.put(r).ok());
  gpu->sync();
  const double put_s = seconds_since(t0);  // every block up once; all but the last kDevice down again
  for (uint64_t i = 0; i < kBlocks; ++i) CHECK(s.tier_of(records[i].header.key) == (i >= kHost ? 0 : 1));
  t0 = Clock::now();
  for (uint64_t i = kHost; i < kBlocks; ++i) {
    auto got = s.get(records[i].header.key);
    REQUIRE(got.ok());
    CHECK(got->bytes == records[i].bytes);
  }
  const double get_dev_s = seconds_since(t0);

  // The limits: pinned host <-> device of the same bytes, each way.
  const size_t n = kDevice * bb;
  void* pinned = gpu->alloc_pinned_host(n);
  void* d = gpu->alloc(n);
  REQUIRE(pinned != nullptr);
  REQUIRE(d != nullptr);
  std::memset(pinned, 1, n);
  t0 = Clock::now();
  gpu->upload(d, pinned, n);
  const double h2d_s = seconds_since(t0);
  t0 = Clock::now();
  gpu->download(pinned, d, n);
  const double d2h_s = seconds_since(t0);
  gpu->free(d);
  gpu->free_pinned_host(pinned);

  const double gb = 1e-9 * double(bb);
  MESSAGE("kv tiers, " << kBlocks << " blocks of " << bb << " B: put (upload + demotion) "
                       << gb * double(kBlocks + kHost) / put_s << " GB/s of moves; device-tier reads "
                       << gb * double(kDevice) / get_dev_s << " GB/s; limits: pinned H2D "
                       << double(n) / h2d_s / 1e9 << " GB/s, D2H " << double(n) / d2h_s / 1e9 << " GB/s");
}
