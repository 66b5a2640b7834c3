// Hot-expert replication as a policy over tables (no threads, no model):
// given the rows each host and each (layer, expert) took in a window, it
// says which expert to copy onto which host, or nothing. ExpertPool applies
// its answer; a replica is one more host for that expert, which the pool's
// least-loaded picking then shares the expert's rows with. Balancing never
// changes a token: a row's bits do not depend on the host.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>



namespace cleave {

struct ReplicaMove {
  int32_t host = 0;  // the host that gains the replica
  int32_t layer = 0;
  int32_t expert = 0;
};

// The spread of a load: standard deviation over mean (0 for no load).
double load_spread(const std::vector<uint64_t>& rows);

struct ReplicationPolicy {
  double max_spread = 0.25;  // act above this spread of the hosts' rows
  // holds(host, layer, expert): whether the host has that expert now.
  // host_rows[h]: rows host h took in the window; expert_rows[layer * n + e]:
  // rows routed to expert e of that layer (n = experts per layer).
  // When the spread is over max_spread: the (layer, expert) of the most
  // loaded host that the least loaded host lacks whose copy narrows their
  // gap most goes to the least loaded host. A replica splits its expert's r
  // rows between the two, so the gap g becomes |g - r|: only 0 < r < 2g helps.
  template <class Holds>
  std::optional<ReplicaMove> pick(const Holds& holds, const std::vector<uint64_t>& host_rows,
                                  const std::vector<uint64_t>& expert_rows, int32_t n_layers,
                                  int32_t experts_per_layer) const {
    if (host_rows.size() < 2 || load_spread(host_rows) <= max_spread) return std::nullopt;
    int32_t hot = 0, cold = 0;
    for (int32_t h = 1; h < int32_t(host_rows.size()); ++h) {
      if (host_rows[size_t(h)] > host_rows[size_t(hot)]) hot = h;
      if (host_rows[size_t(h)] < host_rows[size_t(cold)]) cold = h;
    }
    const uint64_t gap = host_rows[size_t(hot)] - host_rows[size_t(cold)];
    std::optional<ReplicaMove> best;
    uint64_t best_left = gap;  // the gap after the best move so far
    for (int32_t l = 0; l < n_layers; ++l)
      for (int32_t e = 0; e < experts_per_layer; ++e) {
        const uint64_t r = expert_rows[size_t(l) * size_t(experts_per_layer) + size_t(e)];
        if (r == 0 || r >= 2 * gap || !holds(hot, l, e) || holds(cold, l, e)) continue;
        const uint64_t left = r > gap ? r - gap : gap - r;
        if (left < best_left) {
          best = ReplicaMove{cold, l, e};
          best_left = left;
        }
      }
    return best;
  }
};

}  // namespace cleave
