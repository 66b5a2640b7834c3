// The output file of a batch job: JSONL result lines, appended and made
// durable before the journal records them, so that a kill at any instant
// leaves nothing lost or doubled.
//
// The append protocol (JobRunner runs it; fault_point() names each step):
//   1. write the lines at the end of the file          "result.before_write"
//   2. fdatasync the file                              "result.after_write"
//   3. commit to the journal, fsync'd: each line's     "result.after_sync"
//      request done + the new committed length
//   4. done                                            "result.after_commit"
// On restart the file is cut back to the journal's committed length: a
// partial line, or whole lines whose commit never happened, go, and their
// requests are not done (they run again and write the same tokens). A file
// shorter than the committed length was changed by someone else: refused.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace cleave::jobs {

class ResultLog {
 public:
  // Opens (creating when absent) `path` for appending and cuts it to
  // `committed_bytes`. corruption naming the path and both lengths when the
  // file is shorter; io_error naming the path (and errno's text) otherwise.
  static Result<std::unique_ptr<ResultLog>> open(const std::string& path, uint64_t committed_bytes);
  ~ResultLog();
  ResultLog(const ResultLog&) = delete;
  ResultLog& operator=(const ResultLog&) = delete;

  // Steps 1 and 2: writes `bytes` (whole lines) at the end and fdatasyncs.
  // Returns the new end. On an error (ENOSPC, EIO) the file is cut back to
  // where it was, so a later append starts clean; the error names the path.
  Result<uint64_t> append(std::string_view bytes);
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Each complete line in [0, upto) of a file: its end offset and its
  // "custom_id" (empty when the line is not a JSON object with a string
  // custom_id). io_error when the file cannot be read.
  struct Line {
    uint64_t end = 0;
    std::string custom_id;
  };
  static Result<std::vector<Line>> scan(const std::string& path, uint64_t upto);

 private:
  ResultLog() = default;
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

}  // namespace cleave::jobs
