#include "model/experts.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <thread>

namespace cleave {

namespace {

float* grow(std::vector<float>& v, int64_t n) {
  if (v.size() < size_t(n)) v.resize(size_t(n));
  return v.data();
}

// An expert's gate, up and down matrices (a dense FFN is expert 0).
std::array<const WeightView*, 3> expert_views(const LlamaLayer& l, int32_t expert) {
  if (l.gate_exps.empty()) return {&l.gate, &l.up, &l.down};
  const size_t e = size_t(expert);
  return {&l.gate_exps[e], &l.up_exps[e], &l.down_exps[e]};
}

}  // namespace

void compute_expert(Backend& be, const LlamaLayer& l, int64_t ffn, int32_t expert, const float* x,
                    int64_t rows, std::vector<float>& g, std::vector<float>& u, float* y) {
  if (rows == 0) return;
  compute_expert(be, l, ffn, expert, x, rows, grow(g, rows * ffn), grow(u, rows * ffn), y);
}

void compute_expert(Backend& be, const LlamaLayer& l, int64_t ffn, int32_t expert, const float* x,
                    int64_t rows, float* gp, float* up, float* y) {
  if (rows == 0) return;
  const auto views = expert_views(l, expert);
  // The backend's own form of the expert (found again after its first use):
  // replicas a host takes on and experts no one prepared ahead get it too.
  for (const WeightView* w : views) be.prepare(*w);
  const MatmulJob gate_up[] = {{views[0], x, rows, gp}, {views[1], x, rows, up}};
  be.matmuls(gate_up, 2);
  be.silu_mul(gp, up, rows * ffn, gp);
  be.matmul(*views[2], gp, rows, y);
}

void compute_experts(Backend& be, const LlamaLayer& l, int64_t ffn, std::span<const ExpertWork> work,
                     float* g, float* u) {
  std::vector<MatmulJob> jobs;
  jobs.reserve(2 * work.size());
  int64_t total = 0;
  for (const ExpertWork& w : work) {
    if (w.rows == 0) continue;
    const auto views = expert_views(l, w.expert);
    for (const WeightView* v : views) be.prepare(*v);
    jobs.push_back({views[0], w.x, w.rows, g + total * ffn});
    jobs.push_back({views[1], w.x, w.rows, u + total * ffn});
    total += w.rows;
  }
  if (total == 0) return;
  be.matmuls(jobs.data(), int64_t(jobs.size()));
  be.silu_mul(g, u, total * ffn, g);
  jobs.clear();
  int64_t at = 0;
  for (const ExpertWork& w : work) {
    if (w.rows == 0) continue;
    jobs.push_back({expert_views(l, w.expert)[2], g + at * ffn, w.rows, w.y});
    at += w.rows;
  }
  be.matmuls(jobs.data(), int64_t(jobs.size()));
}

double load_spread(const std::vector<uint64_t>& rows) {
  if (rows.empty()) return 0;
  double mean = 0;
  for (uint64_t r : rows) mean += double(r);
  mean /= double(rows.size());
  if (mean == 0) return 0;
  double var = 0;
  for (uint64_t r : rows) var += (double(r) - mean) * (double(r) - mean);
  return std::sqrt(var / double(rows.size())) / mean;
}

void LayerTimes::add(uint64_t ns) {
  constexpr size_t kKeep = 4096;
  if (ring_.size() < kKeep) {
    ring_.push_back(ns);
  } else {
    ring_[next_] = ns;
    next_ = (next_ + 1) % kKeep;
  }
}

uint64_t LayerTimes::percentile_us(double p) const {
  if (ring_.empty()) return 0;
  std::vector<uint64_t> v = ring_;
  const size_t i = std::min(v.size() - 1, size_t(p / 100.0 * double(v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + ptrdiff_t(i), v.end());
  return v[i] / 1000;
}

// ---- ExpertHost ----

Result<std::unique_ptr<ExpertHost>> ExpertHost::create(std::shared_ptr<const GgufFile> file,
                                                       ExpertSet set, int32_t threads,
                                                       Compute compute, const std::string& device,
                                                       std::shared_ptr<Backend> backend) {
  auto where = device_for(device, bool(backend), "expert host");
  if (!where.ok()) return where.status();
  if (threads < 1 || threads > 1024)
    return Status(Code::invalid_argument,
                  "expert host: threads = " + std::to_string(threads) + " must be in [1, 1024]");
  auto model = LlamaModel::load(std::move(file));
  if (!model.ok()) return model.status();
  CLEAVE_RETURN_IF_ERROR(set.validate((*model)->config()));
  CLEAVE_RETURN_IF_ERROR(check_compute(compute, **model, "expert host"));
  std::unique_ptr<ExpertHost> h(new ExpertHost());
  h->model_ = std::move(*model);
  auto on = backend_for(*where, threads, compute, std::move(backend), "expert host");
  if (!on.ok()) return on.status();
  h->backend_ = std::move(on.value());
  h->host_ = h->backend_->caps().host_memory;
  Backend& be = *h->backend_;
  h->weights_ = std::make_unique<WeightCopies>(be);
  h->x_dev_ = std::make_unique<BackendBuffer<float>>(be);
  h->y_dev_ = std::make_unique<BackendBuffer<float>>(be);
  h->g_dev_ = std::make_unique<BackendBuffer<float>>(be);
  h->u_dev_ = std::make_unique<BackendBuffer<float>>(be);
  h->set_ = std::move(set);
  // Panels (on a device: copies) of the experts it holds, made now
  // (replicas added later: on first use).
  const LlamaConfig& c = h->model_->config();
  for (int32_t layer = 0; layer < c.n_layers; ++layer)
    for (int32_t e = 0; e < experts_per_layer(c); ++e) {
      if (!h->set_.holds(c, layer, e)) continue;
      if (!h->host_) {
        CLEAVE_RETURN_IF_ERROR(h->ensure_uploaded(layer, e));
        continue;
      }
      for (const WeightView* w : expert_views(h->model_->layer(layer), e)) h->model_->prepare_one(be, *w);
    }
  return h;
}

ExpertHost::~ExpertHost() {
  // Device buffers and weight copies before the backend.
  x_dev_.reset(), y_dev_.reset(), g_dev_.reset(), u_dev_.reset();
  weights_.reset();
}

Status ExpertHost::ensure_uploaded(int32_t layer, int32_t expert) {
  if (host_ || std::find(uploaded_.begin(), uploaded_.end(), std::pair{layer, expert}) != uploaded_.end())
    return Status::Ok();
  CLEAVE_RETURN_IF_ERROR(model_->upload_expert(*weights_, layer, expert));
  uploaded_.emplace_back(layer, expert);
  return Status::Ok();
}

bool ExpertHost::holds(int32_t layer, int32_t expert) const {
  if (set_.holds(config(), layer, expert)) return true;
  std::lock_guard<std::mutex> lock(added_mu_);
  return std::find(added_.begin(), added_.end(), std::pair{layer, expert}) != added_.end();
}

Status ExpertHost::add_expert(int32_t layer, int32_t expert) {
  if (layer < 0 || layer >= config().n_layers || expert < 0 || expert >= experts_per_layer(config()))
    return Status(Code::invalid_argument, "no expert " + std::to_string(expert) + " of layer " +
                                              std::to_string(layer) + " in this model");
  if (holds(layer, expert)) return Status::Ok();
  std::lock_guard<std::mutex> lock(added_mu_);
  added_.emplace_back(layer, expert);
  return Status::Ok();
}

Status ExpertHost::require(int32_t layer, int32_t expert) const {
  if (holds(layer, expert)) return Status::Ok();
  return Status(Code::invalid_argument, "expert " + std::to_string(expert) + " of layer " + std::to_string(layer) +
                                            " is not held here (" + set_.describe() + ")");
}

Status ExpertHost::compute(int32_t layer, std::span<const ExpertWork> work) {
  for (const ExpertWork& w : work) CLEAVE_RETURN_IF_ERROR(require(layer, w.expert));
  std::lock_guard<std::mutex> lock(mu_);
  const LlamaLayer& l = model_->layer(layer);
  const size_t per_layer = size_t(experts_per_layer(config()));
  if (stats_.expert_busy_ns.empty()) stats_.expert_busy_ns.assign(size_t(config().n_layers) * per_layer, 0);
  const int64_t dim = config().dim, ffn = config().ffn;
  for (const ExpertWork& w : work) {
    const auto t0 = std::chrono::steady_clock::now();
    if (host_) {
      compute_expert(*backend_, l, ffn, w.expert, w.x, w.rows, g_, u_, w.y);
    } else if (w.rows > 0) {  // the rows up, the expert there, its results down
      CLEAVE_RETURN_IF_ERROR(ensure_uploaded(layer, w.expert));
      float* x = x_dev_->try_grow(size_t(w.rows * dim));
      float* y = y_dev_->try_grow(size_t(w.rows * dim));
      float* g = g_dev_->try_grow(size_t(w.rows * ffn));
      float* u = u_dev_->try_grow(size_t(w.rows * ffn));
      if (!x || !y || !g || !u)
        return Status(Code::out_of_memory, "expert host: " + std::to_string(w.rows) + " rows do not fit the " +
                                               backend_->caps().name + " backend's memory");
      backend_->upload(x, w.x, size_t(w.rows * dim) * sizeof(float));
      compute_expert(*backend_, l, ffn, w.expert, x, w.rows, g, u, y);
      backend_->download(w.y, y, size_t(w.rows * dim) * sizeof(float));
    }
    const uint64_t ns = uint64_t(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    stats_.rows += uint64_t(w.rows);
    stats_.busy_ns += ns;
    stats_.expert_busy_ns[size_t(layer) * per_layer + size_t(w.expert)] += ns;
  }
  ++stats_.calls;
  return Status::Ok();
}

ExpertHost::Stats ExpertHost::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void append_routed_counters(std::vector<std::pair<std::string, uint64_t>>& out,
                            const std::vector<uint64_t>& rows, int32_t per_layer) {
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i] > 0)
      out.emplace_back("expert_routed_rows_" + std::to_string(i / size_t(per_layer)) + "_" +
                           std::to_string(i % size_t(per_layer)),
                       rows[i]);
}

void append_expert_busy_counters(std::vector<std::pair<std::string, uint64_t>>& out,
                                 const std::vector<uint64_t>& busy_ns, int32_t per_layer) {
  for (size_t i = 0; i < busy_ns.size(); ++i)
    if (busy_ns[i] >= 1000)
      out.emplace_back("busy_us_" + std::to_string(i / size_t(per_layer)) + "_" +
                           std::to_string(i % size_t(per_layer)),
                       busy_ns[i] / 1000);
}

// ---- ExpertPool ----

// A host's share of each layer runs on the host's own thread, started once:
// a thread start per host and layer cost more than a batch-1 layer's experts.
class ExpertPool::Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Queues a job (jobs run in order); returns its number for wait().
  uint64_t post(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    cv_.notify_all();
    return ++posted_;
  }
  // Returns when job `job` (and every one before it) has run.
  void wait(uint64_t job) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ >= job; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
      ++done_;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  uint64_t posted_ = 0, done_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the rest is set up
};

Result<std::unique_ptr<ExpertPool>> ExpertPool::create(std::shared_ptr<const GgufFile> file,
                                                       int32_t threads, Compute compute,
                                                       const std::string& device) {
  auto fallback = ExpertHost::create(std::move(file), ExpertSet{}, threads, compute, device);
  if (!fallback.ok()) return fallback.status();
  std::unique_ptr<ExpertPool> p(new ExpertPool());
  const LlamaConfig& c = (*fallback)->config();
  p->expert_rows_.assign(size_t(c.n_layers) * size_t(experts_per_layer(c)), 0);
  p->fallback_ = std::move(*fallback);
  return p;
}

Result<std::unique_ptr<ExpertPool>> ExpertPool::create(std::shared_ptr<const GgufFile> file,
                                                       const std::vector<ExpertSet>& sets,
                                                       int32_t threads, Compute compute,
                                                       const std::string& device) {
  auto pool = create(file, threads, compute, device);
  if (!pool.ok()) return pool.status();
  const LlamaConfig& c = (*pool)->fallback_->config();
  for (const ExpertSet& set : sets) CLEAVE_RETURN_IF_ERROR(set.validate(c));
  CLEAVE_RETURN_IF_ERROR(check_expert_coverage(c, sets));
  for (const ExpertSet& set : sets) {
    auto host = ExpertHost::create(file, set, threads, compute, device);
    if (!host.ok()) return host.status();
    (*pool)->add_host(std::move(host.value()));
  }
  return pool;
}

ExpertPool::~ExpertPool() = default;

int32_t ExpertPool::add_host(std::shared_ptr<ExpertHost> host) {
  std::lock_guard<std::mutex> lock(mu_);
  hosts_.push_back(Host{std::move(host), true, 0, std::make_shared<Worker>()});
  if (replication_) window_host_rows_.push_back(0);
  return int32_t(hosts_.size()) - 1;
}

int32_t ExpertPool::n_hosts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int32_t(hosts_.size());
}

void ExpertPool::set_alive(int32_t host, bool alive) {
  std::lock_guard<std::mutex> lock(mu_);
  if (host >= 0 && size_t(host) < hosts_.size()) hosts_[size_t(host)].alive = alive;
}

int32_t ExpertPool::pick(int32_t layer, int32_t expert) const {
  int32_t best = -1;
  for (int32_t i = 0; i < int32_t(hosts_.size()); ++i) {
    const Host& h = hosts_[size_t(i)];
    if (!h.alive || !h.host->holds(layer, expert)) continue;
    if (best < 0 || h.rows < hosts_[size_t(best)].rows) best = i;
  }
  return best;
}

void ExpertPool::run(int32_t layer, std::span<const ExpertWork> work) { finish(start(layer, work)); }

uint64_t ExpertPool::start(int32_t layer, std::span<const ExpertWork> work) {
  // Assign each piece (least loaded live holder; the load counts as it is
  // assigned, so replicas share one layer's work too), then post each
  // host's share to its own thread; finish() computes the fallback's rest.
  Pending p;
  p.ticket = next_ticket_++;
  p.layer = layer;
  p.t0 = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    p.share.resize(hosts_.size());
    const int32_t per_layer = experts_per_layer(fallback_->config());
    for (const ExpertWork& w : work) {
      if (w.rows == 0) continue;
      expert_rows_[size_t(layer) * size_t(per_layer) + size_t(w.expert)] += uint64_t(w.rows);
      const int32_t h = pick(layer, w.expert);
      if (h < 0) {
        p.rest.push_back(w);
        fallback_rows_ += uint64_t(w.rows);
        continue;
      }
      hosts_[size_t(h)].rows += uint64_t(w.rows);
      p.share[size_t(h)].push_back(w);
      if (replication_) {
        window_host_rows_[size_t(h)] += uint64_t(w.rows);
        window_expert_rows_[size_t(layer) * size_t(per_layer) + size_t(w.expert)] += uint64_t(w.rows);
      }
    }
    if (replication_ && ++window_runs_ >= window_) maybe_replicate();
    for (const Host& h : hosts_) {
      p.hosts.push_back(h.host);
      p.workers.push_back(h.worker);
    }
  }
  p.results = std::make_shared<std::vector<Status>>(p.share.size());
  p.jobs.assign(p.share.size(), 0);
  pending_.push_back(std::move(p));
  // Posted from its place in the deque: the jobs read the share there
  // (a deque's elements stay put when others are added or removed at the ends).
  Pending& q = pending_.back();
  for (size_t h = 0; h < q.share.size(); ++h) {
    if (q.share[h].empty()) continue;
    const std::vector<ExpertWork>* piece = &q.share[h];
    ExpertHost* host = q.hosts[h].get();
    auto results = q.results;
    q.jobs[h] = q.workers[h]->post([=] { (*results)[h] = host->compute(layer, *piece); });
  }
  return q.ticket;
}

void ExpertPool::finish(uint64_t ticket) {
  while (!pending_.empty() && pending_.front().ticket <= ticket) {
    Pending& p = pending_.front();
    if (!p.rest.empty()) {
      Status st = fallback_->compute(p.layer, p.rest);
      (void)st;  // the fallback holds every expert
    }
    for (size_t h = 0; h < p.share.size(); ++h)
      if (!p.share[h].empty()) p.workers[h]->wait(p.jobs[h]);
    // A host that refused its share (it cannot: pick checked holds) would
    // leave rows unset; compute them here rather than return garbage.
    for (size_t h = 0; h < p.share.size(); ++h)
      if (!p.share[h].empty() && !(*p.results)[h].ok()) {
        Status st = fallback_->compute(p.layer, p.share[h]);
        (void)st;
      }
    const uint64_t ns = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now() - p.t0)
                                     .count());
    pending_.pop_front();
    std::lock_guard<std::mutex> lock(mu_);
    ++layers_;
    layer_ns_ += ns;
    layer_times_.add(ns);
  }
}

void ExpertPool::set_replication(const ReplicationPolicy& policy, int32_t window) {
  std::lock_guard<std::mutex> lock(mu_);
  replication_ = policy;
  window_ = std::max(1, window);
  window_runs_ = 0;
  window_host_rows_.assign(hosts_.size(), 0);
  window_expert_rows_.assign(expert_rows_.size(), 0);
}

void ExpertPool::maybe_replicate() {
  // Over the live hosts only: a dead host neither gives nor takes replicas.
  std::vector<int32_t> live;
  std::vector<uint64_t> rows;
  for (int32_t h = 0; h < int32_t(hosts_.size()); ++h)
    if (hosts_[size_t(h)].alive && size_t(h) < window_host_rows_.size()) {
      live.push_back(h);
      rows.push_back(window_host_rows_[size_t(h)]);
    }
  const LlamaConfig& c = fallback_->config();
  auto holds = [&](int32_t i, int32_t l, int32_t e) { return hosts_[size_t(live[size_t(i)])].host->holds(l, e); };
  if (auto move = replication_->pick(holds, rows, window_expert_rows_, c.n_layers, experts_per_layer(c))) {
    if (hosts_[size_t(live[size_t(move->host)])].host->add_expert(move->layer, move->expert).ok())
      ++replicas_added_;
  }
  window_runs_ = 0;
  window_host_rows_.assign(hosts_.size(), 0);
  window_expert_rows_.assign(expert_rows_.size(), 0);
}

std::vector<std::pair<std::string, uint64_t>> ExpertPool::counters() const {
  const Stats s = stats();
  uint64_t rows = 0;
  for (uint64_t r : s.host_rows) rows += r;
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::string, uint64_t>> out = {
      {"expert_rows", rows},
      {"expert_fallback_rows", s.fallback_rows},
      {"expert_layers", layers_},
      {"expert_layer_us", layer_ns_ / 1000},
      {"expert_layer_p50_us", layer_times_.percentile_us(50)},
      {"expert_layer_p99_us", layer_times_.percentile_us(99)},
      {"expert_replicas_added", s.replicas_added}};
  append_routed_counters(out, s.expert_rows, experts_per_layer(fallback_->config()));
  return out;
}

ExpertPool::Stats ExpertPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s;
  for (const Host& h : hosts_) s.host_rows.push_back(h.rows);
  s.fallback_rows = fallback_rows_;
  s.replicas_added = replicas_added_;
  s.expert_rows = expert_rows_;
  return s;
}

}  // namespace cleave
