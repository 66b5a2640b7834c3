#include "jobs/fault_point.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace cleave::jobs {
namespace {

constexpr const char* kVariable = "CLEAVE_JOB_FAULT";

struct Fault {
  bool on = false;
  std::string step;
  uint64_t nth = 0;
};

[[noreturn]] void malformed(const char* value) {
  std::fprintf(stderr, "%s='%s' is malformed: expected STEP:N (a step name, N >= 1)\n", kVariable,
               value);
  std::abort();
}

// "STEP:N": the step is everything before the last ':', N a decimal count >= 1.
Fault parse_fault() {
  Fault f;
  const char* value = std::getenv(kVariable);
  if (value == nullptr || *value == '\0') return f;
  const char* colon = std::strrchr(value, ':');
  if (colon == nullptr || colon == value || colon[1] == '\0') malformed(value);
  uint64_t n = 0;
  for (const char* p = colon + 1; *p; ++p) {
    if (*p < '0' || *p > '9') malformed(value);
    if (n > (UINT64_MAX - 9) / 10) malformed(value);
    n = n * 10 + uint64_t(*p - '0');
  }
  if (n == 0) malformed(value);
  f.on = true;
  f.step.assign(value, colon);
  f.nth = n;
  return f;
}

const Fault& fault() {
  static const Fault f = parse_fault();  // read once; thread-safe static init
  return f;
}

std::atomic<uint64_t> g_hits{0};

}  // namespace

void fault_point(const char* step) {
  const Fault& f = fault();
  if (!f.on || f.step != step) return;
  if (g_hits.fetch_add(1, std::memory_order_relaxed) + 1 != f.nth) return;
  ::kill(::getpid(), SIGKILL);
  std::abort();  // not reached: SIGKILL cannot be caught
}

}  // namespace cleave::jobs
