// The Backend interface's defaults: what a backend that does not share its
// memory between processes, or whose memory the host reads, answers.
#include "kernels/backend.h"

namespace cleave {

Result<SharedRegion> Backend::alloc_shared(size_t bytes) {
  (void)bytes;
  return Status(Code::unsupported, "the " + caps().name + " backend cannot share memory between processes");
}

Result<const void*> Backend::open_shared(const std::string& handle, size_t bytes) {
  (void)handle, (void)bytes;
  return Status(Code::unsupported, "the " + caps().name + " backend cannot share memory between processes");
}

Status Backend::checksum_blocks(const void* data, size_t block_bytes, int64_t n, uint64_t* out) {
  (void)data, (void)block_bytes, (void)n, (void)out;
  return Status(Code::unsupported, "the " + caps().name + " backend has no checksum op (the host reads its memory)");
}

}  // namespace cleave
