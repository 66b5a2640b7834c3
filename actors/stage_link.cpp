#include "actors/stage_link.h"

#include <atomic>
#include <cstring>
#include <map>

#include "actors/stage_wire.h"
#include "schema/codec.h"

namespace cleave::actors {
namespace {

class ActorStageLink final : public StageLink {
 public:
  ActorStageLink(caf::actor_system& system, std::vector<PipelineStageRef> stages, int32_t dim,
                 int32_t n_vocab, uint64_t fp)
      : system_(system), stages_(std::move(stages)), dim_(dim), n_vocab_(n_vocab), fp_(fp) {
    // Made here, used only by the engine's thread from then on.
    self_ = std::make_unique<caf::scoped_actor>(system_);
    for (const PipelineStageRef& s : stages_) (*self_)->monitor(s.handle);
  }

  caf::actor mailbox() const { return caf::actor_cast<caf::actor>(self_->ptr()); }

  int32_t first_layer() const override { return stages_.front().layers.first; }

  Result<uint64_t> start(const StageRows& rows) override {
    CLEAVE_RETURN_IF_ERROR(usable());
    const uint64_t ticket = next_ticket_++;
    msg::StageBatch m =
        layers_message(to_batch_data(rows, dim_), first_layer(), fp_, uint32_t(dim_));
    expected_[ticket] = rows.logit_rows.size();
    (*self_)->send(stages_.front().handle, layers_atom::value, ticket, codec::encode(m),
                   caf::actor_cast<caf::actor>(self_->ptr()));
    ++micro_batches_;
    return ticket;
  }

  Status finish(uint64_t ticket, float* logits) override {
    const auto t0 = Clock::now();
    Result<Bytes> answer = await(ticket);
    wait_us_.fetch_add(uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(
                                    Clock::now() - t0).count()),
                       std::memory_order_relaxed);
    Result<std::vector<float>> r = answer.ok() ? take(ticket, *answer) : Result<std::vector<float>>(answer.status());
    expected_.erase(ticket);
    if (!r.ok()) return r.status();
    if (!r->empty()) std::memcpy(logits, r->data(), r->size() * sizeof(float));
    return Status::Ok();
  }

  Status copy_block(int32_t src, int32_t dst) override {
    const int32_t ids[2] = {src, dst};
    for (const PipelineStageRef& s : stages_)
      CLEAVE_RETURN_IF_ERROR(kv_call(s, msg::StageOp::kv_copy, ids, nullptr, 0, nullptr));
    return Status::Ok();
  }

  Status read_blocks(std::span<const int32_t> ids, uint8_t* out) override {
    size_t per_block = 0;
    for (const PipelineStageRef& s : stages_) per_block += s.slice_bytes;
    size_t offset = 0;
    std::vector<uint8_t> got;
    for (const PipelineStageRef& s : stages_) {
      CLEAVE_RETURN_IF_ERROR(kv_call(s, msg::StageOp::kv_read, ids, nullptr, 0, &got));
      if (got.size() != ids.size() * s.slice_bytes)
        return Status(Code::invalid_argument, "pipeline: stage " + s.layers.to_string() +
                                                  " sent " + std::to_string(got.size()) +
                                                  " bytes of KV for " + std::to_string(ids.size()) +
                                                  " blocks");
      for (size_t i = 0; i < ids.size(); ++i)
        std::memcpy(out + i * per_block + offset, got.data() + i * s.slice_bytes, s.slice_bytes);
      offset += s.slice_bytes;
    }
    return Status::Ok();
  }

  Status write_blocks(std::span<const int32_t> ids, const uint8_t* in) override {
    size_t per_block = 0;
    for (const PipelineStageRef& s : stages_) per_block += s.slice_bytes;
    size_t offset = 0;
    std::vector<uint8_t> part;
    for (const PipelineStageRef& s : stages_) {
      part.resize(ids.size() * s.slice_bytes);
      for (size_t i = 0; i < ids.size(); ++i)
        std::memcpy(part.data() + i * s.slice_bytes, in + i * per_block + offset, s.slice_bytes);
      CLEAVE_RETURN_IF_ERROR(
          kv_call(s, msg::StageOp::kv_write, ids, part.data(), part.size(), nullptr));
      offset += s.slice_bytes;
    }
    return Status::Ok();
  }

  std::vector<std::pair<std::string, uint64_t>> counters() const override {
    return {{"pipeline_stages", uint64_t(stages_.size() + 1)},
            {"pipeline_micro_batches", micro_batches_.load(std::memory_order_relaxed)},
            {"pipeline_wait_us", wait_us_.load(std::memory_order_relaxed)},
            {"pipeline_kv_calls", kv_calls_.load(std::memory_order_relaxed)}};
  }

 private:
  // Broken already, or a down notice waits in the mailbox (a stage that
  // went down while the link was idle).
  Status usable() {
    bool more = broken_.ok();
    while (more)
      (*self_)->receive(
          [&](caf::down_msg& dm) { broken_ = went_down(dm); },
          [&](stage_down_atom, int32_t first) { broken_ = stage_gone(first); },
          caf::after(std::chrono::seconds(0)) >> [&] { more = false; });
    return broken_;
  }

  Status stage_gone(int32_t first) {
    return Status(Code::unavailable, "pipeline: the stage holding layers from " +
                                         std::to_string(first) + " went down (its node is gone)");
  }

  Status went_down(const caf::down_msg& dm) {
    for (const PipelineStageRef& s : stages_)
      if (dm.source == caf::actor_cast<caf::actor_addr>(s.handle))
        return Status(Code::unavailable, "pipeline: the stage holding layers " +
                                             s.layers.to_string() + " went down");
    return Status(Code::unavailable, "pipeline: a stage went down");
  }

  Result<std::vector<float>> take(uint64_t ticket, const Bytes& bytes) {
    auto m = codec::decode_as<msg::StageBatch>(bytes);
    if (!m.ok()) return m.status();
    auto want = expected_.find(ticket);
    const size_t rows = want == expected_.end() ? 0 : want->second;
    if (m->op != msg::StageOp::output || m->width != uint32_t(n_vocab_) ||
        m->data.size() != rows * size_t(n_vocab_) * sizeof(float))
      return Status(Code::invalid_argument, "pipeline: the last stage's answer is not " +
                                                std::to_string(rows) + " rows of " +
                                                std::to_string(n_vocab_) + " logits");
    std::vector<float> out(rows * size_t(n_vocab_));
    if (!out.empty()) std::memcpy(out.data(), m->data.data(), m->data.size());
    return out;
  }

  // A KV call answers like a micro-batch (layers_out / layers_err with its
  // ticket), so that waiting for it also hears of a stage going down.
  Status kv_call(const PipelineStageRef& s, msg::StageOp op, std::span<const int32_t> ids,
                 const uint8_t* data, size_t bytes, std::vector<uint8_t>* out) {
    CLEAVE_RETURN_IF_ERROR(usable());
    kv_calls_.fetch_add(1, std::memory_order_relaxed);
    const msg::StageBatch m = kv_message(op, ids, data, bytes, s.layers.first, fp_);
    const uint64_t ticket = next_ticket_++;
    (*self_)->send(s.handle, stage_kv_atom::value, ticket, codec::encode(m), mailbox());
    Status st;
    Result<Bytes> reply = await(ticket);
    if (!reply.ok()) {
      st = reply.status();
    } else {
      auto r = codec::decode_as<msg::StageBatch>(*reply);
      if (!r.ok()) st = r.status();
      else if (out) *out = std::move(r->data);
    }
    if (!st.ok())
      return Status(st.code(), "pipeline: stage " + s.layers.to_string() + ": " + st.message());
    return Status::Ok();
  }

  // The answer of one ticket; answers of others are kept for their turn. A
  // stage that went down (its monitor, or the head's notice for a stage on
  // another node) or no answer in kPipelineTimeout breaks the link.
  Result<Bytes> await(uint64_t ticket) {
    const auto deadline = Clock::now() + kPipelineTimeout;
    while (broken_.ok() && !results_.count(ticket)) {
      const auto left = deadline - Clock::now();
      if (left <= Clock::duration::zero()) {
        broken_ = Status(Code::timed_out, "pipeline: no answer from the stages in " +
                                              std::to_string(kPipelineTimeout.count()) + " s");
        break;
      }
      (*self_)->receive(
          [&](layers_out_atom, uint64_t t, const Bytes& b) { results_.insert_or_assign(t, b); },
          [&](layers_err_atom, uint64_t t, const caf::error& e) {
            results_.insert_or_assign(t, Result<Bytes>(from_error(e)));
          },
          [&](caf::down_msg& dm) { broken_ = went_down(dm); },
          [&](stage_down_atom, int32_t first) { broken_ = stage_gone(first); },
          caf::after(std::chrono::duration_cast<std::chrono::milliseconds>(left) +
                     std::chrono::milliseconds(1)) >> [] {});
    }
    auto it = results_.find(ticket);
    if (it == results_.end()) return broken_;
    Result<Bytes> r = std::move(it->second);
    results_.erase(it);
    return r;
  }

  caf::actor_system& system_;
  std::vector<PipelineStageRef> stages_;
  int32_t dim_, n_vocab_;
  uint64_t fp_;
  std::unique_ptr<caf::scoped_actor> self_;
  Status broken_;
  uint64_t next_ticket_ = 1;
  std::map<uint64_t, size_t> expected_;  // logit rows of each started ticket
  std::map<uint64_t, Result<Bytes>> results_;  // answers not yet taken
  std::atomic<uint64_t> micro_batches_{0}, wait_us_{0}, kv_calls_{0};
};

}  // namespace

Result<std::shared_ptr<StageLink>> make_actor_stage_link(caf::actor_system& system,
                                                         std::vector<PipelineStageRef> stages,
                                                         const LlamaConfig& model, uint64_t fp,
                                                         caf::actor* watcher) {
  if (stages.empty()) return Status(Code::invalid_argument, "pipeline link: no stages");
  for (size_t i = 1; i < stages.size(); ++i)
    if (stages[i].layers.first != stages[i - 1].layers.last + 1)
      return Status(Code::invalid_argument, "pipeline link: stage " + stages[i].layers.to_string() +
                                                " does not follow " + stages[i - 1].layers.to_string());
  if (stages.back().layers.last != model.n_layers - 1)
    return Status(Code::invalid_argument, "pipeline link: the last stage " +
                                              stages.back().layers.to_string() +
                                              " does not end at the model's last layer");
  auto link = std::make_shared<ActorStageLink>(system, std::move(stages), model.dim, model.n_vocab, fp);
  if (watcher) *watcher = link->mailbox();
  return std::shared_ptr<StageLink>(std::move(link));
}

}  // namespace cleave::actors
