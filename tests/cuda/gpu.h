// Whether this machine has a GPU to test, and the CUDA backend when it does
// (header-only: the test glob compiles only *.cpp).
#pragma once

#include <doctest/doctest.h>

#include <memory>
#include <string>

#include "kernels/backend.h"

#ifdef CLEAVE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace cleave::gpu_test {

// Why there is no GPU to test: a build without nvcc, or the CUDA runtime
// says there is no device or no driver (cudaErrorNoDevice,
// cudaErrorInsufficientDriver, or no devices counted). Empty when there
// should be one. Asked of the runtime here, not read from the backend's
// message, so a backend that called every start-up error "no GPU" would not
// turn a broken GPU into a skip.
inline std::string no_gpu_reason() {
#ifndef CLEAVE_HAVE_CUDA
  return "cleave was built without nvcc";
#else
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    cudaGetLastError();  // clear
    return std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err);
  }
  if (err == cudaSuccess && count <= 0) return "cudaGetDeviceCount: 0 devices";
  return "";
#endif
}

// The CUDA backend, or nullptr after the one skip line when there is no
// device or no driver. Any other start-up error is a failure, not a skip.
inline std::unique_ptr<Backend> gpu_or_skip() {
  const std::string none = no_gpu_reason();
  auto r = make_cuda_backend(0);
  if (!none.empty()) {
    CHECK_FALSE(r.ok());
    if (!r.ok()) CHECK(r.status().code() == Code::unavailable);
    MESSAGE("SKIPPED: no GPU (" << none << ")");
    return nullptr;
  }
  REQUIRE_MESSAGE(r.ok(), "CUDA start-up failed with a device or driver present: "
                              << r.status().to_string());
  return std::move(r).value();
}

}  // namespace cleave::gpu_test
