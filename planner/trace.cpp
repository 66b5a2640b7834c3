// Recorded traces for the simulation (plan.h: parse_trace, trace_rate).
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "planner/plan.h"

namespace cleave::planner {

Result<std::vector<TraceRequest>> parse_trace(const std::string& jsonl) {
  std::vector<TraceRequest> out;
  std::istringstream in(jsonl);
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto bad = [&](const std::string& what) {
      return Status(Code::invalid_argument, "plan: trace line " + std::to_string(number) + ": " + what);
    };
    if (out.size() >= 10'000'000) return bad("more than 10000000 requests");
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      return bad("not a JSON object like {\"arrival_s\": 0.5, \"prompt_tokens\": 128, \"output_tokens\": 64}");
    TraceRequest r;
    bool arrival = false, prompt = false, output = false;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "arrival_s") {
        if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0 ||
            it->get<double>() > 1e7)
          return bad("arrival_s must be a number of seconds from 0 to 1e7");
        r.arrival_ms = it->get<double>() * 1e3;
        arrival = true;
      } else if (it.key() == "prompt_tokens" || it.key() == "output_tokens") {
        if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > (1 << 24))
          return bad(it.key() + " must be an integer from 1 to 16777216");
        (it.key() == "prompt_tokens" ? r.prompt : r.output) = int32_t(it->get<int64_t>());
        (it.key() == "prompt_tokens" ? prompt : output) = true;
      } else {
        return bad("unknown field '" + it.key().substr(0, 64) + "' (fields: arrival_s, prompt_tokens, output_tokens)");
      }
    }
    if (!arrival || !prompt || !output)
      return bad(std::string("missing ") + (!arrival ? "arrival_s" : !prompt ? "prompt_tokens" : "output_tokens"));
    out.push_back(r);
  }
  if (out.size() < 2)
    return Status(Code::invalid_argument, "plan: a trace needs at least 2 requests (its rate is their spacing), got " +
                                              std::to_string(out.size()));
  std::stable_sort(out.begin(), out.end(),
                   [](const TraceRequest& a, const TraceRequest& b) { return a.arrival_ms < b.arrival_ms; });
  if (!(out.back().arrival_ms > out.front().arrival_ms))
    return Status(Code::invalid_argument, "plan: every request of the trace arrives at once: it has no rate");
  return out;
}

double trace_rate(const std::vector<TraceRequest>& trace) {
  if (trace.size() < 2) return 0;
  const double span_s = (trace.back().arrival_ms - trace.front().arrival_ms) / 1e3;
  return span_s > 0 ? double(trace.size() - 1) / span_s : 0;
}

}  // namespace cleave::planner
