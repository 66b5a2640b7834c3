#include "bench/attention_bench.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <nlohmann/json.hpp>

#include "bench/limits.h"
#include "bench/stats.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "model/make_model.h"

namespace cleave::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// The 100M GQA model's attention (bench/batched_decode.cpp's model).
constexpr int32_t kLayers = 12, kHeads = 12, kKvHeads = 4, kHeadDim = 64;

// One case: the pool, the rows' block tables and their queries. The pool
// comes from the backend's alloc(), as an engine's KV pool does (on huge
// pages: on 4 KiB pages every scattered run of KV also pays its TLB misses,
// which the engine does not).
struct Case {
  PagedKv kv;
  std::unique_ptr<uint8_t, std::function<void(uint8_t*)>> pool;
  size_t pool_bytes = 0;
  std::vector<int32_t> tables;
  std::vector<AttnRow> rows;
  std::vector<float> q, out;
};

// Every element of the pool holds a valid number of the cache's type (F32
// and F16 in [-1, 1), Q8_0 blocks with a small scale): a seeded pattern of
// whole Q8_0 blocks (and whole floats and halves) tiled over the pool.
void fill(Case& c, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint8_t> pat(size_t(kQ8BlockBytes) * 2048);
  if (c.kv.k_type == DType::F32) {
    for (size_t i = 0; i + 4 <= pat.size(); i += 4) {
      const float f = u(rng);
      std::memcpy(&pat[i], &f, 4);
    }
  } else if (c.kv.k_type == DType::F16) {
    for (size_t i = 0; i + 2 <= pat.size(); i += 2) {
      const uint16_t h = fp32_to_fp16(u(rng));
      std::memcpy(&pat[i], &h, 2);
    }
  } else {
    for (size_t i = 0; i + kQ8BlockBytes <= pat.size(); i += kQ8BlockBytes) {
      const uint16_t d = fp32_to_fp16(1.0f / 127.0f);
      std::memcpy(&pat[i], &d, 2);
      for (int j = 0; j < 32; ++j) pat[i + 2 + j] = uint8_t(int8_t(int(rng() % 255) - 127));
    }
  }
  for (size_t off = 0; off < c.pool_bytes; off += pat.size())
    std::memcpy(c.pool.get() + off, pat.data(), std::min(pat.size(), c.pool_bytes - off));
}

Case make_case(Backend& be, DType type, int rows, int context, int32_t block, uint32_t seed) {
  Case c;
  c.kv.k_type = c.kv.v_type = type;
  c.kv.block_size = block;
  c.kv.n_layers = kLayers;
  c.kv.n_kv_heads = kKvHeads;
  c.kv.head_dim = kHeadDim;
  const int32_t per_row = (context + block - 1) / block;
  c.kv.n_blocks = rows * per_row;
  c.pool_bytes = size_t(c.kv.n_blocks) * c.kv.block_bytes();
  c.pool = {static_cast<uint8_t*>(be.alloc(c.pool_bytes)), [&be](uint8_t* p) { be.free(p); }};
  if (!c.pool) throw std::bad_alloc();
  c.kv.data = c.pool.get();
  std::mt19937 rng(seed);
  fill(c, rng);
  c.tables.resize(size_t(c.kv.n_blocks));
  std::iota(c.tables.begin(), c.tables.end(), 0);
  std::shuffle(c.tables.begin(), c.tables.end(), rng);
  for (int i = 0; i < rows; ++i)
    c.rows.push_back(AttnRow{c.tables.data() + size_t(i) * per_row, per_row, context - 1});
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  c.q.resize(size_t(rows) * kHeads * kHeadDim);
  for (float& f : c.q) f = u(rng);
  c.out.resize(c.q.size());
  return c;
}

// Reads 128 MiB, more than any last-level cache here, so the next step's KV
// comes from memory as it does in an engine's decode step.
void evict_caches() {
  static std::vector<uint64_t> buf((size_t(128) << 20) / 8, 1);
  static volatile uint64_t sink = 0;
  uint64_t s = 0;
  for (size_t i = 0; i < buf.size(); i += 8) s += buf[i];
  sink = sink + s;
}

}  // namespace

int run_attention_section(const AttentionOptions& o) {
  std::vector<DType> types;
  for (const std::string& name : o.kv_types) {
    auto t = kv_type_from_name(name);
    if (!t.ok()) {
      std::fprintf(stderr, "--kv-types: %s\n", t.status().message().c_str());
      return 2;
    }
    types.push_back(*t);
  }
  Isa isa = detect_isa();
  if (!o.isa.empty()) {
    if (o.isa != "avx2" && o.isa != "avx512") {
      std::fprintf(stderr, "--isa takes avx2 or avx512, not '%s'\n", o.isa.c_str());
      return 2;
    }
    const Isa want = o.isa == "avx2" ? Isa::avx2 : Isa::avx512;
    if (int(want) > int(isa)) {
      std::fprintf(stderr, "--isa %s: this CPU has %s at most\n", o.isa.c_str(), isa_name(isa));
      return 2;
    }
    isa = want;
  }
  json results;
  results["isa"] = isa_name(isa);
  std::string blocks;
  for (int bs : o.block_sizes) blocks += (blocks.empty() ? "" : ", ") + std::to_string(bs);
  std::printf(
      "attention of a decode step, 100M GQA shape (%d layers, %d heads, %d kv heads, head_dim %d, "
      "blocks of %s positions), each row's blocks at shuffled places, %s kernels; median of %d runs (range)\n",
      kLayers, kHeads, kKvHeads, kHeadDim, blocks.c_str(), isa_name(isa), o.runs);
  std::printf("%-5s %2s %5s %7s %6s | %18s %9s %8s | %7s %7s\n", "kv", "t", "rows", "context", "block",
              "ms / step", "KV MB", "GB/s", "% read", "% runs");
  for (int threads : o.threads) {
    auto be = make_cpu_backend(threads, isa);
    // The limits, once per thread count: a long read, and runs of one
    // (block, layer) part's K of a row for each type and block size
    // (measured on a pool of 512 MiB, past any cache, like the largest
    // cases below).
    const double read = read_bandwidth(size_t(512) << 20, threads, 5);
    std::printf("limits, %d thread(s): read %.1f GB/s", threads, read);
    json lim = {{"threads", threads}, {"read_gb_s", read}};
    std::map<std::pair<DType, int>, double> runs_bw;
    for (int bs : o.block_sizes)
      for (DType t : types) {
        const size_t run = size_t(kKvHeads) * bs * dtype_row_bytes(t, kHeadDim);
        const double bw = scattered_read_bandwidth(size_t(512) << 20, run, threads, 5);
        runs_bw[{t, bs}] = bw;
        std::printf(", %s runs of %zu B %.1f GB/s", dtype_name(t), run, bw);
        // The first block size keeps the key earlier JSON files used.
        const std::string key = "runs_gb_s_" + std::string(dtype_name(t));
        lim[bs == o.block_sizes.front() ? key : key + "_block" + std::to_string(bs)] = bw;
      }
    std::printf("\n");
    results["limits"].push_back(lim);
    for (DType type : types) {
      for (int bs : o.block_sizes) {
        for (int context : o.contexts) {
          for (int rows : o.rows) {
            Case c = make_case(*be, type, rows, context, bs, uint32_t(rows * 7919 + context));
            // Bytes a step reads: every row's K and V of every layer and position.
            const double kv_bytes = double(rows) * context * kLayers * kKvHeads *
                                    double(dtype_row_bytes(type, kHeadDim)) * 2;
            const float scale = 1.0f / std::sqrt(float(kHeadDim));
            auto step = [&] {
              for (int32_t l = 0; l < kLayers; ++l)
                be->attention(c.kv, l, c.q.data(), c.rows.data(), rows, kHeads, scale, c.out.data());
            };
            step();  // warm-up (scratch, page faults of the output)
            std::vector<double> ms;
            for (int r = 0; r < o.runs; ++r) {
              evict_caches();  // as in a decode step, where the weights stream between layers
              const auto t0 = Clock::now();
              step();
              ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
            }
            const double med = median(ms);
            const double gbs = kv_bytes / (med / 1e3) / 1e9;
            const double runs = runs_bw[{type, bs}];
            std::printf("%-5s %2d %5d %7d %6d | %7.2f (%.2f-%.2f) %9.1f %8.1f | %6.0f%% %6.0f%%\n",
                        dtype_name(type), threads, rows, context, bs, med,
                        *std::min_element(ms.begin(), ms.end()),
                        *std::max_element(ms.begin(), ms.end()), kv_bytes / 1e6, gbs,
                        100.0 * gbs / read, 100.0 * gbs / runs);
            std::fflush(stdout);
            results["runs"].push_back({{"kv_type", dtype_name(type)},
                                       {"threads", threads},
                                       {"rows", rows},
                                       {"context", context},
                                       {"block_size", bs},
                                       {"ms", ms},
                                       {"ms_median", med},
                                       {"kv_bytes", kv_bytes},
                                       {"gb_s", gbs},
                                       {"read_gb_s", read},
                                       {"runs_gb_s", runs}});
          }
        }
      }
    }
  }
  std::printf(
      "%% read: of the streaming read bandwidth; %% runs: of the read bandwidth of runs as long "
      "as one (block, layer) part of a row's K at shuffled places.\n");
  if (!o.out_json.empty()) {
    std::ofstream(o.out_json) << results.dump(2) << "\n";
    std::printf("wrote %s\n", o.out_json.c_str());
  }
  return 0;
}

}  // namespace cleave::bench
