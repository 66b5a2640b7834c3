// Small statistics the benchmarks report their runs with.
#pragma once

#include <algorithm>
#include <vector>

namespace cleave::bench {

// The upper median of the runs (the middle one for an odd count); 0 for none.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace cleave::bench
