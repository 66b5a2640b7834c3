// JobRunner: one batch job over any Frontend (one process's topology or a
// cluster's head), durable across kills.
//
// open() reads the input file, opens the journal in JOB_DIR/journal and the
// output file, and works out what is left:
//   - a new job directory starts the job (status in_progress);
//   - a directory made for another input is refused, naming both
//     fingerprints (and another output path, naming both paths);
//   - the output is cut back to the length the journal committed (a kill
//     between the append and the journal's commit leaves a tail nobody
//     counts), and the lines in it are done;
//   - a request the journal holds as running continues after the tokens
//     it had sampled (Frontend::resume), its KV read back from the
//     topology's store.
// run() keeps up to max_in_flight lines in the front end. Every
// snapshot_interval_s it records each running choice's tokens so far
// (sync=false: a process crash keeps them), and it appends finished lines
// with the ResultLog protocol: write + fdatasync, then one fsync'd journal
// commit of their done records and the new output length, in that order,
// so that a kill anywhere leaves each custom_id exactly once in the output.
//
// Determinism: a line without "seed" samples with the seed XXH3-64(input
// fingerprint, custom_id); choice i samples from RNG stream i; so an
// interrupted and resumed job writes the tokens of an uninterrupted one.
// The sampler's RNG is keyed by (seed, stream, position), and a resumed
// choice replays its journaled tokens first, so its next draw uses the
// position after them, as the uninterrupted run did.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "common/status.h"
#include "frontend/frontend.h"
#include "jobs/batch_input.h"
#include "jobs/journal.h"
#include "server/server.h"

namespace cleave::jobs {

struct JobOptions {
  std::string job_dir;  // journal, input errors; created when absent
  std::string input_path, output_path;
  // What decides a line's tokens besides the input: the model's fingerprint
  // and the flags that change the arithmetic (run-batch: job_settings()).
  // A job directory first run with other settings is refused, since its
  // remaining lines would not have the tokens an uninterrupted run writes.
  // Empty: not checked.
  std::string settings;
  server::ParseOptions parse;      // image limits, local media directory
  // The Batch API's "endpoint": a line whose url differs gets an error
  // record; empty: each line names its own.
  std::string endpoint;
  int32_t max_in_flight = 64;      // lines in the front end at once
  double snapshot_interval_s = 0.05;
  // After each journal commit, on run()'s thread (a progress bar).
  std::function<void(const JobMeta&)> on_progress;
};

class JobRunner {
 public:
  // The errors above, the journal's and the output's (io_error naming the
  // path, disk full included), invalid_argument for a bad input file.
  static Result<std::unique_ptr<JobRunner>> open(JobOptions options, server::ServedModel model);
  ~JobRunner();

  // Runs every line not yet done. Returns the job's meta once all are
  // (status completed), or aborted when *stop turned true (progress kept:
  // the same command continues). An I/O error (disk full, read-only
  // directory) stops the job with that error; nothing committed is lost
  // and restarting continues it.
  // `frontend` runs the requests (its KV store should be the job's, durable:
  // PipelineOptions::kv_durable, so resumed requests find their KV); it must
  // outlive run() (callbacks that come later find the state still there).
  // When *cancel turns true the job is cancelled (the Batch API's cancel):
  // status cancelling, the requests in flight are cancelled, then status
  // cancelled with what was finished in the output; a cancelled job does
  // not run again.
  // Once per open(): the journal closes when it returns.
  Result<JobMeta> run(Frontend& frontend, const std::atomic<bool>* stop = nullptr,
                      const std::atomic<bool>* cancel = nullptr);

  JobMeta meta() const;
  // JOB_DIR/input_errors.jsonl: {"line": N, "error": {...}} for each input
  // line without a custom_id; written at open().
  std::string errors_path() const;
  // Lines left to run when open() returned (not done in the output).
  size_t remaining_at_open() const;
  // Journal records that failed their checksum at open() (those requests
  // start again from nothing).
  uint64_t corrupt_records() const;
  // Seconds from open() to this run's first sampled token; -1 before it.
  double first_token_seconds() const;

  struct Impl;

 private:
  explicit JobRunner(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;  // shared with the front end's callbacks
};

}  // namespace cleave::jobs
