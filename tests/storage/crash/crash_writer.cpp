// kill -9 crash test for the RocksDB tier (issue 3, crash safety).
//
//   storage_crash writer DIR STATE SEED N
//     Opens RocksDbTier(DIR, sync=true) and inserts N blocks with keys drawn
//     from SEED. After each acknowledged insert it appends the key (hex) to
//     STATE and fsyncs STATE: ack from RocksDB first, then "acknowledged".
//   storage_crash drive WORKDIR [--full] [--cycles C] [--seed S]
//     Runs the writer as a child, waits for its first acknowledgement (a new
//     line in STATE), SIGKILLs it after a random delay counted from that
//     acknowledgement, reopens the database with RocksDbTier in this process
//     and checks that every key in STATE is readable, verifies, and holds the
//     expected bytes, with 0 corrupt reads. Keys written but not yet recorded
//     may or may not exist. Every cycle must add acknowledged blocks (a
//     writer that acknowledges nothing within 30 s, or a cycle that adds
//     none, fails the run), so a slow machine cannot pass having verified
//     nothing.
//     Default (ctest): 20 cycles, kill 20-200 ms after the first ack.
//     --full: at least 20 cycles and at least 10,000 acknowledged blocks,
//     kill 100-1000 ms after the first ack.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "storage/rocksdb_tier.h"

using namespace cleave;

namespace {

constexpr uint64_t kModel = 0xC1EA7E5EEDull;
constexpr auto kFirstAckTimeout = std::chrono::seconds(30);

off_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : 0;
}

KvLayout crash_layout() {  // 2 * 2 heads * 4 tokens * 64 * 4 bytes = 4 KiB
  KvLayout l;
  l.tokens_per_block = 4;
  l.n_layers = 1;
  l.n_kv_heads = 2;
  l.head_dim = 64;
  return l;
}

RocksDbTierOptions crash_options() {
  RocksDbTierOptions o;
  o.capacity_bytes = size_t(1) << 40;
  o.sync = true;
  o.model_fingerprint = kModel;
  o.layout = crash_layout();
  return o;
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The bytes of a block are a function of its key, so the driver can check
// content, not only checksums.
std::vector<uint8_t> content(const BlockKey& key) {
  std::vector<uint8_t> b(crash_layout().block_bytes());
  uint64_t s = key.lo ^ (key.hi * 31);
  for (size_t i = 0; i < b.size(); i += 8) {
    const uint64_t v = splitmix(s);
    std::memcpy(b.data() + i, &v, 8);
  }
  return b;
}

bool parse_hex(const std::string& h, BlockKey& k) {
  if (h.size() != 32) return false;
  // Keep the halves alive while `end` points into them.
  const std::string hi = h.substr(0, 16), lo = h.substr(16);
  char* end = nullptr;
  k.hi = std::strtoull(hi.c_str(), &end, 16);
  if (*end) return false;
  k.lo = std::strtoull(lo.c_str(), &end, 16);
  return !*end;
}

int writer(const std::string& dir, const std::string& state, uint64_t seed, long n) {
  auto tier = RocksDbTier::open(dir, crash_options());
  if (!tier.ok()) {
    std::fprintf(stderr, "writer: %s\n", tier.status().to_string().c_str());
    return 2;
  }
  const int fd = ::open(state.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (fd < 0) {
    std::perror(state.c_str());
    return 2;
  }
  std::mt19937_64 rng(seed);
  for (long i = 0; i < n; ++i) {
    BlockRecord r;
    r.header.key = {rng(), rng()};
    r.header.model_fingerprint = kModel;
    r.header.layout = crash_layout();
    r.header.n_tokens = uint32_t(crash_layout().tokens_per_block);
    r.bytes = content(r.header.key);
    seal(r);
    const Status s = (*tier)->insert(r);
    if (!s.ok()) {
      std::fprintf(stderr, "writer: insert: %s\n", s.to_string().c_str());
      return 3;
    }
    const std::string line = r.header.key.hex() + "\n";  // acknowledged
    if (::write(fd, line.data(), line.size()) != ssize_t(line.size()) || ::fsync(fd) != 0) {
      std::perror("writer: state file");
      return 3;
    }
  }
  ::close(fd);
  return 0;
}

// Complete lines only: a kill can cut the last line short.
std::vector<std::string> read_state(const std::string& state) {
  std::ifstream in(state, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> keys;
  size_t start = 0;
  for (size_t nl; (nl = all.find('\n', start)) != std::string::npos; start = nl + 1)
    keys.push_back(all.substr(start, nl - start));
  return keys;
}

int drive(const std::string& workdir, bool full, int min_cycles, uint64_t seed) {
  namespace fs = std::filesystem;
  const std::string db = workdir + "/db", state = workdir + "/expected_state";
  std::error_code ec;
  fs::create_directories(workdir, ec);
  if (!fs::is_directory(workdir)) {
    std::fprintf(stderr, "drive: '%s' is not a directory\n", workdir.c_str());
    return 1;
  }
  fs::remove_all(db);  // only what a previous run left, never the workdir itself
  fs::remove(state);
  const long min_blocks = full ? 10000 : 0;
  const int lo_ms = full ? 100 : 20, hi_ms = full ? 1000 : 200;
  std::mt19937_64 rng(seed);
  int cycles = 0, kills = 0, clean_exits = 0;
  size_t verified_total = 0, last_acked = 0, extra_max = 0;
  uint64_t corrupt = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (cycles < min_cycles || long(last_acked) < min_blocks) {
    if (cycles >= 1000) {
      std::fprintf(stderr, "drive: gave up after %d cycles\n", cycles);
      return 1;
    }
    const std::string child_seed = std::to_string(rng());
    const int delay = lo_ms + int(rng() % uint64_t(hi_ms - lo_ms + 1));
    const off_t state_before = file_size(state);
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    if (pid == 0) {
      const char* argv[] = {"storage_crash", "writer", db.c_str(), state.c_str(),
                            child_seed.c_str(), "100000000", nullptr};
      ::execv("/proc/self/exe", const_cast<char* const*>(argv));
      std::_Exit(127);
    }
    // The delay counts from the writer's first acknowledgement: however slow
    // its start (opening RocksDB, a loaded machine), each kill lands while it
    // acknowledges blocks.
    const auto wait_start = std::chrono::steady_clock::now();
    int status = 0;
    bool exited = false;
    while (file_size(state) <= state_before) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        break;
      }
      if (std::chrono::steady_clock::now() - wait_start > kFirstAckTimeout) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        std::printf("FAIL: cycle %d: the writer acknowledged no block within %lld s\n", cycles + 1,
                    (long long)std::chrono::duration_cast<std::chrono::seconds>(kFirstAckTimeout)
                        .count());
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const double first_ack_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wait_start)
            .count();
    if (!exited) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay));
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    ++cycles;
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
      ++kills;
    } else {
      ++clean_exits;
      std::fprintf(stderr, "drive: writer exited with status %d before the kill\n", status);
      return 1;
    }

    const std::vector<std::string> keys = read_state(state);
    auto tier = RocksDbTier::open(db, crash_options());
    if (!tier.ok()) {
      std::fprintf(stderr, "drive: cycle %d: reopen: %s\n", cycles,
                   tier.status().to_string().c_str());
      return 1;
    }
    size_t ok = 0, bad = 0;
    for (const auto& h : keys) {
      BlockKey k;
      if (!parse_hex(h, k)) {
        std::fprintf(stderr, "drive: bad state line '%s'\n", h.c_str());
        ++bad;
        continue;
      }
      auto r = (*tier)->lookup(k);
      if (!r.ok()) {
        std::fprintf(stderr, "drive: cycle %d: acknowledged block %s: %s\n", cycles, h.c_str(),
                     r.status().to_string().c_str());
        ++bad;
      } else if (r->bytes != content(k)) {
        std::fprintf(stderr, "drive: cycle %d: block %s holds other bytes\n", cycles, h.c_str());
        ++bad;
      } else {
        ++ok;
      }
    }
    const auto c = (*tier)->counters();
    corrupt += c.corrupt_reads;
    const size_t stored = (*tier)->size();
    extra_max = stored - std::min(stored, keys.size());
    const size_t added = keys.size() - std::min(keys.size(), last_acked);
    std::printf("cycle %2d: first ack after %5.1f ms, killed %4d ms later, acknowledged %6zu "
                "(+%zu), verified %6zu, stored %6zu, corrupt reads %llu\n",
                cycles, first_ack_ms, delay, keys.size(), added, ok, stored,
                (unsigned long long)c.corrupt_reads);
    std::fflush(stdout);
    verified_total += ok;
    if (bad || c.corrupt_reads) {
      std::printf("FAIL: %zu of %zu acknowledged blocks missing or wrong, %llu corrupt reads\n",
                  bad, keys.size(), (unsigned long long)c.corrupt_reads);
      return 1;
    }
    if (keys.size() < last_acked || added == 0) {
      std::printf("FAIL: cycle %d acknowledged no new block (%zu before, %zu after)\n", cycles,
                  last_acked, keys.size());
      return 1;
    }
    last_acked = keys.size();
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("PASS: %d cycles, %d SIGKILLs, %zu blocks acknowledged (4 KiB, sync=true), "
              "100%% readable and verified after every kill (%zu block checks), %llu corrupt "
              "reads, %zu written-but-unrecorded blocks present at the end, %.1f s\n",
              cycles, kills, last_acked, verified_total, (unsigned long long)corrupt, extra_max,
              secs);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "writer")
    return writer(argv[2], argv[3], std::strtoull(argv[4], nullptr, 10),
                  std::strtol(argv[5], nullptr, 10));
  if (argc >= 3 && std::string(argv[1]) == "drive") {
    bool full = false;
    int cycles = 20;
    uint64_t seed = uint64_t(std::random_device{}());
    for (int i = 3; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--full") full = true;
      else if (a == "--cycles" && i + 1 < argc) cycles = std::atoi(argv[++i]);
      else if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
      else {
        std::fprintf(stderr, "unknown argument %s\n", a.c_str());
        return 2;
      }
    }
    std::printf("storage_crash: seed %llu\n", (unsigned long long)seed);
    return drive(argv[2], full, cycles, seed);
  }
  std::fprintf(stderr,
               "usage: %s writer DIR STATE SEED N\n"
               "       %s drive WORKDIR [--full] [--cycles C] [--seed S]\n",
               argv[0], argv[0]);
  return 2;
}
