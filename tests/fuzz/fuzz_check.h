// What every libFuzzer target here checks besides the sanitizers: a library
// answers bad input with a Status of an expected code, never a crash, and
// whatever it accepts is consistent. A broken promise prints one line and
// aborts, which libFuzzer reports as a crash (the input is saved).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "common/status.h"

namespace cleave::fuzz {

[[noreturn]] inline void fail(const char* format, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] inline void fail(const char* format, ...) {
  std::va_list ap;
  va_start(ap, format);
  std::fputs("fuzz check failed: ", stderr);
  std::vfprintf(stderr, format, ap);
  std::fputc('\n', stderr);
  va_end(ap);
  std::abort();
}

// An error must carry one of `codes` and a message.
inline void expect_error(const Status& st, std::initializer_list<Code> codes, const char* what) {
  if (st.ok()) fail("%s: expected an error, got ok", what);
  bool known = false;
  for (Code c : codes) known = known || st.code() == c;
  if (!known) fail("%s: unexpected code: %s", what, st.to_string().c_str());
  if (st.message().empty()) fail("%s: error %s without a message", what, code_name(st.code()));
}

// The input as a file, for readers that take a path: an in-memory file
// (memfd) rewritten on each call, at a fixed descriptor so the path (and the
// messages that name it) do not depend on what the parent left open.
inline std::string as_file(const uint8_t* data, size_t size) {
  static const int fd = [] {
    constexpr int kFd = 512;
    const int m = memfd_create("fuzz_input", MFD_CLOEXEC);
    if (m < 0 || dup2(m, kFd) != kFd) fail("memfd_create / dup2 failed");
    close(m);
    return kFd;
  }();
  if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != ssize_t(size)) fail("memfd write");
  return "/proc/self/fd/" + std::to_string(fd);
}

}  // namespace cleave::fuzz
