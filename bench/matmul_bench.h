// cleave_bench --matmul: the exact panel matmul alone on one thread, on the
// matrix shapes of the 100M GQA model, with and without widening narrow
// panels once per pass (kernels/cpu/panels.h, PanelMatmulArgs::wide). The
// two are interleaved rep by rep over several copies of the panels (so the
// weights come from memory as in a decode step, and a machine whose speed
// drifts shifts both alike), their bits compared, and each figure stands
// beside the FMA peak measured in the same run.
#pragma once

#include <string>
#include <vector>

namespace cleave::bench {

struct MatmulOptions {
  std::string out_json;
  std::vector<std::string> types{"f16", "q8_0"};
  std::vector<int> rows{32, 64, 128};  // rows of x (sequences of a decode step, tokens of a prefill)
  int runs = 21;
};

int run_matmul_section(const MatmulOptions& o);

}  // namespace cleave::bench
