#include "kernels/cpu/host_memory.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

namespace cleave::cpu {
namespace {

constexpr size_t kHuge = size_t(2) << 20;

// Where each large request's mapping starts and how long it is.
struct Mapped {
  std::mutex mu;
  std::unordered_map<const void*, size_t> sizes;
};
Mapped& mapped() {
  static Mapped* m = new Mapped;  // outlives static destructors that free memory
  return *m;
}

}  // namespace

void* host_alloc(size_t bytes) {
  if (bytes < kHostLargeBytes) {
    const size_t size = (bytes + 63) / 64 * 64;
    return std::aligned_alloc(64, size == 0 ? 64 : size);
  }
  const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
  // Map one huge page more and trim, so the buffer starts on a 2 MiB line.
  void* raw = ::mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (base + kHuge - 1) / kHuge * kHuge;
  if (start > base) ::munmap(raw, start - base);
  if (const uintptr_t end = base + size + kHuge; end > start + size)
    ::munmap(reinterpret_cast<void*>(start + size), end - (start + size));
  void* p = reinterpret_cast<void*>(start);
  (void)::madvise(p, size, MADV_HUGEPAGE);  // advice: without it, 4 KiB pages
  Mapped& m = mapped();
  std::lock_guard<std::mutex> lock(m.mu);
  m.sizes.emplace(p, size);
  return p;
}

void host_free(void* ptr) {
  if (!ptr) return;
  size_t size = 0;
  {
    Mapped& m = mapped();
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.sizes.find(ptr);
    if (it != m.sizes.end()) {
      size = it->second;
      m.sizes.erase(it);
    }
  }
  if (size > 0)
    ::munmap(ptr, size);
  else
    std::free(ptr);
}

bool host_is_mapped(const void* ptr) {
  Mapped& m = mapped();
  std::lock_guard<std::mutex> lock(m.mu);
  return m.sizes.count(ptr) > 0;
}

}  // namespace cleave::cpu
