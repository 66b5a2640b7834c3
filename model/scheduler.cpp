#include "model/scheduler.h"

#include <algorithm>

namespace cleave {

Status validate_scheduler_options(const SchedulerOptions& o) {
  if (o.max_batch_tokens < 1)
    return Status(Code::invalid_argument, "scheduler: max_batch_tokens = " +
                                              std::to_string(o.max_batch_tokens) +
                                              " must be positive");
  if (o.max_queue < 0)
    return Status(Code::invalid_argument,
                  "scheduler: max_queue = " + std::to_string(o.max_queue) + " must not be negative");
  return Status::Ok();
}

struct Scheduler::Entry {
  explicit Entry(RequestProgress p) : progress(std::move(p)) {}
  RequestProgress progress;
  uint64_t arrival = 0;
  int32_t seq = -1;  // engine sequence while running
  int32_t fed = 0;   // tokens of progress.history() the sequence holds
  bool resumed = false;
  std::vector<BlockRecord> records;  // resume(): KV to import at admission
  std::shared_ptr<const BackendBlocks> backend_records;  // or that KV in the engine's backend memory
  int32_t records_first_block = 0;   // the block records[0] holds (the ones before: cached here)
  int32_t imported = 0;              // tokens of fed that came from records
  bool done = false;                 // left running_ during this step
  int32_t cached = 0;                // prompt tokens the first admission took from the prefix cache

  int32_t remaining() const { return int32_t(progress.history().size()) - fed; }
};

Scheduler::Scheduler(Engine& engine, const Tokenizer* tokenizer, SchedulerOptions options)
    : engine_(engine), tokenizer_(tokenizer), options_(options) {
  CLEAVE_CHECK(validate_scheduler_options(options_).ok());
}

Scheduler::~Scheduler() {
  for (auto& e : running_) engine_.close_sequence(e->seq);
}

bool Scheduler::has(uint64_t request_id) const {
  auto is = [&](const EntryPtr& e) { return e->progress.id() == request_id; };
  return std::any_of(queue_.begin(), queue_.end(), is) ||
         std::any_of(running_.begin(), running_.end(), is);
}

Status Scheduler::check_new(const GenerateRequest& request) const {
  CLEAVE_RETURN_IF_ERROR(validate_request(request, engine_.context(), engine_.config().n_vocab,
                                          engine_.config().dim));
  CLEAVE_RETURN_IF_ERROR(check_images_encoded(request));
  CLEAVE_RETURN_IF_ERROR(check_priority_allowed(request, options_.policy));
  if (has(request.request_id))
    return Status(Code::invalid_argument, "scheduler: request " +
                                              std::to_string(request.request_id) +
                                              " is already queued or running");
  return Status::Ok();
}

Status Scheduler::enqueue(EntryPtr entry) {
  if (int32_t(queue_.size()) >= options_.max_queue) {
    ++counters_.rejected_busy;
    return Status(Code::busy, "scheduler: " + std::to_string(queue_.size()) +
                                  " requests are already waiting (max_queue)");
  }
  entry->arrival = next_arrival_++;
  requeue(std::move(entry));
  ++counters_.submitted;
  return Status::Ok();
}

bool Scheduler::before(const Entry& a, const Entry& b) const {
  if (options_.policy == SchedulingPolicy::priority && a.progress.request().priority != b.progress.request().priority)
    return a.progress.request().priority < b.progress.request().priority;
  return a.arrival < b.arrival;
}

// Into the queue at its place in the policy's order (after equals).
void Scheduler::requeue(EntryPtr entry) {
  auto at = std::upper_bound(queue_.begin(), queue_.end(), entry,
                             [&](const EntryPtr& a, const EntryPtr& b) { return before(*a, *b); });
  queue_.insert(at, std::move(entry));
}

Status Scheduler::submit(GenerateRequest request) {
  CLEAVE_RETURN_IF_ERROR(check_new(request));
  const int32_t context = engine_.context(), n_vocab = engine_.config().n_vocab;
  return enqueue(std::make_unique<Entry>(
      RequestProgress(std::move(request), tokenizer_, context, n_vocab)));
}

Status Scheduler::resume(GenerateRequest request, std::vector<int32_t> generated,
                         std::vector<BlockRecord> blocks, int32_t first_block) {
  auto entry = resumed_entry(std::move(request), generated, first_block);
  if (!entry.ok()) return entry.status();
  (*entry)->records = std::move(blocks);
  return enqueue(std::move(entry.value()));
}

Status Scheduler::resume_from_backend(GenerateRequest request, std::vector<int32_t> generated,
                                      std::shared_ptr<const BackendBlocks> blocks, int32_t first_block) {
  if (blocks && &blocks->backend() != &engine_.backend())
    return Status(Code::invalid_argument, "scheduler: resume blocks are in another backend's memory");
  auto entry = resumed_entry(std::move(request), generated, first_block);
  if (!entry.ok()) return entry.status();
  if (blocks && blocks->size() > 0) (*entry)->backend_records = std::move(blocks);
  return enqueue(std::move(entry.value()));
}

Result<Scheduler::EntryPtr> Scheduler::resumed_entry(GenerateRequest request, const std::vector<int32_t>& generated,
                                                     int32_t first_block) {
  if (first_block < 0)
    return Status(Code::invalid_argument,
                  "scheduler: resume records start at block " + std::to_string(first_block));
  CLEAVE_RETURN_IF_ERROR(check_new(request));
  const int32_t context = engine_.context(), n_vocab = engine_.config().n_vocab;
  auto entry = std::make_unique<Entry>(
      RequestProgress(std::move(request), tokenizer_, context, n_vocab));
  CLEAVE_RETURN_IF_ERROR(entry->progress.replay(generated));
  entry->progress.take_text();  // shown by whoever produced those tokens
  entry->resumed = true;
  entry->records_first_block = first_block;
  return entry;
}

Status Scheduler::cancel(uint64_t request_id) {
  auto is = [&](const EntryPtr& e) { return e->progress.id() == request_id; };
  auto q = std::find_if(queue_.begin(), queue_.end(), is);
  if (q != queue_.end()) {
    queue_.erase(q);
    return Status::Ok();
  }
  auto r = std::find_if(running_.begin(), running_.end(), is);
  if (r == running_.end())
    return Status(Code::not_found,
                  "scheduler: request " + std::to_string(request_id) + " is not queued or running");
  engine_.close_sequence((*r)->seq);
  running_.erase(r);
  return Status::Ok();
}

void Scheduler::release(Entry& e) {
  engine_.close_sequence(e.seq);
  e.seq = -1;
  e.fed = 0;
  e.done = true;
}

void Scheduler::drop_done() {
  std::erase_if(running_, [](const EntryPtr& e) { return e->done; });
}

void Scheduler::fail(Entry& e, Status why, std::vector<SchedulerEvent>& events) {
  SchedulerEvent ev;
  ev.kind = SchedulerEvent::Kind::failed;
  ev.request_id = e.progress.id();
  ev.error = std::move(why);
  events.push_back(std::move(ev));
  ++counters_.failed;
  release(e);
}

void Scheduler::finish(Entry& e, std::vector<SchedulerEvent>& events) {
  SchedulerEvent ev;
  ev.kind = SchedulerEvent::Kind::finished;
  ev.request_id = e.progress.id();
  ev.index = e.progress.n_generated();
  ev.text = e.progress.take_text();
  ev.finish_reason = e.progress.finish_reason();
  if (e.progress.request().keep_logits) ev.logits = e.progress.last_logits();
  events.push_back(std::move(ev));
  ++counters_.finished;
  if (finish_hook_) finish_hook_(e.seq);
  release(e);
}

void Scheduler::handoff(Entry& e, std::vector<SchedulerEvent>& events) {
  SchedulerEvent ev;
  if (engine_.kv_in_backend()) {  // left where it is, for a device-to-device move
    auto blocks = engine_.export_backend_blocks(e.seq);
    if (blocks.ok()) ev.backend_blocks = std::move(*blocks);
    // A device without room for the copy (hand-offs not pulled yet hold
    // theirs): as records through the host instead, never a failed request.
    else if (blocks.status().code() != Code::out_of_memory) return fail(e, blocks.status(), events);
  }
  if (!ev.backend_blocks) {
    auto blocks = engine_.export_blocks(e.seq);
    if (!blocks.ok()) return fail(e, blocks.status(), events);
    ev.blocks = std::move(*blocks);
  }
  ev.kind = SchedulerEvent::Kind::handoff;
  ev.request_id = e.progress.id();
  ev.index = e.progress.n_generated();
  ev.request = e.progress.request();
  ev.generated = e.progress.generated();
  ev.n_kv_tokens = e.fed;  // the newest token has no KV yet
  events.push_back(std::move(ev));
  ++counters_.handed_off;
  release(e);
}

// Puts KV into e's fresh, empty sequence: the longest leading run of resume()
// records that imports cleanly, else the longest cached prefix. The last
// history token is always left to run (its logits give the next token).
// False when the pool has no room for it now.
//
// Records that start after block 0 continue a prefix this engine caches (the
// sender skipped what the receiver said it held): the cached prefix is
// attached first and the records go after it. When the cache lost part of
// that prefix meanwhile, the gap and everything after it is recomputed.
bool Scheduler::attach_kv(Entry& e) {
  const std::vector<int32_t>& history = e.progress.history();
  const int32_t limit = int32_t(history.size()) - 1;
  const int32_t bs = engine_.kv_layout().tokens_per_block;
  e.imported = 0;
  int32_t held = 0;
  size_t skip = 0;  // records the attached prefix covers already
  if (e.records_first_block > 0) {
    auto hit = engine_.attach_cached_prefix(e.seq, history.data(), int32_t(history.size()));
    if (!hit.ok()) return false;
    held = e.fed = *hit;
    if (held % bs != 0 || held / bs < e.records_first_block) return true;  // a gap: recompute
    skip = size_t(held / bs - e.records_first_block);
  }
  const size_t n_records = e.backend_records ? e.backend_records->size() : e.records.size();
  auto header = [&](size_t i) -> const BlockHeader& {
    return e.backend_records ? e.backend_records->headers()[i] : e.records[i].header;
  };
  // Records [skip, skip + k) after what the sequence holds, up to n_tokens.
  auto import_run = [&](size_t k, int32_t n_tokens) {
    if (!e.backend_records) {
      const auto from = e.records.begin() + long(skip);
      return engine_.import_blocks(e.seq, history.data(), n_tokens, std::vector<BlockRecord>(from, from + long(k)));
    }
    const auto& hs = e.backend_records->headers();
    return engine_.import_blocks_from(e.seq, history.data(), n_tokens,
                                      std::vector<BlockHeader>(hs.begin() + long(skip), hs.begin() + long(skip + k)),
                                      e.backend_records->block(skip));
  };
  if (n_records > skip) {
    // covered[k]: tokens held plus those the first k records after skip hold.
    std::vector<int32_t> covered{held};
    for (size_t i = skip; i < n_records; ++i) {
      const int64_t next = int64_t(covered.back()) + header(i).n_tokens;
      if (next > limit) break;
      covered.push_back(int32_t(next));
    }
    // A bad record fails every longer run the same way, so this tries
    // each length at most once; only the checks run on a failed import.
    for (int32_t k = int32_t(covered.size()) - 1; k > 0; --k) {
      Status st = import_run(size_t(k), covered[size_t(k)]);
      if (st.ok()) {
        e.fed = covered[size_t(k)];
        e.imported = e.fed - held;
        return true;
      }
      if (st.code() == Code::out_of_memory) return false;
    }
  }
  if (e.records_first_block > 0) return true;  // the attached prefix; the rest is recomputed
  auto hit = engine_.attach_cached_prefix(e.seq, history.data(), int32_t(history.size()));
  if (!hit.ok()) return false;
  e.fed = *hit;
  return true;
}

void Scheduler::admit(std::vector<SchedulerEvent>& events) {
  while (!queue_.empty()) {
    Entry& e = *queue_.front();
    if (e.progress.finished()) {  // max_tokens 0, or resumed after its last token
      finish(e, events);
      queue_.pop_front();
      continue;
    }
    // Blocks promised to running entries: the rest of their prefill, and one
    // block each to grow by while decoding.
    int32_t promised = 0;
    for (const auto& r : running_) promised += engine_.blocks_needed(r->seq, r->remaining()) + 1;
    auto seq = engine_.open_sequence(image_key_spans(e.progress.request()));
    if (!seq.ok()) {  // every slot is taken (the spans passed validate_request)
      if (preempt_for(e)) continue;
      return;
    }
    e.seq = *seq;
    const int32_t need_all = engine_.blocks_needed(e.seq, int32_t(e.progress.history().size()));
    // Checked first when there are records, so no import is made in vain.
    const bool fits =
        ((e.records.empty() && !e.backend_records) || need_all + promised <= engine_.available_blocks()) && attach_kv(e) &&
        engine_.blocks_needed(e.seq, e.remaining()) + promised <= engine_.available_blocks();
    if (!fits) {
      release(e);
      e.done = false;
      if (preempt_for(e)) continue;
      if (!running_.empty()) return;  // waits for running requests to leave
      fail(e,
           Status(Code::out_of_memory,
                  "scheduler: request " + std::to_string(e.progress.id()) + " needs " +
                      std::to_string(need_all) + " KV blocks for its " +
                      std::to_string(e.progress.history().size()) +
                      " tokens; the pool has only " + std::to_string(engine_.available_blocks())),
           events);
      queue_.pop_front();
      continue;
    }
    if (e.resumed) {
      const int32_t imported = e.imported;
      counters_.imported_tokens += uint64_t(imported);
      counters_.recomputed_tokens += uint64_t(e.remaining() - 1);
      counters_.prefix_hit_tokens += uint64_t(e.fed - imported);
      // A new request whose prompt's KV came from a store reports it cached.
      if (e.progress.n_generated() == 0) e.cached = e.fed;
      e.resumed = false;
      block_buffer_pool().release(e.records);  // imported: the buffers serve later streams
      e.backend_records.reset();               // and the backend memory goes back
    } else {
      counters_.prefix_hit_tokens += uint64_t(e.fed);
      if (e.progress.n_generated() == 0) e.cached = e.fed;
    }
    EntryPtr moved = std::move(queue_.front());
    queue_.pop_front();
    auto at = std::upper_bound(running_.begin(), running_.end(), moved,
                               [&](const EntryPtr& a, const EntryPtr& r) { return before(*a, *r); });
    running_.insert(at, std::move(moved));
  }
}

// The last running entry in the policy's order (the youngest of the highest
// priority value) goes back to the queue; it recomputes its KV when it runs
// again (what the prefix cache still holds is reused).
void Scheduler::preempt_last() {
  EntryPtr last = std::move(running_.back());
  running_.pop_back();
  release(*last);
  last->done = false;
  requeue(std::move(last));
  ++counters_.preempted;
}

// Under the priority policy: makes room for `waiting` (which does not fit)
// by preempting the last running entry when its priority value is higher.
bool Scheduler::preempt_for(const Entry& waiting) {
  if (options_.policy != SchedulingPolicy::priority || running_.empty()) return false;
  if (running_.back()->progress.request().priority <= waiting.progress.request().priority) return false;
  preempt_last();
  ++counters_.preempted_for_priority;
  return true;
}

// One forward's rows: a decode row for every entry with one token to feed,
// then prefill chunks in the policy's order, within the token budget and the
// free KV blocks. Decode rows that cannot get blocks push the last entry out.
std::vector<Scheduler::Row> Scheduler::plan_batch(std::vector<SchedulerEvent>& events) {
  std::vector<Row> rows;
  while (!running_.empty()) {
    rows.clear();
    int32_t budget = options_.max_batch_tokens, blocks = engine_.available_blocks();
    int32_t decode_blocks = 0;
    for (const auto& e : running_) {
      if (e->remaining() != 1 || budget == 0) continue;
      rows.push_back({e.get(), 1});
      decode_blocks += engine_.blocks_needed(e->seq, 1);
      --budget;
    }
    if (decode_blocks <= blocks) {
      blocks -= decode_blocks;
      for (const auto& e : running_) {
        if (e->remaining() <= 1 || budget == 0) continue;
        // The longest chunk whose blocks fit (blocks_needed grows with n).
        int32_t lo = 0, hi = std::min({e->remaining(), e->progress.request().prefill_chunk, budget});
        while (lo < hi) {
          const int32_t mid = (lo + hi + 1) / 2;
          if (engine_.blocks_needed(e->seq, mid) <= blocks) lo = mid;
          else hi = mid - 1;
        }
        if (lo == 0) continue;
        rows.push_back({e.get(), lo});
        blocks -= engine_.blocks_needed(e->seq, lo);
        budget -= lo;
      }
      if (!rows.empty()) return rows;
    }
    if (running_.size() == 1) {
      // Alone and still out of room: the pool can never hold this request.
      Entry& e = *running_.front();
      fail(e,
           Status(Code::out_of_memory, "scheduler: request " + std::to_string(e.progress.id()) +
                                           " needs more KV blocks than the pool holds at " +
                                           std::to_string(e.progress.history().size()) + " tokens"),
           events);
      drop_done();
      return {};
    }
    preempt_last();
  }
  return rows;
}

Status Scheduler::step(std::vector<SchedulerEvent>& events) {
  admit(events);
  const std::vector<Row> rows = plan_batch(events);
  if (rows.empty()) return Status::Ok();

  std::vector<Engine::Item> items;
  items.reserve(rows.size());
  if (image_scratch_.size() < rows.size()) image_scratch_.resize(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const Entry& e = *rows[i].entry;
    // Image rows of prompt chunks (also when a preempted request recomputes).
    items.push_back({e.seq, e.progress.history().data() + e.fed, rows[i].n_tokens,
                     image_rows(e.progress.request(), e.fed, rows[i].n_tokens,
                                engine_.config().dim, image_scratch_[i])});
  }
  const int32_t n_vocab = engine_.config().n_vocab;
  logits_.resize(rows.size() * size_t(n_vocab));
  Status st = engine_.forward(items, logits_.data());
  if (!st.ok()) {
    for (auto& e : running_) fail(*e, st, events);
    drop_done();
    return st;
  }
  ++counters_.steps;
  for (size_t i = 0; i < rows.size(); ++i) {
    Entry& e = *rows[i].entry;
    const bool decode = e.remaining() == 1 && rows[i].n_tokens == 1;
    counters_.batch_tokens += uint64_t(rows[i].n_tokens);
    if (decode) ++counters_.decode_rows;
    else counters_.prefill_tokens += uint64_t(rows[i].n_tokens);
    e.fed += rows[i].n_tokens;
    if (e.remaining() != 0) continue;  // a prefill chunk short of the end

    SchedulerEvent ev;
    ev.kind = SchedulerEvent::Kind::token;
    ev.request_id = e.progress.id();
    const float* row = logits_.data() + i * size_t(n_vocab);
    ev.logits_hash = checksum_bytes(reinterpret_cast<const uint8_t*>(row), size_t(n_vocab) * sizeof(float));
    ev.token = e.progress.step(row);
    ev.index = e.progress.n_generated() - 1;
    ev.text = e.progress.take_text();
    if (e.progress.request().logprobs >= 0) {
      ev.has_logprobs = true;
      ev.logprobs = e.progress.last_logprobs();
    }
    if (ev.index == 0) ev.cached_tokens = e.cached;
    events.push_back(std::move(ev));
    if (e.progress.finished()) finish(e, events);
    else if (options_.prefill_only) handoff(e, events);
  }
  drop_done();
  return Status::Ok();
}

}  // namespace cleave
