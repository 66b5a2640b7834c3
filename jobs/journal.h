// The job journal: one RocksDB database in the job directory that records
// what a batch job has done, so a process killed at any instant (kill -9)
// can be restarted with the same command and go on where it stopped.
//
// Keys (default column family):
//   "meta"            JobMeta: the input's fingerprint, status, timestamps,
//                     counts, the committed length of the output file
//   "req/" + 8 bytes  RequestRecord of input line `index` (big-endian, so a
//                     scan visits lines in order)
// Every value is [u64 XXH3-64 of the payload, little-endian][payload: JSON].
// A value whose checksum fails is reported (corrupt_records) and treated as
// absent: a lost request record costs recomputation (the output file, not
// the journal, is the final word on what is done: see ResultLog::scan), a
// lost meta record is refused by open_job.
//
// Durability: commit(..., sync=true) fsyncs the WAL before it returns (an
// output line is recorded as done only this way); sync=false survives a
// process crash (the OS has the WAL bytes), not a power loss: progress
// snapshots (tokens so far) use it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/sampler.h"

namespace rocksdb {
class DB;
}

namespace cleave::jobs {

// OpenAI's batch statuses.
enum class JobStatus { validating, in_progress, finalizing, completed, failed, cancelling, cancelled };
const char* job_status_name(JobStatus s);
std::optional<JobStatus> parse_job_status(const std::string& name);

struct JobMeta {
  std::string input_fingerprint;  // 32 hex digits: XXH3-128 of the input file's bytes
  std::string input_path, output_path;
  // What decides a line's tokens besides the input (JobOptions::settings),
  // as the first run had it; empty in journals written before it was kept.
  std::string settings;
  std::string endpoint;           // "/v1/chat/completions", "/v1/completions" or "mixed"
  JobStatus status = JobStatus::validating;
  std::string error;              // why the job failed (status failed)
  int64_t created_at = 0, in_progress_at = 0, finalizing_at = 0, completed_at = 0,
          failed_at = 0, cancelling_at = 0, cancelled_at = 0;  // Unix seconds; 0: not yet
  uint64_t total = 0, completed = 0, failed = 0;  // request_counts (lines)
  uint64_t output_bytes = 0;      // committed length of the output file
  uint64_t runs = 0;              // times the job was started (1 for an uninterrupted run)
  // Across every run: tokens sampled, tokens replayed into resumed requests
  // (not sampled again), and of those the ones whose KV was read back from
  // the store vs recomputed.
  uint64_t generated_tokens = 0, resumed_tokens = 0, imported_tokens = 0, recomputed_tokens = 0;
  uint64_t resumed_requests = 0;  // choices continued with Frontend::resume
  double active_seconds = 0;      // wall time spent running, summed over runs (throughput, ETA)
};

enum class RequestState { pending, running, done };
const char* request_state_name(RequestState s);

// What one choice's stream events added up to so far.
struct ChoiceProgress {
  std::vector<int32_t> tokens;
  std::string text;                    // text shown so far (held-back stop-string text excluded)
  std::vector<LogprobEntry> logprobs;  // one per token when the request asked for them
  std::string finish_reason;           // the engine's; empty while running
  int32_t cached_tokens = 0;           // the first token event's
};

struct RequestRecord {
  RequestState state = RequestState::pending;
  std::vector<ChoiceProgress> choices;  // running: the tokens so far, per choice
  uint64_t output_end = 0;              // done: offset just past its line in the output file
  bool ok = true;                       // done: a response (true) or an error record (false)
};

struct JournalCounters {
  uint64_t corrupt_records = 0;  // values whose checksum or JSON failed (treated as absent)
};

class Journal {
 public:
  // Creates the database when `create` and none exists; io_error naming the
  // directory when it cannot be opened (read-only directory, disk full,
  // another process holds it: RocksDB's LOCK), corruption when RocksDB says so;
  // not_found when `create` is false and `dir` holds no journal.
  static Result<std::unique_ptr<Journal>> open(const std::string& dir, bool create = true);
  // A view that does not take the lock (`cleave job status` while the job
  // runs): it sees what was committed when it opened. not_found when `dir`
  // holds no journal; writes answer unsupported.
  static Result<std::unique_ptr<Journal>> open_read_only(const std::string& dir);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // not_found when the journal has no meta yet (a new job); corruption when
  // the meta record fails its checksum.
  Result<JobMeta> meta();
  // Every request record that verifies, by line index.
  Result<std::map<uint64_t, RequestRecord>> records();

  // One atomic write (a RocksDB WriteBatch): the records and, when given,
  // the meta. io_error naming the directory on failure (disk full: the
  // message says so).
  Status commit(const std::vector<std::pair<uint64_t, RequestRecord>>& records, const JobMeta* meta,
                bool sync);
  // Removes records (the job's end: done records are in the output).
  Status erase(const std::vector<uint64_t>& indices, bool sync);

  // Test seam: overwrite one stored value's byte (corruption tests).
  Status corrupt_for_testing(uint64_t index, size_t byte);

  JournalCounters counters() const { return counters_; }
  const std::string& dir() const { return dir_; }

 private:
  Journal() = default;
  std::string dir_;
  bool read_only_ = false;
  std::unique_ptr<rocksdb::DB> db_;
  JournalCounters counters_;
  // The first failed write: RocksDB must not be written again after it
  // (Debian's build asserts), so every later commit answers this.
  Status write_failure_;
};

// The value encoding, exposed for tests: [checksum][JSON].
std::string encode_meta(const JobMeta& m);
Result<JobMeta> decode_meta(const std::string& value);
std::string encode_record(const RequestRecord& r);
Result<RequestRecord> decode_record(const std::string& value);

}  // namespace cleave::jobs
