#include "actors/stage_core.h"

#include <algorithm>
#include <chrono>

#include "storage/prefix.h"

namespace cleave {

msg::StreamEvent to_stream_event(const SchedulerEvent& e, const std::string& origin) {
  msg::StreamEvent m;
  m.request_id = e.request_id;
  m.origin = origin;
  switch (e.kind) {
    case SchedulerEvent::Kind::token:
      m.kind = msg::StreamEvent::Kind::token;
      m.index = e.index;
      m.token = e.token;
      m.text = e.text;
      m.logits_hash = e.logits_hash;
      m.has_logprobs = e.has_logprobs;
      m.logprobs = e.logprobs;
      m.cached_tokens = e.cached_tokens;
      break;
    case SchedulerEvent::Kind::finished:
      m.kind = msg::StreamEvent::Kind::finished;
      m.text = e.text;
      m.finish_reason = e.finish_reason;
      m.logits = e.logits;
      break;
    case SchedulerEvent::Kind::failed:
    case SchedulerEvent::Kind::handoff:  // a handoff is no stream event; never passed here
      m.kind = msg::StreamEvent::Kind::failed;
      m.error = e.error.ok() ? Status(Code::aborted, "handoff passed as a stream event") : e.error;
      break;
  }
  return m;
}

std::vector<BlockKey> resume_kv_keys(const std::vector<int32_t>& prompt,
                                     const std::vector<int32_t>& generated,
                                     uint64_t model_fingerprint, const KvLayout& layout,
                                     std::span<const KeySpan> images) {
  std::vector<int32_t> tokens = prompt;
  tokens.insert(tokens.end(), generated.begin(), generated.end());
  if (tokens.empty()) return {};
  const int32_t n = int32_t(tokens.size()) - 1;  // the last token has no KV yet
  std::vector<BlockKey> keys = chain_keys(tokens.data(), n, model_fingerprint, layout, images);
  const int32_t bs = layout.tokens_per_block;
  const int32_t n_full = n / bs, rest = n % bs;
  if (rest > 0) {
    BlockKey parent = keys.empty() ? BlockKey{} : keys.back();
    keys.push_back(block_key(parent, tokens.data() + n_full * bs, rest, model_fingerprint, layout,
                             n_full * bs, images));
  }
  return keys;
}

Result<std::unique_ptr<StageCore>> StageCore::create(std::shared_ptr<const GgufFile> file,
                                                     std::shared_ptr<const Tokenizer> tokenizer,
                                                     const EngineOptions& engine,
                                                     const SchedulerOptions& scheduler,
                                                     std::string name,
                                                     std::shared_ptr<Backend> backend) {
  auto e = Engine::create(std::move(file), engine, std::move(backend));
  if (!e.ok()) return e.status();
  std::unique_ptr<StageCore> core(new StageCore());
  core->name_ = std::move(name);
  core->tokenizer_ = std::move(tokenizer);
  core->engine_ = std::move(e.value());
  core->scheduler_ = std::make_unique<Scheduler>(*core->engine_, core->tokenizer_.get(), scheduler);
  return core;
}

Status StageCore::check_request(const GenerateRequest& request) const {
  Status st = validate_request(request, engine_->context(), engine_->config().n_vocab,
                               engine_->config().dim);
  if (st.ok()) st = check_images_encoded(request);
  return st.ok() ? check_priority_allowed(request, scheduler_->options().policy) : st;
}

// The backlog keeps the scheduler's order: by priority value under the
// priority policy (arrival among equals), else by arrival.
void StageCore::push_backlog(Work work) {
  auto at = backlog_.end();
  if (scheduler_->options().policy == SchedulingPolicy::priority)
    at = std::upper_bound(backlog_.begin(), backlog_.end(), work.request.priority,
                          [](int32_t p, const Work& w) { return p < w.request.priority; });
  backlog_.insert(at, std::move(work));
}

Status StageCore::submit(GenerateRequest request) {
  Status st = check_request(request);
  if (!st.ok()) return st;
  if (backlog_.empty()) {
    st = scheduler_->submit(request);
    if (st.code() != Code::busy) return st;
  }
  push_backlog(Work{std::move(request), false, {}, {}, 0, nullptr});
  return Status::Ok();
}

Status StageCore::resume(GenerateRequest request, std::vector<int32_t> generated,
                         std::vector<BlockRecord> blocks, int32_t first_block) {
  return queue_resume(Work{std::move(request), true, std::move(generated), std::move(blocks), first_block, nullptr});
}

Status StageCore::resume_from_backend(GenerateRequest request, std::vector<int32_t> generated,
                                      std::shared_ptr<const BackendBlocks> blocks, int32_t first_block) {
  return queue_resume(Work{std::move(request), true, std::move(generated), {}, first_block, std::move(blocks)});
}

Status StageCore::queue_resume(Work work) {
  Status st = check_request(work.request);
  if (!st.ok()) return st;
  if (backlog_.empty()) {
    st = resume_now(work);
    if (st.code() != Code::busy) return st;
  }
  push_backlog(std::move(work));
  return Status::Ok();
}

Status StageCore::resume_now(const Work& w) {
  return w.backend_blocks ? scheduler_->resume_from_backend(w.request, w.generated, w.backend_blocks, w.first_block)
                          : scheduler_->resume(w.request, w.generated, w.blocks, w.first_block);
}

void StageCore::cancel(uint64_t request_id) {
  (void)scheduler_->cancel(request_id);  // not_found: it waits in the backlog or is gone
  std::erase_if(backlog_, [&](const Work& w) { return w.request.request_id == request_id; });
}

void StageCore::drain_backlog(std::vector<SchedulerEvent>& events) {
  while (!backlog_.empty()) {
    Work& w = backlog_.front();
    Status st = w.resume ? resume_now(w) : scheduler_->submit(w.request);
    if (st.code() == Code::busy) return;
    if (!st.ok()) {
      SchedulerEvent failed;
      failed.kind = SchedulerEvent::Kind::failed;
      failed.request_id = w.request.request_id;
      failed.error = st;
      events.push_back(std::move(failed));
    }
    backlog_.pop_front();
  }
}

Status StageCore::step(std::vector<SchedulerEvent>& events) {
  drain_backlog(events);
  if (scheduler_->idle()) return Status::Ok();
  const SchedulerCounters before = scheduler_->counters();
  const auto t0 = std::chrono::steady_clock::now();
  Status st = scheduler_->step(events);
  const uint64_t us = uint64_t(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  step_us_ += us;
  const SchedulerCounters& after = scheduler_->counters();
  moments_.add(us, after.prefill_tokens - before.prefill_tokens, after.decode_rows - before.decode_rows);
  return st;
}

void StepMoments::add(uint64_t us, uint64_t tokens, uint64_t rows) {
  auto acc = [](uint64_t& sum, uint64_t a, uint64_t b) {
    uint64_t prod = 0;
    if (__builtin_mul_overflow(a, b, &prod) || __builtin_add_overflow(sum, prod, &sum)) sum = UINT64_MAX;
  };
  acc(us_sq, us, us);
  acc(tokens_sq, tokens, tokens);
  acc(us_tokens, us, tokens);
  acc(rows_sq, rows, rows);
  acc(us_rows, us, rows);
}

void StageCore::collect_new_blocks(int32_t seq, std::vector<BlockRecord>& out) {
  const int32_t bs = engine_->options().block_size;
  const int32_t n_full = engine_->sequence_length(seq) / bs;
  if (n_full == 0) {
    if (synced_.synced_blocks(uint64_t(seq)) > 0) synced_.forget(uint64_t(seq));
    return;
  }
  std::vector<BlockKey> keys = engine_->block_keys(seq);
  keys.resize(std::min<size_t>(keys.size(), size_t(n_full)));
  std::vector<SyncBlock> current;
  current.reserve(keys.size());
  for (const BlockKey& k : keys) current.push_back(SyncBlock{k, 0});
  std::vector<size_t> pending = synced_.pending(uint64_t(seq), current);
  if (pending.empty()) return;
  const size_t first = *std::min_element(pending.begin(), pending.end());
  auto records = engine_->export_blocks(seq, int32_t(first));
  if (!records.ok()) return;  // the store simply lacks them; a resume recomputes
  for (size_t i = 0; i < records->size() && first + i < current.size(); ++i)
    out.push_back(std::move((*records)[i]));
  synced_.mark_synced(uint64_t(seq), current);
}

void StageCore::keep_finished_blocks() {
  scheduler_->set_finish_hook([this](int32_t seq) { collect_new_blocks(seq, finished_blocks_); });
}

Status StageCore::set_prefill_only(bool on) {
  if (has_work())
    return Status(Code::invalid_argument, name_ + ": cannot switch roles with " + std::to_string(queue_depth()) +
                                              " requests queued and " + std::to_string(scheduler_->running()) +
                                              " running");
  scheduler_->set_prefill_only(on);
  if (on) {
    scheduler_->set_finish_hook(nullptr);
    finished_blocks_.clear();
  } else {
    keep_finished_blocks();
  }
  return Status::Ok();
}

std::vector<BlockRecord> StageCore::take_new_blocks() {
  std::vector<BlockRecord> out = std::move(finished_blocks_);
  finished_blocks_.clear();
  for (int32_t seq = 0; seq < engine_->options().max_seqs; ++seq) collect_new_blocks(seq, out);
  blocks_exported_ += out.size();
  return out;
}

std::vector<BlockKey> StageCore::resume_keys(const GenerateRequest& request,
                                             const std::vector<int32_t>& generated) const {
  return resume_kv_keys(request.prompt, generated, engine_->model_fingerprint(),
                        engine_->kv_layout(), image_key_spans(request));
}

msg::Stats StageCore::stats() const {
  const SchedulerCounters& c = scheduler_->counters();
  const Engine::CacheStats cache = engine_->cache_stats();
  msg::Stats s;
  s.actor = name_;
  s.counters = {
      {"queue_depth", uint64_t(queue_depth())},
      {"running", uint64_t(scheduler_->running())},
      {"scheduler_submitted", c.submitted},
      {"scheduler_finished", c.finished},
      {"scheduler_failed", c.failed},
      {"steps", c.steps},
      {"step_us", step_us_},  // wall time of the steps above
      {"step_us_sq", moments_.us_sq},  // and the second moments (StepMoments)
      {"step_tokens_sq", moments_.tokens_sq},
      {"step_us_tokens", moments_.us_tokens},
      {"step_rows_sq", moments_.rows_sq},
      {"step_us_rows", moments_.us_rows},
      {"batch_tokens", c.batch_tokens},
      {"decode_rows", c.decode_rows},
      {"prefill_tokens", c.prefill_tokens},
      {"prefix_hit_tokens", c.prefix_hit_tokens},
      {"imported_tokens", c.imported_tokens},
      {"recomputed_tokens", c.recomputed_tokens},
      {"preempted", c.preempted},
      {"preempted_for_priority", c.preempted_for_priority},
      {"kv_blocks_exported", blocks_exported_},
      {"cache_published_blocks", cache.published_blocks},
      {"cache_evicted_blocks", cache.evicted_blocks},
      // Held by running sequences (cached blocks no one holds are free to evict).
      {"kv_blocks_total", uint64_t(engine_->total_blocks())},
      {"kv_blocks_used", uint64_t(engine_->total_blocks() - engine_->available_blocks())},
  };
  if (const ExpertExecutor* experts = engine_->expert_executor())
    for (auto& c : experts->counters()) s.counters.push_back(std::move(c));
  if (const StageLink* link = engine_->stage_link()) {
    s.counters.emplace_back("pipeline_last_own_layer", uint64_t(engine_->own_layers().last));
    for (auto& c : link->counters()) s.counters.push_back(std::move(c));
  }
  return s;
}

}  // namespace cleave
