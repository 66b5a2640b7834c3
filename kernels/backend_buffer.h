// Scratch in a backend's memory that grows on demand and is reused across
// calls: what the engine's activations live in, so the same code runs on
// host memory (CPU) and device memory (CUDA).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace cleave {

template <class T>
class BackendBuffer {
 public:
  explicit BackendBuffer(Backend& be) : be_(&be) {}
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;
  BackendBuffer(BackendBuffer&& o) noexcept : be_(o.be_), p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  ~BackendBuffer() { release(); }

  // At least n elements (contents not kept when it grows); nullptr (and
  // empty) when the backend is out of memory.
  T* try_grow(size_t n) {
    if (n > n_) {
      release();
      size_t want = n < 2 * n_ ? 2 * n_ : n;
      p_ = static_cast<T*>(be_->alloc(want * sizeof(T)));
      if (p_ == nullptr && want > n) p_ = static_cast<T*>(be_->alloc((want = n) * sizeof(T)));
      if (p_ == nullptr) return nullptr;
      n_ = want;
    }
    return p_;
  }
  // try_grow() for callers that reserved the size first (or whose sizes are
  // bounded and tiny): out of memory here is a bug, so it aborts.
  T* grow(size_t n) {
    T* p = try_grow(n);
    if (p == nullptr) std::abort();
    return p;
  }
  T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void release() {
    if (p_) be_->free(p_);
    p_ = nullptr;
    n_ = 0;
  }
  Backend* be_;
  T* p_ = nullptr;
  size_t n_ = 0;
};

// Host values the backend's ops read: the host array itself when the
// backend's memory is the host's, else a copy uploaded into buf.
template <class T>
const T* to_backend(Backend& be, bool host_memory, const T* host, size_t n, BackendBuffer<T>& buf) {
  if (host_memory || n == 0) return host;
  T* dev = buf.grow(n);
  be.upload(dev, host, n * sizeof(T));
  return dev;
}

// Weights copied into a backend's memory once (LlamaModel::upload,
// ClipModel::on); freed when this goes, which must be before the backend does.
class WeightCopies {
 public:
  explicit WeightCopies(Backend& backend) : be_(backend) {}
  WeightCopies(const WeightCopies&) = delete;
  WeightCopies& operator=(const WeightCopies&) = delete;
  ~WeightCopies();
  // A copy of bytes at src in the backend's memory; nullptr when it is out of memory.
  void* copy(const void* src, size_t bytes);
  // Copies `bytes` at data in and points data at the copy; out_of_memory
  // naming `what` (and what is copied so far) when there is no room.
  template <class T>
  Status move_in(const T*& data, size_t bytes, const std::string& what) {
    void* p = copy(data, bytes);
    if (p == nullptr)
      return Status(Code::out_of_memory, "no room for " + what + " (" + std::to_string(bytes) + " bytes) in " +
                                             be_.caps().name + " memory after " + std::to_string(bytes_) +
                                             " bytes of weights");
    data = static_cast<const T*>(p);
    return Status::Ok();
  }
  uint64_t bytes() const { return bytes_; }

 private:
  Backend& be_;
  std::vector<void*> ptrs_;
  uint64_t bytes_ = 0;
};

inline WeightCopies::~WeightCopies() {
  for (void* p : ptrs_) be_.free(p);
}

inline void* WeightCopies::copy(const void* src, size_t bytes) {
  void* dst = be_.alloc(bytes);
  if (dst == nullptr) return nullptr;
  be_.upload(dst, src, bytes);
  ptrs_.push_back(dst);
  bytes_ += bytes;
  return dst;
}

}  // namespace cleave
