// One inference topology in one process, behind a CAF-free interface: the
// CLI, the benchmarks and the tests use this header; CAF stays inside
// actors/*.cpp.
//
//   mono       one Engine + Scheduler on a thread, no actors between stages
//   colocated  N actors that each prefill and decode (chunked prefill, so a
//              long prompt never stalls decoding), behind the router
//   pd         prefill actors -> KV through the kv_store actor -> decode
//              actors, behind the router
//
// With an mmproj (a CLIP vision encoder), colocated and pd also run
// vision_encoder actors (pd + encoders = E/P/D): the router sends a request
// whose images lack embeddings to the least loaded encoder first. mono
// encodes on its own thread, before the request's prefill.
//
// Every message between actors is Cap'n Proto bytes (schema/codec.h), in
// process too. For one backend, a request's tokens and logits are the same
// in every topology (DESIGN.md invariant 1).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/kv_stream.h"
#include "actors/pd_controller.h"
#include "actors/scale_controller.h"
#include "actors/placement.h"
#include "frontend/frontend.h"
#include "common/status.h"
#include "model/engine.h"
#include "model/experts.h"
#include "model/layer_compute.h"
#include "model/gguf.h"
#include "model/request.h"
#include "model/scheduler.h"
#include "model/tokenizer.h"
#include "model/vision_encoder.h"
#include "schema/messages.h"

namespace cleave {

enum class Topology { mono, colocated, pd };
const char* topology_name(Topology t);
// invalid_argument naming the accepted values for anything else.
Result<Topology> parse_topology(const std::string& name);

struct PipelineOptions {
  Topology topology = Topology::mono;
  int32_t prefill_actors = 1;    // pd
  int32_t decode_actors = 1;     // pd
  int32_t colocated_actors = 1;  // colocated
  // The vision encoder (a llama.cpp mmproj file); null: text only, requests
  // must come with their images encoded. colocated / pd run vision_actors
  // encoder actors; mono one encoder inline. vision.n_embd is set from the
  // model (the projector must fit it).
  std::shared_ptr<const GgufFile> mmproj;
  int32_t vision_actors = 1;
  VisionEncoderOptions vision;
  EngineOptions engine;          // per engine (each actor owns one)
  SchedulerOptions scheduler;    // per scheduler (prefill_only is set for pd prefill)
  int32_t max_pending = 1024;    // requests admitted and not finished; beyond: busy
  // Where the router places new requests and hand-offs (actors/placement.h);
  // colocated and pd.
  PlacementConfig placement;
  // KV store tiers: tier 0 and tier 1 capacities in bytes (0: 64 MiB each),
  // and the RocksDB directory of tier 2 (empty: no disk tier).
  size_t kv_tier0_bytes = 0, kv_tier1_bytes = 0;
  std::string kv_dir;
  // The store is RocksDB alone (kv_dir required; make_kv_store's durable):
  // batch jobs, whose requests resume from it after a restart. mono has a
  // store only with kv_dir: its engine's new full blocks go to it after
  // each step and resume() reads them back.
  bool kv_durable = false;
  // The RocksDB tier's capacity (0: 16 GiB): beyond it the least recently
  // used blocks are dropped (a batch job's finished requests' first: nothing
  // reads them again), so a job's disk use stays bounded.
  size_t kv_disk_bytes = 0;
  // pd: how KV moves from prefill to decode actors (actors/kv_stream.h).
  KvStreamOptions kv_stream;
  // Attention/FFN disaggregation (model/experts.h): each set is one expert
  // host holding those experts (layer ranges, replicas allowed), and every
  // stage sends each layer's FFN rows to them; together the sets must hold
  // every expert of every layer (not_found naming the first they miss).
  // colocated / pd: one expert actor per set (the stages become attention
  // actors); mono: the hosts in process, without actors. Empty: each engine
  // computes its FFN itself. Tokens and logits are the same either way.
  std::vector<ExpertSet> experts;
  // Hot-expert replication (model/expert_balance.h, the default
  // ReplicationPolicy): once per model step, when the hosts' rows spread
  // over the policy's max, the most loaded host's best expert is copied to
  // the least loaded one. Needs experts (invalid_argument otherwise).
  // Never changes a token.
  bool expert_replication = false;
  // pd: the router moves stages between prefill and decode against these
  // TTFT / TPOT goals (actors/pd_controller.h); off while no goal is set.
  // Refused for another topology and with pipeline stages.
  PdControllerConfig pd_controller;
  // colocated / pd: the router parks and unparks the entry stages (prefill
  // in pd) against a TTFT goal (actors/scale_controller.h); off while no
  // goal is set. Refused for mono, with pipeline stages and with
  // pd_controller.
  AutoscaleConfig autoscale;
  // Pipeline parallelism (model/layer_stage.h): each prefill, decode and
  // colocated actor is the first stage of a pipeline cut into these layer
  // ranges (in order, covering the model: check_cover's errors otherwise);
  // its engine holds the first range, pipeline stage actors the others.
  // mono takes colocated_pipeline and runs the later stages on threads.
  // Empty: each engine holds the whole model. Prefill and decode may be cut
  // differently: the KV a prefill hands off covers every layer. Tokens and
  // logits are the same for any cut (and any
  // engine.pipeline_micro_batches). Not with experts (invalid_argument).
  std::vector<LayerRange> prefill_pipeline, decode_pipeline, colocated_pipeline;
  // A role whose cut above is empty is cut evenly into this many stages
  // (vLLM's --pipeline-parallel-size); 1: none. 1..n_layers.
  int32_t pipeline_parallel_size = 1;
  int32_t actor_threads = 0;     // CAF scheduler workers; 0: CAF's default
  // A request that makes no progress (no token, handoff or re-placement)
  // for this long fails with timed_out: the last guard against a hang.
  double request_timeout_s = 300;
};

class PipelineTestHooks;  // actors/pipeline_testing.h: fault injection, tests only

class Pipeline : public Frontend {
 public:
  // tokenizer may be null. invalid_argument for bad counts or options.
  static Result<std::unique_ptr<Pipeline>> create(std::shared_ptr<const GgufFile> file,
                                                  std::shared_ptr<const Tokenizer> tokenizer,
                                                  const PipelineOptions& options);
  ~Pipeline() override = default;

  // Admits a request: busy when max_pending requests are in flight (the
  // callback is not called then), validate_request()'s errors for a bad one,
  // unavailable when no actor of a needed kind is alive. Otherwise every
  // admitted request gets exactly one finished or failed event, never none.
  Status submit(GenerateRequest request, EventCallback on_event) override = 0;
  Status cancel(uint64_t request_id) override = 0;
  // Submits all and waits for every one to finish or fail
  // (run_to_completion, frontend/frontend.h).
  Result<std::vector<Completion>> run(std::vector<GenerateRequest> requests);

  // Each actor's counters (requests, tokens, queue depth, KV blocks moved,
  // failures, ...), gathered through the stats message.
  std::vector<msg::Stats> stats() override = 0;
  // Live actors of a kind ("prefill", "decode", "colocated", "kv_store",
  // "vision_encoder").
  virtual int32_t alive(const std::string& kind) = 0;
  virtual const PipelineOptions& options() const = 0;

 private:
  friend PipelineTestHooks* test_hooks(Pipeline& pipeline);
  virtual PipelineTestHooks* hooks() { return nullptr; }  // mono: none
};

}  // namespace cleave
