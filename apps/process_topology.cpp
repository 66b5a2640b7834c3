#include "apps/process_topology.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "kernels/backend.h"     // kv_type_from_name
#include "storage/block.h"       // kKvBlockSizes, checksum_bytes

namespace cleave {

void add_numerics_options(CLI::App* cmd, NumericsArgs& a) {
  const auto types = CLI::IsMember({"f32", "f16", "q8_0", "q4_0"});
  // -ctk / -ctv are rewritten to these by rewrite_short_flags (CLI11 takes
  // one-letter short names only).
  cmd->add_option("--cache-type-k", a.k,
                  "KV cache type for K: f32 (exact), f16, q8_0 or q4_0 (these two: head_dim a multiple of 32)")
      ->check(types);
  cmd->add_option("--cache-type-v", a.v, "KV cache type for V: f32, f16, q8_0 or q4_0")->check(types);
  cmd->add_option("--block-size", a.block_size,
                  "token positions per KV block: 8, 16 (the default), 32, 64 or 128; longer blocks "
                  "read long contexts faster, shorter ones share prefixes more finely")
      ->check(CLI::IsMember(std::vector<int32_t>(std::begin(kKvBlockSizes), std::end(kKvBlockSizes))));
  cmd->add_option("--compute", a.compute,
                  "how matmuls over Q8_0 weights compute: exact (F32, the default) or int8 "
                  "(activations quantised per 32 values, integer dot products; faster, not equal "
                  "to exact; needs a Q8_0 model)")
      ->check(CLI::IsMember({"exact", "int8"}));
  cmd->add_option("--device", a.device,
                  "where each engine's forward pass runs: cpu (the default) or cuda:N (weights, "
                  "activations and KV in GPU memory; the bits differ from the CPU's)")
      ->check([](const std::string& s) {
        auto d = parse_device(s);
        return d.ok() ? std::string() : d.status().message();
      });
}

void apply_numerics(const NumericsArgs& a, EngineOptions& eo) {
  eo.cache_type_k = *kv_type_from_name(a.k);
  eo.cache_type_v = *kv_type_from_name(a.v);
  eo.block_size = a.block_size;
  eo.compute = *compute_from_name(a.compute);
  eo.device = a.device;
}

std::string numerics_settings(const NumericsArgs& a) {
  return "KV " + a.k + " K / " + a.v + " V in blocks of " + std::to_string(a.block_size) + ", compute " +
         a.compute + ", device " + a.device.substr(0, a.device.find(':'));
}

std::string job_settings(const GgufFile& model, const GgufFile* mmproj, const NumericsArgs& numerics) {
  auto hex = [](uint64_t v) {
    char b[17];
    std::snprintf(b, sizeof b, "%016llx", (unsigned long long)v);
    return std::string(b);
  };
  std::string s = "model " + hex(checksum_bytes(model.data(), model.file_size()));
  if (mmproj) s += ", mmproj " + hex(checksum_bytes(mmproj->data(), mmproj->file_size()));
  return s + ", " + numerics_settings(numerics);
}

void add_process_topology_options(CLI::App* cmd, ProcessTopologyArgs& a) {
  cmd->add_option("--topology", a.topology, "mono, colocated or pd")
      ->check(CLI::IsMember({"mono", "colocated", "pd"}));
  cmd->add_option("--prefill-actors", a.prefill_actors, "prefill actors (pd)")->check(CLI::Range(1, 64));
  cmd->add_option("--decode-actors", a.decode_actors, "decode actors (pd)")->check(CLI::Range(1, 64));
  cmd->add_option("--colocated-actors", a.colocated_actors, "colocated actors (colocated)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--vision-actors", a.vision_actors, "vision_encoder actors (colocated, pd)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("-t,--threads", a.threads, "threads per engine (default: all cores)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("-c,--ctx-size", a.ctx, "context size (0: the model's)")->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--parallel,--max-num-seqs", a.parallel, "sequences each engine runs at once (-np)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--ubatch-size", a.ubatch, "prompt tokens per prefill step")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-pending", a.max_pending,
                  "requests admitted and not finished; beyond: busy (serve: 503 with Retry-After)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--scheduling-policy", a.scheduling_policy,
                  "fcfs (arrival order; a request's nonzero \"priority\" is refused) or priority "
                  "(lower \"priority\" first; it may preempt a running request of a higher value)")
      ->check(CLI::IsMember({"fcfs", "priority"}));
  cmd->add_option("--experts", a.experts, kExpertsHelp);
  cmd->add_option("--expert-micro-batches", a.expert_micro_batches, kExpertMicroBatchesHelp)
      ->check(CLI::Range(1, 64));
  cmd->add_flag("--enable-eplb", a.enable_eplb, kEnableEplbHelp);
  cmd->add_option("--pipeline-parallel-size", a.pipeline_parallel_size, kPipelineParallelHelp)
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--pipeline-micro-batches", a.pipeline_micro_batches, kPipelineMicroBatchesHelp)
      ->check(CLI::Range(1, 64));
  add_numerics_options(cmd, a.numerics);
}

std::vector<ExpertSet> parse_experts_flag(const std::string& spec) {
  if (spec.empty()) return {};
  auto sets = parse_expert_sets(spec);
  if (!sets.ok()) {
    std::string why = sets.status().message();
    if (why.rfind("--experts: ", 0) == 0) why.erase(0, 11);  // ValidationError names the flag
    throw CLI::ValidationError("--experts", why);
  }
  return std::move(sets.value());
}

void check_process_topology_flags(CLI::App* cmd, const ProcessTopologyArgs& a, bool has_mmproj) {
  const Topology topology = *parse_topology(a.topology);
  auto given = [&](const char* flag) { return cmd->get_option(flag)->count() > 0; };
  if ((given("--prefill-actors") || given("--decode-actors")) && topology != Topology::pd)
    throw CLI::ValidationError(given("--prefill-actors") ? "--prefill-actors" : "--decode-actors",
                               "needs --topology pd");
  if (given("--colocated-actors") && topology != Topology::colocated)
    throw CLI::ValidationError("--colocated-actors", "needs --topology colocated");
  if (given("--vision-actors") && (topology == Topology::mono || !has_mmproj))
    throw CLI::ValidationError("--vision-actors", "needs --mmproj and --topology colocated or pd");
  if (given("--experts")) parse_experts_flag(a.experts);
  if (given("--expert-micro-batches") && a.experts.empty())
    throw CLI::ValidationError("--expert-micro-batches", kExpertMicroBatchesNeeds);
  if (a.enable_eplb && a.experts.empty()) throw CLI::ValidationError("--enable-eplb", kExpertMicroBatchesNeeds);
  if (given("--pipeline-micro-batches") && a.pipeline_parallel_size < 2)
    throw CLI::ValidationError("--pipeline-micro-batches", kPipelineMicroBatchesNeeds);
  if (a.pipeline_parallel_size > 1 && !a.experts.empty())
    throw CLI::ValidationError("--pipeline-parallel-size", kPipelineWithExperts);
}

PipelineOptions process_pipeline_options(const ProcessTopologyArgs& a,
                                         std::shared_ptr<const GgufFile> mmproj) {
  PipelineOptions po;
  po.topology = *parse_topology(a.topology);
  po.prefill_actors = a.prefill_actors;
  po.decode_actors = a.decode_actors;
  po.colocated_actors = a.colocated_actors;
  po.engine.threads = a.threads > 0 ? a.threads : int32_t(std::max(1u, std::thread::hardware_concurrency()));
  po.engine.context = a.ctx;
  po.engine.expert_micro_batches = a.expert_micro_batches;
  po.expert_replication = a.enable_eplb;
  po.engine.max_seqs = a.parallel;
  po.max_pending = a.max_pending;
  po.scheduler.policy = *parse_scheduling_policy(a.scheduling_policy);  // CLI checked the spelling
  po.mmproj = std::move(mmproj);
  po.vision_actors = a.vision_actors;
  po.vision.threads = po.engine.threads;
  po.experts = parse_experts_flag(a.experts);
  po.pipeline_parallel_size = a.pipeline_parallel_size;
  po.engine.pipeline_micro_batches = a.pipeline_micro_batches;
  apply_numerics(a.numerics, po.engine);
  return po;
}

}  // namespace cleave
