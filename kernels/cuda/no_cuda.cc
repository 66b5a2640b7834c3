// Built only when nvcc is absent: the CUDA backend reports itself unavailable.
#include "kernels/backend.h"

namespace cleave {
Result<std::unique_ptr<Backend>> make_cuda_backend(int) {
  return Status(Code::unavailable, "cuda backend: cleave was built without nvcc");
}
}  // namespace cleave
