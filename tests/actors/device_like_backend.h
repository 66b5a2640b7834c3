// A Backend behind a device's contract for KV moves (kv_shared, the KV
// stream actors): the CPU backend's memory and kernels, but memory the
// caller treats as the device's (Caps::host_memory false), blocks checked by
// the backend's own checksum op (the CUDA kernel's XXH3 code, compiled for
// the host), and host <-> device moves counted. Shareable between processes
// (the CPU backend's memfd regions). Header-only.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/xxh3.cuh"

namespace cleave::test {

// A device link over loopback TCP, DeviceLike's stand-in for NCCL: the same
// contract (blocking calls, a timeout, abort from any thread).
class TcpLink final : public DeviceLink {
 public:
  TcpLink(int fd, double timeout_s, std::atomic<bool>* corrupt_next)
      : fd_(fd), timeout_ms_(int(timeout_s * 1000)), corrupt_next_(corrupt_next) {}
  ~TcpLink() override { ::close(fd_); }
  Status send(const void* data, size_t bytes) override {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    std::vector<uint8_t> flipped;
    if (corrupt_next_ && corrupt_next_->exchange(false) && bytes > 0) {
      flipped.assign(p, p + bytes);
      flipped[bytes / 2] ^= 1;
      p = flipped.data();
    }
    for (size_t done = 0; done < bytes;) {
      if (Status st = wait(POLLOUT); !st.ok()) return st;
      const ssize_t n = ::send(fd_, p + done, bytes - done, MSG_NOSIGNAL);
      if (n <= 0) return Status(Code::unavailable, "tcp link: send failed");
      done += size_t(n);
    }
    return Status::Ok();
  }
  Status recv(void* data, size_t bytes) override {
    uint8_t* p = static_cast<uint8_t*>(data);
    for (size_t done = 0; done < bytes;) {
      if (Status st = wait(POLLIN); !st.ok()) return st;
      const ssize_t n = ::recv(fd_, p + done, bytes - done, 0);
      if (n <= 0) return Status(Code::unavailable, "tcp link: the peer closed");
      done += size_t(n);
    }
    return Status::Ok();
  }
  void abort() override {
    aborted_ = true;
    ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  Status wait(short events) {
    if (aborted_) return Status(Code::aborted, "tcp link: aborted");
    pollfd p{fd_, events, 0};
    if (::poll(&p, 1, timeout_ms_) != 1) return Status(Code::timed_out, "tcp link: the peer did not answer");
    if (aborted_) return Status(Code::aborted, "tcp link: aborted");
    return Status::Ok();
  }
  int fd_;
  int timeout_ms_;
  std::atomic<bool>* corrupt_next_;
  std::atomic<bool> aborted_{false};
};

class DeviceLike final : public Backend {
 public:
  std::shared_ptr<Backend> cpu = std::shared_ptr<Backend>(make_cpu_backend(1));
  // Counted from any thread (the KV actors copy on threads of their own).
  std::atomic<int> checksum_calls{0};
  std::atomic<int> uploads{0}, downloads{0};  // host <-> "device" moves
  bool shareable = true;
  // Device links (TcpLink): how many this process opened; a test may flip a
  // byte of the next send.
  std::atomic<int> links_opened{0};
  std::atomic<bool> corrupt_next_send{false};
  Result<std::string> new_link_id() override {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd, 1) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      return Status(Code::unavailable, "tcp link: cannot listen");
    const std::string id = "tcp:" + std::to_string(ntohs(a.sin_port));
    std::lock_guard<std::mutex> lock(mu_);
    listeners_[id] = fd;
    return id;
  }
  Result<std::unique_ptr<DeviceLink>> open_link(const std::string& id, int rank, double timeout_s) override {
    if (id.rfind("tcp:", 0) != 0) return Status(Code::invalid_argument, "tcp link: a malformed id");
    int fd = -1;
    if (rank == 0) {
      int listener = -1;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = listeners_.find(id);
        if (it == listeners_.end()) return Status(Code::invalid_argument, "tcp link: not made here");
        listener = it->second;
        listeners_.erase(it);
      }
      pollfd p{listener, POLLIN, 0};
      if (::poll(&p, 1, int(timeout_s * 1000)) == 1) fd = ::accept(listener, nullptr, nullptr);
      ::close(listener);
      if (fd < 0) return Status(Code::timed_out, "tcp link: the peer did not join");
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(uint16_t(std::stoi(id.substr(4))));
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
        if (fd >= 0) ::close(fd);
        return Status(Code::unavailable, "tcp link: cannot connect");
      }
    }
    ++links_opened;
    return std::unique_ptr<DeviceLink>(new TcpLink(fd, timeout_s, &corrupt_next_send));
  }
  Caps caps() const override {
    Caps c = cpu->caps();
    c.name = "device-like";
    c.host_memory = false;
    c.shareable = shareable;
    return c;
  }
  bool supports(Op o, DType t) const override { return cpu->supports(o, t); }
  void* alloc(size_t b) override { return cpu->alloc(b); }
  void free(void* p) override { cpu->free(p); }
  void upload(void* d, const void* s, size_t b) override {
    ++uploads;
    cpu->upload(d, s, b);
  }
  void download(void* d, const void* s, size_t b) override {
    ++downloads;
    cpu->download(d, s, b);
  }
  void sync() override {}
  void* alloc_pinned_host(size_t b) override { return cpu->alloc_pinned_host(b); }
  void free_pinned_host(void* p) override { cpu->free_pinned_host(p); }
  Result<SharedRegion> alloc_shared(size_t b) override { return cpu->alloc_shared(b); }
  void free_shared(const SharedRegion& r) override { cpu->free_shared(r); }
  Result<const void*> open_shared(const std::string& h, size_t b) override { return cpu->open_shared(h, b); }
  void close_shared(const void* p, size_t b) override { cpu->close_shared(p, b); }
  Status checksum_blocks(const void* p, size_t bb, int64_t n, uint64_t* out) override {
    ++checksum_calls;
    for (int64_t i = 0; i < n; ++i) out[i] = xxh3::xxh3_64(static_cast<const uint8_t*>(p) + size_t(i) * bb, bb);
    return Status::Ok();
  }
  void matmul(const WeightView& w, const float* x, int64_t n, float* y) override { cpu->matmul(w, x, n, y); }
  void matmuls(const MatmulJob* jobs, int64_t count) override { cpu->matmuls(jobs, count); }
  void rmsnorm(const float* x, const float* w, int64_t n, int64_t d, float e, float* y) override {
    cpu->rmsnorm(x, w, n, d, e, y);
  }
  void rope(float* x, int64_t n, int64_t h, int64_t d, const int32_t* p, float t) override {
    cpu->rope(x, n, h, d, p, t);
  }
  void softmax(float* x, int64_t n, int64_t l) override { cpu->softmax(x, n, l); }
  void silu_mul(const float* g, const float* u, int64_t c, float* o) override { cpu->silu_mul(g, u, c, o); }
  void embed(const WeightView& t, const int32_t* ids, int64_t n, float* o) override { cpu->embed(t, ids, n, o); }
  void topk_gating(const float* l, int64_t n, int64_t e, int64_t k, int32_t* ids, float* w) override {
    cpu->topk_gating(l, n, e, k, ids, w);
  }
  void kv_write(const PagedKv& kv, int32_t l, const float* k, const float* v, const AttnRow* r, int64_t n) override {
    cpu->kv_write(kv, l, k, v, r, n);
  }
  void attention(const PagedKv& kv, int32_t l, const float* q, const AttnRow* r, int64_t n, int32_t h, float s,
                 float* o) override {
    cpu->attention(kv, l, q, r, n, h, s, o);
  }
  void layer_norm(const float* x, const float* w, const float* b, int64_t n, int64_t d, float e, float* y) override {
    cpu->layer_norm(x, w, b, n, d, e, y);
  }
  void gelu(const float* x, int64_t c, Gelu k, float* y) override { cpu->gelu(x, c, k, y); }
  void add(const float* a, const float* b, int64_t c, int64_t p, float* y) override { cpu->add(a, b, c, p, y); }
  void full_attention(const float* q, const float* k, const float* v, int64_t s, int64_t t, int64_t h, int64_t d,
                      int64_t ld, float scale, float* o) override {
    cpu->full_attention(q, k, v, s, t, h, d, ld, scale, o);
  }
  void moe_combine(const float* y, const int32_t* r, const float* w, int64_t n, int64_t k, int64_t d,
                   float* o) override {
    cpu->moe_combine(y, r, w, n, k, d, o);
  }
  void copy(void* d, const void* s, size_t b) override { cpu->copy(d, s, b); }
 private:
  std::mutex mu_;
  std::map<std::string, int> listeners_;  // link ids made here, until opened
};

}  // namespace cleave::test
