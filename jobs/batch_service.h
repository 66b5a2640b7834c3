// OpenAI's Batch API on `cleave serve` and a cluster head (--batch-dir DIR):
//   POST /v1/files                 multipart/form-data: purpose=batch, file
//   GET  /v1/files/{id}            the File object
//   GET  /v1/files/{id}/content    its bytes (an input, or a batch's output / errors)
//   POST /v1/batches               {"input_file_id", "endpoint", "completion_window": "24h", "metadata"}
//   GET  /v1/batches               the list, newest first
//   GET  /v1/batches/{id}          the Batch object
//   POST /v1/batches/{id}/cancel   cancelling, then cancelled (what finished stays in the output)
// Each batch is a JobRunner job in DIR/batches/ID/ (journal, output.jsonl),
// run one at a time in creation order through the server's front end, beside
// its online traffic. Everything is on disk: a server restarted on the same
// directory lists the same files and batches and continues the unfinished
// ones where they stopped (each custom_id once in the output, the tokens of
// an uninterrupted run). Batches never expire: "completion_window" must be
// "24h", OpenAI's only value.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "frontend/frontend.h"
#include "server/openai_request.h"
#include "server/server.h"

namespace cleave::jobs {

struct BatchServiceOptions {
  std::string dir;
  server::ParseOptions parse;  // image limits and the local media directory
  int32_t max_in_flight = 64;  // requests of the running batch in the front end at once
  // JobOptions::settings of every batch: one continued after a restart under
  // other settings fails, naming both (empty: not checked).
  std::string settings;
};

class BatchService {
 public:
  // Creates DIR/files and DIR/batches when absent and reads every batch there;
  // io_error naming what cannot be read or written.
  static Result<std::unique_ptr<BatchService>> open(BatchServiceOptions options);
  // Stops the worker: the running batch stays in_progress on disk (the next
  // start continues it); its requests are cancelled.
  ~BatchService();

  // Registers the routes (before Server::ready), then runs batches through
  // `frontend` (which must outlive this object) for `model`.
  void attach(server::Server& server);
  void start(server::ServedModel model, Frontend& frontend);

  struct Impl;

 private:
  explicit BatchService(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace cleave::jobs
