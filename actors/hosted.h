// What one process hosts, built before any actor so that engine, encoder
// and store errors come back first (no CAF). The in-process Pipeline and
// every node build their actors' plain objects here.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "actors/actor_kind.h"
#include "actors/stage_core.h"
#include "common/status.h"
#include "model/engine.h"
#include "model/experts.h"
#include "model/gguf.h"
#include "model/layer_stage.h"
#include "model/scheduler.h"
#include "model/tokenizer.h"
#include "model/vision_encoder.h"
#include "storage/tiered_store.h"

namespace cleave {

struct HostedSpec {
  std::vector<std::pair<ActorKind, int32_t>> groups;  // kinds and counts, in order
  std::string name_prefix;  // "" in process, "NODE/" on a node: names "NODE/decode/0"
  std::shared_ptr<const GgufFile> file;
  std::shared_ptr<const Tokenizer> tokenizer;  // may be null
  EngineOptions engine;
  SchedulerOptions scheduler;  // prefill_only is set for prefill stages
  std::shared_ptr<const GgufFile> mmproj;  // needed when a group is vision_encoder
  VisionEncoderOptions vision;             // n_embd is set from the model
  // An expert group's actors: one per set, each an ExpertHost of those
  // experts (its count must be experts.size()).
  std::vector<ExpertSet> experts;
  // The stages send each layer's FFN to expert actors (attention/FFN
  // disaggregation): each gets a fallback host of every expert.
  bool attention = false;
  // Their executors replicate hot experts across the expert actors
  // (PipelineOptions::expert_replication).
  bool expert_replication = false;
  // Pipeline parallelism: the layer cut of each stage kind's pipelines
  // (PipelineOptions::*_pipeline); a kind not listed holds the whole model.
  std::map<ActorKind, std::vector<LayerRange>> pipelines;
  // A stage group's actors (the later stages of other processes'
  // pipelines): one per range.
  std::vector<LayerRange> stage_layers;
};

struct HostedActors {
  std::vector<std::pair<ActorKind, std::shared_ptr<StageCore>>> stages;
  // Per stage (same order): the later stages of its pipeline, whose
  // actors this process runs (empty: its engine holds every layer).
  std::vector<std::vector<std::shared_ptr<LayerStage>>> pipeline_stages;
  // A stage group's: pipeline stages of other processes' pipelines.
  std::vector<std::shared_ptr<LayerStage>> remote_stages;
  std::vector<std::shared_ptr<VisionEncoder>> encoders;
  std::vector<std::pair<ExpertSet, std::shared_ptr<ExpertHost>>> experts;
  // With HostedSpec::attention, one per stage (same order): what a stage
  // computes itself when no live expert actor hosts an expert.
  std::vector<std::shared_ptr<ExpertHost>> expert_fallbacks;
  bool expert_replication = false;  // HostedSpec's
  // Set on a cluster node: the expert actors' batches from other processes
  // come on a data socket listening there (actors/expert_socket.h).
  std::string expert_socket_host;
};

// A StageCore whose engine holds cut[0] (the whole model when cut is
// empty), and in `later` the LayerStages of the other ranges, sized for its
// KV pool. check_cover's errors for a cut that does not cover the model.
Result<std::unique_ptr<StageCore>> make_pipelined_core(std::shared_ptr<const GgufFile> file,
                                                       std::shared_ptr<const Tokenizer> tokenizer,
                                                       const EngineOptions& engine,
                                                       const SchedulerOptions& scheduler,
                                                       std::string name,
                                                       const std::vector<LayerRange>& cut,
                                                       std::vector<std::shared_ptr<LayerStage>>& later);

// Stage cores and vision encoders for every group (kv_store groups are
// skipped: the store is made by make_kv_store). invalid_argument for a
// vision_encoder group without an mmproj.
Result<HostedActors> make_hosted_actors(const HostedSpec& spec);

// The kv_store's tiers: host memory (tier 0) and pinned host (tier 1), of
// the given bytes each (0: 64 MiB), and RocksDB in `dir` (empty: none).
// durable (needs a dir): RocksDB is the only tier, so every block the store
// acknowledges is on disk (its WAL written, not fsync'd: it survives kill -9,
// not a power cut) and a restarted process finds it; the stages' engines
// keep the hot blocks in memory anyway. disk_bytes: the RocksDB tier's
// capacity (0: 16 GiB); past it the least recently used blocks are dropped.
// device (kv_store_backend()): tier 0 is that backend's memory (DeviceTier:
// GPU memory for CUDA) and tier 1 page-locked host memory it allocates
// (cudaHostAlloc); the store keeps the backend alive. Not durable only.
Result<std::shared_ptr<TieredStore>> make_kv_store(size_t tier0_bytes, size_t tier1_bytes,
                                                   const std::string& dir, uint64_t model_fingerprint,
                                                   const KvLayout& layout, bool durable = false,
                                                   size_t disk_bytes = 0,
                                                   std::shared_ptr<Backend> device = nullptr);
// The kv_store's own backend for engines on `device` ("cpu" or "cuda:N";
// its own, so its copies run on a stream of their own): nullptr for cpu;
// the CUDA backend's status (unavailable, saying why) when there is none.
Result<std::shared_ptr<Backend>> kv_store_backend(const std::string& device);

}  // namespace cleave
