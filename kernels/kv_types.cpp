// The KV cache's element types (backend.h). Apart from the backends so that
// storage's layout checks (and the fuzz builds of them) need nothing else.
#include <string>

#include "kernels/backend.h"

namespace cleave {

Status check_kv_type(DType t, int32_t head_dim, const char* what) {
  if (t != DType::F32 && t != DType::F16 && t != DType::Q8_0)
    return Status(Code::invalid_argument, std::string(what) + " " + dtype_name(t) +
                                              " is not a KV cache type (f32, f16, q8_0)");
  if (t == DType::Q8_0 && head_dim % kQ8Block != 0)
    return Status(Code::invalid_argument, std::string(what) + " q8_0 needs head_dim a multiple of 32 (it is " +
                                              std::to_string(head_dim) + ")");
  return Status::Ok();
}

}  // namespace cleave
