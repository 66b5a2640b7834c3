// What the GGUF reader and writer (model/gguf.cpp, model/gguf_writer.cpp)
// share: the format's default alignment, the value-type classes and the
// message helpers. Private to model/.
#pragma once

#include <cstdint>
#include <string>

#include "model/gguf.h"

namespace cleave::gguf_detail {

constexpr uint64_t kDefaultAlignment = 32;  // general.alignment when absent

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
bool is_known_type(uint32_t t);
bool is_uint_type(GgufType t);
bool is_sint_type(GgufType t);
bool is_float_type(GgufType t);
// "UINT32", "ARRAY of STRING", ...
std::string type_desc(const GgufValue& v);

}  // namespace cleave::gguf_detail
