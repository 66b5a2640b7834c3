// cleave_bench --groups: what running a group of independent matmuls as one
// parallel region (Backend::matmuls: q, k and v; gate and up; every
// expert's matrices) gains over running them one by one. Two engines on one
// model in one process: the CPU backend, and the same backend behind a
// wrapper that runs each group's matmuls one after another (Backend's
// default). Prefills (and decodes) alternate between the two, so both meet
// the same moments of a shared machine, and each pair gives one ratio; the
// logits of every pair must be equal bit for bit.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace cleave::bench {

// `runs` pairs (the first, a warm-up, is not counted) of a prompt of
// `prompt` tokens and `decode` greedy steps on each engine. JSON: the
// medians (ms) of each side, and the median, quartiles and wins of the
// one-by-one / grouped time ratio (above 1: grouping is faster).
nlohmann::json run_groups_ab(const std::string& model_path, int threads, int prompt, int decode, int runs);

}  // namespace cleave::bench
