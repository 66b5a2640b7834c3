// Blocking TCP helpers shared by the data sockets that bypass CAF (the KV
// streams' and the expert batches'): whole-buffer sends and receives under
// the socket's timeouts, typed errors, host resolution, random tokens.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <netinet/in.h>
#include <string>

#include "common/status.h"

namespace cleave::sockio {

constexpr size_t kTokenChars = 32;  // 128 random bits in hex

std::string random_token();
// Constant time in the contents (the length is public).
bool same_token(const char* a, const std::string& b);

// The errno of a failed socket call: timed_out for EAGAIN (a socket
// timeout), else unavailable with strerror.
Status io_status(const std::string& what);
// Every byte of the iovecs (consumed as they go).
Status send_iov(int fd, iovec* iov, size_t n, const std::string& what, int flags = 0);
// Exactly the iovecs' bytes; unavailable when the peer closes first.
Status recv_iov(int fd, iovec* iov, size_t n, const std::string& what);
Status send_bytes(int fd, const void* p, size_t n, const std::string& what, int flags = 0);
Status recv_bytes(int fd, void* p, size_t n, const std::string& what);
// An IPv4 address ("" and "localhost": loopback); invalid_argument naming
// a host that does not resolve.
Result<sockaddr_in> resolve(const std::string& host, uint16_t port);
// SO_RCVTIMEO / SO_SNDTIMEO.
void set_io_timeouts(int fd, std::chrono::milliseconds t);

// Closes its fd when it goes.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
};

}  // namespace cleave::sockio
