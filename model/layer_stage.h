// Pipeline parallelism in the engine: a model cut into stages that each
// hold a contiguous range of layers. The first stage is an Engine (the
// embeddings, its layers, the sequences, the block pool and prefix cache);
// the stages after it are LayerStages, which hold their layers' weights
// and their layers' KV for the same block ids, and run what the first
// stage sends them. A StageLink is how the Engine reaches the stages after
// its own range: forward() passes each micro-batch of rows (positions,
// block tables, hidden states) into it and gets the logits of the rows
// that need them back from the last stage; KV export and import gather
// and scatter the later layers' slices of each block through it.
//
//   LayerStage          one stage's layers over its own paged KV
//   StageLink           the Engine's view of the stages after it
//   ThreadedStageLink   stages in this process, one thread each, micro-
//                       batches flowing from one to the next (the actor
//                       and socket links live in actors/)
//
// Every row's bits depend only on that row and the KV before it, so the
// tokens and logits of any cut and any micro-batch count are those of the
// whole model in one engine.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/backend_buffer.h"
#include "model/gguf.h"
#include "model/layer_compute.h"
#include "model/llama.h"

namespace cleave {

// One micro-batch for the stages after the first: n rows with their
// positions and block tables, the hidden states after the layers before
// (n x dim), and the rows whose logits the last stage returns.
struct StageRows {
  int64_t n = 0;
  const int32_t* positions = nullptr;
  const AttnRow* rows = nullptr;  // block tables in the first stage's ids
  const float* x = nullptr;
  std::vector<int32_t> logit_rows;  // ascending, in [0, n)
};

// A micro-batch as plain data (what crosses a message or a socket): each
// row's table is one of `tables`.
struct StageBatchData {
  std::vector<int32_t> positions, row_table;  // per row
  std::vector<std::vector<int32_t>> tables;
  std::vector<int32_t> logit_rows;
  std::vector<float> x;  // rows x dim
};
// The rows' data, each distinct block table once.
StageBatchData to_batch_data(const StageRows& rows, int32_t dim);

class StageLink {
 public:
  virtual ~StageLink() = default;
  // The first layer after the Engine's own (its range ends just before).
  virtual int32_t first_layer() const = 0;
  // Hands one micro-batch on (the rows' data is copied or sent before it
  // returns) and returns at once; finish() writes logit_rows.size() x
  // n_vocab logits. Tickets finish in the order they started. An error
  // (a stage gone, a bad answer) means the later layers' KV of the rows is
  // unknown: the Engine stops using the link.
  virtual Result<uint64_t> start(const StageRows& rows) = 0;
  virtual Status finish(uint64_t ticket, float* logits) = 0;
  // The later layers' KV: copy block src to dst (copy-on-write), read or
  // write the slices of blocks `ids` (ids.size() x slice bytes, in order).
  virtual Status copy_block(int32_t src, int32_t dst) = 0;
  virtual Status read_blocks(std::span<const int32_t> ids, uint8_t* out) = 0;
  virtual Status write_blocks(std::span<const int32_t> ids, const uint8_t* in) = 0;
  // Counters for the first stage's stats ("pipeline_...", per stage).
  virtual std::vector<std::pair<std::string, uint64_t>> counters() const { return {}; }
};

class LayerStage {
 public:
  // Binds the model's tensors (views into the mapped file: the stage
  // reads only its layers' pages, and the output head's when it is last)
  // and allocates the KV of its layers for kv_blocks blocks of block_size
  // tokens (the first stage's pool: block ids are the same). invalid_argument
  // for a range outside the model, one that starts at layer 0 (the first
  // stage is an Engine) or bad sizes; out_of_memory for the KV. `compute`
  // must be the first stage's (its fingerprint says which: a link between
  // stages of different computes is refused). device: as EngineOptions'
  // ("cpu", "cuda:N"); on a device the stage's weights go up once, its KV
  // and activations live there, and per micro-batch the rows' positions,
  // block tables and hidden states go up and its output (hidden states, or
  // the logits rows) comes down. backend: that backend instead (device must
  // be "cpu" then): the seam tests use (tests/fenced_backend.h).
  static Result<std::unique_ptr<LayerStage>> create(std::shared_ptr<const GgufFile> file,
                                                    LayerRange layers, int32_t kv_blocks,
                                                    int32_t block_size, int32_t threads,
                                                    DType cache_type_k = DType::F32,
                                                    DType cache_type_v = DType::F32,
                                                    Compute compute = Compute::exact,
                                                    const std::string& device = "cpu",
                                                    std::shared_ptr<Backend> backend = nullptr);
  ~LayerStage();

  LayerRange layers() const { return layers_; }
  bool last() const { return layers_.last == model_->config().n_layers - 1; }
  const LlamaConfig& config() const { return model_->config(); }
  int32_t kv_blocks() const { return kv_.n_blocks; }
  int32_t block_size() const { return kv_.block_size; }
  // Bytes of one block's slice (its layers).
  size_t slice_bytes() const { return kv_.block_bytes(); }
  uint64_t model_fingerprint() const { return model_fp_; }

  // The micro-batch through its layers: out is the hidden states (rows x
  // dim) for the next stage, or, on the last stage, the logits of
  // logit_rows (x n_vocab; earlier stages pass logit_rows on). invalid_argument naming the problem for a
  // batch that does not fit (block ids past the pool, a position its table
  // does not reach, sizes); nothing is written then.
  Status run(const StageBatchData& batch, std::vector<float>& out);
  Status copy_block(int32_t src, int32_t dst);
  Status read_blocks(std::span<const int32_t> ids, uint8_t* out) const;
  Status write_blocks(std::span<const int32_t> ids, const uint8_t* in);

  struct Stats {
    uint64_t batches = 0, rows = 0, busy_ns = 0;
  };
  Stats stats() const;

 private:
  LayerStage() = default;
  Status check(std::span<const int32_t> ids) const;
  Status run_on_device(const StageBatchData& batch, std::vector<float>& out);

  std::unique_ptr<LlamaModel> model_;
  std::shared_ptr<Backend> backend_;
  bool host_ = true;  // backend_'s memory is the host's
  std::unique_ptr<WeightCopies> weights_;  // on a device: its layers' weights
  std::unique_ptr<LayerCompute> compute_;
  LayerRange layers_;
  uint64_t model_fp_ = 0;
  PagedKv kv_;
  mutable std::mutex mu_;  // stats_
  Stats stats_;
  std::vector<AttnRow> rows_;
  std::vector<float> x_;
  // On a device: the micro-batch's tables, rows, positions, hidden states
  // and logits in its memory.
  std::vector<int32_t> tables_;
  std::unique_ptr<BackendBuffer<int32_t>> tables_dev_, pos_dev_;
  std::unique_ptr<BackendBuffer<AttnRow>> rows_dev_;
  std::unique_ptr<BackendBuffer<float>> x_dev_, out_dev_;
};

// Stages in this process on threads of their own: a micro-batch goes to
// the first stage's queue; each stage runs it and queues its output to the
// next; the last stage's logits wait for finish(). While stage 2 runs one
// micro-batch the Engine runs the next, so m micro-batches keep every
// stage busy for m / (m + stages - 1) of a forward pass.
class ThreadedStageLink final : public StageLink {
 public:
  // stages: contiguous, starting right after the Engine's range and
  // ending at the model's last layer (invalid_argument otherwise).
  static Result<std::unique_ptr<ThreadedStageLink>> create(
      std::vector<std::shared_ptr<LayerStage>> stages);
  ~ThreadedStageLink() override;

  int32_t first_layer() const override;
  Result<uint64_t> start(const StageRows& rows) override;
  Status finish(uint64_t ticket, float* logits) override;
  Status copy_block(int32_t src, int32_t dst) override;
  Status read_blocks(std::span<const int32_t> ids, uint8_t* out) override;
  Status write_blocks(std::span<const int32_t> ids, const uint8_t* in) override;
  std::vector<std::pair<std::string, uint64_t>> counters() const override;

 private:
  ThreadedStageLink() = default;
  struct Job {
    uint64_t ticket = 0;
    StageBatchData batch;
    Status status;
    std::vector<float> out;
  };
  struct Lane {  // one stage's thread and queue
    std::shared_ptr<LayerStage> stage;
    std::deque<std::shared_ptr<Job>> queue;
    std::thread thread;
  };
  void lane_loop(size_t i);
  // Every queue empty: the KV calls run between micro-batches.
  void wait_idle();

  std::vector<Lane> lanes_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  int32_t busy_ = 0;  // lanes running a job
  uint64_t next_ticket_ = 1;
  std::deque<std::shared_ptr<Job>> started_, done_;
  int32_t n_vocab_ = 0;
};

}  // namespace cleave
