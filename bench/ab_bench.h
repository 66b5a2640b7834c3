// cleave_bench --ab WHAT: one engine change measured in one process. Two
// engines on one model: the CPU backend as cleave runs it, and a variant
// without the change; prefills (and decodes) alternate between the two, so
// both meet the same moments of a shared machine, each pair gives one
// ratio, and the logits of every pair must be equal bit for bit.
// - groups: independent matmuls as one parallel region (Backend::matmuls:
//   q, k and v; gate and up; every expert's matrices); the variant runs a
//   group's matmuls one by one.
// - rows: a prefill's matmuls split over the threads by rows where the
//   weights are small (ThreadPool's own-range-first claiming keeps them on
//   the core that wrote them); the variant always splits panels.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace cleave::bench {

// `runs` pairs (the first, a warm-up, is not counted) of a prompt of
// `prompt` tokens and `decode` greedy steps on each engine. JSON: the
// medians (ms) of each side, and the median, quartiles and wins of the
// variant / default time ratio (above 1: the change is faster).
// Throws std::runtime_error (unknown `what`, a model that does not load,
// logits that differ).
nlohmann::json run_ab(const std::string& what, const std::string& model_path, int threads, int prompt,
                      int decode, int runs);

}  // namespace cleave::bench
