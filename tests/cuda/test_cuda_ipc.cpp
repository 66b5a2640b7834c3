// Device memory shared between two processes on one GPU (CUDA IPC, the
// CUDA backend's alloc_shared / open_shared) and the device checksum
// (checksum_blocks) against the host's XXH3. Skipped without a GPU.
//
// The second process is this executable again, run with
// CLEAVE_IPC_CHILD=<handle> on the case "cuda ipc: the other process"
// (which does nothing without that variable).
#include <doctest/doctest.h>

#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/xxh3.cuh"
#include "tests/cuda/gpu.h"

extern char** environ;

namespace {

using namespace cleave;

constexpr size_t kBlockBytes = 139264;  // a KV block of 2 layers x 8 heads x 16 slots x 2 x 272 B
constexpr int64_t kBlocks = 6;

// The pattern both processes know: byte i of the region.
std::vector<uint8_t> pattern(size_t n) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(4242);
  for (auto& b : v) b = uint8_t(rng());
  return v;
}

}  // namespace

TEST_CASE("cuda ipc: device checksum equals the host's XXH3 on every size class") {
  auto gpu = gpu_test::gpu_or_skip();
  if (!gpu) return;
  CHECK(gpu->caps().shareable);
  const auto host = pattern(kBlockBytes * 4);
  void* dev = gpu->alloc(host.size());
  REQUIRE(dev != nullptr);
  gpu->upload(dev, host.data(), host.size());
  for (size_t bytes : {size_t(7), size_t(100), size_t(240), size_t(241), size_t(1024), size_t(1025), size_t(4096),
                       kBlockBytes}) {
    const int64_t n = int64_t(host.size() / bytes > 4 ? 4 : host.size() / bytes);
    std::vector<uint64_t> got(static_cast<size_t>(n));
    REQUIRE(gpu->checksum_blocks(dev, bytes, n, got.data()).ok());
    for (int64_t i = 0; i < n; ++i)
      CHECK_MESSAGE(got[size_t(i)] == xxh3::xxh3_64(host.data() + size_t(i) * bytes, bytes), "bytes " << bytes);
  }
  // Throughput beside the device's copy bandwidth, for the record.
  const size_t big = size_t(256) << 20;
  void* buf = gpu->alloc(big);
  void* buf2 = gpu->alloc(big);
  if (buf && buf2) {
    std::vector<uint64_t> sums(big / kBlockBytes);
    gpu->sync();
    auto t0 = std::chrono::steady_clock::now();
    REQUIRE(gpu->checksum_blocks(buf, kBlockBytes, int64_t(sums.size()), sums.data()).ok());
    const double hash_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t0 = std::chrono::steady_clock::now();
    gpu->copy(buf2, buf, big);
    gpu->sync();
    const double copy_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MESSAGE("device XXH3 over " << sums.size() << " blocks of " << kBlockBytes << " B: "
                                << double(sums.size() * kBlockBytes) / hash_s / 1e9 << " GB/s; device copy "
                                << 2.0 * double(big) / copy_s / 1e9 << " GB/s (read + write)");
  }
  gpu->free(buf);
  gpu->free(buf2);
  gpu->free(dev);
}

TEST_CASE("cuda ipc: another process maps the region, checks it on the device and reads it back") {
  if (std::getenv("CLEAVE_IPC_CHILD")) return;  // the child runs the case below
  auto gpu = gpu_test::gpu_or_skip();
  if (!gpu) return;
  const auto host = pattern(kBlockBytes * kBlocks);
  auto region = gpu->alloc_shared(host.size());
  REQUIRE(region.ok());
  CHECK(region->handle.rfind("cudaipc:", 0) == 0);
  gpu->upload(region->data, host.data(), host.size());
  gpu->sync();
  // Handles that name no region, or another size, are refused in this process too.
  CHECK(gpu->open_shared("cudaipc:zz", host.size()).status().code() == Code::invalid_argument);
  CHECK(gpu->open_shared(region->handle, host.size() + 1).status().code() == Code::invalid_argument);

  const std::string env = "CLEAVE_IPC_CHILD=" + region->handle;
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e) envp.push_back(*e);
  envp.push_back(const_cast<char*>(env.c_str()));
  envp.push_back(nullptr);
  char arg0[] = "test_cuda", arg1[] = "-tc=cuda ipc: the other process*";
  char* argv[] = {arg0, arg1, nullptr};
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()) == 0);
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0), "the other process failed");
  gpu->free_shared(region.value());
}

TEST_CASE("cuda ipc: the other process (runs only under CLEAVE_IPC_CHILD)") {
  const char* handle = std::getenv("CLEAVE_IPC_CHILD");
  if (!handle) return;
  auto gpu = gpu_test::gpu_or_skip();
  REQUIRE(gpu);
  const auto want = pattern(kBlockBytes * kBlocks);
  auto mapped = gpu->open_shared(handle, want.size());
  REQUIRE_MESSAGE(mapped.ok(), mapped.status().to_string());
  std::vector<uint64_t> sums(kBlocks);
  REQUIRE(gpu->checksum_blocks(mapped.value(), kBlockBytes, kBlocks, sums.data()).ok());
  for (int64_t i = 0; i < kBlocks; ++i)
    CHECK(sums[size_t(i)] == xxh3::xxh3_64(want.data() + size_t(i) * kBlockBytes, kBlockBytes));
  std::vector<uint8_t> got(want.size());
  gpu->download(got.data(), mapped.value(), got.size());
  CHECK(got == want);
  gpu->close_shared(mapped.value(), want.size());
}

TEST_CASE("cuda links (NCCL): an id, a malformed one refused, a peer that never joins times out") {
  // Two ranks need two GPUs (NCCL refuses two ranks on one device): the
  // transfer itself stays unverified on a one-GPU machine.
  if (std::getenv("CLEAVE_IPC_CHILD")) return;
  auto gpu = gpu_test::gpu_or_skip();
  if (!gpu) return;
  auto id = gpu->new_link_id();
  if (id.status().code() == Code::unsupported) {
    MESSAGE("built without NCCL: " << id.status().to_string());
    return;
  }
  REQUIRE_MESSAGE(id.ok(), id.status().to_string());
  CHECK(id->rfind("nccl:", 0) == 0);
  CHECK(gpu->open_link("nccl:zz", 0, 1).status().code() == Code::invalid_argument);
  CHECK(gpu->open_link(*id, 2, 1).status().code() == Code::invalid_argument);
  const auto t0 = std::chrono::steady_clock::now();
  auto lonely = gpu->open_link(*id, 0, 0.5);
  CHECK(lonely.status().code() == Code::timed_out);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
}
