// The expert placement of a cluster against a model (needs model/, so it
// stays out of the loader).
#include <vector>

#include "actors/topology.h"

namespace cleave {

Status check_topology_experts(const ClusterSpec& spec, const LlamaConfig& model) {
  std::vector<ExpertSet> sets;
  for (const NodeSpec& n : spec.nodes) {
    if (n.count("expert") == 0) continue;
    Status st = n.experts.validate(model);
    if (!st.ok())
      return Status(Code::invalid_argument, "node '" + n.name + "' (line " + std::to_string(n.line) +
                                                "): " + st.message());
    sets.push_back(n.experts);
  }
  if (sets.empty()) return Status::Ok();
  Status st = check_expert_coverage(model, sets);
  if (!st.ok())
    return Status(Code::invalid_argument, st.message() + ": place it on some node's expert actors "
                                                          "(expert = { experts = {...}, layers = {...} })");
  return Status::Ok();
}

}  // namespace cleave
