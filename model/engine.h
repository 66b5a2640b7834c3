// The single-process inference engine: a llama model, a paged KV cache and a
// compute backend. forward() runs one batch that may mix prefill chunks and
// decode steps of many sequences; every row's result is independent of the
// others (batch invariance), so how requests are batched never changes the
// answer.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "model/llama.h"

namespace cleave {

struct EngineOptions {
  int32_t threads = 1;
  int32_t context = 0;     // tokens per sequence; 0: the model's context_length
  int32_t max_seqs = 1;    // sequences held at once (KV is reserved for all)
  int32_t block_size = 16; // tokens per KV block (= attention tile)
};

// A fixed pool of KV blocks with a free list and per-sequence block tables.
class KvBlockPool {
 public:
  KvBlockPool(Backend& backend, PagedKv layout);
  ~KvBlockPool();
  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

  const PagedKv& kv() const { return kv_; }
  int32_t free_blocks() const { return static_cast<int32_t>(free_.size()); }
  // Take one block; -1 when none is free ("no room" is a value, not an error).
  int32_t take();
  void give_back(int32_t block);

 private:
  Backend& backend_;
  PagedKv kv_;
  std::vector<int32_t> free_;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(std::shared_ptr<const GgufFile> file,
                                                const EngineOptions& options);
  ~Engine();

  const LlamaModel& model() const { return *model_; }
  const LlamaConfig& config() const { return model_->config(); }
  const EngineOptions& options() const { return options_; }
  Backend& backend() { return *backend_; }
  int32_t context() const { return options_.context; }

  // Sequences: ids in [0, max_seqs). busy when all are taken.
  Result<int32_t> open_sequence();
  void close_sequence(int32_t seq);
  int32_t sequence_length(int32_t seq) const;

  struct Item {
    int32_t seq = 0;
    const int32_t* tokens = nullptr;
    int32_t n_tokens = 0;
  };
  // Appends each item's tokens to its sequence and writes the logits of each
  // item's last token to logits (n_items x n_vocab). out_of_range when a
  // sequence would exceed the context, invalid_argument for a bad token id or
  // sequence; nothing is appended to any sequence then.
  Status forward(const std::vector<Item>& items, float* logits);

 private:
  Engine() = default;
  Status reserve_blocks(int32_t seq, int32_t new_length);
  void ffn_dense(const LlamaLayer& l, int64_t n);
  void ffn_moe(const LlamaLayer& l, int64_t n);

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<KvBlockPool> pool_;
  EngineOptions options_;
  struct Sequence {
    bool open = false;
    int32_t length = 0;
    std::vector<int32_t> blocks;
  };
  std::vector<Sequence> seqs_;

  // Scratch, grown on demand and reused across calls.
  std::vector<float> x_, h_, q_, k_, v_, att_, tmp_, gate_, up_, logits_rows_;
  std::vector<int32_t> positions_, token_ids_;
  std::vector<AttnRow> rows_;
  // MoE scratch.
  std::vector<int32_t> expert_ids_;
  std::vector<float> expert_w_, router_logits_, moe_out_, gather_x_, gather_y_;
  std::vector<int32_t> gather_rows_;
};

}  // namespace cleave
