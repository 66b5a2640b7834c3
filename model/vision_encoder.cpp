#include "model/vision_encoder.h"

#include <algorithm>
#include <chrono>

#include "model/multimodal.h"

namespace cleave {

// ---- EmbeddingCache ----

const std::vector<float>* EmbeddingCache::find(const ImageHash& hash) {
  auto it = index_.find(hash);
  if (it == index_.end()) return nullptr;
  entries_.splice(entries_.begin(), entries_, it->second);
  return &it->second->second;
}

void EmbeddingCache::insert(const ImageHash& hash, std::vector<float> embeddings) {
  const size_t need = embeddings.size() * sizeof(float);
  if (auto it = index_.find(hash); it != index_.end()) {
    bytes_ -= it->second->second.size() * sizeof(float);
    entries_.erase(it->second);
    index_.erase(it);
  }
  if (need > capacity_) return;
  while (bytes_ + need > capacity_ && !entries_.empty()) {
    bytes_ -= entries_.back().second.size() * sizeof(float);
    index_.erase(entries_.back().first);
    entries_.pop_back();
    ++evictions_;
  }
  entries_.emplace_front(hash, std::move(embeddings));
  index_.emplace(hash, entries_.begin());
  bytes_ += need;
}

// ---- VisionEncoder ----

Result<std::unique_ptr<VisionEncoder>> VisionEncoder::create(std::shared_ptr<const GgufFile> mmproj,
                                                             const VisionEncoderOptions& options) {
  if (!mmproj) return Status(Code::invalid_argument, "vision encoder: no mmproj file");
  if (options.threads < 1 || options.threads > 256)
    return Status(Code::invalid_argument, "vision encoder: threads must be between 1 and 256, got " +
                                              std::to_string(options.threads));
  if (options.max_batch < 1 || options.max_batch > 4096)
    return Status(Code::invalid_argument,
                  "vision encoder: max_batch must be between 1 and 4096, got " +
                      std::to_string(options.max_batch));
  auto clip = ClipModel::load(mmproj);
  if (!clip.ok()) return clip.status();
  if (options.n_embd != 0) CLEAVE_RETURN_IF_ERROR(check_projector_fits(**clip, options.n_embd));
  auto device = parse_device(options.device);
  if (!device.ok()) return Status(device.status().code(), "vision encoder: " + device.status().message());
  auto backend = make_backend(*device, options.threads);
  if (!backend.ok()) return Status(backend.status().code(), "vision encoder: " + backend.status().message());
  std::unique_ptr<VisionEncoder> e(new VisionEncoder());
  e->file_ = std::move(mmproj);
  e->backend_ = std::move(backend.value());
  if (e->backend_->caps().host_memory) {
    e->clip_ = std::move(clip.value());
  } else {
    auto placed = (*clip)->on(*e->backend_);
    if (!placed.ok()) return placed.status();
    e->clip_ = std::move(placed.value());
  }
  e->options_ = options;
  e->cache_ = std::make_unique<EmbeddingCache>(options.cache_bytes);
  return e;
}

Status VisionEncoder::check(const std::vector<PromptImage>& images, uint64_t request_id) const {
  return check_encodable(*clip_, images, request_id);
}

std::vector<Status> VisionEncoder::encode(std::span<std::vector<PromptImage>* const> groups,
                                          std::span<const uint64_t> request_ids) {
  auto id_of = [&](size_t g) { return g < request_ids.size() ? request_ids[g] : uint64_t(0); };
  std::vector<Status> status(groups.size());

  // Distinct images of this call: from the cache, or to be encoded.
  struct Distinct {
    ImageHash hash;
    const RgbImage* image = nullptr;
    std::vector<float> rows;
    bool encode = false;
    Status status;
  };
  std::vector<Distinct> distinct;
  std::unordered_map<ImageHash, size_t, ImageHashHasher> by_hash;
  std::vector<std::vector<std::pair<size_t, size_t>>> uses(groups.size());  // (image, distinct)
  for (size_t g = 0; g < groups.size(); ++g) {
    ++counters_.groups;
    status[g] = check(*groups[g], id_of(g));
    if (!status[g].ok()) continue;
    const std::vector<PromptImage>& images = *groups[g];
    for (size_t i = 0; i < images.size(); ++i) {
      if (!images[i].embeddings.empty()) continue;
      ++counters_.images;
      auto [it, added] = by_hash.try_emplace(images[i].hash, distinct.size());
      if (added) {
        Distinct d;
        d.hash = images[i].hash;
        d.image = &images[i].image;
        if (const std::vector<float>* hit = cache_->find(d.hash)) {
          d.rows = *hit;
          ++counters_.cache_hits;
        } else {
          d.encode = true;
          ++counters_.cache_misses;
        }
        distinct.push_back(std::move(d));
      } else {
        ++counters_.cache_hits;
      }
      uses[g].emplace_back(i, it->second);
    }
  }

  // The misses, preprocessed and encoded in batches.
  std::vector<size_t> todo;
  std::vector<float> pixels;
  const size_t per_image = clip_->output_floats();
  auto run_batch = [&] {
    if (todo.empty()) return;
    std::vector<float> out(todo.size() * per_image);
    const auto start = std::chrono::steady_clock::now();
    Status st = clip_->encode(*backend_, pixels.data(), int64_t(todo.size()), out.data());
    counters_.encode_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++counters_.batches;
    for (size_t k = 0; k < todo.size(); ++k) {
      Distinct& d = distinct[todo[k]];
      if (!st.ok()) {
        d.status = st;
        continue;
      }
      d.rows.assign(out.begin() + int64_t(k * per_image), out.begin() + int64_t((k + 1) * per_image));
      cache_->insert(d.hash, d.rows);
    }
    todo.clear();
    pixels.clear();
  };
  for (size_t k = 0; k < distinct.size(); ++k) {
    Distinct& d = distinct[k];
    if (!d.encode) continue;
    auto px = clip_->preprocess(*d.image);
    if (!px.ok()) {
      d.status = Status(px.status().code(), "vision encoder: " + px.status().message());
      continue;
    }
    pixels.insert(pixels.end(), px->begin(), px->end());
    todo.push_back(k);
    if (int32_t(todo.size()) == options_.max_batch) run_batch();
  }
  run_batch();

  // A group gets its rows only when every one of its images has them.
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!status[g].ok()) {
      ++counters_.failed_groups;
      continue;
    }
    for (const auto& [i, k] : uses[g])
      if (!distinct[k].status.ok()) {
        status[g] = distinct[k].status;
        break;
      }
    if (!status[g].ok()) {
      ++counters_.failed_groups;
      continue;
    }
    for (const auto& [i, k] : uses[g]) (*groups[g])[i].embeddings = distinct[k].rows;
  }
  return status;
}

Status VisionEncoder::encode(std::vector<PromptImage>& images, uint64_t request_id) {
  std::vector<PromptImage>* group = &images;
  return encode(std::span<std::vector<PromptImage>* const>(&group, 1),
                std::span<const uint64_t>(&request_id, 1))[0];
}

VisionEncoderCounters VisionEncoder::counters() const {
  VisionEncoderCounters c = counters_;
  c.cache_evictions = cache_->evictions();
  c.cache_entries = cache_->size();
  c.cache_bytes = cache_->bytes();
  return c;
}

}  // namespace cleave
