// cleave_storage_bench: KV storage speed beside the machine's limits,
// measured in the same run.
//   tier 0 <-> tier 1 moves   beside single-thread memcpy (and XXH3) of the same bytes
//   tier 2 (RocksDB) writes   beside a raw sequential write() of the same bytes
//   tier 2 reads              beside a raw sequential read() of the same bytes
//   prefix lookup (1M blocks) beside the key hashing alone
// Prints a table and writes JSON (--json, default storage-bench.json).
#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "storage/block.h"
#include "storage/block_pool.h"
#include "storage/memory_tier.h"
#include "storage/prefix.h"
#include "storage/rocksdb_tier.h"
#include "storage/tiered_store.h"

using namespace cleave;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kModelFp = 0x5EEDF00DCAFEBABEull;

double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

[[noreturn]] void die(const std::string& what, const Status& st) {
  std::fprintf(stderr, "cleave_storage_bench: %s: %s\n", what.c_str(), st.to_string().c_str());
  std::exit(1);
}
void check(const Status& st, const std::string& what) {
  if (!st.ok()) die(what, st);
}
template <class T>
T take(Result<T> r, const std::string& what) {
  if (!r.ok()) die(what, r.status());
  return std::move(r).value();
}

KvLayout make_layout(int tpb, int layers, int heads, int dim) {
  KvLayout l;
  l.tokens_per_block = tpb;
  l.n_layers = layers;
  l.n_kv_heads = heads;
  l.head_dim = dim;
  return l;
}

// n sealed records with random keys and F32 values in [-1, 1) (random
// mantissas: about as incompressible as real KV).
std::vector<BlockRecord> make_records(const KvLayout& l, size_t n, uint64_t seed) {
  std::vector<BlockRecord> out(n);
  const size_t bb = l.block_bytes();
  for (auto& r : out) {
    r.header.key = {splitmix(seed), splitmix(seed)};
    r.header.model_fingerprint = kModelFp;
    r.header.layout = l;
    r.header.n_tokens = uint32_t(l.tokens_per_block);
    r.bytes.resize(bb);
    auto* f = reinterpret_cast<float*>(r.bytes.data());
    for (size_t i = 0; i < bb / 4; i += 2) {
      uint64_t x = splitmix(seed);
      f[i] = float(int32_t(x)) * (1.0f / 2147483648.0f);
      if (i + 1 < bb / 4) f[i + 1] = float(int32_t(x >> 32)) * (1.0f / 2147483648.0f);
    }
    seal(r);
  }
  return out;
}

double gbps(double bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0; }

template <class Fn>
double best_of(int reps, Fn fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    double t0 = now_s();
    fn();
    best = std::min(best, now_s() - t0);
  }
  return best;
}

// ---------------------------------------------------------------- tier 0 <-> 1

json bench_moves(const KvLayout& l, size_t total_bytes, int reps) {
  const size_t bb = l.block_bytes();
  const size_t n = std::max<size_t>(4, total_bytes / bb) & ~size_t(1);
  const double bytes = double(n) * double(bb);
  auto recs = make_records(l, n, 1234 + bb);

  // Limits: memcpy of every block into a fresh (pre-touched) page-aligned
  // slab, single thread; XXH3-64 (checksum_bytes) over the same bytes.
  std::vector<uint8_t*> dst(n);
  for (auto& d : dst) {
    d = static_cast<uint8_t*>(std::aligned_alloc(4096, (bb + 4095) / 4096 * 4096));
    std::memset(d, 1, bb);
  }
  double t_memcpy = best_of(reps, [&] {
    for (size_t i = 0; i < n; ++i) std::memcpy(dst[i], recs[i].bytes.data(), bb);
  });
  volatile uint64_t sink = 0;
  double t_xxh3 = best_of(reps, [&] {
    uint64_t s = 0;
    for (size_t i = 0; i < n; ++i) s += checksum_bytes(recs[i].bytes.data(), bb);
    sink = sink + s;
  });
  for (auto* d : dst) std::free(d);

  // Direct: the store's hop, move_block (Tier::read of the source's bytes in
  // place -> insert, which copies and hashes the copy once -> erase), tier 1
  // -> tier 0 (promote) and back (demote), every block once per pass.
  auto t0 = take(MemoryTier::create(MemoryKind::host_arena, n * bb, kModelFp, l), "tier0");
  auto t1 = take(MemoryTier::create(MemoryKind::pinned_host, n * bb, kModelFp, l), "tier1");
  for (auto& r : recs) check(t1->insert(r), "tier1 insert");
  auto move_all = [&](MemoryTier& from, MemoryTier& to) {
    for (auto& r : recs) check(move_block(from, to, r.header.key), "move_block");
  };
  double t_promote = 1e30, t_demote = 1e30;
  for (int r = 0; r < reps; ++r) {
    double a = now_s();
    move_all(*t1, *t0);
    double b = now_s();
    move_all(*t0, *t1);
    double c = now_s();
    t_promote = std::min(t_promote, b - a);
    t_demote = std::min(t_demote, c - b);
  }
  t0.reset();
  t1.reset();

  // Through TieredStore: tier 0 holds n/2 blocks, tier 1 n. After putting
  // all n, a cyclic get() always hits tier 1: each get promotes one block
  // and demotes the LRU victim of tier 0 (2 block moves), plus returns a copy.
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(take(MemoryTier::create(MemoryKind::host_arena, n / 2 * bb, kModelFp, l), "t0"));
  tiers.push_back(take(MemoryTier::create(MemoryKind::pinned_host, n * bb, kModelFp, l), "t1"));
  auto store = take(TieredStore::create(std::move(tiers), kModelFp, l), "store");
  for (auto& r : recs) check(store->put(r), "put");
  for (size_t i = 0; i < n; ++i) (void)take(store->get(recs[i].header.key), "warm get");
  StoreCounters c0 = store->counters();
  double t_store = best_of(reps, [&] {
    for (size_t i = 0; i < n; ++i) (void)take(store->get(recs[i].header.key), "get");
  });
  StoreCounters c1 = store->counters();
  const uint64_t moves = (c1.promotions[0] - c0.promotions[0]) + (c1.demotions[0] - c0.demotions[0]);
  const double moves_per_get = double(moves) / double(n) / reps;

  json j;
  j["block_bytes"] = bb;
  j["blocks"] = n;
  j["bytes"] = bytes;
  j["memcpy_gbps"] = gbps(bytes, t_memcpy);
  j["xxh3_gbps"] = gbps(bytes, t_xxh3);
  // One move at best = one copy + one hash of the bytes.
  j["copy_plus_hash_gbps"] = gbps(bytes, t_memcpy + t_xxh3);
  j["promote_gbps"] = gbps(bytes, t_promote);
  j["demote_gbps"] = gbps(bytes, t_demote);
  j["store_get_moves_per_get"] = moves_per_get;
  j["store_moved_gbps"] = gbps(bytes * moves_per_get, t_store);
  j["store_get_us"] = t_store / double(n) * 1e6;
  return j;
}

// ---------------------------------------------------------------- tier 2

// Raw sequential write of the blocks into one file: fsync at the end, or
// after every block. Then a read of the file back (page cache warm).
struct RawIo {
  double write_s = 0, read_s = 0;
};
RawIo raw_io(const std::string& path, const std::vector<BlockRecord>& recs, bool fsync_each) {
  RawIo r;
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) die("open " + path, Status(Code::io_error, std::strerror(errno)));
  double a = now_s();
  for (auto& rec : recs) {
    size_t off = 0;
    while (off < rec.bytes.size()) {
      ssize_t w = ::write(fd, rec.bytes.data() + off, rec.bytes.size() - off);
      if (w <= 0) die("write " + path, Status(Code::io_error, std::strerror(errno)));
      off += size_t(w);
    }
    if (fsync_each) ::fsync(fd);
  }
  if (!fsync_each) ::fsync(fd);
  r.write_s = now_s() - a;
  ::close(fd);
  std::vector<uint8_t> buf(recs.at(0).bytes.size());
  fd = ::open(path.c_str(), O_RDONLY);
  a = now_s();
  for (size_t i = 0; i < recs.size(); ++i) {
    size_t off = 0;
    while (off < buf.size()) {
      ssize_t g = ::read(fd, buf.data() + off, buf.size() - off);
      if (g <= 0) die("read " + path, Status(Code::io_error, "short read"));
      off += size_t(g);
    }
  }
  r.read_s = now_s() - a;
  ::close(fd);
  fs::remove(path);
  return r;
}

json bench_tier2(const KvLayout& l, const std::string& dir, size_t n, bool sync) {
  const size_t bb = l.block_bytes();
  const double bytes = double(n) * double(bb);
  auto recs = make_records(l, n, 777 + bb + sync);
  const std::string db_dir = dir + (sync ? "/rdb-sync" : "/rdb-nosync");
  fs::remove_all(db_dir);
  RocksDbTierOptions o;
  o.capacity_bytes = size_t(1) << 40;
  o.sync = sync;
  o.model_fingerprint = kModelFp;
  o.layout = l;
  double t_write, t_read;
  std::string compression;
  {
    auto db = take(RocksDbTier::open(db_dir, o), "rocksdb open");
    compression = db->compression_name();
    double a = now_s();
    for (auto& r : recs) check(db->insert(r), "rocksdb insert");
    t_write = now_s() - a;
    a = now_s();
    for (auto& r : recs) {
      auto got = take(db->lookup(r.header.key), "rocksdb lookup");
      if (got.bytes.size() != bb) die("rocksdb lookup", Status(Code::corruption, "size"));
    }
    t_read = now_s() - a;
  }
  fs::remove_all(db_dir);
  RawIo raw = raw_io(dir + "/raw.bin", recs, sync);

  json j;
  j["block_bytes"] = bb;
  j["blocks"] = n;
  j["bytes"] = bytes;
  j["sync"] = sync;
  j["compression"] = compression;
  j["write_gbps"] = gbps(bytes, t_write);
  j["read_gbps"] = gbps(bytes, t_read);
  j["raw_write_gbps"] = gbps(bytes, raw.write_s);
  j["raw_read_gbps"] = gbps(bytes, raw.read_s);
  j["write_us_per_block"] = t_write / double(n) * 1e6;
  j["raw_write_us_per_block"] = raw.write_s / double(n) * 1e6;
  return j;
}

// ---------------------------------------------------------------- prefix

// Token ids of sequence s, deterministic, so prompts are regenerated rather
// than stored.
void seq_tokens(uint64_t s, size_t n, std::vector<int32_t>& out) {
  out.resize(n);
  uint64_t st = s * 0x100000001B3ull + 17;
  for (size_t i = 0; i < n; ++i) out[i] = int32_t(splitmix(st) % 50000);
}

json pct(std::vector<double>& ns, int blocks) {
  std::sort(ns.begin(), ns.end());
  auto at = [&](double q) { return ns[std::min(ns.size() - 1, size_t(q * double(ns.size())))]; };
  json j;
  j["reps"] = ns.size();
  j["p50_ns"] = at(0.50);
  j["p99_ns"] = at(0.99);
  j["p50_ns_per_block"] = at(0.50) / std::max(1, blocks);
  j["p99_ns_per_block"] = at(0.99) / std::max(1, blocks);
  return j;
}

// Limit for an index probe: one dependent load from DRAM (pointer chase
// over a random cycle of 64 MiB), ns per load.
double dram_latency_ns() {
  const size_t n = (size_t(64) << 20) / sizeof(size_t);
  std::vector<size_t> next(n), order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  uint64_t rng = 5;
  for (size_t i = n - 1; i > 0; --i) std::swap(order[i], order[splitmix(rng) % (i + 1)]);
  for (size_t i = 0; i < n; ++i) next[order[i]] = order[(i + 1) % n];
  const size_t steps = 2000000;
  size_t at = order[0];
  double a = now_s();
  for (size_t i = 0; i < steps; ++i) at = next[at];
  double t = now_s() - a;
  volatile size_t sink = at;
  (void)sink;
  return t / double(steps) * 1e9;
}

json bench_prefix(int32_t n_blocks, int reps) {
  const KvLayout l = make_layout(16, 12, 4, 64);
  const int tpb = l.tokens_per_block;
  const int32_t blocks_per_seq = 64;  // many sequences: short prompts hit many distinct keys
  const int32_t n_seq = std::max<int32_t>(1, n_blocks / blocks_per_seq);
  n_blocks = n_seq * blocks_per_seq;

  auto pool = take(BlockPool::create(n_blocks, tpb), "pool");
  auto index = take(PrefixIndex::create(*pool, kModelFp, l), "index");
  std::vector<int32_t> toks;
  double a = now_s();
  for (int32_t s = 0; s < n_seq; ++s) {
    seq_tokens(uint64_t(s), size_t(blocks_per_seq) * tpb, toks);
    auto keys = chain_keys(toks.data(), int32_t(toks.size()), kModelFp, l);
    for (auto& k : keys) {
      int32_t id = *pool->allocate();
      int32_t got = take(index->insert(k, id), "index insert");
      check(pool->release(id), "release");  // the index holds its own reference
      (void)got;
    }
  }
  const double insert_s = now_s() - a;
  if (index->size() != size_t(n_blocks))
    die("prefix", Status(Code::aborted, "index size " + std::to_string(index->size())));

  // A fresh prompt per repetition, from a random sequence (made outside the
  // timer), so repeated lookups do not keep walking the same cached keys.
  uint64_t rng = 99;
  auto make_prompt = [&](int blocks, bool miss, int hit_blocks, std::vector<int32_t>& p) {
    uint64_t s = miss && hit_blocks == 0 ? uint64_t(n_seq) + splitmix(rng) % 1000000
                                         : splitmix(rng) % uint64_t(n_seq);
    seq_tokens(s, size_t(blocks) * tpb, p);
    if (miss && hit_blocks > 0) p[size_t(hit_blocks) * tpb] ^= 1;  // first absent block
  };
  json out;
  out["blocks_indexed"] = n_blocks;
  out["sequences"] = n_seq;
  out["tokens_per_block"] = tpb;
  out["insert_ns_per_block"] = insert_s / n_blocks * 1e9;
  struct Case {
    const char* name;
    int blocks;
    bool miss;
    int expect;
  };
  const Case cases[] = {{"hit_1", 1, false, 1},      {"hit_8", 8, false, 8},
                        {"hit_64", 64, false, 64},   {"miss_first_of_64", 64, true, 0},
                        {"hit_32_miss_of_64", 64, true, 32}};
  for (const Case& c : cases) {
    std::vector<int32_t> p;
    const int n_rep = std::max(200, reps / std::max(1, c.blocks / 4));
    std::vector<double> ns;
    ns.reserve(size_t(n_rep));
    for (int r = 0; r < n_rep; ++r) {
      make_prompt(c.blocks, c.miss, c.expect, p);
      auto t0 = Clock::now();
      PrefixMatch m = index->longest_prefix(p.data(), int32_t(p.size()));
      auto t1 = Clock::now();
      if (m.n_blocks != c.expect)
        die(c.name, Status(Code::aborted, "matched " + std::to_string(m.n_blocks)));
      ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
    }
    // Blocks whose key is computed (and looked up): the matched ones plus the miss.
    json j = pct(ns, c.miss ? c.expect + 1 : c.blocks);
    j["prompt_blocks"] = c.blocks;
    j["matched_blocks"] = c.expect;
    out["cases"][c.name] = j;
  }
  // Limit: hashing the key chain alone (block_key per block, no map).
  {
    std::vector<int32_t> p;
    std::vector<double> ns;
    volatile uint64_t sink = 0;
    for (int r = 0; r < std::max(200, reps / 16); ++r) {
      make_prompt(64, false, 0, p);
      auto t0 = Clock::now();
      BlockKey k{0, 0};
      for (int b = 0; b < 64; ++b) k = block_key(k, p.data() + size_t(b) * tpb, tpb, kModelFp, l);
      auto t1 = Clock::now();
      sink = sink + k.lo;
      ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
    }
    out["hash_only_64"] = pct(ns, 64);
  }
  out["dram_latency_ns"] = dram_latency_ns();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cleave_storage_bench: KV tier moves, RocksDB tier and prefix lookup beside limits"};
  std::string out_json = "storage-bench.json";
  std::string dir;
  bool quick = false, moves_only = false;
  size_t move_mib = 256, t2_mib = 128;
  int32_t prefix_blocks = 1 << 20;
  app.add_option("--json", out_json, "where to write the results");
  app.add_option("--dir", dir, "temp dir for tier 2 (default: under the system temp dir)");
  app.add_option("--move-mib", move_mib, "bytes moved per tier 0<->1 pass, MiB");
  app.add_option("--tier2-mib", t2_mib, "bytes written to tier 2 with sync=false, MiB");
  app.add_option("--prefix-blocks", prefix_blocks, "blocks indexed for prefix lookup");
  app.add_flag("--moves-only", moves_only, "only the tier 0 <-> 1 moves (for repeated runs)");
  app.add_flag("--quick", quick, "a smaller run (64 MiB moves, 32 MiB tier 2, 256K blocks)");
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    move_mib = std::min<size_t>(move_mib, 64);
    t2_mib = std::min<size_t>(t2_mib, 32);
    prefix_blocks = std::min<int32_t>(prefix_blocks, 1 << 18);
  }
  const int reps = quick ? 2 : 3;
  bool own_dir = dir.empty();
  if (own_dir) dir = (fs::temp_directory_path() / ("cleave-storage-bench-" + std::to_string(getpid()))).string();
  fs::create_directories(dir);

  const KvLayout big = make_layout(16, 12, 4, 64);  // 384 KiB
  const KvLayout small = make_layout(16, 4, 2, 32);  // 32 KiB
  json results;
  results["layouts"] = {{"big", "16 tok x 12 layers x 4 kv heads x 64 dim F32"},
                        {"small", "16 tok x 4 layers x 2 kv heads x 32 dim F32"}};
  const double t_start = now_s();

  for (const KvLayout* l : {&big, &small})
    results["moves"].push_back(bench_moves(*l, move_mib << 20, reps));
  for (const KvLayout* l : {&big, &small}) {
    if (moves_only) break;
    const size_t bb = l->block_bytes();
    results["tier2"].push_back(bench_tier2(*l, dir, std::max<size_t>(8, (t2_mib << 20) / bb), false));
    // sync=true: one fsync per block, so fewer blocks.
    const size_t n_sync = quick ? 32 : 128;
    results["tier2"].push_back(bench_tier2(*l, dir, n_sync, true));
  }

  if (!moves_only) results["prefix"] = bench_prefix(prefix_blocks, quick ? 4000 : 20000);

  // Diagnosis, last because it cannot be undone: the same moves with glibc
  // told to keep freed memory (no mmap per large block, no trimming), so a
  // block's slab and copy reuse already-faulted pages.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  for (const KvLayout* l : {&big, &small}) {
    json m = bench_moves(*l, move_mib << 20, reps);
    m["malloc"] = "reuse";
    results["moves"].push_back(m);
  }
  results["seconds"] = now_s() - t_start;
  if (own_dir) fs::remove_all(dir);

  // ---- table
  std::printf("\nTier 0 <-> tier 1 (MemoryTier host-arena <-> pinned-host), single thread\n");
  std::printf("%-14s %5s | %7s %7s %7s | %8s %8s %6s | %9s %6s %8s\n", "block", "MiB", "memcpy",
              "xxh3", "cp+hash", "promote", "demote", "%cpy", "store-get", "%cpy", "us/get");
  for (auto& m : results["moves"]) {
    double mc = m["memcpy_gbps"];
    double pr = m["promote_gbps"], de = m["demote_gbps"], st = m["store_moved_gbps"];
    std::printf("%5zu KiB %-6s %5.0f | %7.2f %7.2f %7.2f | %8.2f %8.2f %5.0f%% | %9.2f %5.0f%% %8.1f\n",
                size_t(m["block_bytes"]) >> 10, m.contains("malloc") ? "reuse" : "", double(m["bytes"]) / (1 << 20), mc,
                double(m["xxh3_gbps"]), double(m["copy_plus_hash_gbps"]), pr, de,
                100 * std::min(pr, de) / mc, st, 100 * st / mc, double(m["store_get_us"]));
  }
  std::printf("(GB/s; store-get counts promoted + demoted bytes, %.1f moves per get;\n"
              " reuse: rerun with glibc mmap threshold 32 MiB and trim threshold 1 GiB)\n",
              double(results["moves"][0]["store_get_moves_per_get"]));

  if (moves_only) {
    std::printf("\ntotal %.1f s; JSON: %s\n", double(results["seconds"]), out_json.c_str());
    std::ofstream(out_json) << results.dump(2) << "\n";
    return 0;
  }
  std::printf("\nTier 2 (RocksDbTier, %s) vs raw sequential file I/O, same bytes, %s\n",
              std::string(results["tier2"][0]["compression"]).c_str(), dir.c_str());
  std::printf("%-8s %-5s %6s | %8s %8s %6s | %8s %8s %6s | %9s %9s\n", "block", "sync", "blocks",
              "write", "raw-wr", "%raw", "read", "raw-rd", "%raw", "us/blk wr", "raw us/blk");
  for (auto& t : results["tier2"]) {
    double w = t["write_gbps"], rw = t["raw_write_gbps"], r = t["read_gbps"], rr = t["raw_read_gbps"];
    std::printf("%5zu KiB %-5s %6zu | %8.3f %8.3f %5.0f%% | %8.3f %8.3f %5.0f%% | %9.1f %9.1f\n",
                size_t(t["block_bytes"]) >> 10, bool(t["sync"]) ? "true" : "false",
                size_t(t["blocks"]), w, rw, 100 * w / rw, r, rr, 100 * r / rr,
                double(t["write_us_per_block"]), double(t["raw_write_us_per_block"]));
  }
  std::printf("(GB/s of block bytes; raw write = write() + one fsync at the end (sync=false) or\n"
              " fsync per block (sync=true); reads are from a warm page cache)\n");

  auto& p = results["prefix"];
  std::printf("\nPrefix lookup: %d blocks indexed (%d sequences x 64 blocks, %d tok/block), "
              "insert %.0f ns/block\n",
              int(p["blocks_indexed"]), int(p["sequences"]), int(p["tokens_per_block"]),
              double(p["insert_ns_per_block"]));
  std::printf("%-20s %6s %7s | %9s %9s | %9s %9s\n", "case", "blocks", "matched", "p50 ns",
              "p99 ns", "p50 ns/bl", "p99 ns/bl");
  for (auto& [name, c] : p["cases"].items())
    std::printf("%-20s %6d %7d | %9.0f %9.0f | %9.1f %9.1f\n", name.c_str(),
                int(c["prompt_blocks"]), int(c["matched_blocks"]), double(c["p50_ns"]),
                double(c["p99_ns"]), double(c["p50_ns_per_block"]), double(c["p99_ns_per_block"]));
  auto& h = p["hash_only_64"];
  std::printf("%-20s %6d %7s | %9.0f %9.0f | %9.1f %9.1f\n", "limit: hash only", 64, "-",
              double(h["p50_ns"]), double(h["p99_ns"]), double(h["p50_ns_per_block"]),
              double(h["p99_ns_per_block"]));
  std::printf("%-20s %6s %7s | %9s %9s | %9.1f %9s\n", "limit: DRAM load", "-", "-", "", "",
              double(p["dram_latency_ns"]), "(dependent, 64 MiB)");
  std::printf("\ntotal %.1f s; JSON: %s\n", double(results["seconds"]), out_json.c_str());
  std::ofstream(out_json) << results.dump(2) << "\n";
  return 0;
}
