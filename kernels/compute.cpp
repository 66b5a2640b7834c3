// The names of Compute (kernels/backend.h), apart from the CPU backend so
// that what only parses settings (topology scripts, their fuzz target) need
// not link the kernels.
#include "kernels/backend.h"

namespace cleave {

const char* compute_name(Compute c) { return c == Compute::int8 ? "int8" : "exact"; }

Result<Compute> compute_from_name(const std::string& name) {
  if (name == "exact") return Compute::exact;
  if (name == "int8") return Compute::int8;
  return Status(Code::invalid_argument, "compute '" + name + "' is not one of exact, int8");
}

Result<Device> parse_device(const std::string& s) {
  if (s == "cpu") return Device{};
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() <= 9) {
    int index = 0;
    bool digits = true;
    for (size_t i = 5; i < s.size(); ++i) {
      digits = digits && s[i] >= '0' && s[i] <= '9';
      index = index * 10 + (s[i] - '0');
    }
    if (digits && index <= 1023 && (s.size() == 6 || s[5] != '0')) return Device{Device::Kind::cuda, index};
  }
  return Status(Code::invalid_argument,
                "device '" + s + "' is not one of cpu, cuda:N (N a GPU index in [0, 1023])");
}

}  // namespace cleave
