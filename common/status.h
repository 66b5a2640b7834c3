// Status and Result: how every library in cleave reports failure.
// No exception crosses a library boundary; callers get a code they can plan
// with and a message that names the problem and the values involved.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

namespace cleave {

enum class Code {
  ok = 0,
  not_found,
  invalid_argument,
  out_of_memory,
  out_of_range,
  unsupported,
  busy,
  io_error,
  corruption,
  unavailable,
  timed_out,
  aborted,
  rejected,  // refused up front: its goals (deadline, TTFT / TPOT target) cannot be met
};

inline const char* code_name(Code c) {
  switch (c) {
    case Code::ok: return "ok";
    case Code::not_found: return "not_found";
    case Code::invalid_argument: return "invalid_argument";
    case Code::out_of_memory: return "out_of_memory";
    case Code::out_of_range: return "out_of_range";
    case Code::unsupported: return "unsupported";
    case Code::busy: return "busy";
    case Code::io_error: return "io_error";
    case Code::corruption: return "corruption";
    case Code::unavailable: return "unavailable";
    case Code::timed_out: return "timed_out";
    case Code::aborted: return "aborted";
    case Code::rejected: return "rejected";
  }
  return "unknown";
}

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::ok; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "corruption: gguf: tensor 'x' offset 10 + size 20 exceeds data size 16"
  std::string to_string() const {
    return ok() ? std::string("ok") : std::string(code_name(code_)) + ": " + message_;
  }

 private:
  Code code_ = Code::ok;
  std::string message_;
};

// A value or the Status that explains why there is none.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = Status(Code::aborted, "Result built from an ok Status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace cleave

// Always-on invariant check (not for input validation: that returns Status).
#define CLEAVE_CHECK(cond)                                                              \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)

// Propagate a non-ok Status from an expression returning Status.
#define CLEAVE_RETURN_IF_ERROR(expr)      \
  do {                                    \
    ::cleave::Status _st = (expr);        \
    if (!_st.ok()) return _st;            \
  } while (0)
