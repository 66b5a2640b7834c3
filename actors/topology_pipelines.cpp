// The pipelines of a cluster (stage{} on its nodes) against each other and
// against a model.
#include <algorithm>
#include <map>

#include "actors/topology.h"

namespace cleave {

std::vector<const NodeSpec*> pipeline_nodes(const ClusterSpec& spec, const std::string& name) {
  std::vector<const NodeSpec*> out;
  for (const NodeSpec& n : spec.nodes)
    if (n.stage.set && n.stage.pipeline == name) out.push_back(&n);
  std::stable_sort(out.begin(), out.end(), [](const NodeSpec* a, const NodeSpec* b) {
    return a->stage.layers.first < b->stage.layers.first;
  });
  return out;
}

Status check_topology_pipelines(const ClusterSpec& spec, const LlamaConfig* model) {
  std::map<std::string, int> seen;
  for (const NodeSpec& n : spec.nodes)
    if (n.stage.set) seen.emplace(n.stage.pipeline, n.line);
  for (const auto& [name, line] : seen) {
    const std::vector<const NodeSpec*> nodes = pipeline_nodes(spec, name);
    const std::string who = "pipeline '" + name + "'";
    auto node_of = [](const NodeSpec* n) {
      return "node '" + n->name + "' (line " + std::to_string(n->line) + ")";
    };
    int32_t firsts = 0;
    for (const NodeSpec* n : nodes) firsts += n->count("stage") == 0 ? 1 : 0;
    if (firsts != 1)
      return Status(Code::invalid_argument,
                    who + " has " + std::to_string(firsts) +
                        " first stages (a prefill, decode or colocated actor with stage{} from "
                        "layer 0): it needs exactly one");
    int32_t next = 0;
    for (size_t i = 0; i < nodes.size(); ++i) {
      const LayerRange& r = nodes[i]->stage.layers;
      if (r.first > next)
        return Status(Code::invalid_argument,
                      who + ": layers [" + std::to_string(next) + ", " + std::to_string(r.first - 1) +
                          "] are held by no stage (a gap before " + node_of(nodes[i]) + ", " +
                          r.to_string() + ")");
      if (r.first < next)
        return Status(Code::invalid_argument,
                      who + ": " + node_of(nodes[i]) + " holds " + r.to_string() + ", which overlaps " +
                          node_of(nodes[i - 1]) + ", " + nodes[i - 1]->stage.layers.to_string());
      next = r.last + 1;
    }
    if (!model) continue;
    const NodeSpec* last = nodes.back();
    if (last->stage.layers.last >= model->n_layers)
      return Status(Code::invalid_argument,
                    who + ": " + node_of(last) + " holds " + last->stage.layers.to_string() +
                        ", past the model's layers [0, " + std::to_string(model->n_layers - 1) + "]");
    if (last->stage.layers.last < model->n_layers - 1)
      return Status(Code::invalid_argument,
                    who + ": layers [" + std::to_string(last->stage.layers.last + 1) + ", " +
                        std::to_string(model->n_layers - 1) +
                        "] are held by no stage (a gap after " + node_of(last) + ")");
  }
  return Status::Ok();
}

}  // namespace cleave
