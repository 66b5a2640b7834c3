// Host memory another process on this host can map: the CPU backend's
// alloc_shared / open_shared (kernels/backend.h). A region is a memfd
// mapped shared; its handle names the owning process's descriptor,
// "memfd:PID:FD:DEV:INODE:BYTES", and the other process opens it through
// /proc/PID/fd/FD (no name in /dev/shm to leak when a process dies: the
// pages go with the last descriptor or mapping). The device and inode are
// checked after the open, so a descriptor number the owner reused for
// another file is refused rather than mapped.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/backend.h"

namespace cleave {

Result<SharedRegion> memfd_alloc_shared(size_t bytes);
void memfd_free_shared(const SharedRegion& region);
// Read-only mapping of the first `bytes` (at most its size) of another
// process's region. Both ends map with MAP_POPULATE: the page tables are
// filled in one call instead of a fault per 4 KiB.
Result<const void*> memfd_open_shared(const std::string& handle, size_t bytes);
void memfd_close_shared(const void* data, size_t bytes);

}  // namespace cleave
