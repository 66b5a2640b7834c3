// A request's cost budget (GenerateRequest::max_cost): what serving it may
// cost, in cost-seconds. A stage on a node of `cost = c` (the topology
// script's node { cost }, 1 for in-process stages) charges c for every
// second of its work for the request, and that work is predicted from what
// the router measures (SloPredictor):
// - prefill, on an entry stage: the prompt's tokens over the stage's
//   measured prefill rate (a throughput, so a batched prefill's time is
//   shared by its requests);
// - decode, on a continuing stage: the tokens still to come times the
//   stage's measured TPOT, over the rows that decode there with it (its
//   requests in flight + 1: one step's time serves all of its rows).
// A colocated stage charges both. A stage not measured yet is predicted at
// the mean of its measured peers; while none is, nothing is predicted and
// the budget is not checked (a cold server admits, as with the goals).
//
// The router refuses at once (Code::rejected, HTTP 429) a request whose
// cheapest prediction is over its budget, and cost_aware placement keeps
// it on stages within what is left of it (placement.h). Only cost_aware
// reads costs, so any other router, and mono (no router), refuse a budget
// (invalid_argument, HTTP 400). Plain functions (no CAF), unit-tested on
// tables: tests/actors/test_cost_budget.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "actors/slo_predictor.h"
#include "common/status.h"
#include "model/request.h"

namespace cleave {

// One live stage as the budget sees it.
struct CostStage {
  int32_t stage = 0;      // the router's index (SloPredictor's key)
  double cost = 1.0;      // its node's cost per second of work
  int32_t in_flight = 0;  // requests placed on it and not finished
};

// Tokens a request still decodes after its first (which prefill makes),
// with `generated` tokens made so far.
int64_t decode_tokens(const GenerateRequest& r, int64_t generated);

// Predicted cost of prefilling `prompt_tokens` on `s`; none while neither
// it nor any of `peers` has a measured prefill rate.
std::optional<double> prefill_cost(const SloPredictor& slo, const CostStage& s, int64_t prompt_tokens,
                                   const std::vector<int32_t>& peers);
// Predicted cost of decoding `tokens` on `s` (0 for none); none while
// neither it nor any of `peers` has a measured TPOT.
std::optional<double> decode_cost(const SloPredictor& slo, const CostStage& s, int64_t tokens,
                                  const std::vector<int32_t>& peers);

// The cheapest predicted decode of `tokens` among `stages` (each priced
// against the others as peers) and where; none while none can be priced.
std::optional<std::pair<double, CostStage>> cheapest_decode(const SloPredictor& slo,
                                                            const std::vector<CostStage>& stages, int64_t tokens);

struct CostQuote {
  double total = 0, prefill = 0, decode = 0;
  CostStage entry;    // where the prefill is priced
  CostStage decoder;  // where the decode is (the same stage when colocated)
};

// The cheapest predicted way to serve `r` from its start. Colocated
// (`disaggregated` false): the stage of `entry` with the least prefill +
// decode on itself. Disaggregated: the cheapest prefill on `entry` plus the
// cheapest decode on `continuing`. None while a part cannot be predicted.
std::optional<CostQuote> cheapest_cost(const SloPredictor& slo, const GenerateRequest& r,
                                       const std::vector<CostStage>& entry,
                                       const std::vector<CostStage>& continuing, bool disaggregated);

// invalid_argument naming max_cost when `r` has a budget and `policy` (the
// router's placement policy; "" for mono, which has no router) is not
// cost_aware.
Status check_cost_policy(const GenerateRequest& r, std::string_view policy);

// ok when `r` has no budget, its cost cannot be predicted yet, or the
// cheapest prediction is within it; else Code::rejected naming max_cost,
// the prediction and its parts.
Status check_cost(const SloPredictor& slo, const GenerateRequest& r, const std::vector<CostStage>& entry,
                  const std::vector<CostStage>& continuing, bool disaggregated);

}  // namespace cleave
