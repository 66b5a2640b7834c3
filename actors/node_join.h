// The head's join actor (actors/node.h): admits nodes with the cluster
// secret, hands each the router and kv_store of the model it serves, hears
// what they attach (stages, encoders, experts, later pipeline stages) and
// drains them. Private to the node's files.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/actor_types.h"

namespace cleave::actors {

// One model's router and store on the head.
struct ModelRoute {
  router_actor router;
  kv_store_actor kv;
};

struct JoinConfig {
  std::optional<std::string> secret;  // nullopt: an open cluster
  std::vector<ModelRoute> models;      // cluster_models() order: the head's first
  std::map<std::string, size_t> node_model;  // node name -> index into models (absent: 0)
  std::map<std::string, double> costs;       // node name -> NodeSpec::cost
  std::string head;                          // its node name: never drained
  std::shared_ptr<std::atomic<int32_t>> experts_alive;  // expert actors attached and alive
  // For nodes that join with --join HOST:PORT: what the head loaded
  // (source_name, source, then each --set key and value).
  std::vector<std::string> topology;
  // Tests only: never answer a stage's or encoder's attach (the worker's
  // request stays pending), so a test can take the head away mid-start.
  bool fault_stall_attach = false;
};

join_actor spawn_join(caf::actor_system& system, JoinConfig config);

// One line on stderr, flushed (the node's log).
void log_line(const std::string& line);
// A name from the wire, safe to print.
std::string printable(const std::string& s);

}  // namespace cleave::actors
