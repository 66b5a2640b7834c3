// The KV cache's element types (backend.h). Apart from the backends so that
// storage's layout checks (and the fuzz builds of them) need nothing else.
#include <cctype>
#include <string>

#include "kernels/backend.h"

namespace cleave {

Status check_kv_type(DType t, int32_t head_dim, const char* what) {
  if (!kv_dtype_known(uint32_t(t)))
    return Status(Code::invalid_argument, std::string(what) + " " + dtype_name(t) +
                                              " is not a KV cache type (f32, f16, q8_0, q4_0)");
  if ((t == DType::Q8_0 || t == DType::Q4_0) && head_dim % kQ8Block != 0)
    return Status(Code::invalid_argument, std::string(what) + " " + (t == DType::Q8_0 ? "q8_0" : "q4_0") +
                                              " needs head_dim a multiple of 32 (it is " +
                                              std::to_string(head_dim) + ")");
  return Status::Ok();
}

Result<DType> kv_type_from_name(const std::string& name) {
  std::string s;
  for (char c : name) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "f32") return DType::F32;
  if (s == "f16") return DType::F16;
  if (s == "q8_0") return DType::Q8_0;
  if (s == "q4_0") return DType::Q4_0;
  return Status(Code::invalid_argument, "unknown KV cache type '" + name + "' (expected f32, f16, q8_0 or q4_0)");
}

}  // namespace cleave
