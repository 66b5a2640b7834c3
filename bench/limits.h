// The machine's limits, measured in the run that reports a figure beside
// them: memory read bandwidth (bounds decode) and FP32 FMA peak (bounds
// prefill and large batches). Shared by the benchmarks.
#pragma once

#include <cstddef>

#include "kernels/backend.h"

namespace cleave::bench {

// Best-of-`reps` read bandwidth in GB/s over `bytes` split across threads.
double read_bandwidth(size_t bytes, int threads, int reps);
// Best-of-`reps` read bandwidth in GB/s over a `bytes` pool read as runs of
// `run_bytes` (rounded down to 128) in a shuffled order (seeded): what a paged
// KV cache's reads can reach, against read_bandwidth's one long run.
// Threads take alternate runs.
double scattered_read_bandwidth(size_t bytes, size_t run_bytes, int threads, int reps);
// Best-of-3 FP32 FMA throughput in GFLOP/s with `isa`'s widest vectors.
double fma_peak_gflops(Isa isa, int threads);
// Best-of-3 int8 dot-product throughput in GOP/s (a multiply and an add per
// byte pair) with AVX-512 VNNI's vpdpbusd, the int8 matmul's instruction;
// 0 where the CPU lacks AVX512_VNNI.
double int8_peak_gops(int threads);

}  // namespace cleave::bench
