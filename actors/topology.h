// Topology scripts: a Lua 5.4 file says which nodes make up the cluster and
// which actors each one hosts. The script runs in a sandbox (base minus
// file/bytecode loading, string without pattern matching, table, math, utf8;
// text chunks only; instruction, memory and time limits) and every problem
// comes back as a Status naming the script line. CAF-free: `cleave topology`
// and the tests use it without an actor system. The Lua API is documented in
// examples/README.md.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "actors/pd_controller.h"
#include "kernels/backend.h"  // Compute
#include "kernels/dtype.h"
#include "actors/scale_controller.h"
#include "actors/placement.h"
#include "common/status.h"
#include "model/experts.h"
#include "model/layer_compute.h"
#include "model/scheduling_policy.h"

namespace cleave {

// The actor kinds a script may name are actors/actor_kind.h's table;
// kinds that later work implements (attention, expert, stage) are refused,
// naming the implemented ones.
bool is_actor_kind(std::string_view kind);

struct ActorGroupSpec {
  std::string kind;
  int32_t count = 1;
  int32_t line = 0;
};

// stage = { layers = {first, last}, pipeline = "NAME" }: the node's part of
// a pipeline (model/layer_stage.h). On a node whose one prefill, decode or
// colocated actor is the first stage (layers from 0), or on a node with a
// stage actor (a later stage).
struct PipelineStageSpec {
  bool set = false;
  std::string pipeline = "main";
  LayerRange layers;
};

struct NodeSpec {
  std::string name;             // unique, [A-Za-z0-9_-]{1,64}
  std::string host = "127.0.0.1";
  int32_t port = 0;             // 0: ephemeral (the head prints the bound port)
  int32_t threads = 0;          // 0: default
  std::string device = "cpu";   // "cpu" or "cuda:N"
  bool head = false;            // hosts the router; exactly one node is the head
  // node { cost = 1.5 }: what its capacity costs against a node at 1
  // (cost_aware placement scores measured performance over it); > 0.
  double cost = 1.0;
  // node { model = "path.gguf" }: the model its actors serve; "" = the one
  // the command's -m names. Nodes of one model share a router and a KV
  // store on the head (cluster_models).
  std::string model;
  // node { mmproj = "path.gguf" }: the vision encoder of the node's model
  // (its vision_encoder actors load it; the head serves that model's image
  // requests with it); "" = the command's --mmproj. The nodes of one model
  // that name one name the same file (model_mmproj).
  std::string mmproj;
  std::vector<ActorGroupSpec> actors;  // in kActorKindTable order, one group per kind
  uint64_t kv_tier0_bytes = 0, kv_tier1_bytes = 0;  // per kv_store; 0 = default
  std::string kv_dir;           // RocksDB dir of that node's kv_store ("" = none)
  bool kv_durable = false;      // kv.durable: RocksDB is the store's only tier
  // What each of the node's expert actors hosts: expert = { experts = {...},
  // layers = {first, last} }; the default hosts every expert of every layer.
  ExpertSet experts;
  PipelineStageSpec stage;
  int32_t line = 0;             // script line that declared it (for errors)

  int32_t count(const std::string& kind) const;
};

struct ClusterSpec {
  std::vector<NodeSpec> nodes;  // in declaration order
  // router = "NAME" or router = { policy = "kv_aware", prefill_weight = W,
  // decode_weight = W, fetch_weight = W } (actors/placement.h).
  PlacementConfig placement;
  int32_t max_pending = 1024;
  // cluster { scheduling_policy = "priority" }: every stage's scheduler and
  // the router's admission (model/scheduling_policy.h).
  SchedulingPolicy scheduling_policy = SchedulingPolicy::fcfs;
  // cluster { pd_controller = { ttft_ms = 500, tpot_ms = 50, ... } }: the
  // router moves stages between prefill and decode (actors/pd_controller.h);
  // needs prefill and decode actors.
  PdControllerConfig pd_controller;
  // cluster { autoscale = { ttft_ms = 500, forecast = "holt", ... } }: the
  // router parks and unparks entry stages against a TTFT goal
  // (actors/scale_controller.h); not with pd_controller.
  AutoscaleConfig autoscale;
  double request_timeout_s = 300;
  double heartbeat_interval_s = 0.1, connection_timeout_s = 0.5;  // middleman supervision
  // Nodes read the cluster secret from secret_file when it is set, else from
  // the environment variable secret_env.
  std::string secret_env = "CLEAVE_CLUSTER_SECRET", secret_file;
  // cluster { kv_pool = true }: every node's kv_store joins one pool (the
  // head's store keeps its index); new requests read their prompt's blocks
  // from it, kv_aware placement and the router's preloads use it. A worker
  // may host a kv_store only then. kv_replicate_reads: see KvStoreRole.
  bool kv_pool = false;
  int32_t kv_replicate_reads = 2;
  // kv_preload = false: the router does not start the chosen stage's fetch
  // ahead of it (the stage fetches when it takes the request).
  bool kv_preload = true;
  // cluster { cache_type_k = "f16", cache_type_v = "q8_0" }: the KV cache's
  // element types on every node (llama.cpp's -ctk / -ctv; f32, f16, q8_0, q4_0).
  // Cluster-wide: blocks move between nodes only between equal layouts.
  DType cache_type_k = DType::F32, cache_type_v = DType::F32;
  // cluster { block_size = 64 }: token positions per KV block on every node
  // (--block-size; 8, 16, 32, 64 or 128). Cluster-wide for the same reason.
  int32_t block_size = 16;
  // cluster { compute = "int8" }: how every node's matmuls over Q8_0 weights
  // compute (--compute; exact or int8). Cluster-wide, as the KV bits and so
  // the model fingerprint depend on it.
  Compute compute = Compute::exact;
  // What it was loaded from (load_topology_*): the script's text, the name
  // its messages use and the --set pairs. A head hands them to a node that
  // joins with `cleave node --join HOST:PORT` (load_joined_topology).
  std::string source, source_name;
  std::map<std::string, std::string> source_args;

  const NodeSpec* find(const std::string& name) const;
  const NodeSpec& head() const;  // a loaded spec always has exactly one
  int32_t count(const std::string& kind) const;  // over all nodes
  // Over the nodes that serve `model` (a NodeSpec::model value).
  int32_t count(const std::string& kind, const std::string& model) const;
};

// The models a cluster serves (NodeSpec::model values, "" for the -m one):
// the head's first, then in declaration order, each once.
std::vector<std::string> cluster_models(const ClusterSpec& spec);
// The mmproj the nodes of `model` (a cluster_models() entry) name in their
// node{}.mmproj; "" when none does (check_topology refuses two names).
std::string model_mmproj(const ClusterSpec& spec, const std::string& model);

struct TopologyLimits {
  uint64_t max_instructions = 10'000'000;
  size_t max_memory_bytes = 16 << 20;
  // Wall clock, for time spent inside library calls that the instruction
  // count does not see (e.g. string.rep of big strings in a loop).
  double max_seconds = 5.0;
};

// A node the script does not declare, joining a running cluster with
// `cleave node --join HOST:PORT --name NAME --actors decode=2,...`:
// appended as a worker (127.0.0.1, a free port, the head's model) with
// those actors. Kinds: prefill, decode, colocated, vision_encoder (the
// others need fields of the script: kv_store, expert, stage); counts
// 1..4096, each kind once (the loaded cluster already serves both
// sides). invalid_argument naming the problem: a name the script
// declares, a bad name, an unknown or refused kind, a bad count.
Status add_joining_node(ClusterSpec& spec, const std::string& name, const std::string& actors);

// The spec a head hands a joining node: its script text and --set pairs
// loaded again, with the head's host and port set to where it was reached
// (the script may name port 0).
Result<ClusterSpec> load_joined_topology(const std::string& source, const std::string& source_name,
                                         const std::map<std::string, std::string>& args,
                                         const std::string& head_host, int32_t head_port);

// args: the `--set key=value` pairs, visible to the script as the table
// `args` (strings) and through param(name, default), which converts to the
// default's type. Lets tests pass real ports, e.g. args.head_port.
// Errors: invalid_argument for anything wrong with the script (the message
// starts with "FILE:LINE:" where there is a line), not_found / io_error for
// the file.
Result<ClusterSpec> load_topology_file(const std::string& path,
                                       const std::map<std::string, std::string>& args = {},
                                       const TopologyLimits& limits = {});
Result<ClusterSpec> load_topology_string(const std::string& script, const std::string& chunkname,
                                         const std::map<std::string, std::string>& args = {},
                                         const TopologyLimits& limits = {});

// The expert placement against the model: every node's expert set fits it
// (invalid_argument naming the node), and every expert of every layer has a
// host (invalid_argument naming the expert and layer). Ok when no node hosts
// expert actors. `cleave topology check -m` and every node at start run it.
Status check_topology_experts(const ClusterSpec& spec, const LlamaConfig& model);

// Every pipeline (the nodes whose stage{} names it) has one first stage and
// later stages whose ranges follow it without a gap or an overlap; with the
// model, the last one ends at its last layer and none goes past it.
// invalid_argument naming the pipeline, the nodes and the layers. The
// loader runs it without a model; `cleave topology check -m` and every node
// at start with one.
Status check_topology_pipelines(const ClusterSpec& spec, const LlamaConfig* model);
// The stages of pipeline `name` in layer order (the first stage first).
std::vector<const NodeSpec*> pipeline_nodes(const ClusterSpec& spec, const std::string& name);

// A human table: node, host:port, role, threads, device, actors, kv tiers;
// the cluster settings above it and the actor totals below.
std::string placement_table(const ClusterSpec& spec);
// "3 nodes, 5 actors (prefill 1, decode 2, kv_store 2), head 'head' at 127.0.0.1:0"
std::string topology_summary(const ClusterSpec& spec);

}  // namespace cleave
