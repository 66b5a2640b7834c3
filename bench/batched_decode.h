// cleave_bench --batched: decode throughput of the scheduler's continuous
// batching at batch 1, 8, 32 and 64, each beside the roofline of that batch
// (weight and KV bytes over the read bandwidth against the rows' FLOPs over
// the FMA peak, both measured in the same run), with the share of each
// part of a step (output matrix, the layers' matrices, attention, the rest
// of the ops, and what runs outside the backend: sampling and scheduling).
// Rows of --compute int8 put the matrices' FLOPs against the measured int8
// (VNNI) peak instead of the FP32 FMA peak.
#pragma once

#include <string>
#include <vector>

namespace cleave::bench {

struct BatchedOptions {
  std::string vocab, workdir, out_json;
  std::vector<std::string> types{"f16", "q8_0"};
  std::vector<std::string> kv_types{"f32", "f16", "q8_0"};  // K and V alike
  // --compute: exact and/or int8 (int8 runs the q8_0 weights only).
  std::vector<std::string> computes{"exact"};
  std::vector<int> threads{1, 2};
  std::vector<int> batches{1, 8, 32, 64};
  std::vector<int> block_sizes{16};  // --block-size: positions per KV block
  int prompt = 128, generate = 64, runs = 3;
};

int run_batched_section(const BatchedOptions& o);

}  // namespace cleave::bench
