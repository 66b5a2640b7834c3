#include "actors/hosted.h"

#include "storage/device_tier.h"

#include <filesystem>

#include "model/llama.h"
#include "storage/memory_tier.h"
#ifdef CLEAVE_HAVE_ROCKSDB
#include "storage/rocksdb_tier.h"
#endif

namespace cleave {

Result<std::unique_ptr<StageCore>> make_pipelined_core(std::shared_ptr<const GgufFile> file,
                                                       std::shared_ptr<const Tokenizer> tokenizer,
                                                       const EngineOptions& engine,
                                                       const SchedulerOptions& scheduler,
                                                       std::string name,
                                                       const std::vector<LayerRange>& cut,
                                                       std::vector<std::shared_ptr<LayerStage>>& later) {
  later.clear();
  EngineOptions eo = engine;
  if (!cut.empty()) {
    auto lm = LlamaModel::load(file);
    if (!lm.ok()) return lm.status();
    Status covered = check_cover(cut, (*lm)->config().n_layers);
    if (!covered.ok()) return Status(covered.code(), "pipeline cut: " + covered.message());
    eo.last_layer = cut.size() > 1 ? cut[0].last : -1;
  }
  auto core = StageCore::create(file, std::move(tokenizer), eo, scheduler, std::move(name));
  if (!core.ok()) return core.status();
  const Engine& e = (*core)->engine();
  for (size_t i = 1; i < cut.size(); ++i) {
    auto st = LayerStage::create(file, cut[i], e.total_blocks(), e.options().block_size,
                                 engine.threads, e.options().cache_type_k, e.options().cache_type_v,
                                 e.options().compute, engine.device);
    if (!st.ok()) return st.status();
    later.push_back(std::move(st.value()));
  }
  return core;
}

Result<HostedActors> make_hosted_actors(const HostedSpec& spec) {
  HostedActors out;
  for (const auto& [kind, count] : spec.groups) {
    const std::string base = spec.name_prefix + actor_kind_name(kind) + "/";
    if (kind == ActorKind::kv_store) continue;
    if (kind == ActorKind::vision_encoder) {
      if (!spec.mmproj)
        return Status(Code::invalid_argument, "vision_encoder actors need a vision encoder file (--mmproj)");
      auto lm = LlamaModel::load(spec.file);
      if (!lm.ok()) return lm.status();
      VisionEncoderOptions vo = spec.vision;
      vo.n_embd = (*lm)->config().dim;
      vo.device = spec.engine.device;  // encoders run where the node's engines do
      for (int32_t i = 0; i < count; ++i) {
        auto e = VisionEncoder::create(spec.mmproj, vo);
        if (!e.ok()) return e.status();
        out.encoders.push_back(std::move(e.value()));
      }
      continue;
    }
    if (kind == ActorKind::expert) {
      if (size_t(count) != spec.experts.size())
        return Status(Code::invalid_argument, "expert actors: " + std::to_string(count) +
                                                  " asked for, " + std::to_string(spec.experts.size()) +
                                                  " expert sets given");
      for (const ExpertSet& set : spec.experts) {
        auto h = ExpertHost::create(spec.file, set, spec.engine.threads, spec.engine.compute, spec.engine.device);
        if (!h.ok()) return h.status();
        out.experts.emplace_back(set, std::shared_ptr<ExpertHost>(std::move(h.value())));
      }
      continue;
    }
    if (kind == ActorKind::stage) {
      auto lm = LlamaModel::load(spec.file);
      if (!lm.ok()) return lm.status();
      const int32_t pool = kv_pool_blocks(spec.engine, (*lm)->config());
      if (size_t(count) != spec.stage_layers.size())
        return Status(Code::invalid_argument, "stage actors: " + std::to_string(count) +
                                                  " asked for, " +
                                                  std::to_string(spec.stage_layers.size()) +
                                                  " layer ranges given");
      for (const LayerRange& r : spec.stage_layers) {
        auto st = LayerStage::create(spec.file, r, pool, spec.engine.block_size, spec.engine.threads,
                                     spec.engine.cache_type_k, spec.engine.cache_type_v,
                                     spec.engine.compute, spec.engine.device);
        if (!st.ok()) return st.status();
        out.remote_stages.push_back(std::move(st.value()));
      }
      continue;
    }
    CLEAVE_CHECK(actor_kind_info(kind).stage);
    SchedulerOptions so = spec.scheduler;
    so.prefill_only = kind == ActorKind::prefill;
    auto cut = spec.pipelines.find(kind);
    for (int32_t i = 0; i < count; ++i) {
      std::vector<std::shared_ptr<LayerStage>> later;
      auto core = make_pipelined_core(spec.file, spec.tokenizer, spec.engine, so,
                                      base + std::to_string(i),
                                      cut == spec.pipelines.end() ? std::vector<LayerRange>{}
                                                                  : cut->second,
                                      later);
      if (!core.ok()) return core.status();
      out.stages.emplace_back(kind, std::shared_ptr<StageCore>(std::move(core.value())));
      out.pipeline_stages.push_back(std::move(later));
      if (spec.attention) {
        auto fallback = ExpertHost::create(spec.file, ExpertSet{}, spec.engine.threads,
                                           spec.engine.compute, spec.engine.device);
        if (!fallback.ok()) return fallback.status();
        out.expert_fallbacks.push_back(std::move(fallback.value()));
      }
    }
  }
  out.expert_replication = spec.expert_replication;
  return out;
}

Result<std::shared_ptr<TieredStore>> make_kv_store(size_t tier0_bytes, size_t tier1_bytes,
                                                   const std::string& dir, uint64_t fp,
                                                   const KvLayout& layout, bool durable, size_t disk_bytes,
                                                   std::shared_ptr<Backend> device) {
  constexpr size_t kDefaultTierBytes = size_t(64) << 20;
  std::vector<std::unique_ptr<Tier>> tiers;
  if (durable && dir.empty())
    return Status(Code::invalid_argument, "a durable KV store needs a directory (kv_dir)");
  if (durable && device)
    return Status(Code::invalid_argument, "a durable KV store keeps no memory tiers: no " +
                                              device->caps().name + " tier (the engines' KV is on the device)");
  if (device) {
    auto t0 = DeviceTier::create(*device, tier0_bytes ? tier0_bytes : kDefaultTierBytes, fp, layout);
    if (!t0.ok()) return t0.status();
    tiers.push_back(std::move(t0.value()));
    auto t1 = MemoryTier::create(MemoryKind::pinned_host, tier1_bytes ? tier1_bytes : kDefaultTierBytes,
                                 fp, layout, device.get());
    if (!t1.ok()) return t1.status();
    tiers.push_back(std::move(t1.value()));
  } else if (!durable) {
    auto t0 = MemoryTier::create(MemoryKind::host_arena, tier0_bytes ? tier0_bytes : kDefaultTierBytes,
                                 fp, layout);
    if (!t0.ok()) return t0.status();
    tiers.push_back(std::move(t0.value()));
    auto t1 = MemoryTier::create(MemoryKind::pinned_host, tier1_bytes ? tier1_bytes : kDefaultTierBytes,
                                 fp, layout);
    if (!t1.ok()) return t1.status();
    tiers.push_back(std::move(t1.value()));
  }
  if (!dir.empty()) {
#ifdef CLEAVE_HAVE_ROCKSDB
    RocksDbTierOptions ro;
    ro.capacity_bytes = disk_bytes ? disk_bytes : size_t(16) << 30;
    ro.model_fingerprint = fp;
    ro.sync = !durable;  // durable: every put, so no fsync each (see hosted.h)
    ro.layout = layout;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);  // RocksDB would make only the last part
    auto t2 = RocksDbTier::open(dir, ro);
    if (!t2.ok()) return t2.status();
    tiers.push_back(std::move(t2.value()));
#else
    return Status(Code::unsupported,
                  "kv_dir '" + dir + "': this build has no RocksDB tier (CLEAVE_STORAGE=OFF)");
#endif
  }
  auto store = TieredStore::create(std::move(tiers), fp, layout);
  if (!store.ok()) return store.status();
  // The tiers use the backend until the store is gone: it goes after.
  return std::shared_ptr<TieredStore>(store.value().release(),
                                      [device](TieredStore* s) { delete s; });
}

Result<std::shared_ptr<Backend>> kv_store_backend(const std::string& device) {
  auto d = parse_device(device);
  if (!d.ok()) return d.status();
  if (d->kind == Device::Kind::cpu) return std::shared_ptr<Backend>();
  auto be = make_backend(*d, 1);
  if (!be.ok()) return Status(be.status().code(), "kv_store on " + device + ": " + be.status().message());
  return std::shared_ptr<Backend>(std::move(be.value()));
}

}  // namespace cleave
