// The CPU backend's memory (Backend::alloc): small buffers from the C heap,
// large ones (a KV pool, weight panels, scratch) mapped on their own and
// advised to use transparent huge pages. On the VMs measured here a fresh
// 4 KiB page costs about 10 us at its first touch, and a KV pool is touched
// block by block as sequences grow: a batch-32 decode step spent 2 ms of
// its 45 in kv_write faulting pages in. A huge page is one fault per 2 MiB
// (0.3 us per 4 KiB measured), where the kernel has one to give.
#pragma once

#include <cstddef>

namespace cleave::cpu {

// At least `bytes` (0 counts as 1), 64-byte aligned; large requests are
// 2 MiB aligned. nullptr when out of memory.
void* host_alloc(size_t bytes);
// Frees what host_alloc gave (nullptr: nothing).
void host_free(void* ptr);
// Requests from this size on are mapped with the huge-page advice.
constexpr size_t kHostLargeBytes = size_t(4) << 20;
// Whether ptr came from a large request (tests).
bool host_is_mapped(const void* ptr);

}  // namespace cleave::cpu
