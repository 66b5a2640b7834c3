// The colocated and pd topologies in one process (actors/actor_pipeline.cpp);
// pipeline.cpp dispatches here.
#pragma once

#include <memory>

#include "actors/pipeline.h"

namespace cleave {

// Spawns the kv_store, the stage actors and the router for options.topology
// (colocated or pd). Engines and the store are built before any actor, so
// their errors come back here.
Result<std::unique_ptr<Pipeline>> make_actor_pipeline(std::shared_ptr<const GgufFile> file,
                                                       std::shared_ptr<const Tokenizer> tokenizer,
                                                       const PipelineOptions& options);

// options.vision_actors encoders (1 for mono) when options.mmproj is set,
// each with its own backend and cache, checked against the model's n_embd;
// none without an mmproj.
Result<std::vector<std::shared_ptr<VisionEncoder>>> make_vision_encoders(const PipelineOptions& options,
                                                                         int32_t n_embd);

}  // namespace cleave
