// Always-on CUDA error checks for the CUDA backend. The Backend interface has
// no error return, so a failed CUDA call prints the call, the error and the
// place, then aborts. C++17-clean (included from .cu files).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace cleave::cuda {

[[noreturn]] inline void check_failed(const char* call, cudaError_t err, const char* file,
                                      int line) {
  std::fprintf(stderr, "%s:%d: CUDA call failed: %s -> %s (%s)\n", file, line, call,
               cudaGetErrorName(err), cudaGetErrorString(err));
  std::fflush(stderr);
  std::abort();
}

// A CUDA backend invariant broken by its caller (the Backend interface has
// no error return): print and abort.
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda backend: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

}  // namespace cleave::cuda

#define CLEAVE_CUDA_CHECK(call)                                                \
  do {                                                                         \
    cudaError_t cleave_cuda_err_ = (call);                                     \
    if (cleave_cuda_err_ != cudaSuccess)                                       \
      ::cleave::cuda::check_failed(#call, cleave_cuda_err_, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define CLEAVE_CUDA_CHECK_LAUNCH(kernel_name)                                   \
  do {                                                                          \
    cudaError_t cleave_cuda_err_ = cudaGetLastError();                          \
    if (cleave_cuda_err_ != cudaSuccess)                                        \
      ::cleave::cuda::check_failed("launch of " kernel_name, cleave_cuda_err_,  \
                                   __FILE__, __LINE__);                         \
  } while (0)
