// Prometheus metrics for the server: a small thread-safe registry (counters,
// gauges, histograms with fixed buckets, label values, HELP/TYPE, text
// exposition format 0.0.4) and ServerMetrics, the server's metric set.
//
// Registry
//   Families are created once (at start-up) and live as long as the
//   registry; a family's children (one per label-value tuple) are created on
//   first use and never move, so a route may keep a child reference and hit
//   only an atomic (counters, gauges) or the child's own mutex (histograms).
//   render() may run concurrently with any update.
//
// ServerMetrics (names follow Prometheus rules: prefix cleave_, snake case,
// base units, _total on counters; meanings as vLLM's vllm:* metrics)
//
//   metric                                   type       filled by
//   cleave_num_requests_running              gauge      see "running and waiting" below
//   cleave_num_requests_waiting              gauge      see "running and waiting" below
//   cleave_kv_cache_usage_perc               gauge      set_kv_cache_usage() only (0..1): no
//                                                       runtime counter reports KV usage, so
//                                                       no sample until it is set
//   cleave_prefix_cache_queries_total        counter    on_finish: n_prompt (requests with a token)
//   cleave_prefix_cache_hits_total           counter    on_finish: cached_tokens (same requests)
//   cleave_prompt_tokens_total               counter    on_finish: n_prompt
//   cleave_generation_tokens_total           counter    on_first_token + on_token: 1 each
//   cleave_request_success_total{finished_reason}       on_finish: stop|length|abort|error
//   cleave_requests_cancelled_total          counter    on_cancel (the client went away)
//   cleave_http_requests_total{route,status} counter    on_http
//   cleave_time_to_first_token_seconds       histogram  on_first_token
//   cleave_time_per_output_token_seconds     histogram  on_token (each inter-token gap, vLLM v0)
//   cleave_e2e_request_latency_seconds       histogram  on_finish (every reason but error)
//   cleave_request_queue_time_seconds        histogram  on_first_token
//
//   From the runtime's actor counters, update_from_stats() (Frontend::stats()).
//   Actors are told apart by their counters: a stage (StageCore: "mono",
//   "prefill/0", "decode/1", "colocated/0", "NODE/decode/0", ...) reports
//   "running"; a vision encoder reports "encode_us"; the router and the KV
//   store are the actors named "router" and "kv_store".
//
//   metric                                          actor       counter(s), summed over actors
//   cleave_kv_blocks_moved_total{from=stage,to=kv_store}   stage  kv_blocks_put
//   cleave_kv_blocks_moved_total{from=kv_store,to=stage}   stage  kv_blocks_got
//   cleave_kv_blocks_moved_total{from=stage,to=stage}      stage  kv_blocks_received (KV streams,
//                                                                 counted by the receiving decoder)
//   cleave_kv_transfer_bytes_total{direction=sent}         stage  kv_bytes_sent
//   cleave_kv_transfer_bytes_total{direction=received}     stage  kv_bytes_received
//   cleave_kv_transfer_failures_total{reason=receive_failed} stage kv_transfers_failed
//   cleave_kv_transfer_failures_total{reason=send_aborted}   stage kv_transfers_aborted
//   cleave_kv_transfer_failures_total{reason=store_error}    stage kv_errors (KV store put/get
//                                                                 failed or stored only part)
//   cleave_kv_transfer_failures_total{reason=store_corrupt}  kv_store store_corrupt_detected
//   cleave_stage_deaths_total                              router stage_downs
//   cleave_replacements_total                              router replacements
//   cleave_requests_rejected_slo_total                     router, mono  rejected_slo
//   cleave_requests_rejected_cost_total                    router rejected_cost
//   cleave_encoder_cache_hits_total                        encoder cache_hits
//   cleave_stage_steps_total{stage}                        stage, encoder  steps
//   cleave_stage_step_seconds_total{stage}                 stage    step_us / 1e6
//                                                          encoder  encode_us / 1e6
//   cleave_expert_fallback_rows_total                      stage  expert_fallback_rows (FFN rows an
//                                                                 attention stage computed itself)
//   cleave_expert_host_failures_total                      stage  expert_host_failures
//   cleave_expert_rows_total{host}                         expert rows (an expert actor: it
//                                                                 reports "busy_us" and "refused")
//   cleave_expert_busy_seconds_total{host}                 expert busy_us / 1e6
//   cleave_expert_routed_rows_total{layer,expert}          stage  expert_routed_rows_L_E (rows the
//                                                                 router sent to that expert)
//   cleave_expert_compute_seconds_total{layer,expert}      expert busy_us_L_E / 1e6 (summed over
//                                                                 the hosts of that expert)
//   cleave_expert_replicas_added_total                     stage  expert_replicas_added
//   cleave_expert_host_rows_spread / _busy_spread          expert stddev / mean over the expert
//                                                                 actors of rows / busy_us (gauges)
//   cleave_num_requests_running / _waiting                 stage  running / queue_depth
//   cleave_actor_stat{actor,name}                          every  every counter as it is (gauge;
//                                                                 the set of the latest call)
//
//   cleave_kv_blocks_moved_total{from=tierA,to=tierB}       kv_store tier_hops_A_B (its LRU moves)
//   cleave_kv_cache_usage_perc is set by the server (set_kv_cache_usage) from
//   the stages' kv_blocks_used / kv_blocks_total.
//
//   The mirrored counters stay monotonic: each actor's last value is kept
//   when the actor disappears (a dead stage), and a value that goes down
//   (an actor restarted under the same name) starts a new run on top of the
//   old one.
//
// Running and waiting: by default the server's own view, moved by the
// record API (on_request_start: waiting + 1; on_first_token: waiting - 1,
// running + 1; on_finish: running - 1, or waiting - 1 when n_generated == 0).
// Once set_running/set_waiting is called, or update_from_stats() sees stage
// counters (the schedulers' running and queued requests, vLLM's meaning),
// that value wins and the record API stops moving that gauge.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "schema/messages.h"

namespace cleave::server {

namespace prom {

inline constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

// Label values, in the order of the family's label names.
using Labels = std::vector<std::string>;

// Label value: backslash, double quote and line feed escaped (\\, \", \n).
std::string escape_label_value(std::string_view v);
// HELP text: backslash and line feed escaped.
std::string escape_help(std::string_view v);
// A sample value: shortest round-trip decimal, NaN, +Inf, -Inf.
std::string format_value(double v);

class Family {
 public:
  virtual ~Family() = default;
  Family(const Family&) = delete;
  Family& operator=(const Family&) = delete;
  const std::string& name() const { return name_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  // Appends the family: # HELP, # TYPE, then one line per sample.
  virtual void render(std::string& out) const = 0;

 protected:
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         const char* type);
  void render_header(std::string& out) const;
  // name{l1="v1",...[,extra="value"]} (no braces when there are no labels).
  void render_series(std::string& out, std::string_view suffix, const Labels& values,
                     std::string_view extra_name = {}, std::string_view extra_value = {}) const;
  void check_arity(const Labels& values) const;

  std::string name_, help_;
  std::vector<std::string> label_names_;
  const char* type_;
  mutable std::mutex mu_;  // the children maps
};

class CounterChild {
 public:
  void inc(double by = 1);  // by >= 0
  // Mirrors a cumulative count kept elsewhere (the runtime's actors).
  void set(double total);
  double value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0};
};

class Counter final : public Family {
 public:
  Counter(std::string name, std::string help, std::vector<std::string> label_names);
  // The child for these label values, created at 0 on first use.
  CounterChild& labels(const Labels& values);
  void inc(double by = 1) { labels({}).inc(by); }  // families without labels
  double value(const Labels& values = {}) const;   // 0 when the child does not exist
  void render(std::string& out) const override;

 private:
  std::map<Labels, std::unique_ptr<CounterChild>> children_;
};

class GaugeChild {
 public:
  void set(double v) { v_.store(v, std::memory_order_relaxed); }
  void inc(double by = 1);
  void dec(double by = 1) { inc(-by); }
  double value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0};
};

class Gauge final : public Family {
 public:
  Gauge(std::string name, std::string help, std::vector<std::string> label_names);
  GaugeChild& labels(const Labels& values);
  void set(double v) { labels({}).set(v); }  // families without labels
  double value(const Labels& values = {}) const;
  // Replaces every child at once (references to old children dangle).
  void replace_all(const std::vector<std::pair<Labels, double>>& samples);
  void render(std::string& out) const override;

 private:
  std::map<Labels, std::unique_ptr<GaugeChild>> children_;
};

class HistogramChild {
 public:
  explicit HistogramChild(const std::vector<double>* bounds);
  void observe(double v);  // NaN is dropped
  struct Snapshot {
    std::vector<uint64_t> cumulative;  // per bucket, le bound[i]; last: +Inf (== count)
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  const std::vector<double>* bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last: above every bound
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Histogram final : public Family {
 public:
  // bounds: finite, strictly increasing (the +Inf bucket is implied).
  Histogram(std::string name, std::string help, std::vector<double> bounds,
            std::vector<std::string> label_names);
  HistogramChild& labels(const Labels& values);
  void observe(double v) { labels({}).observe(v); }                    // families without labels
  HistogramChild::Snapshot snapshot(const Labels& values = {}) const;  // empty when absent
  const std::vector<double>& bounds() const { return bounds_; }
  void render(std::string& out) const override;

 private:
  std::vector<double> bounds_;
  std::map<Labels, std::unique_ptr<HistogramChild>> children_;
};

// Names must match [a-zA-Z_:][a-zA-Z0-9_:]* and be unique; label names
// [a-zA-Z_][a-zA-Z0-9_]*, not __-prefixed, not "le" (checked: aborts).
// Families without labels have their one child from the start (so they
// render 0 before the first update).
class Registry {
 public:
  Counter& counter(std::string name, std::string help, std::vector<std::string> label_names = {});
  Gauge& gauge(std::string name, std::string help, std::vector<std::string> label_names = {});
  Histogram& histogram(std::string name, std::string help, std::vector<double> bounds,
                       std::vector<std::string> label_names = {});
  // Every family in registration order, text format 0.0.4 (kContentType).
  std::string render() const;

 private:
  template <typename F>
  F& add(std::unique_ptr<F> f);
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Family>> families_;
};

}  // namespace prom

// vLLM's bucket choices (vllm/v1/metrics/loggers.py).
extern const std::vector<double> kTtftBuckets;            // time to first token
extern const std::vector<double> kTpotBuckets;            // time per output token
extern const std::vector<double> kRequestLatencyBuckets;  // e2e and queue time

class ServerMetrics {
 public:
  ServerMetrics();

  prom::Registry& registry() { return registry_; }
  std::string render() const { return registry_.render(); }
  static constexpr const char* content_type() { return prom::kContentType; }

  // --- the routes' record API (any thread) ---
  void on_request_start();
  // The first token: seconds since the request arrived, and the part of it
  // spent queued before the runtime took the request.
  void on_first_token(double ttft_seconds, double queue_seconds);
  // Every later token, with the time since the previous one.
  void on_token(double since_previous_token_seconds);
  // Once per request that on_request_start counted. reason: "stop",
  // "length" ("context" counts as "length"), "abort" (the client went
  // away: call on_cancel too), "error"; anything else counts as "error".
  // n_generated: the tokens on_first_token/on_token were told about.
  void on_finish(std::string_view reason, double e2e_seconds, int64_t n_prompt, int64_t n_generated,
                 int64_t cached_tokens);
  void on_cancel();
  // route: the route's pattern ("/v1/completions", "other"), never a raw
  // path (label cardinality).
  void on_http(std::string_view route, int status);
  void set_running(int64_t n);
  void set_waiting(int64_t n);
  void set_kv_cache_usage(double fraction);  // 0..1

  // --- the runtime's counters (see the table above) ---
  void update_from_stats(const std::vector<msg::Stats>& stats);

 private:
  void move_server_view(int64_t d_waiting, int64_t d_running);

  prom::Registry registry_;
  prom::Gauge& running_;
  prom::Gauge& waiting_;
  prom::Gauge& kv_usage_;
  prom::Counter& prefix_queries_;
  prom::Counter& prefix_hits_;
  prom::Counter& prompt_tokens_;
  prom::Counter& generation_tokens_;
  prom::Counter& success_;
  prom::Counter& cancelled_;
  prom::Counter& http_;
  prom::Histogram& ttft_;
  prom::Histogram& tpot_;
  prom::Histogram& e2e_;
  prom::Histogram& queue_;
  prom::Counter& kv_blocks_moved_;
  prom::Counter& kv_bytes_;
  prom::Counter& kv_failures_;
  prom::Counter& stage_deaths_;
  prom::Counter& replacements_;
  prom::Counter& rejected_slo_;
  prom::Counter& rejected_cost_;
  prom::Counter& encoder_cache_hits_;
  prom::Counter& stage_steps_;
  prom::Counter& stage_step_seconds_;
  prom::Counter& expert_fallback_rows_;
  prom::Counter& expert_host_failures_;
  prom::Counter& expert_rows_;
  prom::Counter& expert_busy_seconds_;
  prom::Counter& expert_routed_rows_;
  prom::Counter& expert_compute_seconds_;
  prom::Counter& expert_replicas_added_;
  prom::Gauge& expert_rows_spread_;
  prom::Gauge& expert_busy_spread_;
  prom::Gauge& actor_stat_;

  // The server's own running/waiting, and whether an absolute value took over.
  std::mutex view_mu_;
  int64_t view_waiting_ = 0, view_running_ = 0;
  bool waiting_external_ = false, running_external_ = false;

  // Mirrors of the runtime's counters: (counter, labels, actor) -> its run.
  struct Run {
    double last = 0;     // the actor's latest value
    double carried = 0;  // earlier runs' totals (values that went down)
  };
  std::mutex stats_mu_;
  std::map<std::tuple<prom::Counter*, prom::Labels, std::string>, Run> runs_;
};

}  // namespace cleave::server
