// What every libFuzzer target here checks besides the sanitizers: a library
// answers bad input with a Status of an expected code, never a crash, and
// whatever it accepts is consistent. A broken promise prints one line and
// aborts, which libFuzzer reports as a crash (the input is saved).
#pragma once

#include <cstdarg>
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

}  // namespace cleave::fuzz
