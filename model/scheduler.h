// Continuous batching over one Engine with iteration-level scheduling (Orca,
// vLLM): every step() builds one forward batch from all running sequences:
// first one decode row for each sequence that is generating, then prefill
// chunks of sequences that still have prompt (or recompute) tokens to feed,
// up to a token budget. Requests join and leave between steps, so batch
// sizes change all the time; batch-invariant kernels and RequestProgress
// keep every request's tokens and logits independent of that.
//
// The same class runs the colocated topology (prefill and decode in one
// place), the decode side of P/D (resume() a request whose KV arrives as
// records) and, with prefill_only, the prefill side (each request stops after
// its first token and is handed off with its KV).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "model/engine.h"
#include "model/request.h"
#include "model/scheduling_policy.h"
#include "storage/block.h"

namespace cleave {

struct SchedulerOptions {
  int32_t max_batch_tokens = 256;  // tokens per forward: decode rows first, then prefill chunks
  int32_t max_queue = 256;         // requests waiting for a sequence slot; beyond: busy
  bool prefill_only = false;       // hand each request off after its first token
  SchedulingPolicy policy = SchedulingPolicy::fcfs;
};

// invalid_argument naming the field: max_batch_tokens < 1, max_queue < 0.
Status validate_scheduler_options(const SchedulerOptions& options);

struct SchedulerEvent {
  enum class Kind { token, finished, handoff, failed };
  Kind kind = Kind::token;
  uint64_t request_id = 0;
  // token: the new token, its index in the generated tokens, and the text
  // that became safe to show with it (may be empty).
  int32_t token = -1;
  int32_t index = 0;
  std::string text;
  uint64_t logits_hash = 0;  // token: XXH3-64 of the logits row it was sampled from
  bool has_logprobs = false; // token: when the request asked for logprobs
  LogprobEntry logprobs;
  int32_t cached_tokens = 0; // the first token: prompt tokens taken from the prefix cache
  // finished: "length", "stop" or "context"; the final logits row when the
  // request asked for keep_logits; text holds any text not sent yet (in
  // practice empty: the last token event carries the flushed tail).
  std::string finish_reason;
  std::vector<float> logits;
  // failed: why (the request is gone).
  Status error;
  // handoff (prefill_only): everything needed to continue elsewhere with
  // resume(): the request, the tokens generated so far, and the KV of the
  // first n_kv_tokens tokens of prompt + generated: sealed records, or on a
  // device engine that holds every layer (Engine::kv_in_backend) blocks
  // left in its backend memory (backend_blocks; blocks is empty then), for
  // a device-to-device move, unless the device has no room for that copy.
  GenerateRequest request;
  std::vector<int32_t> generated;
  std::vector<BlockRecord> blocks;
  std::shared_ptr<const BackendBlocks> backend_blocks;
  int32_t n_kv_tokens = 0;
};

struct SchedulerCounters {
  uint64_t submitted = 0, finished = 0, failed = 0, rejected_busy = 0;
  uint64_t steps = 0, batch_tokens = 0, decode_rows = 0, prefill_tokens = 0;
  uint64_t prefix_hit_tokens = 0;   // prompt tokens reused from the prefix cache
  uint64_t imported_tokens = 0;     // tokens whose KV came in through resume()
  uint64_t recomputed_tokens = 0;   // resume()d tokens whose KV had to be recomputed
  uint64_t preempted = 0;           // sequences released for KV room (recomputed later)
  uint64_t preempted_for_priority = 0;  // of those: for a queued request of a lower value
  uint64_t handed_off = 0;          // prefill_only requests handed off after their first token
};

class Scheduler {
 public:
  // engine and tokenizer (may be null) must outlive the scheduler; the
  // scheduler owns every engine sequence while it lives. options must pass
  // validate_scheduler_options() (checked: aborts otherwise).
  Scheduler(Engine& engine, const Tokenizer* tokenizer, SchedulerOptions options = {});
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. validate_request()'s errors (with the engine's n_embd),
  // check_images_encoded()'s and check_priority_allowed()'s; invalid_argument
  // for a request id already queued or running; busy when max_queue requests
  // wait. Image positions
  // are fed from the request's embeddings in every prefill chunk, also when
  // a preempted request recomputes and in resume().
  Status submit(GenerateRequest request);
  // Continues a request begun elsewhere: `generated` tokens were already
  // produced (the first one by a prefill actor, or more by a decode actor
  // that died), and `blocks` hold KV for leading tokens of prompt +
  // generated (possibly none, or fewer than all: what the store had). The
  // leading records that verify and match those tokens are imported, the
  // rest is recomputed, and decoding goes on where it stopped, with the
  // tokens and logits an uninterrupted run would give. Token events go on
  // from index generated.size(); the text of `generated` is not sent again.
  // A request that can use no record falls back to the prefix cache.
  // Incremental: with first_block k > 0, blocks hold KV from block k on and
  // the first k blocks come from this engine's prefix cache (whatever it
  // lost meanwhile is recomputed). Errors as submit(), plus replay()'s.
  Status resume(GenerateRequest request, std::vector<int32_t> generated,
                std::vector<BlockRecord> blocks, int32_t first_block = 0);
  // resume() with the KV in this engine's backend memory (a device
  // decoder's, fetched there from a device prefill): imported by the backend
  // (Engine::import_blocks_from), never through the host; the memory is let
  // go once admitted. invalid_argument for blocks of another backend.
  Status resume_from_backend(GenerateRequest request, std::vector<int32_t> generated,
                             std::shared_ptr<const BackendBlocks> blocks, int32_t first_block = 0);
  // Drops a queued or running request (no event). not_found when unknown.
  Status cancel(uint64_t request_id);

  // One iteration: admits queued requests that fit (sequence slot and KV
  // blocks for their whole history, beyond what running requests still need
  // plus one block each to grow) in the policy's order, runs one forward
  // batch, samples, and appends the events it produced. When decode rows
  // find no free block, the last running request in that order is preempted
  // (requeued in its place; it recomputes later with the same tokens); under
  // the priority policy a queued request that does not fit preempts running
  // ones of a higher value the same way. A request that fails (e.g. it can never fit) gets a failed
  // event; step() itself fails only on an engine error that leaves the
  // batch's state unknown (then every running request was failed too).
  Status step(std::vector<SchedulerEvent>& events);

  // Called with a finishing request's engine sequence just before it is
  // closed (its KV still there): a stage saves the blocks it filled last.
  void set_finish_hook(std::function<void(int32_t seq)> hook) { finish_hook_ = std::move(hook); }

  bool idle() const { return queue_.empty() && running_.empty(); }
  // A stage switching between prefill and decode: only while idle.
  void set_prefill_only(bool on) { options_.prefill_only = on; }
  int32_t queued() const { return int32_t(queue_.size()); }
  int32_t running() const { return int32_t(running_.size()); }
  bool has(uint64_t request_id) const;
  const SchedulerCounters& counters() const { return counters_; }
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Entry;
  using EntryPtr = std::unique_ptr<Entry>;
  Status enqueue(EntryPtr entry);
  // A resume()d entry before its KV: the request checked, generated replayed.
  Result<EntryPtr> resumed_entry(GenerateRequest request, const std::vector<int32_t>& generated,
                                 int32_t first_block);
  Status check_new(const GenerateRequest& request) const;
  void admit(std::vector<SchedulerEvent>& events);
  bool attach_kv(Entry& e);
  struct Row {
    Entry* entry;
    int32_t n_tokens;
  };
  std::vector<Row> plan_batch(std::vector<SchedulerEvent>& events);
  bool before(const Entry& a, const Entry& b) const;  // the policy's order
  void requeue(EntryPtr entry);
  void preempt_last();
  bool preempt_for(const Entry& waiting);
  void fail(Entry& e, Status why, std::vector<SchedulerEvent>& events);
  void finish(Entry& e, std::vector<SchedulerEvent>& events);
  void handoff(Entry& e, std::vector<SchedulerEvent>& events);
  void release(Entry& e);
  void drop_done();

  Engine& engine_;
  const Tokenizer* tokenizer_;
  SchedulerOptions options_;
  std::deque<std::unique_ptr<Entry>> queue_;
  std::vector<std::unique_ptr<Entry>> running_;
  SchedulerCounters counters_;
  std::function<void(int32_t seq)> finish_hook_;
  std::vector<float> logits_;
  std::vector<std::vector<float>> image_scratch_;  // per batch row, when its image rows need a copy
  uint64_t next_arrival_ = 0;  // with the policy, orders both lists: the last is preempted first
};

}  // namespace cleave
