// Private to actors/*.cpp (CAF): the first pipeline stage's StageLink over
// pipeline stage actors (model/layer_stage.h). A micro-batch goes to the
// first of them and on from stage to stage; the last one's logits come
// back to this link's own mailbox, tagged with the ticket. The link
// watches every stage: one that goes down, an error from any, or no answer
// within kPipelineTimeout fails the call (the engine then stops using the
// link, and its stage actor exits so the router re-places its requests).
#pragma once

#include <memory>
#include <vector>

#include "actors/actor_types.h"
#include "model/layer_stage.h"

namespace cleave::actors {

struct PipelineStageRef {
  pipeline_stage_actor handle;
  LayerRange layers;
  size_t slice_bytes = 0;  // one block's KV of its layers
};

// stages: in layer order, contiguous, the last ending at the model's last
// layer (invalid_argument otherwise). watcher (when not null): the link's
// mailbox, where (stage_down, first layer) breaks it at once (the head
// sends that for stages on other workers).
Result<std::shared_ptr<StageLink>> make_actor_stage_link(caf::actor_system& system,
                                                         std::vector<PipelineStageRef> stages,
                                                         const LlamaConfig& model,
                                                         uint64_t model_fingerprint,
                                                         caf::actor* watcher = nullptr);

}  // namespace cleave::actors
