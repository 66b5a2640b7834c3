// The checks of a whole cluster that the loader runs once every node is
// declared.
#include <map>
#include <string_view>

#include "actors/topology_internal.h"

namespace cleave {
namespace topology_detail {

// The checks that need every node.
Status check_cluster(const ClusterSpec& c, const std::string& display) {
  auto at = [&](int line, const std::string& msg) {
    return Status(Code::invalid_argument, display + ":" + std::to_string(line) + ": " + msg);
  };
  if (c.nodes.empty())
    return Status(Code::invalid_argument,
                  display + ": no node declared (add node { name = \"head\", head = true, ... })");
  std::map<std::string, const NodeSpec*> names, addresses;
  const NodeSpec* head = nullptr;
  for (const NodeSpec& n : c.nodes) {
    auto [it, fresh] = names.emplace(n.name, &n);
    if (!fresh)
      return at(n.line, "duplicate node name '" + n.name + "' (first declared at line " +
                            std::to_string(it->second->line) + ")");
    if (n.port != 0) {
      std::string address = n.host + ":" + std::to_string(n.port);
      auto [a, fresh_address] = addresses.emplace(address, &n);
      if (!fresh_address)
        return at(n.line, "duplicate address " + address + ": node '" + n.name +
                              "' and node '" + a->second->name + "' (line " +
                              std::to_string(a->second->line) + ")");
    }
    if (n.head) {
      if (head != nullptr)
        return at(n.line, "two head nodes: '" + n.name + "' and '" + head->name + "' (line " +
                              std::to_string(head->line) + "); mark exactly one head = true");
      head = &n;
    }
  }
  if (head == nullptr)
    return at(c.nodes.front().line,
              "no head node: mark exactly one node head = true (it hosts the router)");
  for (const NodeSpec& n : c.nodes)
    if (n.cost != 1.0 && c.placement.policy != "cost_aware")
      return at(n.line, "node '" + n.name + "' has a cost, which only router policy 'cost_aware' reads (the "
                        "router is '" + c.placement.policy + "'): set cluster { router = \"cost_aware\" } or "
                        "drop the cost");
  for (const NodeSpec& n : c.nodes)
    if (!n.head && n.count("kv_store") > 0 && !c.kv_pool)
      return at(n.line, "node '" + n.name + "' is not the head: a kv_store on a worker needs "
                        "cluster { kv_pool = true } (its store joins the head's pool)");

  // Several models: each model's nodes make a cluster of their own behind
  // the head's router for that model (with kv_pool, a pool of their own
  // whose directory is the head's store of that model; vision encoders
  // attach to their model's router); what spans models is refused.
  const std::vector<std::string> models = cluster_models(c);
  if (models.size() > 1) {
    for (const NodeSpec& n : c.nodes) {
      const char* what = n.stage.set || n.count("stage") > 0 ? "stage{} pipelines"
                         : n.count("expert") > 0             ? "expert actors"
                                                             : nullptr;
      if (what)
        return at(n.line, "node '" + n.name + "': " + what + " with several models (node{}.model) are not "
                          "supported; serve that model in a cluster of its own");
    }
  }
  // One vision encoder per model: the nodes of a model that name an mmproj
  // name the same file. With several models the head serves each model's
  // images with its node{}.mmproj (its --mmproj would name one model's), so
  // a model with vision_encoder actors names it.
  for (const std::string& model : models) {
    const std::string named = model_mmproj(c, model);
    for (const NodeSpec& n : c.nodes)
      if (n.model == model && !n.mmproj.empty() && n.mmproj != named)
        return at(n.line, "node '" + n.name + "': mmproj '" + n.mmproj + "' differs from '" + named +
                          "', named by another node of the same model (one vision encoder per model)");
    if (models.size() > 1 && named.empty() && c.count("vision_encoder", model) > 0)
      for (const NodeSpec& n : c.nodes)
        if (n.model == model && n.count("vision_encoder") > 0)
          return at(n.line, "node '" + n.name + "' hosts vision_encoder actors in a cluster of several models: "
                            "name its model's vision encoder with node{}.mmproj (the head serves each model's "
                            "images with it)");
  }
  for (const std::string& model : models) {
    const std::string of = models.size() == 1 ? "" : model.empty() ? " for the -m model" : " for model '" + model + "'";
    auto first_with = [&](const char* kind) -> const NodeSpec* {
      for (const NodeSpec& n : c.nodes)
        if (n.model == model && n.count(kind) > 0) return &n;
      return nullptr;
    };
    auto first_of_model = [&]() -> const NodeSpec* {
      for (const NodeSpec& n : c.nodes)
        if (n.model == model) return &n;
      return head;
    };
    const int32_t prefill = c.count("prefill", model), decode = c.count("decode", model);
    const int32_t colocated = c.count("colocated", model);
    if (prefill + decode + colocated == 0)
      return at(models.size() == 1 ? head->line : first_of_model()->line,
                "no actor serves requests" + of + ": add prefill and decode, or colocated, to some node");
    if (decode > 0 && prefill + colocated == 0)
      return at(first_with("decode")->line,
                "decode actors but no prefill or colocated actor in the cluster" + of + " (P/D needs both)");
    if (prefill > 0 && decode + colocated == 0)
      return at(first_with("prefill")->line,
                "prefill actors but no decode or colocated actor in the cluster" + of + " (P/D needs both)");
    if (c.pd_controller.ttft_ms != 0 || c.pd_controller.tpot_ms != 0 || c.pd_controller.confirm != 3 ||
        c.pd_controller.interval_s != 1.0 || c.pd_controller.cooldown_s != 5.0 || c.pd_controller.margin != 0.25 ||
        c.pd_controller.switch_grace_s != PdControllerConfig{}.switch_grace_s) {
      if (Status st = validate_pd_controller(c.pd_controller); !st.ok()) return at(head->line, "cluster{}." + st.message());
      if (prefill == 0 || decode == 0)
        return at(head->line, "cluster{}.pd_controller moves stages between prefill and decode: the cluster" + of +
                              " needs prefill and decode actors (it has " + std::to_string(prefill) + " and " +
                              std::to_string(decode) + ")");
    }
    if (!(c.autoscale == AutoscaleConfig{})) {
      if (Status st = validate_autoscale(c.autoscale); !st.ok()) return at(head->line, "cluster{}." + st.message());
      if (c.pd_controller.enabled())
        return at(head->line, "cluster{}.autoscale and cluster{}.pd_controller together are not supported "
                              "(both move entry stages)");
      const int32_t entry = prefill + colocated;
      if (entry < c.autoscale.min_stages)
        return at(head->line, "cluster{}.autoscale: min_stages " + std::to_string(c.autoscale.min_stages) +
                              " is more than the " + std::to_string(entry) +
                              " prefill and colocated actors of the cluster" + of);
      const int32_t encoders = c.count("vision_encoder", model);
      if (c.autoscale.encoders() && encoders < c.autoscale.min_encoders)
        return at(head->line, "cluster{}.autoscale: min_encoders " + std::to_string(c.autoscale.min_encoders) +
                              " is more than the " + std::to_string(encoders) +
                              " vision_encoder actors of the cluster" + of);
    }
  }
  return Status::Ok();
}

}  // namespace topology_detail

}  // namespace cleave
