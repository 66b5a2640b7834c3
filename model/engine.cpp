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

Result<std::unique_ptr<Engine>> Engine::create(std::shared_ptr<const GgufFile> file,
                                               const EngineOptions& options) {
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
  if (o.kv_blocks < 0)
    return Status(Code::invalid_argument,
                  "engine: kv_blocks = " + std::to_string(o.kv_blocks) + " must not be negative");
  if (o.context == 0) o.context = c.context;
  if (o.context > c.context)
    return Status(Code::out_of_range, "engine: context " + std::to_string(o.context) +
                                          " exceeds the model's context_length " +
                                          std::to_string(c.context));
  const int32_t blocks_per_seq = (o.context + o.block_size - 1) / o.block_size;
  if (o.kv_blocks == 0) o.kv_blocks = blocks_per_seq * o.max_seqs;

  auto e = std::unique_ptr<Engine>(new Engine());
  e->model_ = std::move(*model);
  e->options_ = o;
  e->model_fp_ = model_fp;
  e->backend_ = make_cpu_backend(o.threads);
  e->layout_.dtype = uint32_t(DType::F32);
  e->layout_.tokens_per_block = o.block_size;
  e->layout_.n_layers = c.n_layers;
  e->layout_.n_kv_heads = c.n_kv_heads;
  e->layout_.head_dim = c.head_dim;
  CLEAVE_RETURN_IF_ERROR(e->layout_.validate());
  e->kv_.block_size = o.block_size;
  e->kv_.n_layers = c.n_layers;
  e->kv_.n_kv_heads = c.n_kv_heads;
  e->kv_.head_dim = c.head_dim;
  e->kv_.n_blocks = o.kv_blocks;
  CLEAVE_CHECK(e->kv_.block_elems() * sizeof(float) == e->layout_.block_bytes());
  e->kv_.data = static_cast<float*>(e->backend_->alloc(e->block_bytes() * size_t(o.kv_blocks)));
  if (e->kv_.data == nullptr)
    return Status(Code::out_of_memory, "engine: cannot allocate " + std::to_string(o.kv_blocks) +
                                           " KV blocks of " + std::to_string(e->block_bytes()) +
                                           " bytes");
  auto pool = BlockPool::create(o.kv_blocks, o.block_size);
  if (!pool.ok()) return pool.status();
  e->pool_ = std::move(*pool);
  if (o.prefix_cache) {
    auto index = PrefixIndex::create(*e->pool_, model_fp, e->layout_);
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

void Engine::copy_block(int32_t src, int32_t dst) {
  // Through host memory: the backend moves bytes only between host and its own memory.
  staging_.resize(block_bytes());
  backend_->download(staging_.data(), block_data(src), block_bytes());
  backend_->upload(block_data(dst), staging_.data(), block_bytes());
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

Result<std::vector<BlockRecord>> Engine::export_blocks(int32_t seq, int32_t first_block) const {
  if (!is_open(seq))
    return Status(Code::invalid_argument, "engine: export of sequence " + std::to_string(seq) +
                                              ", which is not open");
  const Sequence& s = seqs_[size_t(seq)];
  const int32_t n_blocks = s.blocks->n_blocks();
  if (first_block < 0 || first_block > n_blocks)
    return Status(Code::invalid_argument, "engine: export from block " + std::to_string(first_block) +
                                              " of a sequence with " + std::to_string(n_blocks) +
                                              " blocks");
  const std::vector<BlockKey> keys = keys_of(s);
  const int32_t bs = options_.block_size, len = int32_t(s.tokens.size());
  std::vector<BlockRecord> records(size_t(n_blocks - first_block));
  for (int32_t b = first_block; b < n_blocks; ++b) {
    BlockRecord& r = records[size_t(b - first_block)];
    r.header.key = keys[size_t(b)];
    r.header.model_fingerprint = model_fp_;
    r.header.layout = layout_;
    r.header.n_tokens = uint32_t(std::min(bs, len - b * bs));
    r.bytes.resize(block_bytes());
    backend_->download(r.bytes.data(), block_data(s.blocks->blocks()[size_t(b)]), block_bytes());
    seal(r);
  }
  return records;
}

Status Engine::import_blocks(int32_t seq, const int32_t* tokens, int32_t n_tokens,
                             const std::vector<BlockRecord>& records) {
  if (!is_open(seq))
    return Status(Code::invalid_argument, "engine: import_blocks needs an open sequence; " +
                                              std::to_string(seq) + " is not");
  if (n_tokens < 0 || (n_tokens > 0 && tokens == nullptr))
    return Status(Code::invalid_argument, "engine: import of " + std::to_string(n_tokens) +
                                              " tokens without a token array");
  if (n_tokens > options_.context)
    return Status(Code::out_of_range, "engine: import of " + std::to_string(n_tokens) +
                                          " tokens exceeds the context of " +
                                          std::to_string(options_.context));
  const int32_t n_vocab = config().n_vocab;
  for (int32_t i = 0; i < n_tokens; ++i)
    if (tokens[i] < 0 || tokens[i] >= n_vocab)
      return Status(Code::invalid_argument, "engine: import token id " + std::to_string(tokens[i]) +
                                                " is outside the vocabulary [0, " +
                                                std::to_string(n_vocab) + ")");
  const int32_t bs = options_.block_size;
  // What the sequence holds already (an attached cached prefix) must be
  // whole blocks of these tokens; the records continue after it.
  const std::vector<int32_t>& held = seqs_[size_t(seq)].tokens;
  const int32_t n_held = int32_t(held.size());
  if (n_held % bs != 0 || n_held > n_tokens || !std::equal(held.begin(), held.end(), tokens))
    return Status(Code::invalid_argument,
                  "engine: import into sequence " + std::to_string(seq) + ", which holds " +
                      std::to_string(n_held) + " tokens that are not whole blocks of the " +
                      std::to_string(n_tokens) + " tokens imported");
  const int32_t first = n_held / bs;
  const int32_t n_blocks = (n_tokens + bs - 1) / bs - first;
  if (int32_t(records.size()) != n_blocks)
    return Status(Code::invalid_argument, "engine: import of " + std::to_string(n_tokens) +
                                              " tokens after " + std::to_string(n_held) +
                                              " held needs " + std::to_string(n_blocks) +
                                              " blocks, got " + std::to_string(records.size()));
  // The keys these tokens give: a record made for other tokens cannot attach.
  Sequence probe;
  probe.tokens.assign(tokens, tokens + n_tokens);
  probe.images = seqs_[size_t(seq)].images;
  const std::vector<BlockKey> keys = keys_of(probe);
  for (int32_t i = 0; i < n_blocks; ++i) {
    const int32_t b = first + i;
    const BlockRecord& r = records[size_t(i)];
    const std::string who = "engine: import block " + std::to_string(b) + ": ";
    Status st = verify(r, model_fp_, layout_);
    if (!st.ok()) return Status(st.code(), who + st.message());
    const uint32_t want = uint32_t(std::min(bs, n_tokens - b * bs));
    if (r.header.n_tokens != want)
      return Status(Code::invalid_argument, who + "holds " + std::to_string(r.header.n_tokens) +
                                                " tokens, the sequence needs " +
                                                std::to_string(want) + " there");
    if (!(r.header.key == keys[size_t(b)]))
      return Status(Code::invalid_argument, who + "key " + r.header.key.hex() +
                                                " is not the key of these tokens (" +
                                                keys[size_t(b)].hex() + ")");
  }
  CLEAVE_RETURN_IF_ERROR(make_room(n_blocks));
  Sequence& s = seqs_[size_t(seq)];
  auto grant = s.blocks->append_tokens(n_tokens - n_held);
  CLEAVE_CHECK(grant.ok() && !grant->no_room && !grant->copy);
  for (int32_t i = 0; i < n_blocks; ++i)
    backend_->upload(block_data(s.blocks->blocks()[size_t(first + i)]),
                     records[size_t(i)].bytes.data(), block_bytes());
  s.tokens = std::move(probe.tokens);
  publish_full_blocks(s);
  return Status::Ok();
}

Engine::CacheStats Engine::cache_stats() const { return stats_; }

namespace {
template <class T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
}  // namespace

Status Engine::forward(const std::vector<Item>& items, float* logits) {
  const LlamaConfig& c = config();
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
  std::vector<int32_t> start(seqs_.size());
  for (size_t s = 0; s < seqs_.size(); ++s) {
    start[s] = int32_t(seqs_[s].tokens.size());
    if (!added[s]) continue;
    auto grant = seqs_[s].blocks->append_tokens(added[s]);
    CLEAVE_CHECK(grant.ok() && !grant->no_room);
    // A shared, partly filled last block (a cached prefix) is copied before it is written.
    if (grant->copy) copy_block(grant->copy->src, grant->copy->dst);
  }

  // Rows: one per token, with its sequence's block table and position.
  int32_t* pos = grow(positions_, n);
  int32_t* ids = grow(token_ids_, n);
  AttnRow* rows = grow(rows_, n);
  std::vector<int32_t> last_row(items.size());
  {
    std::vector<int32_t> cursor = start;
    int64_t r = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      Sequence& s = seqs_[it.seq];
      s.tokens.insert(s.tokens.end(), it.tokens, it.tokens + it.n_tokens);
      const std::vector<int32_t>& table = s.blocks->blocks();
      for (int32_t t = 0; t < it.n_tokens; ++t, ++r) {
        ids[r] = it.tokens[t];
        pos[r] = cursor[it.seq]++;
        rows[r] = AttnRow{table.data(), int32_t(table.size()), pos[r]};
      }
      last_row[i] = int32_t(r - 1);
    }
  }

  Backend& be = *backend_;
  const int64_t dim = c.dim, q_dim = int64_t(c.n_heads) * c.head_dim,
                kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  float* x = grow(x_, n * dim);
  float* h = grow(h_, n * dim);
  // The layers' scratch (attend() and the FFN groups take their rows).
  grow(q_, n * q_dim);
  grow(k_, n * kv_dim);
  grow(v_, n * kv_dim);
  grow(att_, n * q_dim);
  grow(tmp_, n * dim);

  be.embed(model_->token_embd(), ids, n, x);
  // Image rows: the item's embeddings replace the placeholders' rows.
  for (size_t i = 0, r0 = 0; i < items.size(); r0 += size_t(items[i].n_tokens), ++i) {
    const Item& it = items[i];
    if (it.embeddings.empty()) continue;
    const float* src = it.embeddings.data();
    for (int32_t t = 0; t < it.n_tokens; ++t) {
      if (!in_image(seqs_[it.seq].images, pos[r0 + size_t(t)])) continue;
      std::copy(src, src + dim, x + int64_t(r0 + size_t(t)) * dim);
      src += dim;
    }
  }
  // Micro-batch ping-pong: with an expert executor the rows go in m
  // groups, and while the experts compute one group's FFN of a layer the
  // next group's attention runs here. Each row's bits do not depend on the
  // rows beside it, and the groups run each layer in row order (a row
  // attends only to positions before it), so any m gives the same bits.
  const int64_t mb = experts_ ? std::min<int64_t>(options_.expert_micro_batches, n) : 1;
  if (int64_t(groups_.size()) < mb) groups_.resize(size_t(mb));
  for (int64_t g = 0; g < mb; ++g) {
    groups_[size_t(g)].r0 = n * g / mb;
    groups_[size_t(g)].n = n * (g + 1) / mb - n * g / mb;
  }
  for (int32_t li = 0; li < c.n_layers; ++li) {
    const LlamaLayer& l = model_->layer(li);
    for (int64_t g = 0; g < mb; ++g) {
      FfnGroup& grp = groups_[size_t(g)];
      if (li > 0) ffn_finish(grp);
      attend(l, li, grp.r0, grp.n);
      ffn_start(l, li, grp);
    }
  }
  for (int64_t g = 0; g < mb; ++g) ffn_finish(groups_[size_t(g)]);

  // Logits only for each item's last token.
  const int64_t m = int64_t(items.size());
  float* last = grow(logits_rows_, m * dim);
  for (int64_t i = 0; i < m; ++i)
    std::copy(x + int64_t(last_row[i]) * dim, x + int64_t(last_row[i] + 1) * dim, last + i * dim);
  be.rmsnorm(last, model_->output_norm(), m, dim, c.rms_eps, h);
  be.matmul(model_->output(), h, m, logits);

  if (index_)
    for (size_t s = 0; s < seqs_.size(); ++s)
      if (added[s]) publish_full_blocks(seqs_[s]);
  return Status::Ok();
}

// Rows [r0, r0 + n) of layer li up to the FFN: x += attention(x), then
// h = ffn_norm(x).
void Engine::attend(const LlamaLayer& l, int32_t li, int64_t r0, int64_t n) {
  const LlamaConfig& c = config();
  Backend& be = *backend_;
  const int64_t dim = c.dim, q_dim = int64_t(c.n_heads) * c.head_dim,
                kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  float* x = x_.data() + r0 * dim;
  float* h = h_.data() + r0 * dim;
  float* q = q_.data() + r0 * q_dim;
  float* k = k_.data() + r0 * kv_dim;
  float* v = v_.data() + r0 * kv_dim;
  float* att = att_.data() + r0 * q_dim;
  float* tmp = tmp_.data() + r0 * dim;
  const int32_t* pos = positions_.data() + r0;
  const AttnRow* rows = rows_.data() + r0;
  const float scale = 1.0f / std::sqrt(float(c.head_dim));
  be.rmsnorm(x, l.attn_norm, n, dim, c.rms_eps, h);
  be.matmul(l.wq, h, n, q);
  be.matmul(l.wk, h, n, k);
  be.matmul(l.wv, h, n, v);
  be.rope(q, n, c.n_heads, c.head_dim, pos, c.rope_base);
  be.rope(k, n, c.n_kv_heads, c.head_dim, pos, c.rope_base);
  be.kv_write(kv_, li, k, v, rows, n);
  be.attention(kv_, li, q, rows, n, c.n_heads, scale, att);
  be.matmul(l.wo, att, n, tmp);
  for (int64_t i = 0; i < n * dim; ++i) x[i] += tmp[i];
  be.rmsnorm(x, l.ffn_norm, n, dim, c.rms_eps, h);
}

// The group's FFN input is h (rows r0..): routes it (MoE: gate, softmax,
// top-k, renormalisation) and gathers each expert's rows into one run of
// gx, then computes the experts here, or starts them on the executor.
void Engine::ffn_start(const LlamaLayer& l, int32_t layer, FfnGroup& g) {
  const LlamaConfig& c = config();
  const int64_t dim = c.dim, n = g.n;
  const float* h = h_.data() + g.r0 * dim;
  float* tmp = tmp_.data() + g.r0 * dim;
  g.work.clear();
  g.started = true;
  if (c.n_experts == 0) {  // dense: the FFN is expert 0, straight into tmp
    g.work.push_back(ExpertWork{0, n, h, tmp});
    if (experts_) g.ticket = experts_->start(layer, g.work);
    else compute_expert(*backend_, l, c.ffn, 0, h, n, gate_, up_, tmp);
    return;
  }
  const int64_t k = c.n_experts_used;
  float* rl = grow(g.router_logits, n * c.n_experts);
  int32_t* eid = grow(g.expert_ids, n * k);
  float* ew = grow(g.expert_w, n * k);
  backend_->matmul(l.router, h, n, rl);
  backend_->topk_gating(rl, n, c.n_experts, k, eid, ew);
  float* gx = grow(g.gather_x, n * k * dim);
  float* gy = grow(g.gather_y, n * k * dim);
  int32_t* slot = grow(g.gather_rows, n * k);  // row*k + j of each gathered row
  int64_t cnt = 0;
  for (int32_t e = 0; e < c.n_experts; ++e) {
    const int64_t first = cnt;
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < k; ++j) {
        if (eid[r * k + j] != e) continue;
        std::copy(h + r * dim, h + (r + 1) * dim, gx + cnt * dim);
        slot[cnt++] = int32_t(r * k + j);
      }
    }
    if (cnt > first) g.work.push_back(ExpertWork{e, cnt - first, gx + first * dim, gy + first * dim});
  }
  g.gathered = cnt;
  if (experts_) {
    g.ticket = experts_->start(layer, g.work);
  } else {
    for (const ExpertWork& w : g.work)
      compute_expert(*backend_, l, c.ffn, w.expert, w.x, w.rows, gate_, up_, w.y);
  }
}

// Waits for the group's experts, combines them (MoE: tmp = sum_j w_j *
// expert_j(h), experts taken per row in gating order, most weight first,
// so the sum's order is fixed for every row) and adds the FFN to x.
void Engine::ffn_finish(FfnGroup& g) {
  if (!g.started) return;
  g.started = false;
  const LlamaConfig& c = config();
  const int64_t dim = c.dim, n = g.n;
  if (experts_) experts_->finish(g.ticket);
  float* tmp = tmp_.data() + g.r0 * dim;
  if (c.n_experts > 0) {
    const int64_t k = c.n_experts_used;
    float* out = grow(g.moe_out, n * k * dim);  // row-major [row][j][dim]
    const float* gy = g.gather_y.data();
    const int32_t* slot = g.gather_rows.data();
    const float* ew = g.expert_w.data();
    for (int64_t i = 0; i < g.gathered; ++i)
      std::copy(gy + i * dim, gy + (i + 1) * dim, out + int64_t(slot[i]) * dim);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t d = 0; d < dim; ++d) {
        float acc = 0.f;
        for (int64_t j = 0; j < k; ++j) acc += ew[r * k + j] * out[(r * k + j) * dim + d];
        tmp[r * dim + d] = acc;
      }
    }
  }
  float* x = x_.data() + g.r0 * dim;
  for (int64_t i = 0; i < n * dim; ++i) x[i] += tmp[i];
}

}  // namespace cleave
