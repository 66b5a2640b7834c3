#include "actors/socket_io.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

namespace cleave::sockio {

std::string random_token() {
  uint8_t raw[kTokenChars / 2];
  size_t got = 0;
  while (got < sizeof raw) {
    const ssize_t n = ::getrandom(raw + got, sizeof raw - got, 0);
    if (n > 0) got += size_t(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string out(kTokenChars, '0');
  for (size_t i = 0; i < sizeof raw; ++i) {
    out[2 * i] = hex[raw[i] >> 4];
    out[2 * i + 1] = hex[raw[i] & 15];
  }
  return out;
}

// Constant time in the contents (the length is public).
bool same_token(const char* a, const std::string& b) {
  if (b.size() != kTokenChars) return false;
  unsigned diff = 0;
  for (size_t i = 0; i < kTokenChars; ++i) diff |= unsigned(uint8_t(a[i]) ^ uint8_t(b[i]));
  return diff == 0;
}

void set_io_timeouts(int fd, std::chrono::milliseconds t) {
  timeval tv{};
  tv.tv_sec = time_t(t.count() / 1000);
  tv.tv_usec = suseconds_t((t.count() % 1000) * 1000);
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

Fd::~Fd() {
  if (fd >= 0) ::close(fd);
}

namespace {
// Drops the first `bytes` bytes from the n iovecs at iov (a partial
// sendmsg or recvmsg): whole ones are skipped, a split one shortened.
void consume(iovec*& iov, size_t& n, size_t bytes) {
  while (n > 0 && bytes >= iov->iov_len) {
    bytes -= iov->iov_len;
    ++iov;
    --n;
  }
  if (n > 0) {
    iov->iov_base = static_cast<char*>(iov->iov_base) + bytes;
    iov->iov_len -= bytes;
  }
}

}  // namespace

// The errno of a failed socket call as a Status.
Status io_status(const std::string& what) {
  if (errno == EAGAIN || errno == EWOULDBLOCK)
    return Status(Code::timed_out, what + ": no progress within the timeout");
  return Status(Code::unavailable, what + ": " + std::strerror(errno));
}

// Sends every byte of the iovecs (advancing them: they are consumed).
Status send_iov(int fd, iovec* iov, size_t n, const std::string& what, int flags) {
  while (n > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = std::min<size_t>(n, IOV_MAX);
    const ssize_t w = ::sendmsg(fd, &m, MSG_NOSIGNAL | flags);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return io_status(what);
    consume(iov, n, size_t(w));
  }
  return Status::Ok();
}

// Receives exactly the iovecs' bytes (consuming them); unavailable when the
// peer closes first.
Status recv_iov(int fd, iovec* iov, size_t n, const std::string& what) {
  while (n > 0) {
    while (n > 0 && iov->iov_len == 0) ++iov, --n;
    if (n == 0) break;
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = std::min<size_t>(n, IOV_MAX);
    const ssize_t r = ::recvmsg(fd, &m, MSG_WAITALL);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return Status(Code::unavailable, what + ": the peer closed the connection");
    if (r < 0) return io_status(what);
    consume(iov, n, size_t(r));
  }
  return Status::Ok();
}

Status send_bytes(int fd, const void* p, size_t n, const std::string& what, int flags) {
  iovec v{const_cast<void*>(p), n};
  return send_iov(fd, &v, 1, what, flags);
}

Status recv_bytes(int fd, void* p, size_t n, const std::string& what) {
  iovec v{p, n};
  return recv_iov(fd, &v, 1, what);
}

Result<sockaddr_in> resolve(const std::string& host, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (host.empty() || host == "localhost") {
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return addr;
  }
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res)
    return Status(Code::invalid_argument, "cannot resolve host " + host);
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return addr;
}


}  // namespace cleave::sockio
