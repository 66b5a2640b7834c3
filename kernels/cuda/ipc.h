// Device memory shared between processes on one host (CUDA IPC memory
// handles) and the device-side block checksum: the CUDA backend's
// alloc_shared / open_shared / checksum_blocks (kernels/backend.h).
// Handles read "cudaipc:UUID:BYTES:HANDLE" (the GPU's UUID and the 64-byte
// cudaIpcMemHandle_t, hex): a process on another GPU is refused (unsupported)
// rather than mapped through peer access.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kernels/backend.h"

namespace cleave::cuda {

// Bytes as lowercase hex, and back (false for another length or a non-hex digit).
std::string to_hex(const void* data, size_t n);
bool from_hex(const std::string& hex, void* out, size_t n);

Result<SharedRegion> ipc_alloc(int device, size_t bytes);
void ipc_free(int device, const SharedRegion& region);
Result<const void*> ipc_open(int device, const std::string& handle, size_t bytes);
void ipc_close(int device, const void* data);
// XXH3-64 of n blocks of block_bytes at data (device memory), 8 threads per
// block (kernels/cuda/xxh3.cuh's lanes), into out on the host.
void checksum_blocks(const void* data, size_t block_bytes, int64_t n, uint64_t* out, cudaStream_t stream);

}  // namespace cleave::cuda
