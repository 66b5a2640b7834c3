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

}  // namespace cleave
