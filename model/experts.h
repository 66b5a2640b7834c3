// The FFN of each layer as experts that need not run where attention runs
// (attention/FFN disaggregation). A MoE layer has n_experts experts; a dense
// layer has one, its FFN (expert 0). Expert e of layer l computes
// down(silu(gate(x)) * up(x)) for the rows dispatched to it.
//
// The engine routes (gate, softmax, top-k, renormalisation), gathers each
// expert's rows, hands one layer's work to an ExpertExecutor and combines
// the outputs in its own order. The kernels are batch invariant, so a row's
// expert output has the same bits whichever host computes it and whatever
// rows come with it: any placement of experts, with or without replicas,
// gives the monolithic engine's tokens and logits.
//
//   ExpertSet     which experts of which layers one host holds
//   ExpertHost    computes the experts of its set (own backend and scratch)
//   ExpertPool    an executor over hosts: each piece of work goes to the
//                 least loaded live host holding its expert, hosts run in
//                 parallel; an expert no live host holds is computed from
//                 the model file by the pool itself (slower, same bits)
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/backend_buffer.h"
#include "model/expert_balance.h"
#include "model/expert_set.h"
#include "model/gguf.h"
#include "model/llama.h"

namespace cleave {

// One expert's rows of one layer: x is rows x dim, y receives rows x dim.
struct ExpertWork {
  int32_t expert = 0;
  int64_t rows = 0;
  const float* x = nullptr;
  float* y = nullptr;
};

// Computes every piece of one layer's work. It must not fail: an executor
// that cannot reach an expert's host computes the expert some other way,
// since the engine is inside a forward pass (KV already written).
class ExpertExecutor {
 public:
  virtual ~ExpertExecutor() = default;
  virtual void run(int32_t layer, std::span<const ExpertWork> work) = 0;
  // Split form for micro-batch ping-pong: start() hands one layer's work
  // to wherever it is computed and returns at once when that is elsewhere;
  // finish() returns when every y of it is written. Tickets finish in the
  // order they started; the work's buffers stay valid until then. The
  // default computes at start().
  virtual uint64_t start(int32_t layer, std::span<const ExpertWork> work) {
    run(layer, work);
    return 0;
  }
  virtual void finish(uint64_t ticket) { (void)ticket; }
  // Counters for the stats of whoever runs the engine ("expert_rows", ...).
  virtual std::vector<std::pair<std::string, uint64_t>> counters() const { return {}; }
};

// expert_routed_rows_L_E = rows[L * per_layer + E] for each nonzero entry:
// the per-(layer, expert) routing counts in an executor's counters.
void append_routed_counters(std::vector<std::pair<std::string, uint64_t>>& out,
                            const std::vector<uint64_t>& rows, int32_t per_layer);
// busy_us_L_E = busy_ns[L * per_layer + E] / 1000 for each nonzero entry: an
// expert host's compute time per (layer, expert).
void append_expert_busy_counters(std::vector<std::pair<std::string, uint64_t>>& out,
                                 const std::vector<uint64_t>& busy_ns, int32_t per_layer);

// The last 4096 durations of one layer's expert work, for percentiles
// (not thread-safe: its owner serialises).
class LayerTimes {
 public:
  void add(uint64_t ns);
  uint64_t percentile_us(double p) const;  // 0 when empty
 private:
  std::vector<uint64_t> ring_;
  size_t next_ = 0;
};

// y = down(silu(gate x) * up x) of expert `expert` of layer l (the dense
// FFN for a dense layer); g and u are scratch, grown as needed.
void compute_expert(Backend& be, const LlamaLayer& l, int64_t ffn, int32_t expert, const float* x,
                    int64_t rows, std::vector<float>& g, std::vector<float>& u, float* y);
// The same with scratch g and u of rows x ffn floats each in the backend's
// memory (as x and y are).
void compute_expert(Backend& be, const LlamaLayer& l, int64_t ffn, int32_t expert, const float* x,
                    int64_t rows, float* g, float* u, float* y);
// Every piece of `work` (experts of layer l) as compute_expert computes it,
// with the same bits, as three backend ops: all gate and up matmuls in one
// group, one silu_mul, all down matmuls in one group. g and u hold the
// pieces' rows x ffn one after another (total rows x ffn floats each).
void compute_experts(Backend& be, const LlamaLayer& l, int64_t ffn, std::span<const ExpertWork> work,
                     float* g, float* u);

class ExpertHost {
 public:
  // Binds the model's tensors (views into the mapped file: the host reads
  // only its experts' pages) and makes a backend of `threads` on `device`
  // ("cpu", "cuda:N") computing as `compute` says (the engines' it serves,
  // or their tokens change). On a device its experts' weights go up now
  // (one it computes besides, a replica or a fallback's, on first use), and
  // each piece of work's rows go up and its results come down. backend:
  // that backend instead (device "cpu" then): the tests' seam.
  static Result<std::unique_ptr<ExpertHost>> create(std::shared_ptr<const GgufFile> file,
                                                    ExpertSet set, int32_t threads,
                                                    Compute compute = Compute::exact,
                                                    const std::string& device = "cpu",
                                                    std::shared_ptr<Backend> backend = nullptr);

  const ExpertSet& set() const { return set_; }
  const LlamaConfig& config() const { return model_->config(); }
  // Its set, plus the replicas added since.
  bool holds(int32_t layer, int32_t expert) const;
  // invalid_argument naming the expert when it is not held.
  Status require(int32_t layer, int32_t expert) const;
  // Holds expert `expert` of `layer` from now on too (a replica: the host
  // maps the whole model, so this only widens what it accepts).
  // invalid_argument for an expert or layer the model lacks.
  Status add_expert(int32_t layer, int32_t expert);
  // invalid_argument naming the expert when one piece is not held (nothing
  // is computed then). One call at a time per host (serialised).
  Status compute(int32_t layer, std::span<const ExpertWork> work);

  struct Stats {
    uint64_t calls = 0, rows = 0, busy_ns = 0;
    // Time computing each expert: [layer * experts_per_layer + expert]
    // (empty before the first compute).
    std::vector<uint64_t> expert_busy_ns;
  };
  Stats stats() const;
  ~ExpertHost();

 private:
  ExpertHost() = default;
  // On a device: the expert's weights there (under mu_).
  Status ensure_uploaded(int32_t layer, int32_t expert);
  std::unique_ptr<LlamaModel> model_;
  std::shared_ptr<Backend> backend_;
  bool host_ = true;
  std::unique_ptr<WeightCopies> weights_;            // on a device: the experts uploaded
  std::vector<std::pair<int32_t, int32_t>> uploaded_;  // their (layer, expert)
  std::unique_ptr<BackendBuffer<float>> x_dev_, y_dev_, g_dev_, u_dev_;
  ExpertSet set_;
  mutable std::mutex added_mu_;
  std::vector<std::pair<int32_t, int32_t>> added_;  // (layer, expert) replicas
  mutable std::mutex mu_;
  std::vector<float> g_, u_;
  Stats stats_;
};

class ExpertPool final : public ExpertExecutor {
 public:
  // The pool's own fallback computes any expert from `file` on `threads`.
  // device: where its hosts (and the fallback) compute (ExpertHost::create).
  static Result<std::unique_ptr<ExpertPool>> create(std::shared_ptr<const GgufFile> file,
                                                    int32_t threads,
                                                    Compute compute = Compute::exact,
                                                    const std::string& device = "cpu");
  // A pool with one host per set: each set validated, then their coverage
  // of every expert (check_expert_coverage's not_found).
  static Result<std::unique_ptr<ExpertPool>> create(std::shared_ptr<const GgufFile> file,
                                                    const std::vector<ExpertSet>& sets, int32_t threads,
                                                    Compute compute = Compute::exact,
                                                    const std::string& device = "cpu");
  ~ExpertPool() override;

  // A host of this model; returns its index. Hosts start alive.
  int32_t add_host(std::shared_ptr<ExpertHost> host);
  int32_t n_hosts() const;
  // A host that is not alive gets no work (its experts go to replicas, else
  // to the fallback) until it is alive again.
  void set_alive(int32_t host, bool alive);
  // Hot-expert replication (model/expert_balance.h): every `window` layer
  // runs the policy looks at the rows of that window and may add one
  // replica to a host. Off by default.
  void set_replication(const ReplicationPolicy& policy, int32_t window);

  // One engine per pool: run() or start()/finish() from its thread only.
  void run(int32_t layer, std::span<const ExpertWork> work) override;
  uint64_t start(int32_t layer, std::span<const ExpertWork> work) override;
  void finish(uint64_t ticket) override;
  // expert_rows (dispatched to hosts), expert_fallback_rows, expert_layers,
  // expert_layer_us (the wall time of run(), summed) and its p50 / p99 over
  // the last 4096 layers (expert_layer_p50_us, expert_layer_p99_us).
  std::vector<std::pair<std::string, uint64_t>> counters() const override;

  struct Stats {
    std::vector<uint64_t> host_rows;      // rows dispatched to each host
    uint64_t fallback_rows = 0;           // rows no live host held
    uint64_t replicas_added = 0;          // by the replication policy
    // rows routed to each expert: [layer * experts_per_layer + expert]
    std::vector<uint64_t> expert_rows;
  };
  Stats stats() const;

 private:
  ExpertPool() = default;
  class Worker;  // a host's persistent thread (experts.cpp)
  struct Host {
    std::shared_ptr<ExpertHost> host;
    bool alive = true;
    uint64_t rows = 0;
    std::shared_ptr<Worker> worker;
  };
  // The least loaded live host holding (layer, expert), or -1.
  int32_t pick(int32_t layer, int32_t expert) const;
  // One started layer: each host's share (posted to its worker as job
  // `job`), the fallback's rest.
  struct Pending {
    uint64_t ticket = 0;
    int32_t layer = 0;
    std::chrono::steady_clock::time_point t0;
    std::vector<std::vector<ExpertWork>> share;
    std::vector<ExpertWork> rest;
    std::vector<std::shared_ptr<ExpertHost>> hosts;
    std::vector<std::shared_ptr<Worker>> workers;
    std::vector<uint64_t> jobs;
    std::shared_ptr<std::vector<Status>> results;  // written by the workers
  };
  std::deque<Pending> pending_;  // engine thread only
  uint64_t next_ticket_ = 1;

  std::unique_ptr<ExpertHost> fallback_;
  mutable std::mutex mu_;  // hosts_' alive flags and counters, stats
  std::vector<Host> hosts_;
  uint64_t fallback_rows_ = 0, layers_ = 0, layer_ns_ = 0;
  LayerTimes layer_times_;
  std::vector<uint64_t> expert_rows_;
  // Replication: the policy, its window and the rows seen in it.
  std::optional<ReplicationPolicy> replication_;
  int32_t window_ = 0, window_runs_ = 0;
  std::vector<uint64_t> window_host_rows_, window_expert_rows_;
  uint64_t replicas_added_ = 0;
  void maybe_replicate();  // under mu_
};

}  // namespace cleave
