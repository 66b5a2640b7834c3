// The flags that choose one process's topology, shared by `cleave serve`
// and `cleave run-batch`: --topology, the actor counts, threads, context,
// sequences per engine, prefill chunk and admission.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "actors/pipeline.h"

namespace cleave {

// The flags that choose a run's arithmetic: -ctk / --cache-type-k and
// -ctv / --cache-type-v (llama.cpp's spellings), the KV cache's element
// types: f32 (the default: exact), f16, q8_0; --block-size (vLLM's
// spelling), token positions per KV block, which is also the tile that
// attention reduces over, so it changes the last bits of the logits; --compute exact|int8, how
// matmuls over Q8_0 weights compute (kernels/backend.h's Compute); and
// --device cpu|cuda:N (EngineOptions::device).
struct NumericsArgs {
  std::string k = "f32", v = "f32";
  int32_t block_size = 16;
  std::string compute = "exact";
  std::string device = "cpu";  // --device: where the engines' forward pass runs
};
void add_numerics_options(CLI::App* cmd, NumericsArgs& a);
// Sets eo's cache types and compute from the flags (their spellings checked
// by CLI; a model without Q8_0 weights refuses int8 when the engine is made).
void apply_numerics(const NumericsArgs& a, EngineOptions& eo);
// The flags' arithmetic in words ("KV f32 K / f32 V in blocks of 16,
// compute exact, device cpu"): what, beside the model, decides the tokens
// (a job resumed under other words is refused). The device's kind only: any
// GPU gives the same bits.
std::string numerics_settings(const NumericsArgs& a);
// jobs::JobOptions::settings: the model's and the mmproj's (null: none)
// bytes, hashed as the engine fingerprints them, and numerics_settings.
std::string job_settings(const GgufFile& model, const GgufFile* mmproj, const NumericsArgs& numerics);

struct ProcessTopologyArgs {
  std::string topology = "mono";
  int32_t threads = 0, ctx = 0, parallel = 8, ubatch = 512;
  int32_t prefill_actors = 1, decode_actors = 1, colocated_actors = 1, vision_actors = 1;
  int32_t max_pending = 1024;
  std::string scheduling_policy = "fcfs";  // vLLM's --scheduling-policy
  std::string experts;  // --experts: FFN expert hosts (model/experts.h's spelling)
  int32_t expert_micro_batches = 1;
  bool enable_eplb = false;
  int32_t pipeline_parallel_size = 1, pipeline_micro_batches = 1;
  NumericsArgs numerics;
};

inline constexpr const char* kPipelineParallelHelp =
    "pipeline parallelism (vLLM's spelling): each engine's layers cut evenly into this many stages "
    "(pipeline stage actors in colocated and pd, threads in mono); same tokens for any value";
inline constexpr const char* kPipelineMicroBatchesHelp =
    "each step's rows go through the pipeline stages in this many micro-batches, one behind another, "
    "so the stages work at once (same tokens for any value)";
inline constexpr const char* kPipelineMicroBatchesNeeds = "needs --pipeline-parallel-size above 1";
inline constexpr const char* kPipelineWithExperts =
    "pipeline stages and expert hosts (--experts) together are not supported";

inline constexpr const char* kExpertsHelp =
    "attention/FFN disaggregation: the FFN experts on their own hosts (expert actors in colocated "
    "and pd, in-process hosts in mono); sets separated by ';', each EXPERTS[@LAYERS], e.g. "
    "'0-3;4-7', 'all;all' (replicas), 'all@0-5;all@6-11'; a dense model's FFN is expert 0";
inline constexpr const char* kExpertMicroBatchesHelp =
    "micro-batch ping-pong: each step's rows go through a layer in this many groups, so attention on "
    "one overlaps the expert hosts' FFN of another (same tokens for any value)";
inline constexpr const char* kExpertMicroBatchesNeeds = "needs expert hosts (--experts)";
inline constexpr const char* kEnableEplbHelp =
    "expert load balancing (vLLM's spelling): once per model step, when the expert hosts' rows spread "
    "over 25 %, copy the most loaded host's best expert onto the least loaded one (same tokens)";
// --experts' sets ({} for ""); CLI::ValidationError naming the flag for a bad spelling.
std::vector<ExpertSet> parse_experts_flag(const std::string& spec);

void add_process_topology_options(CLI::App* cmd, ProcessTopologyArgs& args);

// Refuses (CLI::ValidationError naming the flag) the counts a topology does
// not use; call before loading anything.
void check_process_topology_flags(CLI::App* cmd, const ProcessTopologyArgs& args, bool has_mmproj);
// The PipelineOptions the flags give (mmproj: an open mmproj or null).
PipelineOptions process_pipeline_options(const ProcessTopologyArgs& args,
                                         std::shared_ptr<const GgufFile> mmproj);

}  // namespace cleave
