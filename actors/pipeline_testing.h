// Fault injection for tests: a seam kept out of the production Pipeline
// interface. Only tests include this header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "actors/pipeline.h"

namespace cleave {

class PipelineTestHooks {
 public:
  virtual ~PipelineTestHooks() = default;
  // Kills actor `index` (0-based) of `kind` ("prefill", "decode",
  // "colocated", "vision_encoder") as if it crashed (exit_reason::kill).
  // not_found when there is no such live actor.
  virtual Status kill_actor(const std::string& kind, int32_t index) = 0;
  // Sends `bytes` as the main message of actor `index` of `kind` (stages
  // and router: a request; kv_store: a KvPut; vision_encoder: an
  // EncodeRequest) and returns its answer as a Status (a typed error for
  // bytes that do not decode).
  virtual Status send_raw(const std::string& kind, int32_t index, const std::vector<char>& bytes) = 0;
};

// The actor topologies' hooks; null for mono (it has no actors).
inline PipelineTestHooks* test_hooks(Pipeline& pipeline) { return pipeline.hooks(); }

}  // namespace cleave
