// Tests only, a seam kept out of kernels/backend.h: while a stand-in is set,
// make_backend() answers "cuda:N" with factory(N), a backend behind a
// device's contract on the CPU (tests/actors/device_like_backend.h), so a
// whole topology (engines, pipeline stages, expert hosts, the kv_store's
// tiers, the KV hand-off between stages) takes the device path on a machine
// without a GPU. Set it before the topology is made; clear it (nullptr)
// after.
#pragma once

#include <functional>
#include <memory>

#include "kernels/backend.h"

namespace cleave {

void set_cuda_stand_in(std::function<std::unique_ptr<Backend>(int index)> factory);

// Tests and benchmarks only: CUDA backends made while this is on take the
// CUDA-core FMA matmul (kernels/cuda/matmul.h) instead of the tensor-core
// one, so test_cuda checks and times both on one device.
void set_cuda_fma_matmul(bool on);
bool cuda_fma_matmul();

// Tests and benchmarks only: a CPU backend whose matmuls always split their
// panels over the threads, never their rows (make_cpu_backend splits a
// prefill's rows when its weights are small), so a test holds both splits
// to the same bits and a benchmark compares them in one process.
std::unique_ptr<Backend> make_cpu_backend_panel_split(int threads, Isa isa = detect_isa(),
                                                      Compute compute = Compute::exact);

}  // namespace cleave
