// An expert actor: one ExpertHost behind ExpertBatch in, ExpertBatch out
// (in process; between processes the batches take its data socket,
// actors/expert_socket.h).
#include <cstring>

#include "actors/actor_types.h"
#include "actors/expert_socket.h"
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

expert_actor::behavior_type expert_fn(expert_pointer self, std::shared_ptr<ExpertHost> host,
                                      std::string name) {
  self->state.host = std::move(host);
  self->state.origin = std::move(name);
  return {
      [=](expert_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto& s = self->state;
        Result<Bytes> out = serve_expert_batch(*s.host, bytes);
        if (!out.ok()) {
          ++s.refused;
          return to_error(out.status());
        }
        ++s.batches;
        return std::move(out.value());
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
        std::vector<std::pair<std::string, uint64_t>> counters = {{"batches", s.batches},
                                                                  {"refused", s.refused},
                                                                  {"replicas_added", s.replicas},
                                                                  {"rows", h.rows},
                                                                  {"busy_us", h.busy_ns / 1000}};
        append_expert_busy_counters(counters, h.expert_busy_ns, experts_per_layer(s.host->config()));
        return encode_stats(s.origin, counters);
      },
  };
}

}  // namespace

expert_actor spawn_expert(caf::actor_system& system, std::shared_ptr<ExpertHost> host, std::string name) {
  return system.spawn<caf::detached>(expert_fn, std::move(host), std::move(name));
}

}  // namespace cleave::actors
