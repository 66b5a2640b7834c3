// Launchers of the CUDA matmuls (Backend::matmul) on a stream: n >= 1 x
// rows, w.rows >= 1 and w.cols >= 1 (the backend handles the empty cases).
// Each checks its launch. A backend takes one of them for every n, so a
// row's bits never depend on the batch (DESIGN.md invariant 1):
// - launch_matmul_tc (kernels/cuda/matmul_tc.cu): TF32 tensor cores, 3xTF32
//   accuracy; sm_80 and newer, the default there.
// - launch_matmul (kernels/cuda/matmul.cu): CUDA-core FMA, one warp per
//   output feature; older devices, and beside the first in the benchmarks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/backend.h"

namespace cleave::cuda {

void launch_matmul(const WeightView& w, const float* x, int64_t n, float* y, int sm_count,
                   cudaStream_t stream);

void launch_matmul_tc(const WeightView& w, const float* x, int64_t n, float* y, int sm_count,
                      cudaStream_t stream);

// FLOP/s of TF32 m16n8k8 mma chains on registers across the device (the
// limit the tensor-core matmul is reported against). Synchronises.
double measure_tf32_mma_peak(int sm_count, cudaStream_t stream);

}  // namespace cleave::cuda
