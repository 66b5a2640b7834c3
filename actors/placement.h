// Where the router sends a request: policies as plain classes (no CAF),
// chosen by the topology script's `router` field (or PipelineOptions),
// unit-tested on tables (tests/actors/test_placement.cpp).
//
//   least_loaded         fewest requests in flight; ties to the lowest index
//   round_robin          the next live candidate after the last one chosen
//   least_loaded_prefix  least loaded, but a request whose first full prompt
//                        block was last placed on stage S goes to S while S's
//                        load is within 4 of the least (the default)
//   kv_aware             the lowest cost = prefill_weight x the prompt blocks
//                        the candidate would have to compute (those after the
//                        longest leading run it holds, as far as the router
//                        knows) + decode_weight x the blocks of the requests
//                        it is serving (prompt + max_tokens each); ties to
//                        fewer in flight, then the lowest index. The router
//                        learns what each stage holds from its own placements
//                        (Dynamo's approximate KV indexer): a stage that has
//                        evicted a block costs a recompute, never wrong KV.
//                        In a KV pool the router also tells it what each
//                        stage's store holds (Candidate::pool_local) and
//                        what other stores hold (pool_any): those blocks
//                        cost fetch_weight each instead of prefill_weight.
//   cost_aware           the highest measured performance over cost: the
//                        router predicts the request's seconds on each
//                        candidate (TTFT on an entry stage from its queue
//                        and measured prefill rate, TPOT on a continuing
//                        one; a stage not measured yet is predicted at its
//                        role's mean measured rate) and scores 1 / (seconds
//                        x its node's cost), among the candidates that meet
//                        the request's limit (PlacementRequest::limit_s);
//                        when none does, the fastest. A request with a cost
//                        budget (PlacementRequest::max_cost) goes to a
//                        candidate whose predicted cost is within it
//                        (Candidate::predicted_cost, actors/cost_budget.h),
//                        by the same rule among those; when none is, to
//                        the cheapest. While no candidate is predicted: the
//                        fewest (in flight + 1) x cost. Ties to fewer in
//                        flight, then the lowest index.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/request.h"

namespace cleave {

// A prompt block held by another node's store costs this much against
// computing it (prefill_weight): fetching a block of the 100M GQA model
// over loopback takes well under a millisecond, computing it tens
// (docs/PERFORMANCE.md, "KV pool").
inline constexpr double kDefaultFetchWeight = 0.05;

struct PlacementConfig {
  std::string policy = "least_loaded_prefix";
  double prefill_weight = 1.0, decode_weight = 1.0;  // kv_aware only
  double fetch_weight = kDefaultFetchWeight;          // kv_aware only
  size_t max_blocks = size_t(1) << 16;  // kv_aware: block -> stage entries remembered (LRU)
};

// The policy names, in the order the docs list them.
inline constexpr const char* kPlacementPolicies[] = {"least_loaded_prefix", "least_loaded",
                                                     "round_robin", "kv_aware", "cost_aware"};
std::string placement_policy_list();

// What a policy may look at of a request.
struct PlacementRequest {
  std::vector<uint64_t> blocks;  // chain hashes of the prompt's full blocks, in order
  int64_t load_blocks = 0;       // the blocks it adds to a stage's load (prompt + max_tokens)
  // cost_aware: the most seconds Candidate::predicted_s may be (the
  // request's TTFT or TPOT goal for the role placed); 0 = none.
  double limit_s = 0;
  // cost_aware: what is left of the request's cost budget for this
  // placement (GenerateRequest::max_cost less what its prefill is predicted
  // to cost, for a hand-off); 0 = none.
  double max_cost = 0;
};
// prompt_block_hashes over the request's tokens (and images' content
// hashes, for the blocks they cover), with its load.
PlacementRequest placement_request(const GenerateRequest& r, int32_t block_size);

// One live stage that can take the request.
struct Candidate {
  int32_t stage = 0;        // the router's index
  int32_t in_flight = 0;    // requests placed on it and not finished
  int64_t load_blocks = 0;  // the sum of their load_blocks
  // In a KV pool: the leading prompt blocks the stage's own store holds,
  // and those some store of the pool holds (>= pool_local).
  int32_t pool_local = 0, pool_any = 0;
  // cost_aware: its node's cost (the script's node { cost = 1.5 }, > 0), and
  // the request's predicted seconds there (< 0: nothing to predict from).
  double cost = 1.0;
  double predicted_s = -1;
  // cost_aware with a budget: what serving the rest of the request here is
  // predicted to cost (< 0: nothing to predict from; counts as within it).
  double predicted_cost = -1;
};

class PlacementPolicy {
 public:
  virtual ~PlacementPolicy() = default;
  virtual std::string_view name() const = 0;
  // The stage to place on (a Candidate::stage), or -1 when there are none.
  virtual int32_t pick(const PlacementRequest& r, const std::vector<Candidate>& candidates) = 0;
  // The request went to `stage`: policies that learn record it.
  virtual void placed(const PlacementRequest&, int32_t) {}
  // `stage` went down: forget what it held.
  virtual void forget(int32_t) {}
};

// invalid_argument naming the policy and the accepted ones for an unknown
// name; weights must be finite and >= 0, and are refused (named) for a
// policy other than kv_aware when not at their defaults.
Result<std::unique_ptr<PlacementPolicy>> make_placement_policy(const PlacementConfig& config);

}  // namespace cleave
