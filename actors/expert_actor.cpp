// An expert actor: one ExpertHost behind ExpertBatch in, ExpertBatch out.
#include <cstring>

#include "actors/actor_types.h"
#include "model/experts.h"
#include "schema/codec.h"

namespace cleave::actors {
namespace {

struct ExpertActorState {
  std::shared_ptr<ExpertHost> host;
  std::string origin;  // "NODE/expert/0": names its stats
  uint64_t batches = 0, refused = 0, replicas = 0;
  static inline const char* name = "cleave.expert";
};
using expert_pointer = expert_actor::stateful_pointer<ExpertActorState>;

// The rows of every piece, computed; the reply carries the same pieces.
Result<msg::ExpertBatch> compute(ExpertHost& host, const msg::ExpertBatch& in) {
  const LlamaConfig& c = host.config();
  if (in.dim != uint32_t(c.dim))
    return Status(Code::invalid_argument, "expert batch rows of " + std::to_string(in.dim) +
                                              " floats, the model's are " + std::to_string(c.dim));
  if (in.layer >= c.n_layers)
    return Status(Code::invalid_argument, "expert batch for layer " + std::to_string(in.layer) +
                                              " of a model with " + std::to_string(c.n_layers));
  std::vector<float> x(in.data.size() / sizeof(float)), y(x.size());
  if (!in.data.empty()) std::memcpy(x.data(), in.data.data(), in.data.size());
  std::vector<ExpertWork> work;
  size_t at = 0;
  for (const msg::ExpertPiece& p : in.pieces) {
    work.push_back(ExpertWork{p.expert, int64_t(p.rows), x.data() + at, y.data() + at});
    at += size_t(p.rows) * in.dim;
  }
  CLEAVE_RETURN_IF_ERROR(host.compute(in.layer, work));
  msg::ExpertBatch out;
  out.layer = in.layer;
  out.dim = in.dim;
  out.pieces = in.pieces;
  out.data.resize(y.size() * sizeof(float));
  if (!y.empty()) std::memcpy(out.data.data(), y.data(), out.data.size());
  out.checksum = checksum_bytes(out.data.data(), out.data.size());
  return out;
}

expert_actor::behavior_type expert_fn(expert_pointer self, std::shared_ptr<ExpertHost> host,
                                      std::string name) {
  self->state.host = std::move(host);
  self->state.origin = std::move(name);
  return {
      [=](expert_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto& s = self->state;
        auto in = codec::decode_as<msg::ExpertBatch>(bytes);
        Result<msg::ExpertBatch> out = in.ok() ? compute(*s.host, in.value()) : in.status();
        if (!out.ok()) {
          ++s.refused;
          return to_error(out.status());
        }
        ++s.batches;
        return codec::encode(out.value());
      },
      [=](expert_add_atom, int32_t layer, int32_t expert) -> caf::result<bool> {
        Status st = self->state.host->add_expert(layer, expert);
        if (!st.ok()) return to_error(st);
        ++self->state.replicas;
        return true;
      },
      [=](stats_atom) -> Bytes {
        auto& s = self->state;
        const ExpertHost::Stats h = s.host->stats();
        return encode_stats(s.origin, {{"batches", s.batches},
                                     {"refused", s.refused},
                                     {"replicas_added", s.replicas},
                                     {"rows", h.rows},
                                     {"busy_us", h.busy_ns / 1000}});
      },
  };
}

}  // namespace

expert_actor spawn_expert(caf::actor_system& system, std::shared_ptr<ExpertHost> host, std::string name) {
  return system.spawn<caf::detached>(expert_fn, std::move(host), std::move(name));
}

}  // namespace cleave::actors
