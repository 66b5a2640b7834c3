// The order a scheduler admits and runs requests in, and what a request's
// priority needs. A small header: the router and the topology loader use it
// without the engine.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "model/request.h"

namespace cleave {

// vLLM's --scheduling-policy: the order requests are admitted and run in.
// fcfs: arrival order; a request with a nonzero priority is refused.
// priority: (priority, arrival), lower first; a queued request that does not
// fit preempts the running request of the highest value (the youngest of
// those) when that value is higher than its own.
enum class SchedulingPolicy : uint8_t { fcfs, priority };
inline constexpr const char* kSchedulingPolicies = "fcfs, priority";
const char* scheduling_policy_name(SchedulingPolicy policy);
// invalid_argument naming the spelling and the choices.
Result<SchedulingPolicy> parse_scheduling_policy(const std::string& name);

// invalid_argument when the policy does not take the request's priority
// (nonzero under fcfs), naming both; what the router and the scheduler say.
Status check_priority_allowed(const GenerateRequest& request, SchedulingPolicy policy);

}  // namespace cleave
