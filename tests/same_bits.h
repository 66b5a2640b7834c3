#pragma once
// Bit-for-bit equality of float vectors (memcmp, so -0.0 != 0.0 and NaNs
// compare by payload). Empty vectors may hold a null data(), which memcmp
// must never see (UBSan flags it).
#include <cstring>
#include <vector>

namespace cleave::testing {

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

}  // namespace cleave::testing
