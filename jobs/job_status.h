// A job as OpenAI's Batch object shows it (`cleave job status DIR --json`,
// GET /v1/batches/{id}), plus cleave's throughput and ETA; the same figures
// as one line of text and as a TTY progress bar.
#pragma once

#include <string>

#include "jobs/journal.h"

namespace cleave::jobs {

struct JobRates {
  double requests_per_second = 0;  // lines finished (completed + failed) per active second
  double tokens_per_second = 0;    // tokens sampled per active second
  double eta_seconds = -1;         // lines left / requests_per_second; -1 when unknown
};
JobRates job_rates(const JobMeta& m);

// {"id","object":"batch","endpoint","input_file_id","completion_window",
//  "status","output_file_id","error_file_id","created_at","in_progress_at",
//  "finalizing_at","completed_at","failed_at","cancelling_at","cancelled_at",
//  "request_counts":{"total","completed","failed"},"errors","metadata",
//  "cleave":{"runs","throughput":{requests_per_second,tokens_per_second},
//  "eta_seconds","generated_tokens","resumed_tokens","resumed_requests","imported_tokens",
//  "recomputed_tokens","input","output"}}; timestamps not reached are null.
std::string batch_object_json(const JobMeta& m, const std::string& id, const std::string& input_file_id,
                              const std::string& output_file_id, const std::string& error_file_id);

// "status in_progress: 120/500 (3 failed) | 4.1 req/s 310 tok/s | ETA 1m33s | runs 2"
std::string job_summary(const JobMeta& m);
// A progress bar of `width` cells and the summary, for a TTY ("\r" first).
std::string progress_bar(const JobMeta& m, int width = 30);

}  // namespace cleave::jobs
