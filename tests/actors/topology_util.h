// Helpers the topology script tests share (header only: the test glob
// compiles only *.cpp).
#pragma once

#include <doctest/doctest.h>

#include <map>
#include <string>

#include "actors/topology.h"

namespace cleave::testing {

using Args = std::map<std::string, std::string>;

inline ClusterSpec load_ok(const std::string& script, const Args& args = {}) {
  auto r = load_topology_string(script, "topo.lua", args);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(r.value());
}

// A head with a colocated actor, so that the script under test only adds
// what it is about.
inline const std::string kHead = "node { name = 'head', head = true, actors = { colocated = 1 } }\n";

}  // namespace cleave::testing
