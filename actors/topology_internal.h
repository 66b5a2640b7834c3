// Private to actors/topology*.cpp: what the loader, the cluster checks and
// the report share.
#pragma once

#include <cstdint>
#include <string>

#include "actors/topology.h"

namespace cleave::topology_detail {

std::string format_bytes(uint64_t b);  // "16 MiB", "1000 B"
std::string format_seconds(double s);  // "0.5 s"

// The checks that need every node (heads, duplicates, P/D pairs, where
// kv_store may be); messages start with "DISPLAY:LINE:".
Status check_cluster(const ClusterSpec& c, const std::string& display);

}  // namespace cleave::topology_detail
