#include "model/engine.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace cleave {
namespace {
// Positions of [first, first + n) that lie in one of the sequence's image spans.
int64_t image_rows_in(const std::vector<KeySpan>& images, int64_t first, int64_t n) {
  int64_t rows = 0;
  for (const KeySpan& sp : images)
    rows += std::max<int64_t>(0, std::min<int64_t>(first + n, int64_t(sp.position) + sp.n_tokens) -
                                     std::max<int64_t>(first, sp.position));
  return rows;
}
bool in_image(const std::vector<KeySpan>& images, int32_t position) {
  for (const KeySpan& sp : images)
    if (position >= sp.position && position - sp.position < sp.n_tokens) return true;
  return false;
}
}  // namespace

int32_t kv_pool_blocks(const EngineOptions& o, const LlamaConfig& c) {
  if (o.kv_blocks > 0) return o.kv_blocks;
  const int32_t context = o.context > 0 ? std::min(o.context, c.context) : c.context;
  const int32_t bs = std::max(1, o.block_size);
  return (context + bs - 1) / bs * std::max(1, o.max_seqs);
}

Result<std::unique_ptr<Engine>> Engine::create(std::shared_ptr<const GgufFile> file,
                                               const EngineOptions& options) {
  return create(std::move(file), options, nullptr);
}

Result<std::unique_ptr<Engine>> Engine::create(std::shared_ptr<const GgufFile> file,
                                               const EngineOptions& options,
                                               std::shared_ptr<Backend> backend) {
  auto device = device_for(options.device, bool(backend), "engine");
  if (!device.ok()) return device.status();
  if (!file) return Status(Code::invalid_argument, "engine: no model file");
  // Names the weights every KV block is made with; hashed once, before the
  // model takes the file.
  const uint64_t model_fp = checksum_bytes(file->data(), file->file_size());
  file->release_resident_pages();  // keep only what this engine reads resident
  auto model = LlamaModel::load(std::move(file));
  if (!model.ok()) return model.status();
  const LlamaConfig& c = (*model)->config();
  EngineOptions o = options;
  if (o.threads < 1 || o.threads > 1024)
    return Status(Code::invalid_argument, "engine: threads = " + std::to_string(o.threads) +
                                              " must be in [1, 1024]");
  if (o.context < 0 || o.max_seqs < 1 || o.block_size < 1)
    return Status(Code::invalid_argument, "engine: context, max_seqs and block_size must be positive");
  if (o.expert_micro_batches < 1 || o.expert_micro_batches > 64)
    return Status(Code::invalid_argument, "engine: expert_micro_batches = " +
                                              std::to_string(o.expert_micro_batches) +
                                              " must be in [1, 64]");
  if (o.pipeline_micro_batches < 1 || o.pipeline_micro_batches > 64)
    return Status(Code::invalid_argument, "engine: pipeline_micro_batches = " +
                                              std::to_string(o.pipeline_micro_batches) +
                                              " must be in [1, 64]");
  if (o.last_layer < -1 || o.last_layer >= c.n_layers)
    return Status(Code::invalid_argument, "engine: last_layer = " + std::to_string(o.last_layer) +
                                              " must be in [-1, " + std::to_string(c.n_layers - 1) +
                                              "] (the model's layers)");
  CLEAVE_RETURN_IF_ERROR(check_kv_type(o.cache_type_k, c.head_dim, "engine: cache type k"));
  CLEAVE_RETURN_IF_ERROR(check_kv_type(o.cache_type_v, c.head_dim, "engine: cache type v"));
  CLEAVE_RETURN_IF_ERROR(check_compute(o.compute, **model, "engine"));
  if (o.kv_blocks < 0)
    return Status(Code::invalid_argument,
                  "engine: kv_blocks = " + std::to_string(o.kv_blocks) + " must not be negative");
  if (o.context == 0) o.context = c.context;
  if (o.context > c.context)
    return Status(Code::out_of_range, "engine: context " + std::to_string(o.context) +
                                          " exceeds the model's context_length " +
                                          std::to_string(c.context));
  o.kv_blocks = kv_pool_blocks(o, c);

  auto e = std::unique_ptr<Engine>(new Engine());
  e->model_ = std::move(*model);
  e->options_ = o;
  e->model_fp_ = compute_fingerprint(model_fp, o.compute);
  e->own_last_ = o.last_layer < 0 ? c.n_layers - 1 : o.last_layer;
  auto on = backend_for(*device, o.threads, o.compute, std::move(backend), "engine");
  if (!on.ok()) return on.status();
  e->backend_ = std::move(on.value());
  e->host_ = e->backend_->caps().host_memory;
  for (const auto& [t, what] : {std::pair{o.cache_type_k, "k"}, std::pair{o.cache_type_v, "v"}})
    if (!e->backend_->supports(Op::kv_write, t) || !e->backend_->supports(Op::attention, t))
      return Status(Code::unsupported, std::string("engine: cache type ") + what + " " +
                                           dtype_name(t) + " is not supported by the " +
                                           e->backend_->caps().name + " backend");
  if (!e->host_) {
    // Weights once, in their stored types; the file's pages are not read again.
    auto copies = e->model_->upload(*e->backend_, 0, e->own_last_, e->own_last_ == c.n_layers - 1);
    if (!copies.ok()) return Status(copies.status().code(), "engine: " + copies.status().message());
    e->weights_ = std::move(*copies);
  }
  Backend& be = *e->backend_;
  e->x_ = std::make_unique<BackendBuffer<float>>(be);
  e->logits_ = std::make_unique<BackendBuffer<float>>(be);
  e->ids_dev_ = std::make_unique<BackendBuffer<int32_t>>(be);
  e->pos_dev_ = std::make_unique<BackendBuffer<int32_t>>(be);
  e->tables_dev_ = std::make_unique<BackendBuffer<int32_t>>(be);
  e->rows_dev_ = std::make_unique<BackendBuffer<AttnRow>>(be);
  if (o.profile_ops) {
    auto profiling = std::make_shared<ProfilingBackend>(std::move(e->backend_));
    e->profile_ = profiling.get();
    e->backend_ = std::move(profiling);
  }
  e->compute_ = std::make_unique<LayerCompute>(*e->model_, *e->backend_);
  // The backend's panels now, not in the first request (experts: on first
  // use, as expert hosts may compute them instead).
  e->model_->prepare(*e->backend_, 0, e->own_last_, LlamaModel::Matrices::dense,
                     e->own_last_ == c.n_layers - 1);
  e->layout_.k_type = o.cache_type_k;
  e->layout_.v_type = o.cache_type_v;
  e->layout_.tokens_per_block = o.block_size;
  e->layout_.n_layers = c.n_layers;
  e->layout_.n_kv_heads = c.n_kv_heads;
  e->layout_.head_dim = c.head_dim;
  CLEAVE_RETURN_IF_ERROR(e->layout_.validate());
  e->kv_.k_type = o.cache_type_k;
  e->kv_.v_type = o.cache_type_v;
  e->kv_.block_size = o.block_size;
  e->kv_.n_layers = e->own_last_ + 1;  // our layers' KV; the stages after hold theirs
  e->kv_.n_kv_heads = c.n_kv_heads;
  e->kv_.head_dim = c.head_dim;
  e->kv_.n_blocks = o.kv_blocks;
  CLEAVE_CHECK(e->own_last_ + 1 < c.n_layers ||
               e->kv_.block_bytes() == e->layout_.block_bytes());
  e->kv_.data = static_cast<uint8_t*>(e->backend_->alloc(e->own_block_bytes() * size_t(o.kv_blocks)));
  if (e->kv_.data == nullptr)
    return Status(Code::out_of_memory, "engine: cannot allocate " + std::to_string(o.kv_blocks) +
                                           " KV blocks of " + std::to_string(e->own_block_bytes()) +
                                           " bytes");
  auto pool = BlockPool::create(o.kv_blocks, o.block_size);
  if (!pool.ok()) return pool.status();
  e->pool_ = std::move(*pool);
  if (o.prefix_cache) {
    auto index = PrefixIndex::create(*e->pool_, e->model_fp_, e->layout_);
    if (!index.ok()) return index.status();
    e->index_ = std::move(*index);
  }
  e->block_info_.resize(size_t(o.kv_blocks));
  e->seqs_.resize(o.max_seqs);
  return e;
}

Engine::~Engine() {
  // Block tables and the index hold references into the pool: drop them first.
  seqs_.clear();
  index_.reset();
  pool_.reset();
  if (backend_ && kv_.data) backend_->free(kv_.data);
}

uint64_t Engine::model_fingerprint() const { return model_fp_; }


Status Engine::set_stage_link(std::shared_ptr<StageLink> link) {
  if (link && link->first_layer() != own_last_ + 1)
    return Status(Code::invalid_argument, "engine: a stage link from layer " +
                                              std::to_string(link->first_layer()) +
                                              " does not follow this engine's layers [0, " +
                                              std::to_string(own_last_) + "]");
  link_ = std::move(link);
  link_error_ = Status::Ok();
  return Status::Ok();
}

Status Engine::link_ready() const {
  if (!link_error_.ok()) return link_error_;
  if (own_last_ + 1 < config().n_layers && !link_)
    return Status(Code::invalid_argument,
                  "engine: holds layers [0, " + std::to_string(own_last_) +
                      "] of " + std::to_string(config().n_layers) + " and has no stage link");
  return Status::Ok();
}

Status Engine::broke(Status why) {
  link_error_ = Status(Code::unavailable, "engine: pipeline broken: " + why.to_string());
  return link_error_;
}
const KvLayout& Engine::kv_layout() const { return layout_; }

bool Engine::is_open(int32_t seq) const {
  return seq >= 0 && seq < int32_t(seqs_.size()) && seqs_[size_t(seq)].open;
}

Result<int32_t> Engine::open_sequence(std::vector<KeySpan> images) {
  for (size_t i = 0; i < images.size(); ++i) {
    const KeySpan& sp = images[i];
    const int64_t end = int64_t(sp.position) + sp.n_tokens;
    const int64_t prev_end = i ? int64_t(images[i - 1].position) + images[i - 1].n_tokens : 0;
    if (sp.position < 0 || sp.n_tokens < 1 || end > options_.context || sp.position < prev_end)
      return Status(Code::invalid_argument,
                    "engine: image span " + std::to_string(i) + " [" + std::to_string(sp.position) +
                        ", " + std::to_string(end) +
                        ") must be non-empty, sorted, not overlap the one before (ending at " +
                        std::to_string(prev_end) + ") and lie inside the context of " +
                        std::to_string(options_.context));
  }
  for (size_t s = 0; s < seqs_.size(); ++s) {
    if (!seqs_[s].open) {
      seqs_[s] = Sequence{};
      seqs_[s].open = true;
      seqs_[s].images = std::move(images);
      seqs_[s].blocks.emplace(*pool_);
      return static_cast<int32_t>(s);
    }
  }
  return Status(Code::busy, "engine: all " + std::to_string(seqs_.size()) +
                                " sequence slots are in use");
}

void Engine::close_sequence(int32_t seq) {
  if (!is_open(seq)) return;
  Sequence& s = seqs_[size_t(seq)];
  // Cached blocks count as used until the last sequence lets go of them.
  touch_chain(s.blocks->blocks());
  s = Sequence{};
}

int32_t Engine::sequence_length(int32_t seq) const {
  return is_open(seq) ? int32_t(seqs_[size_t(seq)].tokens.size()) : 0;
}

const std::vector<int32_t>& Engine::sequence_tokens(int32_t seq) const {
  static const std::vector<int32_t> none;
  return is_open(seq) ? seqs_[size_t(seq)].tokens : none;
}

const std::vector<KeySpan>& Engine::sequence_images(int32_t seq) const {
  static const std::vector<KeySpan> none;
  return is_open(seq) ? seqs_[size_t(seq)].images : none;
}

int32_t Engine::evictable_blocks() const {
  if (!index_) return 0;
  int32_t n = 0;
  for (size_t b = 0; b < block_info_.size(); ++b)
    if (block_info_[b].cached && *pool_->refcount(int32_t(b)) == 1) ++n;
  return n;
}

int32_t Engine::available_blocks() const { return pool_->free_count() + evictable_blocks(); }
int32_t Engine::total_blocks() const { return pool_->capacity(); }

int32_t Engine::blocks_needed(int32_t seq, int32_t n_tokens) const {
  return is_open(seq) ? seqs_[size_t(seq)].blocks->blocks_needed(n_tokens) : 0;
}

Status Engine::make_room(int32_t need) {
  const int32_t missing = need - pool_->free_count();
  if (missing <= 0) return Status::Ok();
  std::vector<std::pair<uint64_t, int32_t>> unused;  // (last_use, block)
  if (index_) {
    for (size_t b = 0; b < block_info_.size(); ++b)
      if (block_info_[b].cached && *pool_->refcount(int32_t(b)) == 1)
        unused.emplace_back(block_info_[b].last_use, int32_t(b));
  }
  if (int32_t(unused.size()) < missing)
    return Status(Code::out_of_memory,
                  "engine: KV block pool exhausted: " + std::to_string(need) + " blocks needed, " +
                      std::to_string(pool_->free_count()) + " free and " +
                      std::to_string(unused.size()) + " evictable of " +
                      std::to_string(pool_->capacity()));
  std::partial_sort(unused.begin(), unused.begin() + missing, unused.end());
  for (int32_t i = 0; i < missing; ++i) {
    BlockInfo& info = block_info_[size_t(unused[size_t(i)].second)];
    CLEAVE_CHECK(index_->erase(info.key).ok());
    info.cached = false;
    ++stats_.evicted_blocks;
  }
  return Status::Ok();
}

void Engine::touch_chain(const std::vector<int32_t>& blocks) {
  // Last block first: a chain's tail is evicted before its head, so what
  // stays cached is still a reachable prefix.
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b)
    if (block_info_[size_t(*b)].cached) touch(*b);
}

void Engine::publish_full_blocks(Sequence& s) {
  if (!index_) return;
  const int32_t bs = options_.block_size;
  const size_t n_full = s.tokens.size() / size_t(bs);
  while (s.keys.size() < n_full) {
    const size_t b = s.keys.size();
    const BlockKey parent = b ? s.keys.back() : BlockKey{};
    s.keys.push_back(block_key(parent, s.tokens.data() + b * size_t(bs), bs, model_fp_, layout_,
                               int32_t(b) * bs, s.images));
    const int32_t id = s.blocks->blocks()[b];
    auto indexed = index_->insert(s.keys.back(), id);
    CLEAVE_CHECK(indexed.ok());
    // Another sequence may have published the same content first: keep ours.
    if (*indexed == id && !block_info_[size_t(id)].cached) {
      block_info_[size_t(id)] = BlockInfo{true, s.keys.back(), 0};
      touch(id);
      ++stats_.published_blocks;
    }
  }
}

std::vector<BlockKey> Engine::keys_of(const Sequence& s) const {
  const int32_t bs = options_.block_size;
  const int32_t len = int32_t(s.tokens.size());
  const int32_t n_full = len / bs;
  std::vector<BlockKey> keys(s.keys.begin(), s.keys.begin() + std::min<size_t>(s.keys.size(), n_full));
  while (int32_t(keys.size()) < n_full) {
    const BlockKey parent = keys.empty() ? BlockKey{} : keys.back();
    const int32_t first = int32_t(keys.size()) * bs;
    keys.push_back(block_key(parent, s.tokens.data() + first, bs, model_fp_, layout_, first, s.images));
  }
  if (len % bs) {
    const BlockKey parent = keys.empty() ? BlockKey{} : keys.back();
    keys.push_back(block_key(parent, s.tokens.data() + size_t(n_full) * bs, len % bs, model_fp_,
                             layout_, n_full * bs, s.images));
  }
  return keys;
}

Status Engine::copy_block(int32_t src, int32_t dst) {
  backend_->copy(block_data(dst), block_data(src), own_block_bytes());  // within its memory
  if (link_) {
    Status st = link_->copy_block(src, dst);
    if (!st.ok()) return broke(st);
  }
  return Status::Ok();
}

Result<int32_t> Engine::attach_cached_prefix(int32_t seq, const int32_t* tokens, int32_t n) {
  if (!is_open(seq) || !seqs_[size_t(seq)].tokens.empty())
    return Status(Code::invalid_argument,
                  "engine: attach_cached_prefix needs an open, empty sequence; " +
                      std::to_string(seq) + " is not");
  if (n < 0 || (n > 0 && tokens == nullptr))
    return Status(Code::invalid_argument, "engine: attach_cached_prefix of " + std::to_string(n) +
                                              " tokens without a token array");
  if (!index_) return 0;
  ++stats_.lookups;
  Sequence& s = seqs_[size_t(seq)];
  const PrefixMatch m = index_->longest_prefix(tokens, std::min(n, options_.context), s.images);
  const int32_t usable = m.usable_tokens(n);
  if (usable == 0) return 0;
  const int32_t bs = options_.block_size;
  const std::vector<int32_t> ids(m.block_ids.begin(), m.block_ids.begin() + (usable + bs - 1) / bs);
  auto shared = SequenceBlocks::from_shared(*pool_, ids, usable);
  if (!shared.ok()) return shared.status();
  s.blocks = std::move(*shared);
  s.tokens.assign(tokens, tokens + usable);
  s.keys.assign(m.keys.begin(), m.keys.begin() + usable / bs);
  touch_chain(ids);  // a hit refreshes
  stats_.hit_tokens += uint64_t(usable);
  return usable;
}

int32_t Engine::cached_leading_blocks(const std::vector<BlockKey>& keys) const {
  if (!index_) return 0;
  int32_t n = 0;
  while (size_t(n) < keys.size() && index_->contains(keys[size_t(n)])) ++n;
  return n;
}

std::vector<BlockKey> Engine::block_keys(int32_t seq) const {
  return is_open(seq) ? keys_of(seqs_[size_t(seq)]) : std::vector<BlockKey>{};
}

Engine::CacheStats Engine::cache_stats() const { return stats_; }


Status Engine::forward(const std::vector<Item>& items, float* logits) {
  const LlamaConfig& c = config();
  CLEAVE_RETURN_IF_ERROR(link_ready());
  // Validate everything before touching any sequence.
  int64_t n = 0;
  std::vector<int32_t> added(seqs_.size(), 0);
  for (const Item& it : items) {
    if (it.seq < 0 || it.seq >= int32_t(seqs_.size()) || !seqs_[it.seq].open)
      return Status(Code::invalid_argument, "engine: sequence " + std::to_string(it.seq) +
                                                " is not open");
    if (it.n_tokens < 1)
      return Status(Code::invalid_argument, "engine: an item must carry at least one token");
    for (int32_t i = 0; i < it.n_tokens; ++i) {
      if (it.tokens[i] < 0 || it.tokens[i] >= c.n_vocab)
        return Status(Code::invalid_argument, "engine: token id " + std::to_string(it.tokens[i]) +
                                                  " is outside the vocabulary [0, " +
                                                  std::to_string(c.n_vocab) + ")");
    }
    const int64_t first = int64_t(seqs_[it.seq].tokens.size()) + added[it.seq];
    const int64_t image_rows = image_rows_in(seqs_[it.seq].images, first, it.n_tokens);
    if (int64_t(it.embeddings.size()) != image_rows * c.dim)
      return Status(Code::invalid_argument,
                    "engine: sequence " + std::to_string(it.seq) + " positions [" +
                        std::to_string(first) + ", " + std::to_string(first + it.n_tokens) +
                        ") hold " + std::to_string(image_rows) + " image rows, which need " +
                        std::to_string(image_rows * c.dim) + " embedding floats (n_embd " +
                        std::to_string(c.dim) + "); the item carries " +
                        std::to_string(it.embeddings.size()));
    added[it.seq] += it.n_tokens;
    const int32_t len = int32_t(seqs_[it.seq].tokens.size()) + added[it.seq];
    if (len > options_.context)
      return Status(Code::out_of_range, "engine: sequence " + std::to_string(it.seq) + " of " +
                                            std::to_string(len) + " tokens exceeds the context of " +
                                            std::to_string(options_.context));
    n += it.n_tokens;
  }
  // Room for every sequence first (evicting unused cached blocks if need
  // be), so no sequence grows unless all can.
  int32_t need = 0;
  for (size_t s = 0; s < seqs_.size(); ++s)
    if (added[s]) need += seqs_[s].blocks->blocks_needed(added[s]);
  CLEAVE_RETURN_IF_ERROR(make_room(need));
  if (n == 0) return Status::Ok();
  // Every buffer this batch needs, before any sequence changes: a device
  // without room for its activations refuses the batch, losing nothing.
  CLEAVE_RETURN_IF_ERROR(reserve(n, int64_t(items.size())));
  if (c.n_experts > 0 && !experts_ && !experts_prepared_) {
    // MoE experts this engine computes itself: their panels once, here
    // (with an expert executor the hosts hold them instead).
    model_->prepare(*backend_, 0, own_last_, LlamaModel::Matrices::experts, false);
    experts_prepared_ = true;
  }
  std::vector<int32_t> start(seqs_.size());
  for (size_t s = 0; s < seqs_.size(); ++s) {
    start[s] = int32_t(seqs_[s].tokens.size());
    if (!added[s]) continue;
    auto grant = seqs_[s].blocks->append_tokens(added[s]);
    CLEAVE_CHECK(grant.ok() && !grant->no_room);
    // A shared, partly filled last block (a cached prefix) is copied before it is written.
    if (grant->copy) CLEAVE_RETURN_IF_ERROR(copy_block(grant->copy->src, grant->copy->dst));
  }

  // Rows: one per token, with its sequence's block table and position.
  int32_t* pos = grow_scratch(positions_, n);
  int32_t* ids = grow_scratch(token_ids_, n);
  AttnRow* rows = grow_scratch(rows_, n);
  std::vector<int32_t> last_row(items.size());
  // Each item's block table, at this offset of tables_ (on a device: of its copy).
  std::vector<size_t> table_at(items.size());
  tables_.clear();
  {
    std::vector<int32_t> cursor = start;
    int64_t r = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      Sequence& s = seqs_[it.seq];
      s.tokens.insert(s.tokens.end(), it.tokens, it.tokens + it.n_tokens);
      const std::vector<int32_t>& table = s.blocks->blocks();
      table_at[i] = tables_.size();
      if (!host_) tables_.insert(tables_.end(), table.begin(), table.end());
      for (int32_t t = 0; t < it.n_tokens; ++t, ++r) {
        ids[r] = it.tokens[t];
        pos[r] = cursor[it.seq]++;
        rows[r] = AttnRow{table.data(), int32_t(table.size()), pos[r]};
      }
      last_row[i] = int32_t(r - 1);
    }
  }
  // On a device the ops read ids, positions and block tables from its
  // memory: one upload each per step.
  const int32_t* ids_b = to_backend(*backend_, host_, ids, size_t(n), *ids_dev_);
  const int32_t* pos_b = to_backend(*backend_, host_, pos, size_t(n), *pos_dev_);
  const AttnRow* rows_b = rows;
  std::vector<AttnRow> host_rows;  // a stage link sends the rows with their tables on the host
  if (!host_ && link_) host_rows.assign(rows, rows + n);
  if (!host_) {  // and the rows that point into them: four uploads in all
    const int32_t* tables = to_backend(*backend_, host_, tables_.data(), tables_.size(), *tables_dev_);
    for (size_t i = 0, r = 0; i < items.size(); ++i)
      for (int32_t t = 0; t < items[i].n_tokens; ++t, ++r) rows[r].block_table = tables + table_at[i];
    rows_b = to_backend(*backend_, host_, rows, size_t(n), *rows_dev_);
  }

  const int64_t dim = c.dim;
  float* x = x_->grow(size_t(n * dim));
  backend_->embed(model_->token_embd(), ids_b, n, x);
  // Image rows: the item's embeddings replace the placeholders' rows.
  for (size_t i = 0, r0 = 0; i < items.size(); r0 += size_t(items[i].n_tokens), ++i) {
    const Item& it = items[i];
    if (it.embeddings.empty()) continue;
    const float* src = it.embeddings.data();
    for (int32_t t = 0; t < it.n_tokens; ++t) {
      if (!in_image(seqs_[it.seq].images, pos[r0 + size_t(t)])) continue;
      float* dst = x + int64_t(r0 + size_t(t)) * dim;
      if (host_) std::copy(src, src + dim, dst);
      else backend_->upload(dst, src, size_t(dim) * sizeof(float));
      src += dim;
    }
  }
  CLEAVE_RETURN_IF_ERROR(
      run_layers(n, x, pos_b, rows_b, last_row, logits, pos, host_rows.empty() ? rows : host_rows.data()));
  if (index_)
    for (size_t s = 0; s < seqs_.size(); ++s)
      if (added[s]) publish_full_blocks(seqs_[s]);
  return Status::Ok();
}

Status Engine::reserve(int64_t n, int64_t m) {
  const LlamaConfig& c = config();
  const size_t table_bound = size_t(m) * size_t((options_.context + options_.block_size - 1) / options_.block_size);
  bool ok = x_->try_grow(size_t(n * c.dim));
  if (ok && !host_)
    ok = logits_->try_grow(size_t(m * c.n_vocab)) && ids_dev_->try_grow(size_t(n)) &&
         pos_dev_->try_grow(size_t(n)) && tables_dev_->try_grow(table_bound) && rows_dev_->try_grow(size_t(n));
  Status st = ok ? compute_->reserve(n, m) : Status(Code::out_of_memory, "");
  if (st.ok()) return st;
  return Status(Code::out_of_memory, "engine: a batch of " + std::to_string(n) + " rows (" +
                                         std::to_string(m) + " logits rows) does not fit the " +
                                         backend_->caps().name + " backend's memory beside the weights and KV");
}

Status Engine::run_layers(int64_t n, float* x, const int32_t* pos, const AttnRow* rows,
                          const std::vector<int32_t>& last_row, float* logits, const int32_t* host_pos,
                          const AttnRow* host_rows) {
  const LlamaConfig& c = config();
  const int64_t dim = c.dim;
  const int32_t emb = options_.expert_micro_batches;
  if (!link_) {
    compute_->run(kv_, 0, {0, own_last_}, n, pos, rows, x, experts_.get(), emb);
    const int64_t m = int64_t(last_row.size());
    if (host_) {
      compute_->logits(x, last_row.data(), m, logits);
    } else {  // the only activations that come back: the logits rows
      float* dev = logits_->grow(size_t(m * c.n_vocab));
      compute_->logits(x, last_row.data(), m, dev);
      backend_->download(logits, dev, size_t(m * c.n_vocab) * sizeof(float));
    }
    return Status::Ok();
  }
  // Pipeline micro-batches: group g runs our layers, then goes to the
  // stages after, and while they run it we run group g + 1. Groups go
  // through every stage in row order (a row attends only to positions
  // before it, written by earlier groups), so any count gives the same bits.
  const int64_t mb = std::clamp<int64_t>(options_.pipeline_micro_batches, 1, n);
  std::vector<uint64_t> tickets;
  std::vector<size_t> first_item(size_t(mb) + 1, 0);
  size_t item = 0;
  for (int64_t g = 0; g < mb; ++g) {
    const int64_t r0 = n * g / mb, rn = n * (g + 1) / mb - r0;
    compute_->run(kv_, 0, {0, own_last_}, rn, pos + r0, rows + r0, x + r0 * dim, experts_.get(), emb);
    const float* xg = x + r0 * dim;
    if (!host_) {  // the link sends from the host: this group's hidden states come down
      link_x_.resize(size_t(rn * dim));
      backend_->download(link_x_.data(), xg, link_x_.size() * sizeof(float));
      xg = link_x_.data();
    }
    StageRows sr{rn, host_pos + r0, host_rows + r0, xg, {}};
    first_item[size_t(g)] = item;
    while (item < last_row.size() && last_row[item] < r0 + rn)
      sr.logit_rows.push_back(int32_t(last_row[item++] - r0));
    auto t = link_->start(sr);
    if (!t.ok()) return broke(t.status());
    tickets.push_back(*t);
  }
  first_item[size_t(mb)] = item;
  Status failed;
  for (int64_t g = 0; g < mb; ++g) {
    // Every started ticket is finished, even after a failure.
    Status st = link_->finish(tickets[size_t(g)], logits + first_item[size_t(g)] * size_t(c.n_vocab));
    if (!st.ok() && failed.ok()) failed = st;
  }
  if (!failed.ok()) return broke(failed);
  return Status::Ok();
}

}  // namespace cleave
