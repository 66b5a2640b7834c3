#include "kernels/cuda/ipc.h"

#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/xxh3.cuh"

namespace cleave::cuda {
namespace {

std::string uuid_of(int device) {
  cudaDeviceProp prop{};
  CLEAVE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return to_hex(prop.uuid.bytes, sizeof prop.uuid.bytes);
}

__global__ void xxh3_blocks_kernel(const uint8_t* data, size_t block_bytes, uint64_t* out) {
  __shared__ uint64_t acc[8];
  const uint8_t* in = data + size_t(blockIdx.x) * block_bytes;
  const int lane = int(threadIdx.x);
  if (block_bytes <= 240) {
    if (lane == 0) out[blockIdx.x] = xxh3::short_64(in, block_bytes);
    return;
  }
  acc[lane] = xxh3::long_lane(in, block_bytes, lane);
  __syncthreads();
  if (lane == 0) out[blockIdx.x] = xxh3::merge(acc, block_bytes);
}

}  // namespace

std::string to_hex(const void* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t b = static_cast<const uint8_t*>(p)[i];
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

bool from_hex(const std::string& s, void* out, size_t n) {
  if (s.size() != 2 * n) return false;
  auto val = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  for (size_t i = 0; i < n; ++i) {
    const int hi = val(s[2 * i]), lo = val(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    static_cast<uint8_t*>(out)[i] = uint8_t(hi * 16 + lo);
  }
  return true;
}

Result<SharedRegion> ipc_alloc(int device, size_t bytes) {
  CLEAVE_CUDA_CHECK(cudaSetDevice(device));
  if (bytes == 0) return Status(Code::invalid_argument, "shared memory: a region of 0 bytes");
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return Status(Code::out_of_memory, "shared memory: " + std::to_string(bytes) + " bytes of device memory");
  }
  CLEAVE_CUDA_CHECK(err);
  cudaIpcMemHandle_t h;
  err = cudaIpcGetMemHandle(&h, p);
  if (err != cudaSuccess) {
    cudaGetLastError();
    cudaFree(p);
    return Status(Code::unsupported, std::string("shared memory: cudaIpcGetMemHandle: ") + cudaGetErrorString(err));
  }
  SharedRegion r;
  r.data = p;
  r.bytes = bytes;
  r.handle = "cudaipc:" + uuid_of(device) + ":" + std::to_string(bytes) + ":" + to_hex(&h, sizeof h);
  return r;
}

void ipc_free(int device, const SharedRegion& region) {
  if (!region.data) return;
  CLEAVE_CUDA_CHECK(cudaSetDevice(device));
  CLEAVE_CUDA_CHECK(cudaDeviceSynchronize());
  CLEAVE_CUDA_CHECK(cudaFree(region.data));
}

Result<const void*> ipc_open(int device, const std::string& handle, size_t bytes) {
  // "cudaipc:" + 32 hex + ":" + bytes + ":" + 128 hex
  const size_t a = handle.find(':'), b = handle.find(':', a + 1), c = handle.find(':', b + 1);
  cudaIpcMemHandle_t h;
  unsigned long long n = 0;
  int used = 0;
  if (handle.rfind("cudaipc:", 0) != 0 || b == std::string::npos || c == std::string::npos ||
      std::sscanf(handle.c_str() + b + 1, "%llu%n", &n, &used) != 1 || b + 1 + size_t(used) != c ||
      !from_hex(handle.substr(c + 1), &h, sizeof h))
    return Status(Code::invalid_argument, "shared memory: malformed handle '" + handle.substr(0, 64) + "'");
  if (bytes == 0 || n < bytes)
    return Status(Code::invalid_argument, "shared memory: handle names " + std::to_string(n) + " bytes, " +
                                              std::to_string(bytes) + " asked for");
  if (handle.substr(a + 1, b - a - 1) != uuid_of(device))
    return Status(Code::unsupported, "shared memory: the region is on another GPU");
  CLEAVE_CUDA_CHECK(cudaSetDevice(device));
  void* p = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status(Code::not_found, std::string("shared memory: cudaIpcOpenMemHandle: ") + cudaGetErrorString(err));
  }
  return static_cast<const void*>(p);
}

void ipc_close(int device, const void* data) {
  if (!data) return;
  CLEAVE_CUDA_CHECK(cudaSetDevice(device));
  CLEAVE_CUDA_CHECK(cudaDeviceSynchronize());
  CLEAVE_CUDA_CHECK(cudaIpcCloseMemHandle(const_cast<void*>(data)));
}

void checksum_blocks(const void* data, size_t block_bytes, int64_t n, uint64_t* out, cudaStream_t stream) {
  if (n <= 0) return;
  if (n > 0x7fffffff) fail("too many blocks for one checksum launch");
  uint64_t* dev = nullptr;
  CLEAVE_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&dev), size_t(n) * 8, stream));
  xxh3_blocks_kernel<<<unsigned(n), 8, 0, stream>>>(static_cast<const uint8_t*>(data), block_bytes, dev);
  CLEAVE_CUDA_CHECK_LAUNCH("xxh3_blocks_kernel");
  CLEAVE_CUDA_CHECK(cudaMemcpyAsync(out, dev, size_t(n) * 8, cudaMemcpyDeviceToHost, stream));
  CLEAVE_CUDA_CHECK(cudaFreeAsync(dev, stream));
  CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace cleave::cuda
