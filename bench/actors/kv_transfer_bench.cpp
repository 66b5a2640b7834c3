// KV transfer between two processes: the chunk protocol (the real kv_sender
// and kv_receiver actors over CAF's middleman, actors/kv_stream.h) beside
// raw TCP over loopback (plain sockets, the same bytes, the same chunk
// size, measured before and after the protocol, the better of the two), in
// the same run, per chunk size. The bench starts itself a second time
// (--serve) as the sending process. --transport shared moves the same
// streams through shared memory (actors/kv_shared.h: the sender copies the
// blocks into a region, the receiver copies them out and checks each
// block's XXH3), beside one memcpy of the same bytes in this process.
//
//   cleave_kv_bench [--mib 64] [--reps 5] [--chunks 65536,262144,1048576,4194304]
//                   [--window 8] [--transport socket|shared] [--json FILE]
#include <CLI/CLI.hpp>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "actors/kv_socket.h"
#include "actors/kv_stream.h"
#include "bench/stats.h"
#include "kernels/backend.h"  // kv_type_from_name

extern char** environ;

using namespace cleave;
using bench::median;
using Clock = std::chrono::steady_clock;

namespace {

// The KV cache type of every row (--kv-type).
DType g_kv_type = DType::F32;

// A llama-8B-like block (32 layers, 8 KV heads of 128, 16 tokens): 4 MiB in
// F32, 2 MiB in F16, 1.06 MiB in Q8_0, 0.56 MiB in Q4_0.
KvLayout bench_layout() {
  KvLayout l;
  l.k_type = l.v_type = g_kv_type;
  l.tokens_per_block = 16;
  l.n_layers = 32;
  l.n_kv_heads = 8;
  l.head_dim = 128;
  return l;
}

// The same records in both processes (a fixed generator), sealed.
// --mib counts F32 bytes, so every type moves the same tokens.
std::shared_ptr<const std::vector<BlockRecord>> make_records(int mib) {
  const KvLayout layout = bench_layout();
  KvLayout f32 = layout;
  f32.k_type = f32.v_type = DType::F32;
  const int n = std::max(1, int((size_t(mib) << 20) / f32.block_bytes()));
  auto out = std::make_shared<std::vector<BlockRecord>>(size_t(n));
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int b = 0; b < n; ++b) {
    BlockRecord& r = (*out)[size_t(b)];
    r.header.key = BlockKey{uint64_t(b) + 1, 42};
    r.header.model_fingerprint = 7;
    r.header.layout = layout;
    r.header.n_tokens = 16;
    r.bytes.resize(layout.block_bytes());
    for (size_t i = 0; i + 8 <= r.bytes.size(); i += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::memcpy(r.bytes.data() + i, &x, 8);
    }
    seal(r);
  }
  return out;
}

bool send_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    c += w;
    n -= size_t(w);
  }
  return true;
}

bool recv_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::recv(fd, c, n, 0);
    if (r <= 0) return false;
    c += r;
    n -= size_t(r);
  }
  return true;
}

// Raw TCP server: per request (chunk bytes, 0 ends), sends every record's
// bytes in writes of that size.
void serve_raw(int listener, const std::vector<BlockRecord>& records) {
  const int fd = ::accept(listener, nullptr, nullptr);
  if (fd < 0) return;
  (void)configure_kv_data_socket(fd);  // the data socket's options: a like-for-like limit
  uint64_t chunk = 0;
  while (recv_all(fd, &chunk, sizeof chunk) && chunk > 0) {
    for (const BlockRecord& r : records)
      for (size_t at = 0; at < r.bytes.size(); at += chunk)
        if (!send_all(fd, r.bytes.data() + at, std::min<size_t>(chunk, r.bytes.size() - at))) break;
  }
  ::close(fd);
}

bool g_shared = false;  // --transport shared

int serve(int mib, int streams) {
  auto records = make_records(mib);
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(listener, 1) != 0 || ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("raw tcp listen");
    return 1;
  }
  std::thread raw([&] { serve_raw(listener, *records); });
  Status st = serve_kv_sender(KvOutbox::Kept{records, nullptr}, streams, "127.0.0.1", [&](uint16_t port) {
    std::printf("ports %u %u\n", unsigned(port), unsigned(ntohs(addr.sin_port)));
    std::fflush(stdout);
  }, 300, g_shared);
  raw.join();
  ::close(listener);
  if (!st.ok()) {
    std::fprintf(stderr, "serve: %s\n", st.to_string().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"KV transfer between two processes: chunk protocol vs raw TCP loopback"};
  int mib = 64, reps = 5, window = kDefaultKvWindow, serve_streams = 0;
  std::vector<uint32_t> chunks{64u << 10, 256u << 10, 1u << 20, 4u << 20};
  std::string json_path;
  app.add_option("--mib", mib, "KV per transfer (MiB of F32 KV: 4 MiB blocks of 16 tokens)")
      ->check(CLI::Range(4, 4096));
  std::string kv_type = "f32";
  app.add_option("--kv-type", kv_type, "KV cache type of K and V rows (-ctk / -ctv): the same tokens, fewer bytes")
      ->check(CLI::IsMember({"f32", "f16", "q8_0", "q4_0"}));
  app.add_option("--reps", reps, "transfers per chunk size and path (median reported)")
      ->check(CLI::Range(1, 100));
  app.add_option("--chunks", chunks, "chunk sizes in bytes")->delimiter(',');
  app.add_option("--window", window, "chunks in flight per stream")->check(CLI::Range(1, 1024));
  app.add_option("--json", json_path, "write the figures as JSON");
  std::string transport = "socket";
  app.add_option("--transport", transport,
                 "socket: the data socket beside raw TCP, per chunk size; shared: shared memory beside memcpy")
      ->check(CLI::IsMember({"socket", "shared"}));
  app.add_option("--serve", serve_streams, "internal: be the sending process for N streams");
  CLI11_PARSE(app, argc, argv);
  g_kv_type = *kv_type_from_name(kv_type);
  g_shared = transport == "shared";
  if (g_shared) chunks = {chunks.front()};  // one region per stream: no chunks
  retain_freed_memory();  // as `cleave node` does
  if (serve_streams > 0) return serve(mib, serve_streams);

  auto records = make_records(mib);
  uint64_t total = 0;
  for (const BlockRecord& r : *records) total += r.bytes.size();
  std::printf("KV transfer: %d blocks of %zu bytes (%s KV, %.1f MiB, %d tokens) per transfer, window %d, %d reps\n",
              int(records->size()), bench_layout().block_bytes(), kv_type.c_str(), double(total) / (1 << 20),
              int(records->size()) * bench_layout().tokens_per_block, window, reps);
  if (g_shared)
    std::printf("%10s %14s %14s %8s %8s %12s\n", "transport", "memcpy GB/s", "kv shared GB/s", "ratio", "blocks",
                "ms/transfer");
  else
    std::printf("%10s %14s %14s %8s %8s %12s\n", "chunk", "raw tcp GB/s", "kv chunks GB/s", "ratio", "chunks",
                "ms/transfer");
  nlohmann::json out = nlohmann::json::array();
  std::string congestion;  // of the raw TCP and KV data sockets alike
  for (uint32_t chunk : chunks) {
    // The sending process.
    int pipe_fd[2];
    if (::pipe(pipe_fd) != 0) return 1;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pipe_fd[1], 1);
    posix_spawn_file_actions_addclose(&fa, pipe_fd[0]);
    const std::string mib_s = std::to_string(mib), streams_s = std::to_string(reps);
    char* child_argv[] = {argv[0], const_cast<char*>("--serve"), const_cast<char*>(streams_s.c_str()),
                          const_cast<char*>("--mib"), const_cast<char*>(mib_s.c_str()),
                          const_cast<char*>("--kv-type"), const_cast<char*>(kv_type.c_str()),
                          const_cast<char*>("--transport"), const_cast<char*>(transport.c_str()), nullptr};
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, child_argv, environ) != 0) {
      std::perror("posix_spawn");
      return 1;
    }
    posix_spawn_file_actions_destroy(&fa);
    ::close(pipe_fd[1]);
    FILE* child_out = ::fdopen(pipe_fd[0], "r");
    unsigned caf_port = 0, raw_port = 0;
    if (std::fscanf(child_out, "ports %u %u", &caf_port, &raw_port) != 2) {
      std::fprintf(stderr, "the sending process did not start\n");
      return 1;
    }
    // Raw TCP (the same bytes in writes of the chunk size) before and after
    // the chunk protocol; the better median of the two is the limit, so a
    // change in the machine's load between the phases cannot flatter the
    // ratio.
    const int raw_fd = ::socket(AF_INET, SOCK_STREAM, 0);
    {
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(uint16_t(raw_port));
      if (::connect(raw_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        std::perror("raw tcp connect");
        return 1;
      }
    }
    congestion = configure_kv_data_socket(raw_fd);
    std::vector<uint8_t> buf(total);
    // With --transport shared the limit is one memcpy of the same bytes
    // into a buffer already touched (the receiver's pool is warm too).
    auto memcpy_phase = [&]() -> double {
      std::vector<double> seconds;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = Clock::now();
        for (const BlockRecord& b : *records)
          std::memcpy(buf.data() + size_t(&b - records->data()) * b.bytes.size(), b.bytes.data(), b.bytes.size());
        seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      return median(seconds);
    };
    auto raw_phase = [&]() -> double {
      if (g_shared) return memcpy_phase();
      std::vector<double> seconds;
      for (int r = 0; r < reps; ++r) {
        const uint64_t c = chunk;
        const auto t0 = Clock::now();
        if (!send_all(raw_fd, &c, sizeof c)) return 0;
        for (size_t at = 0; at < total; at += chunk)
          if (!recv_all(raw_fd, buf.data() + at, std::min<size_t>(chunk, total - at))) return 0;
        seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      return median(seconds);
    };
    const double raw_before = raw_phase();
    // The chunk protocol through the actors; every stream's blocks checked.
    bool same = true;
    auto pulls = pull_kv_streams("127.0.0.1", uint16_t(caf_port), reps, chunk, window,
                                 [&](const KvReceived& received) {
                                   const std::vector<BlockRecord>& got = received.records;
                                   same = same && got.size() == records->size();
                                   for (size_t b = 0; same && b < got.size(); ++b)
                                     same = got[b].bytes == (*records)[b].bytes;
                                 }, g_shared);
    const double raw_after = raw_phase();
    const uint64_t end = 0;
    send_all(raw_fd, &end, sizeof end);
    ::close(raw_fd);
    if (raw_before <= 0 || raw_after <= 0) {
      std::fprintf(stderr, "chunk %u: raw tcp failed\n", chunk);
      return 1;
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    std::fclose(child_out);
    if (!pulls.ok()) {
      std::fprintf(stderr, "chunk %u: %s\n", chunk, pulls.status().to_string().c_str());
      return 1;
    }
    std::vector<double> kv_s;
    for (const KvPullTiming& t : *pulls) {
      kv_s.push_back(t.seconds);
      same = same && t.bytes == total;
    }
    if (!same) {
      std::fprintf(stderr, "chunk %u: the streamed blocks differ from the sent ones\n", chunk);
      return 1;
    }
    const double raw_gbs = double(total) / std::min(raw_before, raw_after) / 1e9;
    const double kv_gbs = double(total) / median(kv_s) / 1e9;
    const uint64_t n_chunks = (total + chunk - 1) / chunk;
    if (g_shared)
      std::printf("%10s %14.2f %14.2f %7.0f%% %8zu %12.2f\n", "shared", raw_gbs, kv_gbs, 100 * kv_gbs / raw_gbs,
                  records->size(), 1e3 * median(kv_s));
    else
      std::printf("%10u %14.2f %14.2f %7.0f%% %8llu %12.2f\n", chunk, raw_gbs, kv_gbs, 100 * kv_gbs / raw_gbs,
                  static_cast<unsigned long long>(n_chunks), 1e3 * median(kv_s));
    out.push_back({{"chunk_bytes", chunk}, {"bytes", total}, {"window", window}, {"reps", reps},
                   {g_shared ? "memcpy_gb_s" : "raw_tcp_gb_s", raw_gbs}, {"kv_stream_gb_s", kv_gbs},
                   {"ratio", kv_gbs / raw_gbs}, {"chunks", n_chunks}, {"kv_type", kv_type},
                   {"tokens", records->size() * size_t(bench_layout().tokens_per_block)},
                   {"kv_ms_per_transfer", 1e3 * median(kv_s)}, {"transport", transport},
                   {"limit", g_shared ? "memcpy" : "raw_tcp"},
                   {"tcp_congestion", congestion}});
  }
  std::printf("TCP congestion control of both paths: %s\n", congestion.c_str());
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) return 1;
    std::fprintf(f, "%s\n", out.dump(2).c_str());
    std::fclose(f);
  }
  return 0;
}
