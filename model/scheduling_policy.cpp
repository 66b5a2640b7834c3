#include "model/scheduling_policy.h"

namespace cleave {

const char* scheduling_policy_name(SchedulingPolicy policy) {
  return policy == SchedulingPolicy::priority ? "priority" : "fcfs";
}

Result<SchedulingPolicy> parse_scheduling_policy(const std::string& name) {
  if (name == "fcfs") return SchedulingPolicy::fcfs;
  if (name == "priority") return SchedulingPolicy::priority;
  return Status(Code::invalid_argument, "unknown scheduling policy '" + name.substr(0, 64) +
                                            "' (expected one of " + kSchedulingPolicies + ")");
}

Status check_priority_allowed(const GenerateRequest& request, SchedulingPolicy policy) {
  if (request.priority == 0 || policy == SchedulingPolicy::priority) return Status::Ok();
  return Status(Code::invalid_argument,
                "request " + std::to_string(request.request_id) + " has priority " +
                    std::to_string(request.priority) + ", but the scheduling policy is " +
                    scheduling_policy_name(policy) + " (priority needs --scheduling-policy priority)");
}

}  // namespace cleave
