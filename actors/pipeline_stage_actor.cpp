// Pipeline stage actors: a LayerStage behind the layers and stage_kv
// messages (actor_types.h). Detached: each micro-batch is computed in the
// behaviour, one after another, in the order they came (a sequence's later
// rows need its earlier rows' KV).
#include "actors/actor_types.h"

#include "actors/stage_wire.h"
#include "model/layer_stage.h"
#include "schema/codec.h"

namespace cleave::actors {
namespace {

struct PipelineStageState {
  std::shared_ptr<LayerStage> stage;
  std::string label;  // "NODE/stage/0"
  caf::actor next;  // the stage after this one (none on the last)
  std::shared_ptr<PipelineStageCounters> counters;  // shared with its ActorSet
  static inline const char* name = "cleave.pipeline_stage";
};
using stage_pointer = pipeline_stage_actor::stateful_pointer<PipelineStageState>;

// Runs one micro-batch; the next stage's message, or the last stage's logits.
Result<msg::StageBatch> run_layers(PipelineStageState& s, const Bytes& bytes) {
  auto m = codec::decode_as<msg::StageBatch>(bytes);
  if (!m.ok()) {
    ++s.counters->bad_messages;
    return m.status();
  }
  const LayerStage& st = *s.stage;
  CLEAVE_RETURN_IF_ERROR(check_addressed(*m, st.layers(), st.model_fingerprint()));
  if (m->op != msg::StageOp::layers || m->width != uint32_t(st.config().dim))
    return Status(Code::invalid_argument, s.label + ": a layers message needs rows of " +
                                              std::to_string(st.config().dim) + " floats");
  std::vector<float> out;
  StageBatchData b = batch_of(*m);  // once: the next stage gets the same rows
  CLEAVE_RETURN_IF_ERROR(s.stage->run(b, out));
  const uint64_t fp = st.model_fingerprint();
  if (!st.last()) {
    if (!s.next)
      return Status(Code::unavailable, s.label + " has no next stage to hand its rows to");
    b.x = std::move(out);
    return layers_message(b, st.layers().last + 1, fp, uint32_t(st.config().dim));
  }
  return output_message(reinterpret_cast<const uint8_t*>(out.data()), out.size() * sizeof(float),
                        uint32_t(st.config().n_vocab), st.layers().first, fp);
}

Result<msg::StageBatch> run_kv(PipelineStageState& s, const Bytes& bytes) {
  auto m = codec::decode_as<msg::StageBatch>(bytes);
  if (!m.ok()) {
    ++s.counters->bad_messages;
    return m.status();
  }
  LayerStage& st = *s.stage;
  CLEAVE_RETURN_IF_ERROR(check_addressed(*m, st.layers(), st.model_fingerprint()));
  ++s.counters->kv_calls;
  const size_t slice = st.slice_bytes();
  std::vector<uint8_t> data;
  switch (m->op) {
    case msg::StageOp::kv_read:
      data.resize(m->blocks.size() * slice);
      CLEAVE_RETURN_IF_ERROR(st.read_blocks(m->blocks, data.data()));
      break;
    case msg::StageOp::kv_write:
      if (m->data.size() != m->blocks.size() * slice)
        return Status(Code::invalid_argument, s.label + ": " + std::to_string(m->blocks.size()) +
                                                  " blocks need " +
                                                  std::to_string(m->blocks.size() * slice) +
                                                  " bytes of KV, the message has " +
                                                  std::to_string(m->data.size()));
      CLEAVE_RETURN_IF_ERROR(st.write_blocks(m->blocks, m->data.data()));
      break;
    case msg::StageOp::kv_copy:
      CLEAVE_RETURN_IF_ERROR(st.copy_block(m->blocks[0], m->blocks[1]));
      break;
    default:
      return Status(Code::invalid_argument, s.label + ": a stage_kv message must be a KV call");
  }
  return output_message(data.data(), data.size(), 0, st.layers().first, st.model_fingerprint());
}

pipeline_stage_actor::behavior_type pipeline_stage_fn(stage_pointer self,
                                                      std::shared_ptr<LayerStage> stage,
                                                      std::string name,
                                                      std::shared_ptr<PipelineStageCounters> counters) {
  self->state.stage = std::move(stage);
  self->state.label = std::move(name);
  self->state.counters = std::move(counters);
  return {
      [=](layers_atom, uint64_t ticket, const Bytes& bytes, const caf::actor& reply_to) {
        auto& s = self->state;
        auto out = run_layers(s, bytes);
        if (!out.ok()) {
          ++s.counters->failures;
          caf::anon_send(reply_to, layers_err_atom::value, ticket, to_error(out.status()));
          return;
        }
        if (out->op == msg::StageOp::layers) {
          ++s.counters->forwarded;
          caf::anon_send(caf::actor_cast<pipeline_stage_actor>(s.next), layers_atom::value, ticket,
                     codec::encode(*out), reply_to);
          return;
        }
        caf::anon_send(reply_to, layers_out_atom::value, ticket, codec::encode(*out));
      },
      [=](stage_kv_atom, uint64_t ticket, const Bytes& bytes, const caf::actor& reply_to) {
        auto out = run_kv(self->state, bytes);
        if (!out.ok()) {
          ++self->state.counters->failures;
          caf::anon_send(reply_to, layers_err_atom::value, ticket, to_error(out.status()));
          return;
        }
        caf::anon_send(reply_to, layers_out_atom::value, ticket, codec::encode(*out));
      },
      [=](next_atom, const caf::actor& next) {
        self->state.next = next;
        return true;
      },
      [=](stats_atom) -> Bytes {
        auto& s = self->state;
        return pipeline_stage_stats(s.label, *s.stage, *s.counters);
      },
  };
}

}  // namespace

pipeline_stage_actor spawn_pipeline_stage(caf::actor_system& system, std::shared_ptr<LayerStage> stage,
                                          std::string name, std::shared_ptr<PipelineStageCounters> counters) {
  return system.spawn<caf::detached>(pipeline_stage_fn, std::move(stage), std::move(name), std::move(counters));
}

Bytes pipeline_stage_stats(const std::string& label, const LayerStage& stage,
                           const PipelineStageCounters& c) {
  const LayerStage::Stats st = stage.stats();
  return encode_stats(label, {{"stage_first_layer", uint64_t(stage.layers().first)},
                              {"stage_last_layer", uint64_t(stage.layers().last)},
                              {"stage_batches", st.batches},
                              {"stage_rows", st.rows},
                              {"stage_busy_us", st.busy_ns / 1000},
                              {"stage_forwarded", c.forwarded.load()},
                              {"stage_kv_calls", c.kv_calls.load()},
                              {"bad_messages", c.bad_messages.load()},
                              {"failures", c.failures.load()}});
}

}  // namespace cleave::actors
