#include "actors/cost_budget.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace cleave {
namespace {

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::vector<int32_t> indices(const std::vector<CostStage>& stages) {
  std::vector<int32_t> out;
  out.reserve(stages.size());
  for (const CostStage& s : stages) out.push_back(s.stage);
  return out;
}

std::string where(const CostStage& s) { return "stage " + std::to_string(s.stage) + ", cost " + num(s.cost); }

}  // namespace

int64_t decode_tokens(const GenerateRequest& r, int64_t generated) {
  return std::max<int64_t>(0, int64_t(r.sampling.max_tokens) - std::max<int64_t>(generated, 1));
}

std::optional<double> prefill_cost(const SloPredictor& slo, const CostStage& s, int64_t prompt_tokens,
                                   const std::vector<int32_t>& peers) {
  const auto rate = slo.estimate_prefill_rate(s.stage, peers);
  if (!rate || !(*rate > 0)) return std::nullopt;
  return double(prompt_tokens) / *rate * s.cost;
}

std::optional<double> decode_cost(const SloPredictor& slo, const CostStage& s, int64_t tokens,
                                  const std::vector<int32_t>& peers) {
  if (tokens <= 0) return 0.0;
  const auto tpot = slo.estimate_tpot(s.stage, peers);
  if (!tpot) return std::nullopt;
  return double(tokens) * *tpot / double(std::max(0, s.in_flight) + 1) * s.cost;
}

std::optional<std::pair<double, CostStage>> cheapest_decode(const SloPredictor& slo,
                                                            const std::vector<CostStage>& stages, int64_t tokens) {
  const std::vector<int32_t> peers = indices(stages);
  std::optional<std::pair<double, CostStage>> best;
  for (const CostStage& s : stages)
    if (auto d = decode_cost(slo, s, tokens, peers); d && (!best || *d < best->first)) best = {{*d, s}};
  return best;
}

std::optional<CostQuote> cheapest_cost(const SloPredictor& slo, const GenerateRequest& r,
                                       const std::vector<CostStage>& entry,
                                       const std::vector<CostStage>& continuing, bool disaggregated) {
  const int64_t prompt = int64_t(r.prompt.size());
  const int64_t tokens = decode_tokens(r, 0);
  const std::vector<int32_t> entry_peers = indices(entry);
  std::optional<CostQuote> best;
  if (!disaggregated) {
    for (const CostStage& s : entry) {
      const auto p = prefill_cost(slo, s, prompt, entry_peers);
      const auto d = decode_cost(slo, s, tokens, entry_peers);
      if (!p || !d) continue;
      if (!best || *p + *d < best->total) best = CostQuote{*p + *d, *p, *d, s, s};
    }
    return best;
  }
  std::optional<CostQuote> pre;
  for (const CostStage& s : entry)
    if (auto p = prefill_cost(slo, s, prompt, entry_peers); p && (!pre || *p < pre->prefill))
      pre = CostQuote{*p, *p, 0, s, {}};
  const auto dec = cheapest_decode(slo, continuing, tokens);
  if (!pre || !dec) return std::nullopt;
  return CostQuote{pre->prefill + dec->first, pre->prefill, dec->first, pre->entry, dec->second};
}

Status check_cost_policy(const GenerateRequest& r, std::string_view policy) {
  if (r.max_cost <= 0 || policy == "cost_aware") return Status::Ok();
  return Status(Code::invalid_argument,
                "max_cost: a cost budget needs router policy 'cost_aware' (" +
                    (policy.empty() ? std::string("this topology has no router")
                                    : "this router's is '" + std::string(policy) + "'") +
                    ")");
}

Status check_cost(const SloPredictor& slo, const GenerateRequest& r, const std::vector<CostStage>& entry,
                  const std::vector<CostStage>& continuing, bool disaggregated) {
  if (r.max_cost <= 0) return Status::Ok();
  const auto q = cheapest_cost(slo, r, entry, continuing, disaggregated);
  if (!q || q->total <= r.max_cost) return Status::Ok();
  std::string parts = "prefill " + num(q->prefill) + " (" + where(q->entry) + ") + decode of " +
                      std::to_string(decode_tokens(r, 0)) + " tokens " + num(q->decode) + " (" +
                      where(q->decoder) + ")";
  return Status(Code::rejected, "request " + std::to_string(r.request_id) + " cannot meet its max_cost " +
                                    num(r.max_cost) + ": the cheapest prediction is " + num(q->total) +
                                    " cost-seconds = " + parts);
}

}  // namespace cleave
