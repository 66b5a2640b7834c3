#include "server/metrics.h"

#include <charconv>
#include <cmath>
#include <optional>

#include "common/status.h"
#include "model/expert_balance.h"

namespace cleave::server {

namespace prom {

namespace {

bool valid_name(std::string_view s, bool colons) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colons && c == ':');
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

void add_double(std::atomic<double>& a, double by) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + by, std::memory_order_relaxed)) {
  }
}

template <typename Child, typename Map, typename Make>
Child& child_of(std::mutex& mu, Map& children, const Labels& values, Make make) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = children.find(values);
  if (it == children.end()) it = children.emplace(values, make()).first;
  return *it->second;
}

}  // namespace

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string escape_help(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// ---- Family ----

Family::Family(std::string name, std::string help, std::vector<std::string> label_names,
               const char* type)
    : name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      type_(type) {
  CLEAVE_CHECK(valid_name(name_, true));
  for (size_t i = 0; i < label_names_.size(); ++i) {
    const std::string& l = label_names_[i];
    CLEAVE_CHECK(valid_name(l, false) && l.rfind("__", 0) != 0 && l != "le");
    for (size_t j = 0; j < i; ++j) CLEAVE_CHECK(label_names_[j] != l);
  }
}

void Family::render_header(std::string& out) const {
  out += "# HELP " + name_ + " " + escape_help(help_) + "\n";
  out += "# TYPE " + name_ + " " + type_ + "\n";
}

void Family::render_series(std::string& out, std::string_view suffix, const Labels& values,
                           std::string_view extra_name, std::string_view extra_value) const {
  out += name_;
  out += suffix;
  if (values.empty() && extra_name.empty()) return;
  out += '{';
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ',';
    out += label_names_[i] + "=\"" + escape_label_value(values[i]) + "\"";
  }
  if (!extra_name.empty()) {
    if (!values.empty()) out += ',';
    out += std::string(extra_name) + "=\"" + escape_label_value(extra_value) + "\"";
  }
  out += '}';
}

void Family::check_arity(const Labels& values) const {
  CLEAVE_CHECK(values.size() == label_names_.size());
}

// ---- Counter ----

void CounterChild::inc(double by) {
  CLEAVE_CHECK(by >= 0);  // also refuses NaN
  add_double(v_, by);
}

void CounterChild::set(double total) {
  v_.store(total, std::memory_order_relaxed);
}

Counter::Counter(std::string name, std::string help, std::vector<std::string> label_names)
    : Family(std::move(name), std::move(help), std::move(label_names), "counter") {
  if (label_names_.empty()) labels({});
}

CounterChild& Counter::labels(const Labels& values) {
  check_arity(values);
  return child_of<CounterChild>(mu_, children_, values,
                                [] { return std::make_unique<CounterChild>(); });
}

double Counter::value(const Labels& values) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(values);
  return it == children_.end() ? 0 : it->second->value();
}

void Counter::render(std::string& out) const {
  render_header(out);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [values, child] : children_) {
    render_series(out, "", values);
    out += ' ' + format_value(child->value()) + '\n';
  }
}

// ---- Gauge ----

void GaugeChild::inc(double by) {
  add_double(v_, by);
}

Gauge::Gauge(std::string name, std::string help, std::vector<std::string> label_names)
    : Family(std::move(name), std::move(help), std::move(label_names), "gauge") {
  if (label_names_.empty()) labels({});
}

GaugeChild& Gauge::labels(const Labels& values) {
  check_arity(values);
  return child_of<GaugeChild>(mu_, children_, values,
                              [] { return std::make_unique<GaugeChild>(); });
}

double Gauge::value(const Labels& values) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(values);
  return it == children_.end() ? 0 : it->second->value();
}

void Gauge::replace_all(const std::vector<std::pair<Labels, double>>& samples) {
  std::map<Labels, std::unique_ptr<GaugeChild>> next;
  for (const auto& [values, v] : samples) {
    check_arity(values);
    auto& c = next[values];
    if (!c) c = std::make_unique<GaugeChild>();
    c->set(v);
  }
  std::lock_guard<std::mutex> lock(mu_);
  children_.swap(next);
}

void Gauge::render(std::string& out) const {
  render_header(out);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [values, child] : children_) {
    render_series(out, "", values);
    out += ' ' + format_value(child->value()) + '\n';
  }
}

// ---- Histogram ----

HistogramChild::HistogramChild(const std::vector<double>* bounds)
    : bounds_(bounds), counts_(bounds->size() + 1, 0) {}

void HistogramChild::observe(double v) {
  if (std::isnan(v)) return;
  // The first bucket whose bound is >= v (le is inclusive); past the end: +Inf.
  size_t i = 0;
  while (i < bounds_->size() && v > (*bounds_)[i]) ++i;
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[i];
  sum_ += v;
  ++count_;
}

HistogramChild::Snapshot HistogramChild::snapshot() const {
  Snapshot s;
  std::lock_guard<std::mutex> lock(mu_);
  s.cumulative.resize(counts_.size());
  uint64_t acc = 0;
  for (size_t i = 0; i < counts_.size(); ++i) s.cumulative[i] = acc += counts_[i];
  s.sum = sum_;
  s.count = count_;
  return s;
}

Histogram::Histogram(std::string name, std::string help, std::vector<double> bounds,
                     std::vector<std::string> label_names)
    : Family(std::move(name), std::move(help), std::move(label_names), "histogram"),
      bounds_(std::move(bounds)) {
  CLEAVE_CHECK(!bounds_.empty());
  for (size_t i = 0; i < bounds_.size(); ++i) {
    CLEAVE_CHECK(std::isfinite(bounds_[i]));
    if (i > 0) CLEAVE_CHECK(bounds_[i] > bounds_[i - 1]);
  }
  if (label_names_.empty()) labels({});
}

HistogramChild& Histogram::labels(const Labels& values) {
  check_arity(values);
  return child_of<HistogramChild>(mu_, children_, values,
                                  [this] { return std::make_unique<HistogramChild>(&bounds_); });
}

HistogramChild::Snapshot Histogram::snapshot(const Labels& values) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(values);
  if (it == children_.end()) return {};
  return it->second->snapshot();
}

void Histogram::render(std::string& out) const {
  render_header(out);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [values, child] : children_) {
    const HistogramChild::Snapshot s = child->snapshot();
    for (size_t i = 0; i < s.cumulative.size(); ++i) {
      render_series(out, "_bucket", values, "le",
                    i < bounds_.size() ? format_value(bounds_[i]) : "+Inf");
      out += ' ' + std::to_string(s.cumulative[i]) + '\n';
    }
    render_series(out, "_sum", values);
    out += ' ' + format_value(s.sum) + '\n';
    render_series(out, "_count", values);
    out += ' ' + std::to_string(s.count) + '\n';
  }
}

// ---- Registry ----

template <typename F>
F& Registry::add(std::unique_ptr<F> f) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& g : families_) CLEAVE_CHECK(g->name() != f->name());
  F& ref = *f;
  families_.push_back(std::move(f));
  return ref;
}

Counter& Registry::counter(std::string name, std::string help,
                           std::vector<std::string> label_names) {
  return add(std::make_unique<Counter>(std::move(name), std::move(help), std::move(label_names)));
}

Gauge& Registry::gauge(std::string name, std::string help, std::vector<std::string> label_names) {
  return add(std::make_unique<Gauge>(std::move(name), std::move(help), std::move(label_names)));
}

Histogram& Registry::histogram(std::string name, std::string help, std::vector<double> bounds,
                               std::vector<std::string> label_names) {
  return add(std::make_unique<Histogram>(std::move(name), std::move(help), std::move(bounds),
                                         std::move(label_names)));
}

std::string Registry::render() const {
  std::string out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& f : families_) f->render(out);
  return out;
}

}  // namespace prom

// ---- ServerMetrics ----

const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                          0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                          20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kTpotBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                          0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
const std::vector<double> kRequestLatencyBuckets = {
    0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

namespace {

constexpr const char* kReasons[] = {"stop", "length", "abort", "error"};

std::optional<uint64_t> find(const msg::Stats& s, std::string_view name) {
  for (const auto& [k, v] : s.counters)
    if (k == name) return v;
  return std::nullopt;
}

// The router (or store) of a model: "router", or "model:PATH/router" for
// the other models of a cluster head (actors/node.cpp).
bool model_actor(std::string_view actor, std::string_view role) {
  if (actor == role) return true;
  constexpr std::string_view kModel = "model:";
  return actor.size() > kModel.size() + role.size() + 1 && actor.substr(0, kModel.size()) == kModel &&
         actor.substr(actor.size() - role.size() - 1) == std::string(1, '/').append(role);
}

}  // namespace

ServerMetrics::ServerMetrics()
    : running_(
          registry_.gauge("cleave_num_requests_running",
                          "Number of requests running in the schedulers (prefill or decode).")),
      waiting_(registry_.gauge("cleave_num_requests_waiting",
                               "Number of requests waiting to be scheduled.")),
      kv_usage_(registry_.gauge(
          "cleave_kv_cache_usage_perc",
          "KV cache usage, the fraction of KV blocks in use (1 means 100 percent).")),
      prefix_queries_(registry_.counter("cleave_prefix_cache_queries_total",
                                        "Prefix cache queries, in prompt tokens queried.")),
      prefix_hits_(registry_.counter("cleave_prefix_cache_hits_total",
                                     "Prefix cache hits, in prompt tokens served from the cache.")),
      prompt_tokens_(
          registry_.counter("cleave_prompt_tokens_total", "Number of prompt tokens processed.")),
      generation_tokens_(registry_.counter("cleave_generation_tokens_total",
                                           "Number of generation tokens processed.")),
      success_(registry_.counter("cleave_request_success_total",
                                 "Count of finished requests, by finish reason.",
                                 {"finished_reason"})),
      cancelled_(registry_.counter("cleave_requests_cancelled_total",
                                   "Requests cancelled because the client went away.")),
      http_(registry_.counter("cleave_http_requests_total",
                              "HTTP requests, by route and status code.", {"route", "status"})),
      ttft_(registry_.histogram("cleave_time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.", kTtftBuckets)),
      tpot_(registry_.histogram(
          "cleave_time_per_output_token_seconds",
          "Histogram of time per output token (each inter-token gap) in seconds.", kTpotBuckets)),
      e2e_(registry_.histogram("cleave_e2e_request_latency_seconds",
                               "Histogram of end to end request latency in seconds.",
                               kRequestLatencyBuckets)),
      queue_(registry_.histogram(
          "cleave_request_queue_time_seconds",
          "Histogram of time spent queued before the runtime took the request, in seconds.",
          kRequestLatencyBuckets)),
      kv_blocks_moved_(registry_.counter(
          "cleave_kv_blocks_moved_total",
          "KV blocks moved between a stage's cache, the KV store and other stages.",
          {"from", "to"})),
      kv_bytes_(registry_.counter(
          "cleave_kv_transfer_bytes_total",
          "KV stream bytes between stages, by direction as the stages count them.", {"direction"})),
      kv_failures_(registry_.counter("cleave_kv_transfer_failures_total",
                                     "KV transfers that failed, by reason.", {"reason"})),
      stage_deaths_(
          registry_.counter("cleave_stage_deaths_total", "Stage actors the router saw go down.")),
      replacements_(registry_.counter("cleave_replacements_total",
                                      "Requests placed again after their stage went down.")),
      rejected_slo_(registry_.counter("cleave_requests_rejected_slo_total",
                                      "Requests refused on arrival: a deadline or TTFT / TPOT target "
                                      "the router predicts they cannot meet.")),
      rejected_cost_(registry_.counter("cleave_requests_rejected_cost_total",
                                       "Requests refused on arrival: a cost budget (max_cost) under "
                                       "the cheapest cost the router predicts.")),
      encoder_cache_hits_(
          registry_.counter("cleave_encoder_cache_hits_total",
                            "Images served from a vision encoder's embedding cache.")),
      stage_steps_(
          registry_.counter("cleave_stage_steps_total", "Engine steps, by stage.", {"stage"})),
      stage_step_seconds_(registry_.counter(
          "cleave_stage_step_seconds_total",
          "Wall time of engine steps in seconds, by stage.", {"stage"})),
      expert_fallback_rows_(registry_.counter(
          "cleave_expert_fallback_rows_total",
          "FFN rows an attention stage computed itself: no live expert actor hosted their expert.")),
      expert_host_failures_(registry_.counter(
          "cleave_expert_host_failures_total",
          "Expert actors an attention stage dropped (gone, timed out or a bad answer).")),
      expert_rows_(registry_.counter("cleave_expert_rows_total",
                                     "Rows an expert actor computed, by expert host.", {"host"})),
      expert_busy_seconds_(registry_.counter("cleave_expert_busy_seconds_total",
                                             "Time an expert actor spent computing, by expert host.",
                                             {"host"})),
      expert_routed_rows_(registry_.counter("cleave_expert_routed_rows_total",
                                            "Rows the router sent to each expert, by layer and expert.",
                                            {"layer", "expert"})),
      expert_compute_seconds_(registry_.counter(
          "cleave_expert_compute_seconds_total",
          "Time the expert actors spent computing each expert, by layer and expert.", {"layer", "expert"})),
      expert_replicas_added_(registry_.counter(
          "cleave_expert_replicas_added_total",
          "Expert replicas the hot-expert replication (--enable-eplb) added at run time.")),
      expert_rows_spread_(registry_.gauge(
          "cleave_expert_host_rows_spread",
          "Standard deviation over mean of the rows each expert actor computed (0: even).")),
      expert_busy_spread_(registry_.gauge(
          "cleave_expert_host_busy_spread",
          "Standard deviation over mean of each expert actor's busy time (0: even).")),
      actor_stat_(registry_.gauge(
          "cleave_actor_stat",
          "Every counter of every runtime actor as it reports it, by actor and counter name.",
          {"actor", "name"})) {
  // No runtime counter reports KV usage: no sample until set_kv_cache_usage().
  kv_usage_.replace_all({});
  for (const char* r : kReasons) success_.labels({r});
  kv_blocks_moved_.labels({"stage", "kv_store"});
  kv_blocks_moved_.labels({"kv_store", "stage"});
  kv_blocks_moved_.labels({"stage", "stage"});
  for (const char* d : {"sent", "received"}) kv_bytes_.labels({d});
  for (const char* r : {"receive_failed", "send_aborted", "store_error", "store_corrupt"})
    kv_failures_.labels({r});
}

void ServerMetrics::move_server_view(int64_t d_waiting, int64_t d_running) {
  std::lock_guard<std::mutex> lock(view_mu_);
  view_waiting_ += d_waiting;
  view_running_ += d_running;
  if (!waiting_external_) waiting_.set(double(std::max<int64_t>(view_waiting_, 0)));
  if (!running_external_) running_.set(double(std::max<int64_t>(view_running_, 0)));
}

void ServerMetrics::on_request_start() {
  move_server_view(1, 0);
}

void ServerMetrics::on_first_token(double ttft_seconds, double queue_seconds) {
  move_server_view(-1, 1);
  ttft_.observe(ttft_seconds);
  queue_.observe(queue_seconds);
  generation_tokens_.inc();
}

void ServerMetrics::on_token(double since_previous_token_seconds) {
  tpot_.observe(since_previous_token_seconds);
  generation_tokens_.inc();
}

void ServerMetrics::on_finish(std::string_view reason, double e2e_seconds, int64_t n_prompt,
                              int64_t n_generated, int64_t cached_tokens) {
  if (n_generated > 0) {
    move_server_view(0, -1);
  } else {
    move_server_view(-1, 0);
  }
  if (reason == "context") reason = "length";
  if (reason != "stop" && reason != "length" && reason != "abort") reason = "error";
  success_.labels({std::string(reason)}).inc();
  if (reason != "error") e2e_.observe(e2e_seconds);
  prompt_tokens_.inc(double(std::max<int64_t>(n_prompt, 0)));
  // The first token event reports cached_tokens: queries count the
  // requests whose prompt reached a stage's prefix cache.
  if (n_generated > 0) {
    prefix_queries_.inc(double(std::max<int64_t>(n_prompt, 0)));
    prefix_hits_.inc(double(std::max<int64_t>(cached_tokens, 0)));
  }
}

void ServerMetrics::on_cancel() {
  cancelled_.inc();
}

void ServerMetrics::on_http(std::string_view route, int status) {
  http_.labels({std::string(route), std::to_string(status)}).inc();
}

void ServerMetrics::set_running(int64_t n) {
  std::lock_guard<std::mutex> lock(view_mu_);
  running_external_ = true;
  running_.set(double(n));
}

void ServerMetrics::set_waiting(int64_t n) {
  std::lock_guard<std::mutex> lock(view_mu_);
  waiting_external_ = true;
  waiting_.set(double(n));
}

void ServerMetrics::set_kv_cache_usage(double fraction) {
  kv_usage_.set(fraction);
}

void ServerMetrics::update_from_stats(const std::vector<msg::Stats>& stats) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  std::vector<std::pair<prom::Labels, double>> raw;
  auto mirror = [&](prom::Counter& c, const prom::Labels& labels, const msg::Stats& s,
                    std::string_view counter, double scale = 1) {
    auto v = find(s, counter);
    if (!v) return;
    Run& run = runs_[{&c, labels, s.actor}];
    const double value = double(*v) * scale;
    if (value < run.last) run.carried += run.last;  // the actor started over
    run.last = value;
  };
  int64_t running = 0, waiting = 0;
  bool any_stage = false;
  std::vector<uint64_t> host_rows, host_busy;  // the expert actors', for the spread
  for (const msg::Stats& s : stats) {
    for (const auto& [name, v] : s.counters) raw.push_back({{s.actor, name}, double(v)});
    if (auto r = find(s, "running")) {  // a stage (StageCore)
      any_stage = true;
      running += int64_t(*r);
      waiting += int64_t(find(s, "queue_depth").value_or(0));
      mirror(kv_blocks_moved_, {"stage", "kv_store"}, s, "kv_blocks_put");
      mirror(kv_blocks_moved_, {"kv_store", "stage"}, s, "kv_blocks_got");
      mirror(kv_blocks_moved_, {"stage", "stage"}, s, "kv_blocks_received");
      mirror(kv_bytes_, {"sent"}, s, "kv_bytes_sent");
      mirror(kv_bytes_, {"received"}, s, "kv_bytes_received");
      mirror(kv_failures_, {"receive_failed"}, s, "kv_transfers_failed");
      mirror(kv_failures_, {"send_aborted"}, s, "kv_transfers_aborted");
      mirror(kv_failures_, {"store_error"}, s, "kv_errors");
      mirror(stage_steps_, {s.actor}, s, "steps");
      mirror(stage_step_seconds_, {s.actor}, s, "step_us", 1e-6);
      mirror(expert_fallback_rows_, {}, s, "expert_fallback_rows");
      mirror(expert_host_failures_, {}, s, "expert_host_failures");
      mirror(expert_replicas_added_, {}, s, "expert_replicas_added");
      mirror(rejected_slo_, {}, s, "rejected_slo");  // mono's (no router)
      for (const auto& [name, value] : s.counters) {  // expert_routed_rows_L_E
        constexpr std::string_view prefix = "expert_routed_rows_";
        if (name.rfind(prefix, 0) != 0) continue;
        const size_t sep = name.find('_', prefix.size());
        if (sep == std::string::npos) continue;
        mirror(expert_routed_rows_, {name.substr(prefix.size(), sep - prefix.size()), name.substr(sep + 1)}, s, name);
      }
    } else if (find(s, "busy_us") && find(s, "refused")) {  // an expert actor
      mirror(expert_rows_, {s.actor}, s, "rows");
      mirror(expert_busy_seconds_, {s.actor}, s, "busy_us", 1e-6);
      for (const auto& [name, value] : s.counters) {  // busy_us_L_E
        constexpr std::string_view prefix = "busy_us_";
        if (name.rfind(prefix, 0) != 0) continue;
        const size_t sep = name.find('_', prefix.size());
        if (sep == std::string::npos) continue;
        mirror(expert_compute_seconds_, {name.substr(prefix.size(), sep - prefix.size()), name.substr(sep + 1)}, s,
               name, 1e-6);
      }
      host_rows.push_back(find(s, "rows").value_or(0));
      host_busy.push_back(find(s, "busy_us").value_or(0));
    } else if (find(s, "encode_us")) {  // a vision encoder
      mirror(encoder_cache_hits_, {}, s, "cache_hits");
      mirror(stage_steps_, {s.actor}, s, "steps");
      mirror(stage_step_seconds_, {s.actor}, s, "encode_us", 1e-6);
    } else if (model_actor(s.actor, "router")) {
      mirror(stage_deaths_, {}, s, "stage_downs");
      mirror(replacements_, {}, s, "replacements");
      mirror(rejected_slo_, {}, s, "rejected_slo");
      mirror(rejected_cost_, {}, s, "rejected_cost");
    } else if (model_actor(s.actor, "kv_store")) {
      mirror(kv_failures_, {"store_corrupt"}, s, "store_corrupt_detected");
      for (const auto& [name, value] : s.counters) {  // tier_hops_A_B: the store's own LRU moves
        if (name.rfind("tier_hops_", 0) != 0) continue;
        const size_t sep = name.find('_', 10);
        if (sep == std::string::npos) continue;
        mirror(kv_blocks_moved_, {"tier" + name.substr(10, sep - 10), "tier" + name.substr(sep + 1)}, s, name);
      }
    }
  }
  // Totals over every actor ever seen (gone ones at their last value).
  std::map<std::pair<prom::Counter*, prom::Labels>, double> totals;
  for (const auto& [key, run] : runs_) {
    totals[{std::get<0>(key), std::get<1>(key)}] += run.carried + run.last;
  }
  for (const auto& [k, total] : totals) k.first->labels(k.second).set(total);
  actor_stat_.replace_all(raw);
  if (!host_rows.empty()) {
    expert_rows_spread_.set(load_spread(host_rows));
    expert_busy_spread_.set(load_spread(host_busy));
  }
  if (any_stage) {
    std::lock_guard<std::mutex> view(view_mu_);
    running_external_ = waiting_external_ = true;
    running_.set(double(running));
    waiting_.set(double(waiting));
  }
}

}  // namespace cleave::server
