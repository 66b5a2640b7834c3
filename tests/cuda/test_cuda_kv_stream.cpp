// KV handed between two processes on one GPU through the stages' own path:
// a kv_sender holding a prefill's blocks in GPU memory (BackendBlocks on the
// CUDA backend) and a kv_receiver given its own CUDA backend, in two
// processes: the blocks go through a CUDA IPC region device to device,
// checked on the device where they land (KvReceived::blocks in the
// receiver's GPU memory). Skipped without a GPU.
//
// The sender is this executable again, run with CLEAVE_KV_SENDER=<file> on
// the case "cuda kv stream: the sender" (it writes its port to the file).
#include <doctest/doctest.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "actors/kv_stream.h"
#include "tests/cuda/gpu.h"

extern char** environ;

namespace {

using namespace cleave;

constexpr int kBlocks = 6, kStreams = 2;

KvLayout layout() {
  KvLayout l;
  l.tokens_per_block = 16;
  l.n_layers = 4;
  l.n_kv_heads = 4;
  l.head_dim = 64;
  return l;
}

// The records both processes know (sealed: their checksums are the host's).
std::vector<BlockRecord> records() {
  std::vector<BlockRecord> out;
  std::mt19937_64 rng(777);
  for (int b = 0; b < kBlocks; ++b) {
    BlockRecord r;
    r.header.key = BlockKey{uint64_t(b) + 1, 5};
    r.header.model_fingerprint = 99;
    r.header.layout = layout();
    r.header.n_tokens = 16;
    r.bytes.resize(layout().block_bytes());
    for (auto& x : r.bytes) x = uint8_t(rng());
    seal(r);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

TEST_CASE("cuda kv stream: a prefill's GPU blocks reach another process's GPU memory through the kv actors") {
  if (std::getenv("CLEAVE_KV_SENDER")) return;  // the sender runs the case below
  auto gpu = gpu_test::gpu_or_skip();
  if (!gpu) return;
  const std::string port_file = "/tmp/cleave-kv-sender-" + std::to_string(::getpid());
  std::remove(port_file.c_str());
  const std::string env = "CLEAVE_KV_SENDER=" + port_file;
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e) envp.push_back(*e);
  envp.push_back(const_cast<char*>(env.c_str()));
  envp.push_back(nullptr);
  char arg0[] = "test_cuda", arg1[] = "-tc=cuda kv stream: the sender*";
  char* argv[] = {arg0, arg1, nullptr};
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()) == 0);
  int port = 0;
  for (int i = 0; i < 600 && port == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::ifstream f(port_file);
    f >> port;
  }
  REQUIRE(port > 0);
  std::shared_ptr<Backend> device(std::move(gpu));
  const auto want = records();
  int streams = 0;
  auto pulls = pull_kv_streams(
      "127.0.0.1", uint16_t(port), kStreams, 1 << 20, 8,
      [&](const KvReceived& got) {
        ++streams;
        REQUIRE(got.blocks);  // in this process's GPU memory, not host records
        CHECK(got.records.empty());
        REQUIRE(got.blocks->size() == size_t(kBlocks));
        std::vector<uint8_t> host(want[0].bytes.size());
        for (size_t i = 0; i < size_t(kBlocks); ++i) {
          device->download(host.data(), got.blocks->block(i), host.size());
          CHECK(host == want[i].bytes);
          CHECK(got.blocks->headers()[i].checksum == want[i].header.checksum);
        }
      },
      true, device);
  CHECK_MESSAGE(pulls.ok(), pulls.status().to_string());
  if (pulls.ok())
    for (const KvPullTiming& t : *pulls)
      MESSAGE("stream of " << t.bytes << " bytes in " << t.seconds * 1e3 << " ms ("
                           << double(t.bytes) / t.seconds / 1e9 << " GB/s, GPU to GPU through IPC)");
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0), "the sender failed");
  CHECK(streams == kStreams);
  std::remove(port_file.c_str());
}

TEST_CASE("cuda kv stream: the sender (runs only under CLEAVE_KV_SENDER)") {
  const char* port_file = std::getenv("CLEAVE_KV_SENDER");
  if (!port_file) return;
  auto gpu = gpu_test::gpu_or_skip();
  REQUIRE(gpu);
  std::shared_ptr<Backend> device(std::move(gpu));
  const auto rs = records();
  const size_t bb = rs[0].bytes.size();
  auto blocks = BackendBlocks::allocate(device, kBlocks, bb);
  REQUIRE(blocks.ok());
  for (size_t i = 0; i < size_t(kBlocks); ++i) {
    device->upload(static_cast<uint8_t*>((*blocks)->data()) + i * bb, rs[i].bytes.data(), bb);
    (*blocks)->headers().push_back(rs[i].header);
  }
  Status st = serve_kv_sender(
      KvOutbox::Kept{nullptr, blocks.value()}, kStreams, "127.0.0.1",
      [&](uint16_t port) {
        const std::string tmp = std::string(port_file) + ".tmp";
        std::ofstream(tmp) << port << "\n";
        std::rename(tmp.c_str(), port_file);
      },
      120, true, device);
  CHECK_MESSAGE(st.ok(), st.to_string());
}
