// cleave_bench --attention: the backend's attention alone, as a decode step
// of many sequences runs it: `rows` query rows (one per sequence) at a given
// context, every layer of the 100M GQA shape (12 layers, 12 heads, 4 kv
// heads, head_dim 64, blocks of 16 positions or --block-size's), each sequence's blocks spread
// over the pool in a shuffled (seeded) order as a long-running server's
// allocator hands them out, the caches evicted before each timed step (an
// engine streams its weights between two layers' attention). Each figure stands beside two limits measured in
// the same run: the streaming read bandwidth, and the read bandwidth of runs
// as long as one (block, layer) part of a row's K (or V) at shuffled places
// in a pool as large (what paged KV reads can reach on this machine).
#pragma once

#include <string>
#include <vector>

namespace cleave::bench {

struct AttentionOptions {
  std::string out_json;
  std::vector<std::string> kv_types{"f32", "f16", "q8_0"};  // K and V alike
  std::vector<int> threads{1, 2};
  std::vector<int> rows{1, 8, 32, 64};
  std::vector<int> contexts{160, 1024};
  int runs = 5;
  std::vector<int> block_sizes{16};  // positions per KV block (the engine's --block-size)
  std::string isa;  // avx2 / avx512; empty: the best this CPU has
};

int run_attention_section(const AttentionOptions& o);

}  // namespace cleave::bench
