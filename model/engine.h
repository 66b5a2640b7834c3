// The single-process inference engine: a llama model, a paged KV cache and a
// compute backend. forward() runs one batch that may mix prefill chunks and
// decode steps of many sequences; every row's result is independent of the
// others (batch invariance), so how requests are batched never changes the
// answer.
//
// Images (mixed token / embedding input): a sequence is opened with the
// image spans of its prompt (KeySpan: positions, content hash). Rows at
// those positions take the embedding rows the forward() items carry instead
// of their placeholder token's embedding; everything after the embedding
// lookup is the same for both kinds of row. Every KV block a span overlaps
// is keyed with the span's content hash as well as the placeholder ids
// (storage/prefix.h), so the prefix cache, block_keys(), export_blocks()
// and import_blocks() reuse KV only for the same image at the same
// positions; blocks no image touches keep their plain text keys.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/op_profile.h"
#include "model/experts.h"
#include "model/layer_compute.h"
#include "model/layer_stage.h"
#include "model/llama.h"
#include "storage/backend_blocks.h"
#include "storage/block.h"
#include "storage/block_pool.h"
#include "storage/prefix.h"

namespace cleave {

struct EngineOptions {
  int32_t threads = 1;
  int32_t context = 0;     // tokens per sequence; 0: the model's context_length
  int32_t max_seqs = 1;    // sequences held at once
  int32_t block_size = 16; // tokens per KV block (= attention tile)
  // KV blocks in the pool; 0: enough for max_seqs sequences of full context.
  int32_t kv_blocks = 0;
  // Keep every full block a sequence filled, keyed by its prefix chain key
  // (storage/prefix.h), so later sequences with the same prompt start reuse
  // it. Cached blocks no sequence holds are evicted least recently used
  // first when the pool runs out.
  bool prefix_cache = true;
  // Micro-batch ping-pong with an expert executor (set_expert_executor): a
  // forward() batch goes through each layer in this many groups of rows,
  // so attention on one overlaps the experts on another. Same bits for
  // any value; 1..64 (invalid_argument otherwise); no effect without an
  // executor.
  int32_t expert_micro_batches = 1;
  // Pipeline parallelism (model/layer_stage.h): this engine holds layers
  // [0, last_layer] (-1: all of them) and their KV; the layers after run
  // on the stages behind set_stage_link(). KV records still cover every
  // layer (gathered from the stages). invalid_argument for a value outside
  // [-1, n_layers - 1].
  int32_t last_layer = -1;
  // A forward() batch goes to the stages in this many micro-batches of
  // rows, one behind another, so the stages work at once. Same bits for
  // any value; 1..64; no effect without a link.
  int32_t pipeline_micro_batches = 1;
  // Time every backend op (kernels/op_profile.h; op_profile() reads it):
  // where a step's time goes, for benchmarks. Off: no wrapper, no cost.
  bool profile_ops = false;
  // Element types of the KV cache's K and V rows (llama.cpp's -ctk / -ctv):
  // F32, F16 or Q8_0 (head_dim a multiple of 32). Part of the KV layout and
  // so of every block key: blocks of other types are never reused.
  DType cache_type_k = DType::F32, cache_type_v = DType::F32;
  // How matmuls over Q8_0 weights compute (--compute; kernels/backend.h):
  // exact (F32, the default) or int8. int8 needs Q8_0 weights
  // (invalid_argument otherwise) and is part of the model fingerprint, so
  // its KV blocks never mix with exact ones.
  Compute compute = Compute::exact;
  // Where the forward pass runs (--device): "cpu", or "cuda:N", where the
  // weights are uploaded once and the activations, logits and paged KV live
  // in device memory; per step the host uploads token ids, positions and
  // block tables and downloads the logits rows (and an MoE layer its rows'
  // expert ids). On a device: no expert executor or stage link
  // (unsupported otherwise), and KV types the backend supports.
  std::string device = "cpu";
};

// The KV pool an engine of these options makes for this model: kv_blocks,
// or enough for max_seqs sequences of the full context (pipeline stages
// after the first size theirs the same, so block ids agree).
int32_t kv_pool_blocks(const EngineOptions& options, const LlamaConfig& model);

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(std::shared_ptr<const GgufFile> file,
                                                const EngineOptions& options);
  // On this backend instead of the one options.device names (which must be
  // "cpu" then): the seam tests use to run the device path on the CPU's
  // kernels (tests/fenced_backend.h).
  static Result<std::unique_ptr<Engine>> create(std::shared_ptr<const GgufFile> file,
                                                const EngineOptions& options,
                                                std::shared_ptr<Backend> backend);
  ~Engine();

  const LlamaModel& model() const { return *model_; }
  const LlamaConfig& config() const { return model_->config(); }
  const EngineOptions& options() const { return options_; }
  Backend& backend() { return *backend_; }
  // The same, for what outlives a call (blocks exported into its memory).
  const std::shared_ptr<Backend>& shared_backend() const { return backend_; }
  // The backend's memory is the host's (the CPU backend).
  bool host_memory() const { return host_; }
  // Whether this engine's KV blocks can move straight from and into its
  // backend's memory (export_blocks_to / import_blocks_from): a device's,
  // on an engine that holds every layer (no stage link).
  bool kv_in_backend() const { return !host_ && !link_; }
  // The op times since the engine began (or the last reset()), when
  // options().profile_ops; nullptr otherwise.
  ProfilingBackend* op_profile() { return profile_; }
  int32_t context() const { return options_.context; }

  // XXH3-64 of the whole GGUF file: names the weights KV blocks were made with.
  uint64_t model_fingerprint() const;
  // The KV block layout (storage's view of the engine's paged KV).
  const KvLayout& kv_layout() const;

  // Sequences: ids in [0, max_seqs). busy when all are taken. images: the
  // positions that take embedding rows instead of token embeddings, with
  // the content key that goes into their KV blocks' keys (see the top of
  // this file); sorted, not overlapping, n_tokens > 0, inside the context,
  // else invalid_argument naming the span.
  Result<int32_t> open_sequence(std::vector<KeySpan> images = {});
  // Releases the sequence's blocks; with prefix_cache its full blocks stay
  // cached (they were published as they filled).
  void close_sequence(int32_t seq);
  int32_t sequence_length(int32_t seq) const;  // 0 for a sequence not open
  // The tokens whose KV the sequence holds (sequence_length of them; empty
  // for a sequence not open).
  const std::vector<int32_t>& sequence_tokens(int32_t seq) const;
  // The image spans the sequence was opened with (empty for one not open).
  const std::vector<KeySpan>& sequence_images(int32_t seq) const;

  // KV blocks: free ones plus cached ones no sequence holds (evictable).
  int32_t available_blocks() const;
  int32_t total_blocks() const;  // the pool's size
  // Blocks forward() would need to take to append n tokens to seq.
  int32_t blocks_needed(int32_t seq, int32_t n_tokens) const;

  // Prefix reuse: on an open, empty sequence, attaches the longest cached
  // prefix of tokens[0..n), capped at n - 1 tokens (the last prompt token
  // must still run to give logits; see PrefixMatch::usable_tokens). Returns
  // how many tokens were reused (the sequence's length afterwards; 0 on a
  // miss or without prefix_cache). invalid_argument for a sequence that is
  // not open and empty. When the reused prefix ends inside a shared block,
  // the next forward() copies that block before writing it (copy-on-write;
  // blocks_needed counts the copy), so attaching itself takes no block.
  Result<int32_t> attach_cached_prefix(int32_t seq, const int32_t* tokens, int32_t n);

  // How many leading keys of a chain (block_keys() of some tokens) name
  // full blocks the prefix cache holds now: the blocks a sender need not
  // send. 0 without prefix_cache.
  int32_t cached_leading_blocks(const std::vector<BlockKey>& keys) const;

  // Content keys of the sequence's blocks, in order: the prefix chain key of
  // each full block, then (when the last block is partly filled) the key of
  // its tokens so far, chained the same way (a partial block's key differs
  // from any full block's because the token count is hashed).
  std::vector<BlockKey> block_keys(int32_t seq) const;
  // Sealed records (bytes, checksum, model fingerprint, layout, n_tokens) of
  // blocks [first_block, n_blocks) of the sequence, keyed as block_keys().
  // invalid_argument for a bad sequence or first_block.
  Result<std::vector<BlockRecord>> export_blocks(int32_t seq, int32_t first_block = 0) const;
  // On an open sequence that is empty or holds whole blocks of tokens (an
  // attached cached prefix of k blocks): copies records[i] into the
  // sequence's block k + i and makes tokens[0..n_tokens) its tokens.
  // records must cover exactly the tokens after the held ones (all blocks
  // full but the last), each must pass verify() for this model and layout
  // and carry the key block_keys() would give it for those tokens (and the
  // images the sequence was opened with: a record made for another image
  // does not import). corruption or invalid_argument naming the block
  // otherwise, and the sequence stays as it was; out_of_memory when the
  // pool has no room.
  Status import_blocks(int32_t seq, const int32_t* tokens, int32_t n_tokens,
                       const std::vector<BlockRecord>& records);

  // Blocks [first_block, n) of the sequence copied by the backend into
  // `dst`, this engine's backend memory of at least (n - first_block) x
  // block_bytes() (block i at i x block_bytes()), the bytes never passing
  // through the host; `headers` gets their sealed headers, the checksums
  // taken where the bytes are (Backend::checksum_blocks on a device).
  // invalid_argument as export_blocks; unsupported on a pipeline stage
  // (its later layers are elsewhere).
  Status export_blocks_to(int32_t seq, int32_t first_block, void* dst, std::vector<BlockHeader>& headers) const;
  // export_blocks_to into new memory of this engine's backend (what a device
  // prefill hands off). Its errors, and out_of_memory when there is no room.
  Result<std::shared_ptr<BackendBlocks>> export_backend_blocks(int32_t seq, int32_t first_block = 0) const;
  // import_blocks for blocks in this engine's backend memory: headers[i]'s
  // bytes at src + i x block_bytes(). The same checks, the checksums taken
  // where the bytes are, then copied by the backend.
  Status import_blocks_from(int32_t seq, const int32_t* tokens, int32_t n_tokens,
                            const std::vector<BlockHeader>& headers, const void* src);

  struct CacheStats {
    uint64_t lookups = 0, hit_tokens = 0, published_blocks = 0, evicted_blocks = 0;
  };
  CacheStats cache_stats() const;

  struct Item {
    int32_t seq = 0;
    const int32_t* tokens = nullptr;
    int32_t n_tokens = 0;
    // One row of n_embd floats for each of the item's positions that lies
    // in one of the sequence's image spans, in position order (empty when
    // it covers none); these rows replace the token embeddings there.
    std::span<const float> embeddings = {};
  };
  // Appends each item's tokens to its sequence and writes the logits of each
  // item's last token to logits (n_items x n_vocab). out_of_range when a
  // sequence would exceed the context, invalid_argument for a bad token id or
  // sequence, out_of_memory when the KV pool has no room even after evicting
  // unused cached blocks; invalid_argument when an item's embeddings are
  // not exactly its image rows x n_embd floats; nothing is appended to any
  // sequence then. With prefix_cache, the blocks this call fills are
  // published.
  Status forward(const std::vector<Item>& items, float* logits);

  // The FFN of every layer goes to this executor (model/experts.h): each
  // expert's gathered rows (a dense model's FFN as expert 0), combined here
  // in the engine's order, so the bits are the same as without one. null
  // (the default): the engine computes its experts itself.
  void set_expert_executor(std::shared_ptr<ExpertExecutor> executor) {
    experts_ = std::move(executor);
  }
  const ExpertExecutor* expert_executor() const { return experts_.get(); }

  // The stages after this engine's layers (options().last_layer). The
  // link must start at last_layer + 1 (invalid_argument otherwise). Without
  // one, an engine that does not hold every layer refuses forward(),
  // export and import (invalid_argument). Once a link call fails, the
  // later layers' KV is unknown: every later forward(), export and import
  // fails with unavailable (the pipeline is broken; its requests go
  // elsewhere).
  Status set_stage_link(std::shared_ptr<StageLink> link);
  const StageLink* stage_link() const { return link_.get(); }
  LayerRange own_layers() const { return {0, own_last_}; }
  bool pipeline_broken() const { return !link_error_.ok(); }

 private:
  Engine() = default;
  struct Sequence {
    bool open = false;
    std::optional<SequenceBlocks> blocks;  // set while open
    std::vector<int32_t> tokens;
    std::vector<KeySpan> images;  // positions fed from embeddings, keyed by content
    // With prefix_cache: chain keys of the full blocks, in order (the parent
    // of the next block to publish).
    std::vector<BlockKey> keys;
  };
  // Per pool block: whether the prefix index holds it under `key`, and when
  // it was last used (LRU eviction order).
  struct BlockInfo {
    bool cached = false;
    BlockKey key;
    uint64_t last_use = 0;
  };

  bool is_open(int32_t seq) const;
  int32_t evictable_blocks() const;
  // Makes `need` blocks free, evicting unused cached blocks LRU first;
  // out_of_memory (nothing evicted) when even that cannot.
  Status make_room(int32_t need);
  void touch(int32_t block) { block_info_[size_t(block)].last_use = ++clock_; }
  void touch_chain(const std::vector<int32_t>& blocks);
  // Publishes the sequence's full blocks that have no key yet.
  void publish_full_blocks(Sequence& s);
  // Keys of the first n_full full blocks of s, then the partial one if any.
  std::vector<BlockKey> keys_of(const Sequence& s) const;
  // engine_blocks.cpp: what every export and import checks first. An
  // import's checks (everything but the bytes' checksums) return the first
  // block the records fill and the sequence's tokens afterwards.
  Status check_export(int32_t seq, int32_t first_block) const;
  BlockHeader header_of(const Sequence& s, const std::vector<BlockKey>& keys, int32_t b) const;
  Result<int32_t> check_import(int32_t seq, const int32_t* tokens, int32_t n_tokens,
                               const std::vector<const BlockHeader*>& headers, size_t n_bytes,
                               std::vector<int32_t>& probe_tokens) const;
  size_t block_bytes() const { return layout_.block_bytes(); }  // a record's: every layer
  uint8_t* block_data(int32_t block) const { return kv_.data + size_t(block) * kv_.block_bytes(); }
  Status copy_block(int32_t src, int32_t dst);
  // The stages after ours are reachable (or there are none).
  Status link_ready() const;
  // A link call failed: the engine is broken from now on.
  Status broke(Status why);
  size_t own_block_bytes() const { return kv_.block_bytes(); }
  // The layers' work of forward()'s n rows: ours, then the link's in
  // micro-batches; logits of the rows in last_row. pos and rows in the
  // backend's memory; host_pos and host_rows the same on the host (what a
  // link sends on; on a device the rows' hidden states come down for it).
  Status run_layers(int64_t n, float* x, const int32_t* pos, const AttnRow* rows,
                    const std::vector<int32_t>& last_row, float* logits, const int32_t* host_pos,
                    const AttnRow* host_rows);
  // Scratch for a forward() of n rows and m logits rows, allocated now
  // (out_of_memory when the backend has no room).
  Status reserve(int64_t n, int64_t m);

  std::unique_ptr<LlamaModel> model_;
  std::shared_ptr<Backend> backend_;
  bool host_ = true;  // backend_'s memory is the host's
  ProfilingBackend* profile_ = nullptr;  // backend_ itself, when profile_ops
  // On a device: the weights' copies there (the model's views point at them).
  std::unique_ptr<WeightCopies> weights_;
  std::vector<float> link_x_;  // on a device with a stage link: a micro-batch's rows, downloaded
  EngineOptions options_;
  uint64_t model_fp_ = 0;
  KvLayout layout_;
  // KV bytes (backend memory, PagedKv layout); storage's pool owns the ids and
  // reference counts, the index the cached full blocks.
  PagedKv kv_;
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<PrefixIndex> index_;  // null without prefix_cache
  std::vector<BlockInfo> block_info_;
  uint64_t clock_ = 0;
  CacheStats stats_;
  std::vector<Sequence> seqs_;

  // Scratch, grown on demand and reused across calls: the rows' ids,
  // positions, block tables and AttnRows on the host (and their copies in
  // backend memory on a device), the activations and logits in backend memory.
  std::vector<int32_t> positions_, token_ids_, tables_;
  std::vector<AttnRow> rows_;  // on a device: block_table pointers into tables_dev_
  std::unique_ptr<BackendBuffer<float>> x_, logits_;
  std::unique_ptr<BackendBuffer<int32_t>> ids_dev_, pos_dev_, tables_dev_;
  std::unique_ptr<BackendBuffer<AttnRow>> rows_dev_;
  std::unique_ptr<LayerCompute> compute_;
  std::shared_ptr<ExpertExecutor> experts_;
  bool experts_prepared_ = false;  // forward() prepared the local experts
  int32_t own_last_ = 0;  // our layers are [0, own_last_]
  std::shared_ptr<StageLink> link_;
  Status link_error_;     // the first link failure (ok: none)
};

}  // namespace cleave
