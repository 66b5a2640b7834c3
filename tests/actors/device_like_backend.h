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
#include "kernels/forwarding_backend.h"
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

class DeviceLike final : public ForwardingBackend {
 public:
  DeviceLike() : ForwardingBackend(make_cpu_backend(1)) {}
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
    Caps c = ForwardingBackend::caps();
    c.name = "device-like";
    c.host_memory = false;
    c.shareable = shareable;
    return c;
  }
  // No panels kept: every matmul packs its (device) weights for the call,
  // as a backend that never prepares does.
  bool prepare(const WeightView& w) override { return Backend::prepare(w); }
  // Everything else (memory, sharing, the ops) goes to the CPU backend.
  void upload(void* d, const void* s, size_t b) override {
    ++uploads;
    ForwardingBackend::upload(d, s, b);
  }
  void download(void* d, const void* s, size_t b) override {
    ++downloads;
    ForwardingBackend::download(d, s, b);
  }
  Status checksum_blocks(const void* p, size_t bb, int64_t n, uint64_t* out) override {
    ++checksum_calls;
    for (int64_t i = 0; i < n; ++i) out[i] = xxh3::xxh3_64(static_cast<const uint8_t*>(p) + size_t(i) * bb, bb);
    return Status::Ok();
  }
 private:
  std::mutex mu_;
  std::map<std::string, int> listeners_;  // link ids made here, until opened
};

}  // namespace cleave::test
