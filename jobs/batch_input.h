// OpenAI batch input files: one JSON object per line,
//   {"custom_id": STRING, "method": "POST",
//    "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}
// (vllm run-batch's and OpenAI's Batch API format). The file is read whole
// once: its XXH3-128 fingerprint ties a job directory to it.
//
// A line whose custom_id can be read but whose other fields are wrong gets
// an error record of its own in the output (BatchLine::error); a line
// without a readable custom_id (not JSON, no string custom_id) is a
// LineError, reported in the errors file with its line number. Blank lines
// are skipped. Two lines with one custom_id refuse the whole file before
// anything runs (invalid_argument naming both line numbers). The body is
// checked later, against the served model (JobRunner).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "server/api_error.h"
#include "server/openai_request.h"

namespace cleave::jobs {

struct BatchLine {
  int64_t line_no = 0;   // 1-based line of the file
  std::string custom_id;
  std::string url;       // as given
  server::RequestKind kind = server::RequestKind::chat;
  std::string body;      // the body object as JSON text
  bool valid = true;     // false: `error` is its output
  server::ApiError error;
};

struct LineError {
  int64_t line_no = 0;
  std::string message;
};

struct BatchInput {
  std::string fingerprint;        // 32 hex digits: XXH3-128 of the file's bytes
  std::vector<BatchLine> lines;   // every line with a custom_id, in file order
  std::vector<LineError> errors;  // lines without one
  // "/v1/chat/completions", "/v1/completions", or "mixed" when both appear
  std::string endpoint() const;
};

struct BatchInputLimits {
  size_t max_file_bytes = size_t(4) << 30;
  size_t max_line_bytes = size_t(64) << 20;  // a chat body with inline images
  size_t max_custom_id_bytes = 512;
};

// io_error naming the path when it cannot be read; invalid_argument naming
// the path when it is too large, has a line over the limit, or repeats a
// custom_id (both line numbers).
Result<BatchInput> read_batch_input(const std::string& path, const BatchInputLimits& limits = {});
// The same over bytes already in memory (`name` for messages).
Result<BatchInput> parse_batch_input(std::string_view bytes, const std::string& name,
                                     const BatchInputLimits& limits = {});

// XXH3-128 of the bytes as 32 hex digits (hi then lo).
std::string fingerprint_hex(std::string_view bytes);

}  // namespace cleave::jobs
