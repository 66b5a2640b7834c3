// Private to actors/*.cpp (CAF): an attention stage's ExpertExecutor over
// expert actors. Each piece of a layer's work goes to the least loaded live
// actor hosting its expert; all actors' batches are sent before any answer
// is awaited, so they compute at the same time. An actor that fails (gone,
// timed out, a bad answer) is dropped and its pieces go to a replica, or,
// when no live actor hosts an expert, to the stage's own fallback host (the
// whole model's experts from the model file): a layer always completes, with
// the same bits.
#pragma once

#include <memory>
#include <vector>

#include "actors/actor_types.h"
#include "model/experts.h"

namespace cleave::actors {

struct ExpertRef {
  expert_actor handle;
  ExpertSet set;
};

std::shared_ptr<ExpertExecutor> make_actor_expert_executor(caf::actor_system& system,
                                                           std::vector<ExpertRef> experts,
                                                           std::shared_ptr<ExpertHost> fallback);

}  // namespace cleave::actors
