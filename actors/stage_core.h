// StageCore: the plain (CAF-free) class a stage owns: one Engine and one
// Scheduler, a backlog for work the scheduler's queue cannot take yet, the
// KV keys a resumed request asks the store for, and the incremental sync of
// newly filled KV blocks. The mono topology drives it from a thread; the
// prefill, decode and colocated actors drive it from their behaviours.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/scheduler.h"
#include "model/tokenizer.h"
#include "schema/messages.h"
#include "storage/tiered_store.h"

namespace cleave {

// The stream event a requester sees for a scheduler event (token, finished
// or failed; not handoff).
msg::StreamEvent to_stream_event(const SchedulerEvent& e, const std::string& origin);

// Keys of the KV blocks a request needs to continue after `generated`
// tokens: the KV of prompt + generated minus the last token (which has not
// run yet), as Engine::block_keys() names them: the chain keys of the full
// blocks, then the key of the partly filled last block, if any; blocks that
// images overlap keyed with their spans (image_key_spans of the request).
std::vector<BlockKey> resume_kv_keys(const std::vector<int32_t>& prompt,
                                     const std::vector<int32_t>& generated,
                                     uint64_t model_fingerprint, const KvLayout& layout,
                                     std::span<const KeySpan> images = {});

// Second moments of the steps, saturating rather than wrapping.
struct StepMoments {
  uint64_t us_sq = 0, tokens_sq = 0, us_tokens = 0, rows_sq = 0, us_rows = 0;
  void add(uint64_t us, uint64_t tokens, uint64_t rows);
};

class StageCore {
 public:
  // invalid_argument / the engine's errors. tokenizer may be null. backend:
  // as Engine::create's (null: the one engine.device names).
  static Result<std::unique_ptr<StageCore>> create(std::shared_ptr<const GgufFile> file,
                                                   std::shared_ptr<const Tokenizer> tokenizer,
                                                   const EngineOptions& engine,
                                                   const SchedulerOptions& scheduler,
                                                   std::string name,
                                                   std::shared_ptr<Backend> backend = nullptr);

  const std::string& name() const { return name_; }
  Engine& engine() { return *engine_; }
  const Scheduler& scheduler() const { return *scheduler_; }

  // What submit() and resume() check first: validate_request() with this
  // engine's sizes, and check_images_encoded().
  Status check_request(const GenerateRequest& request) const;
  // Queues a request or a resumed one: check_request()'s and replay()'s
  // errors; a full scheduler queue is not an error (the work waits here).
  Status submit(GenerateRequest request);
  // first_block: see Scheduler::resume (incremental KV).
  Status resume(GenerateRequest request, std::vector<int32_t> generated,
                std::vector<BlockRecord> blocks, int32_t first_block = 0);
  // The KV in the engine's backend memory (Scheduler::resume_from_backend).
  Status resume_from_backend(GenerateRequest request, std::vector<int32_t> generated,
                             std::shared_ptr<const BackendBlocks> blocks, int32_t first_block = 0);
  // Drops the request wherever it waits or runs; no event.
  void cancel(uint64_t request_id);

  bool has_work() const { return !backlog_.empty() || !scheduler_->idle(); }
  int32_t queue_depth() const { return int32_t(backlog_.size()) + scheduler_->queued(); }
  // Feeds the backlog to the scheduler and runs one iteration.
  Status step(std::vector<SchedulerEvent>& events);

  // Sealed records of the full KV blocks the engine's sequences filled since
  // the last call (the store makes a replacement decoder recompute only what
  // it lacks, and in a KV pool other nodes read a prompt's blocks).
  std::vector<BlockRecord> take_new_blocks();
  // From now on take_new_blocks() also returns the blocks of requests that
  // finished since the last call (only for a caller that keeps calling it).
  void keep_finished_blocks();
  // A role switch (a prefill stage becoming a decoder or back): only while
  // nothing waits or runs (invalid_argument naming what does). A decoder
  // keeps its finished requests' blocks for the store; a prefill hands
  // them off and keeps none.
  Status set_prefill_only(bool on);

  // Keys the store is asked for when resuming (see resume_kv_keys).
  std::vector<BlockKey> resume_keys(const GenerateRequest& request,
                                    const std::vector<int32_t>& generated) const;

  // Scheduler and engine counters, plus the ones the caller adds.
  msg::Stats stats() const;

 private:
  struct Work {
    GenerateRequest request;
    bool resume = false;
    std::vector<int32_t> generated;
    std::vector<BlockRecord> blocks;
    int32_t first_block = 0;
    std::shared_ptr<const BackendBlocks> backend_blocks;  // instead of blocks
  };
  StageCore() = default;
  Status queue_resume(Work work);
  // The scheduler's resume() for queued work (busy when its queue is full).
  Status resume_now(const Work& work);
  void push_backlog(Work work);
  // Feeds queued work to the scheduler until it answers busy.
  void drain_backlog(std::vector<SchedulerEvent>& events);
  // Appends the records of seq's full blocks not yet taken.
  void collect_new_blocks(int32_t seq, std::vector<BlockRecord>& out);

  std::string name_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Scheduler> scheduler_;
  std::deque<Work> backlog_;
  SyncTracker synced_;
  std::vector<BlockRecord> finished_blocks_;  // of sequences closed since take_new_blocks
  uint64_t blocks_exported_ = 0;
  uint64_t step_us_ = 0;  // wall time of scheduler steps
  // Sums over the steps of x^2, u^2 and x u (x a step's us, u its prompt
  // tokens or decode rows): with the sums above they give the spread of
  // the steps around a linear cost (planner: calibrate's step_cv).
  StepMoments moments_;
};

}  // namespace cleave
