// Launcher of the CUDA matmul (kernels/cuda/matmul.cu) on a stream: n >= 1
// x rows, w.rows >= 1 and w.cols >= 1 (the backend handles the empty cases).
// Checks its launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/backend.h"

namespace cleave::cuda {

void launch_matmul(const WeightView& w, const float* x, int64_t n, float* y, int sm_count,
                   cudaStream_t stream);

}  // namespace cleave::cuda
