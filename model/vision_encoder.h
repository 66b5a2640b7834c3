// VisionEncoder: what a vision_encoder actor owns (no CAF). A CLIP model
// with its own compute backend, and an LRU cache of projected embeddings
// keyed by image content hash, so a repeated image is encoded once. encode()
// takes every group of images that arrived since the last call (one group
// per request), answers the cached ones from the cache and runs the rest
// through ClipModel::encode in batches of up to max_batch. An image's rows
// are the same bits alone or batched (ClipModel's batch invariance), so how
// requests are grouped never changes an answer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "model/clip.h"
#include "model/gguf.h"
#include "model/request.h"

namespace cleave {

struct VisionEncoderOptions {
  int32_t threads = 1;                    // the encoder backend's threads
  int32_t max_batch = 16;                 // images per ClipModel::encode call
  size_t cache_bytes = size_t(64) << 20;  // embedding cache; 0: no cache
  // The language model's embedding width: 0 skips the check, else the
  // projector must give rows of this size.
  int32_t n_embd = 0;
  // Where the encoder runs: "cpu", or "cuda:N" (the weights placed there
  // once, ClipModel::on; the host uploads patches and downloads features).
  std::string device = "cpu";
};

struct VisionEncoderCounters {
  uint64_t groups = 0;          // groups (requests) handed to encode()
  uint64_t failed_groups = 0;   // of them, answered with an error
  uint64_t images = 0;          // images that needed embeddings
  uint64_t cache_hits = 0;      // served from the cache (or a twin in the same call)
  uint64_t cache_misses = 0;    // run through the encoder
  uint64_t cache_evictions = 0;
  uint64_t batches = 0;         // ClipModel::encode calls
  uint64_t cache_entries = 0, cache_bytes = 0;  // now
  double encode_seconds = 0;    // inside ClipModel::encode, in total
};

// For unordered containers keyed by image (XXH3 output: any bits will do).
struct ImageHashHasher {
  size_t operator()(const ImageHash& h) const { return size_t(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull)); }
};

// LRU map image hash -> embeddings, bounded in bytes (floats x 4). An entry
// larger than the capacity is not kept.
class EmbeddingCache {
 public:
  explicit EmbeddingCache(size_t capacity_bytes) : capacity_(capacity_bytes) {}
  // The entry (and marks it recently used), or null.
  const std::vector<float>* find(const ImageHash& hash);
  // Inserts or replaces; evicts least recently used entries to fit.
  void insert(const ImageHash& hash, std::vector<float> embeddings);
  size_t bytes() const { return bytes_; }
  size_t size() const { return entries_.size(); }
  uint64_t evictions() const { return evictions_; }

 private:
  using Entry = std::pair<ImageHash, std::vector<float>>;
  size_t capacity_, bytes_ = 0;
  uint64_t evictions_ = 0;
  std::list<Entry> entries_;  // most recent first
  std::unordered_map<ImageHash, std::list<Entry>::iterator, ImageHashHasher> index_;
};

class VisionEncoder {
 public:
  // The mmproj file's errors (ClipModel::load); invalid_argument for
  // threads or max_batch < 1 and, with options.n_embd, a projector whose
  // output width is not n_embd (naming both).
  static Result<std::unique_ptr<VisionEncoder>> create(std::shared_ptr<const GgufFile> mmproj,
                                                       const VisionEncoderOptions& options);

  const ClipModel& clip() const { return *clip_; }
  const VisionEncoderOptions& options() const { return options_; }

  // invalid_argument naming the image when one that still needs embeddings
  // cannot be encoded here: its span is not n_patches tokens, or it has no
  // pixels (or pixels that do not match its width and height).
  Status check(const std::vector<PromptImage>& images, uint64_t request_id = 0) const;

  // Fills the embeddings of every image that has none, in each group; one
  // Status per group (check()'s error, or the encoder's: such a group is
  // left unchanged). Groups that fail do not stop the others. Pixels are
  // kept (callers drop them when they no longer need them).
  std::vector<Status> encode(std::span<std::vector<PromptImage>* const> groups,
                             std::span<const uint64_t> request_ids = {});
  // One group.
  Status encode(std::vector<PromptImage>& images, uint64_t request_id = 0);

  VisionEncoderCounters counters() const;

 private:
  VisionEncoder() = default;
  std::shared_ptr<const GgufFile> file_;
  std::unique_ptr<Backend> backend_;  // before clip_: a placed model's weights live in it
  std::unique_ptr<ClipModel> clip_;
  VisionEncoderOptions options_;
  std::unique_ptr<EmbeddingCache> cache_;
  VisionEncoderCounters counters_;
};

}  // namespace cleave
