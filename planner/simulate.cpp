// The discrete-event simulation behind `cleave plan` (plan.h).
#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <queue>
#include <random>

#include "planner/plan.h"

namespace cleave::planner {
namespace {

struct Request {
  double arrival = 0;
  int32_t prompt = 0, output = 0;
  int32_t prefilled = 0;  // prompt tokens computed so far
  double first_token = -1, finish = -1;
};

struct Decoder {
  struct Row {
    int32_t request;
    int32_t left;     // tokens still to generate
    int64_t context;  // tokens its KV holds
  };
  std::vector<Row> rows;
  std::deque<int32_t> waiting;
  bool busy = false;
  double busy_ms = 0;
};

struct Prefiller {
  bool busy = false;
  std::vector<std::pair<int32_t, int32_t>> batch;  // (request, its tokens) of the step under way
  double busy_ms = 0;
};

enum class Kind { arrival, prefill_done, handoff, decode_done };
struct Event {
  double t;
  uint64_t seq;
  Kind kind;
  int32_t index;
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
};

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, size_t(q * double(v.size())));
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(k), v.end());
  return v[k];
}

// A step's factor: log-normal of mean 1 and the given coefficient of
// variation (sigma^2 = ln(1 + cv^2), mu = -sigma^2 / 2); exactly 1, with
// no draw, at cv 0.
class Spread {
 public:
  explicit Spread(double cv)
      : sigma_(std::sqrt(std::log1p(cv * cv))), normal_(-sigma_ * sigma_ / 2, cv > 0 ? sigma_ : 1.0) {}
  double operator()(std::mt19937_64& rng) { return sigma_ > 0 ? std::exp(normal_(rng)) : 1.0; }

 private:
  double sigma_;
  std::normal_distribution<double> normal_;
};

class Sim {
 public:
  Sim(const StepProfile& p, const Workload& w, const Placement& pl)
      : p_(p),
        prefill_(size_t(pl.prefill)),
        decode_(size_t(pl.decode)),
        prefill_spread_(p.prefill_step_cv),
        decode_spread_(p.decode_step_cv),
        spread_rng_(w.seed ^ 0x5bd1e995u) {
    if (!w.trace.empty()) {
      for (const TraceRequest& tr : w.trace) {
        Request r;
        r.arrival = tr.arrival_ms;
        r.prompt = tr.prompt;
        r.output = tr.output;
        requests_.push_back(r);
      }
    } else {
      std::mt19937_64 rng(w.seed);
      std::exponential_distribution<double> gap(w.rate);
      std::uniform_int_distribution<int32_t> prompt(w.prompt_min, w.prompt_max), output(w.output_min, w.output_max);
      double t = 0;
      requests_.resize(size_t(w.requests));
      for (auto& r : requests_) {
        t += gap(rng) * 1e3;  // ms
        r.arrival = t;
        r.prompt = prompt(rng);
        r.output = output(rng);
      }
    }
    for (int32_t i = 0; i < int32_t(requests_.size()); ++i) push(requests_[size_t(i)].arrival, Kind::arrival, i);
  }

  void run() {
    while (!events_.empty()) {
      const Event e = events_.top();
      events_.pop();
      now_ = e.t;
      switch (e.kind) {
        case Kind::arrival: queue_.push_back(e.index); break;
        case Kind::prefill_done: prefill_done(e.index); break;
        case Kind::handoff: to_decoder(e.index); break;
        case Kind::decode_done: decode_done(e.index); break;
      }
      start_prefills();
      for (int32_t d = 0; d < int32_t(decode_.size()); ++d) start_decode(d);
    }
  }

  const std::vector<Request>& requests() const { return requests_; }
  double end() const { return now_; }
  double prefill_busy_ms() const {
    double s = 0;
    for (const auto& x : prefill_) s += x.busy_ms;
    return s;
  }
  double decode_busy_ms() const {
    double s = 0;
    for (const auto& x : decode_) s += x.busy_ms;
    return s;
  }

 private:
  void push(double t, Kind k, int32_t i) { events_.push(Event{t, seq_++, k, i}); }

  // Idle prefill stages take from the queue's head up to the token budget;
  // a prompt longer than what is left of it runs a chunk and goes back to
  // the head when the step ends.
  void start_prefills() {
    for (int32_t s = 0; s < int32_t(prefill_.size()) && !queue_.empty(); ++s) {
      Prefiller& x = prefill_[size_t(s)];
      if (x.busy) continue;
      int64_t tokens = 0;
      x.batch.clear();
      while (!queue_.empty() && tokens < p_.max_batch_tokens) {
        const int32_t id = queue_.front();
        const Request& r = requests_[size_t(id)];
        const int32_t take = int32_t(std::min<int64_t>(p_.max_batch_tokens - tokens, r.prompt - r.prefilled));
        queue_.pop_front();
        x.batch.push_back({id, take});
        tokens += take;
      }
      const double ms = (p_.prefill_ms + p_.prefill_ms_per_token * double(tokens)) * prefill_spread_(spread_rng_);
      x.busy = true;
      x.busy_ms += ms;
      push(now_ + ms, Kind::prefill_done, s);
    }
  }

  void prefill_done(int32_t s) {
    Prefiller& x = prefill_[size_t(s)];
    x.busy = false;
    for (auto [id, take] : x.batch) {
      Request& r = requests_[size_t(id)];
      r.prefilled += take;
      if (r.prefilled < r.prompt) {  // a chunk: the rest next
        queue_.push_front(id);
        continue;
      }
      r.first_token = now_;
      if (r.output <= 1) {
        r.finish = now_;
        continue;
      }
      push(now_ + p_.handoff_ms + p_.handoff_ms_per_token * double(r.prompt), Kind::handoff, id);
    }
    x.batch.clear();
  }

  void to_decoder(int32_t id) {
    int32_t best = 0;
    size_t best_load = std::numeric_limits<size_t>::max();
    for (int32_t d = 0; d < int32_t(decode_.size()); ++d) {
      const size_t load = decode_[size_t(d)].rows.size() + decode_[size_t(d)].waiting.size();
      if (load < best_load) best = d, best_load = load;
    }
    decode_[size_t(best)].waiting.push_back(id);
  }

  void start_decode(int32_t d) {
    Decoder& x = decode_[size_t(d)];
    if (x.busy) return;
    while (!x.waiting.empty() && int32_t(x.rows.size()) < p_.max_seqs) {
      const int32_t id = x.waiting.front();
      x.waiting.pop_front();
      const Request& r = requests_[size_t(id)];
      x.rows.push_back({id, r.output - 1, int64_t(r.prompt) + 1});
    }
    if (x.rows.empty()) return;
    int64_t context = 0;
    for (const auto& row : x.rows) context += row.context;
    const double ms = (p_.decode_ms + p_.decode_ms_per_row * double(x.rows.size()) +
                       p_.decode_ms_per_context_token * double(context)) *
                      decode_spread_(spread_rng_);
    x.busy = true;
    x.busy_ms += ms;
    push(now_ + ms, Kind::decode_done, d);
  }

  void decode_done(int32_t d) {
    Decoder& x = decode_[size_t(d)];
    x.busy = false;
    for (auto& row : x.rows) {
      --row.left;
      ++row.context;
      if (row.left == 0) requests_[size_t(row.request)].finish = now_;
    }
    std::erase_if(x.rows, [](const Decoder::Row& r) { return r.left == 0; });
  }

  const StepProfile& p_;
  std::vector<Request> requests_;
  std::vector<Prefiller> prefill_;
  std::vector<Decoder> decode_;
  Spread prefill_spread_, decode_spread_;
  std::mt19937_64 spread_rng_;
  std::deque<int32_t> queue_;  // arrived, prompt not done, not in a step
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  uint64_t seq_ = 0;
  double now_ = 0;
};

}  // namespace

Outcome simulate(const StepProfile& profile, const Workload& workload, const Slo& slo, const Placement& placement) {
  const double rate = workload.trace.empty() ? workload.rate : trace_rate(workload.trace);
  const StepProfile loaded = at_load(profile, rate, placement.prefill, placement.decode);
  Sim sim(loaded, workload, placement);
  sim.run();
  Outcome o;
  o.placement = placement;
  std::vector<double> ttft, tpot;
  int64_t met = 0;
  for (const Request& r : sim.requests()) {
    const double t = r.first_token - r.arrival;
    const double g = r.output > 1 ? (r.finish - r.first_token) / double(r.output - 1) : 0;
    ttft.push_back(t);
    if (r.output > 1) tpot.push_back(g);
    met += (slo.ttft_ms <= 0 || t <= slo.ttft_ms) && (slo.tpot_ms <= 0 || g <= slo.tpot_ms);
  }
  const size_t n = sim.requests().size();
  o.attainment = n ? double(met) / double(n) : 0;
  o.goodput = rate * o.attainment;
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / double(v.size());
  };
  o.ttft_mean_ms = mean(ttft);
  o.tpot_mean_ms = mean(tpot);
  o.ttft_p50_ms = percentile(ttft, 0.5);
  o.ttft_p90_ms = percentile(ttft, 0.9);
  o.tpot_p50_ms = percentile(tpot, 0.5);
  o.tpot_p90_ms = percentile(tpot, 0.9);
  const double span = std::max(sim.end(), 1e-9);
  o.prefill_busy = sim.prefill_busy_ms() / span / double(std::max(1, placement.prefill));
  o.decode_busy = sim.decode_busy_ms() / span / double(std::max(1, placement.decode));
  return o;
}

std::vector<Outcome> search(const StepProfile& profile, const Workload& workload, const Slo& slo,
                            int32_t max_stages, double prefill_cost, double decode_cost) {
  std::vector<Outcome> out;
  for (int32_t p = 1; p < max_stages; ++p)
    for (int32_t d = 1; p + d <= max_stages; ++d)
      out.push_back(simulate(profile, workload, slo, Placement{p, d, prefill_cost, decode_cost}));
  return out;
}

std::vector<Outcome> pareto_front(std::vector<Outcome> all) {
  // Simulated figures within 1 % of each other count as equal (sampling
  // noise is not a reason to pay for a dearer split).
  auto le = [](double a, double b) { return a <= b * 1.01 + 1e-12; };
  auto lt = [](double a, double b) { return a * 1.01 < b; };
  auto no_worse = [&](const Outcome& a, const Outcome& b) {  // a at least as good as b everywhere
    return le(b.goodput, a.goodput) && le(a.ttft_p90_ms, b.ttft_p90_ms) && le(a.tpot_p90_ms, b.tpot_p90_ms) &&
           a.placement.cost() <= b.placement.cost();
  };
  auto better_somewhere = [&](const Outcome& a, const Outcome& b) {
    return lt(b.goodput, a.goodput) || lt(a.ttft_p90_ms, b.ttft_p90_ms) || lt(a.tpot_p90_ms, b.tpot_p90_ms) ||
           a.placement.cost() < b.placement.cost();
  };
  std::vector<Outcome> front;
  for (const Outcome& o : all) {
    bool dominated = false;
    for (const Outcome& q : all)
      if (no_worse(q, o) && better_somewhere(q, o)) {
        dominated = true;
        break;
      }
    if (!dominated) front.push_back(o);
  }
  std::sort(front.begin(), front.end(), [](const Outcome& a, const Outcome& b) {
    if (a.goodput != b.goodput) return a.goodput > b.goodput;
    return a.placement.cost() < b.placement.cost();
  });
  return front;
}

}  // namespace cleave::planner
