// Which experts of which layers one host holds, and the --experts
// spelling of a list of them. Plain data over a model's configuration (no
// weights): the topology loader uses it too.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/llama.h"

namespace cleave {

// Experts of a layer: n_experts for MoE, 1 (the FFN) for a dense model.
inline int32_t experts_per_layer(const LlamaConfig& c) { return c.n_experts > 0 ? c.n_experts : 1; }

struct ExpertSet {
  int32_t first_layer = 0;
  int32_t last_layer = -1;       // inclusive; -1: the model's last layer
  std::vector<int32_t> experts;  // empty: every expert of those layers

  bool holds(const LlamaConfig& c, int32_t layer, int32_t expert) const;
  // invalid_argument naming the value: layers outside the model or first
  // after last, an expert outside [0, experts_per_layer), a repeated expert.
  Status validate(const LlamaConfig& c) const;
  std::string describe() const;  // "layers 0-5, experts {0, 1}"
  // The --experts spelling of this one set ("0,1@0-5", "all@2-"): what
  // parse_expert_sets reads back into the same set (nodes send it on join).
  std::string spec() const;
};

// Experts `ids` (empty: all) of layers first..last (-1: the last layer).
inline ExpertSet expert_set(std::vector<int32_t> ids, int32_t first = 0, int32_t last = -1) {
  ExpertSet s;
  s.first_layer = first;
  s.last_layer = last;
  s.experts = std::move(ids);
  return s;
}

// not_found naming the first (layer, expert) that no set holds.
Status check_expert_coverage(const LlamaConfig& c, std::span<const ExpertSet> sets);

// The --experts spelling: sets separated by ';', each EXPERTS[@LAYERS];
// EXPERTS is "all" or ids and ranges ("0-3,6"), LAYERS "L", "L-L" or "L-"
// (from L to the last layer):
// "0-3;4-7" (two hosts), "all;all" (replicas), "all@0-5;all@6-11" (by
// layer). invalid_argument naming the piece it cannot read. Sizes against a
// model are checked by ExpertSet::validate.
Result<std::vector<ExpertSet>> parse_expert_sets(const std::string& spec);

}  // namespace cleave
