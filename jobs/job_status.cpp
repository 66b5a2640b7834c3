#include "jobs/job_status.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

namespace cleave::jobs {
namespace {

using json = nlohmann::json;

json timestamp(int64_t t) { return t == 0 ? json(nullptr) : json(t); }

std::string duration_text(double s) {
  if (s < 0) return "?";
  const long long t = (long long)std::llround(s);
  char buf[64];
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, (t / 60) % 60);
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%llds", t);
  return buf;
}

}  // namespace

JobRates job_rates(const JobMeta& m) {
  JobRates r;
  if (m.active_seconds <= 0) return r;
  const double done = double(m.completed + m.failed);
  r.requests_per_second = done / m.active_seconds;
  r.tokens_per_second = double(m.generated_tokens) / m.active_seconds;
  const double left = double(m.total) - done;
  if (left <= 0) r.eta_seconds = 0;
  else if (r.requests_per_second > 0) r.eta_seconds = left / r.requests_per_second;
  return r;
}

std::string batch_object_json(const JobMeta& m, const std::string& id, const std::string& input_file_id,
                              const std::string& output_file_id, const std::string& error_file_id) {
  const JobRates r = job_rates(m);
  json errors = nullptr;
  if (!m.error.empty())
    errors = {{"object", "list"}, {"data", json::array({{{"code", "job_failed"}, {"message", m.error}}})}};
  json o = {
      {"id", id},
      {"object", "batch"},
      {"endpoint", m.endpoint},
      {"errors", errors},
      {"input_file_id", input_file_id},
      {"completion_window", "24h"},
      {"status", job_status_name(m.status)},
      {"output_file_id", output_file_id.empty() ? json(nullptr) : json(output_file_id)},
      {"error_file_id", error_file_id.empty() ? json(nullptr) : json(error_file_id)},
      {"created_at", m.created_at},
      {"in_progress_at", timestamp(m.in_progress_at)},
      {"expires_at", nullptr},
      {"finalizing_at", timestamp(m.finalizing_at)},
      {"completed_at", timestamp(m.completed_at)},
      {"failed_at", timestamp(m.failed_at)},
      {"expired_at", nullptr},
      {"cancelling_at", timestamp(m.cancelling_at)},
      {"cancelled_at", timestamp(m.cancelled_at)},
      {"request_counts", {{"total", m.total}, {"completed", m.completed}, {"failed", m.failed}}},
      {"metadata", nullptr},
      {"cleave",
       {{"runs", m.runs},
        {"active_seconds", m.active_seconds},
        {"throughput", {{"requests_per_second", r.requests_per_second}, {"tokens_per_second", r.tokens_per_second}}},
        {"eta_seconds", r.eta_seconds < 0 ? json(nullptr) : json(r.eta_seconds)},
        {"generated_tokens", m.generated_tokens},
        {"resumed_tokens", m.resumed_tokens},
        {"resumed_requests", m.resumed_requests},
        {"imported_tokens", m.imported_tokens},
        {"recomputed_tokens", m.recomputed_tokens},
        {"input", m.input_path},
        {"output", m.output_path},
        {"input_fingerprint", m.input_fingerprint},
        {"settings", m.settings}}}};
  return o.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string job_summary(const JobMeta& m) {
  const JobRates r = job_rates(m);
  char buf[256];
  std::snprintf(buf, sizeof buf, "status %s: %llu/%llu (%llu failed) | %.1f req/s %.0f tok/s | ETA %s | runs %llu",
                job_status_name(m.status), (unsigned long long)(m.completed + m.failed),
                (unsigned long long)m.total, (unsigned long long)m.failed, r.requests_per_second,
                r.tokens_per_second, duration_text(r.eta_seconds).c_str(), (unsigned long long)m.runs);
  return buf;
}

std::string progress_bar(const JobMeta& m, int width) {
  const double frac = m.total == 0 ? 1.0 : double(m.completed + m.failed) / double(m.total);
  const int filled = int(frac * width);
  std::string bar = "\r[";
  for (int i = 0; i < width; ++i) bar += i < filled ? '#' : '.';
  char pct[16];
  std::snprintf(pct, sizeof pct, "] %3d%% ", int(frac * 100));
  return bar + pct + job_summary(m);
}

}  // namespace cleave::jobs
