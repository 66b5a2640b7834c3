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

inline Status load_bad(const std::string& script, const Args& args = {},
                const TopologyLimits& limits = {}) {
  auto r = load_topology_string(script, "topo.lua", args, limits);
  REQUIRE_MESSAGE(!r.ok(), "the script loaded:\n", script);
  return r.status();
}

// The error is invalid_argument, starts with "topo.lua:LINE:" and names the
// problem.
inline void expect_error(const std::string& script, int line, const std::string& needle) {
  INFO("script:\n", script);
  Status st = load_bad(script);
  INFO("error: ", st.to_string());
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().rfind("topo.lua:" + std::to_string(line) + ": ", 0) == 0);
  CHECK(st.message().find(needle) != std::string::npos);
  CHECK(st.message().find('\n') == std::string::npos);
}

// A head with a colocated actor, so that the script under test only adds
// what it is about.
inline const std::string kHead = "node { name = 'head', head = true, actors = { colocated = 1 } }\n";

}  // namespace cleave::testing
