#include "model/engine.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace cleave {

KvBlockPool::KvBlockPool(Backend& backend, PagedKv layout) : backend_(backend), kv_(layout) {
  size_t bytes = kv_.block_elems() * kv_.n_blocks * sizeof(float);
  kv_.data = static_cast<float*>(backend_.alloc(bytes));
  CLEAVE_CHECK(kv_.data != nullptr);
  free_.reserve(kv_.n_blocks);
  // Hand out low block ids first.
  for (int32_t b = kv_.n_blocks - 1; b >= 0; --b) free_.push_back(b);
}

KvBlockPool::~KvBlockPool() { backend_.free(kv_.data); }

int32_t KvBlockPool::take() {
  if (free_.empty()) return -1;
  int32_t b = free_.back();
  free_.pop_back();
  return b;
}

void KvBlockPool::give_back(int32_t block) { free_.push_back(block); }

Result<std::unique_ptr<Engine>> Engine::create(std::shared_ptr<const GgufFile> file,
                                               const EngineOptions& options) {
  auto model = LlamaModel::load(std::move(file));
  if (!model.ok()) return model.status();
  const LlamaConfig& c = (*model)->config();
  EngineOptions o = options;
  if (o.threads < 1 || o.threads > 1024)
    return Status(Code::invalid_argument, "engine: threads = " + std::to_string(o.threads) +
                                              " must be in [1, 1024]");
  if (o.context < 0 || o.max_seqs < 1 || o.block_size < 1)
    return Status(Code::invalid_argument, "engine: context, max_seqs and block_size must be positive");
  if (o.context == 0) o.context = c.context;
  if (o.context > c.context)
    return Status(Code::out_of_range, "engine: context " + std::to_string(o.context) +
                                          " exceeds the model's context_length " +
                                          std::to_string(c.context));

  auto e = std::unique_ptr<Engine>(new Engine());
  e->model_ = std::move(*model);
  e->options_ = o;
  e->backend_ = make_cpu_backend(o.threads);
  PagedKv layout;
  layout.block_size = o.block_size;
  layout.n_layers = c.n_layers;
  layout.n_kv_heads = c.n_kv_heads;
  layout.head_dim = c.head_dim;
  const int32_t blocks_per_seq = (o.context + o.block_size - 1) / o.block_size;
  layout.n_blocks = blocks_per_seq * o.max_seqs;
  e->pool_ = std::make_unique<KvBlockPool>(*e->backend_, layout);
  e->seqs_.resize(o.max_seqs);
  return e;
}

Engine::~Engine() = default;

Result<int32_t> Engine::open_sequence() {
  for (size_t s = 0; s < seqs_.size(); ++s) {
    if (!seqs_[s].open) {
      seqs_[s] = Sequence{true, 0, {}};
      return static_cast<int32_t>(s);
    }
  }
  return Status(Code::busy, "engine: all " + std::to_string(seqs_.size()) +
                                " sequence slots are in use");
}

void Engine::close_sequence(int32_t seq) {
  if (seq < 0 || seq >= int32_t(seqs_.size()) || !seqs_[seq].open) return;
  for (int32_t b : seqs_[seq].blocks) pool_->give_back(b);
  seqs_[seq] = Sequence{};
}

int32_t Engine::sequence_length(int32_t seq) const { return seqs_.at(seq).length; }

Status Engine::reserve_blocks(int32_t seq, int32_t new_length) {
  Sequence& s = seqs_[seq];
  const int32_t need = (new_length + options_.block_size - 1) / options_.block_size;
  while (int32_t(s.blocks.size()) < need) {
    int32_t b = pool_->take();
    if (b < 0) return Status(Code::out_of_memory, "engine: KV block pool exhausted");
    s.blocks.push_back(b);
  }
  return Status::Ok();
}

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
    added[it.seq] += it.n_tokens;
    const int32_t len = seqs_[it.seq].length + added[it.seq];
    if (len > options_.context)
      return Status(Code::out_of_range, "engine: sequence " + std::to_string(it.seq) + " of " +
                                            std::to_string(len) + " tokens exceeds the context of " +
                                            std::to_string(options_.context));
    n += it.n_tokens;
  }
  for (size_t s = 0; s < seqs_.size(); ++s) {
    if (added[s]) CLEAVE_RETURN_IF_ERROR(reserve_blocks(int32_t(s), seqs_[s].length + added[s]));
  }
  if (n == 0) return Status::Ok();

  // Rows: one per token, with its sequence's block table and position.
  int32_t* pos = grow(positions_, n);
  int32_t* ids = grow(token_ids_, n);
  AttnRow* rows = grow(rows_, n);
  std::vector<int32_t> last_row(items.size());
  {
    std::vector<int32_t> cursor(seqs_.size());
    for (size_t s = 0; s < seqs_.size(); ++s) cursor[s] = seqs_[s].length;
    int64_t r = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      Sequence& s = seqs_[it.seq];
      for (int32_t t = 0; t < it.n_tokens; ++t, ++r) {
        ids[r] = it.tokens[t];
        pos[r] = cursor[it.seq]++;
        rows[r] = AttnRow{s.blocks.data(), int32_t(s.blocks.size()), pos[r]};
      }
      last_row[i] = int32_t(r - 1);
    }
  }

  Backend& be = *backend_;
  const int64_t dim = c.dim, q_dim = int64_t(c.n_heads) * c.head_dim,
                kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  float* x = grow(x_, n * dim);
  float* h = grow(h_, n * dim);
  float* q = grow(q_, n * q_dim);
  float* k = grow(k_, n * kv_dim);
  float* v = grow(v_, n * kv_dim);
  float* att = grow(att_, n * q_dim);
  float* tmp = grow(tmp_, n * dim);
  const float scale = 1.0f / std::sqrt(float(c.head_dim));

  be.embed(model_->token_embd(), ids, n, x);
  for (int32_t li = 0; li < c.n_layers; ++li) {
    const LlamaLayer& l = model_->layer(li);
    be.rmsnorm(x, l.attn_norm, n, dim, c.rms_eps, h);
    be.matmul(l.wq, h, n, q);
    be.matmul(l.wk, h, n, k);
    be.matmul(l.wv, h, n, v);
    be.rope(q, n, c.n_heads, c.head_dim, pos, c.rope_base);
    be.rope(k, n, c.n_kv_heads, c.head_dim, pos, c.rope_base);
    be.kv_write(pool_->kv(), li, k, v, rows, n);
    be.attention(pool_->kv(), li, q, rows, n, c.n_heads, scale, att);
    be.matmul(l.wo, att, n, tmp);
    for (int64_t i = 0; i < n * dim; ++i) x[i] += tmp[i];

    be.rmsnorm(x, l.ffn_norm, n, dim, c.rms_eps, h);
    if (c.n_experts == 0) ffn_dense(l, n);
    else ffn_moe(l, n);
    for (int64_t i = 0; i < n * dim; ++i) x[i] += tmp[i];
  }

  // Logits only for each item's last token.
  const int64_t m = int64_t(items.size());
  float* last = grow(logits_rows_, m * dim);
  for (int64_t i = 0; i < m; ++i)
    std::copy(x + int64_t(last_row[i]) * dim, x + int64_t(last_row[i] + 1) * dim, last + i * dim);
  be.rmsnorm(last, model_->output_norm(), m, dim, c.rms_eps, h);
  be.matmul(model_->output(), h, m, logits);

  for (size_t s = 0; s < seqs_.size(); ++s) seqs_[s].length += added[s];
  return Status::Ok();
}

// tmp = down(silu(gate h) * up h)
void Engine::ffn_dense(const LlamaLayer& l, int64_t n) {
  const int64_t ffn = config().ffn;
  float* g = grow(gate_, n * ffn);
  float* u = grow(up_, n * ffn);
  backend_->matmul(l.gate, h_.data(), n, g);
  backend_->matmul(l.up, h_.data(), n, u);
  backend_->silu_mul(g, u, n * ffn, g);
  backend_->matmul(l.down, g, n, tmp_.data());
}

// tmp = sum_j w_j * expert_j(h), experts taken per row in gating order (most
// weight first), so the sum's order is fixed for every row.
void Engine::ffn_moe(const LlamaLayer& l, int64_t n) {
  const LlamaConfig& c = config();
  const int64_t dim = c.dim, ffn = c.ffn, k = c.n_experts_used;
  float* rl = grow(router_logits_, n * c.n_experts);
  int32_t* eid = grow(expert_ids_, n * k);
  float* ew = grow(expert_w_, n * k);
  float* out = grow(moe_out_, n * k * dim);  // row-major [row][j][dim]
  backend_->matmul(l.router, h_.data(), n, rl);
  backend_->topk_gating(rl, n, c.n_experts, k, eid, ew);

  float* gx = grow(gather_x_, n * dim);
  float* gy = grow(gather_y_, n * dim);
  float* g = grow(gate_, n * ffn);
  float* u = grow(up_, n * ffn);
  int32_t* slot = grow(gather_rows_, n);  // row*k + j of each gathered row
  for (int32_t e = 0; e < c.n_experts; ++e) {
    int64_t cnt = 0;
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < k; ++j) {
        if (eid[r * k + j] != e) continue;
        std::copy(h_.data() + r * dim, h_.data() + (r + 1) * dim, gx + cnt * dim);
        slot[cnt++] = int32_t(r * k + j);
      }
    }
    if (cnt == 0) continue;
    backend_->matmul(l.gate_exps[e], gx, cnt, g);
    backend_->matmul(l.up_exps[e], gx, cnt, u);
    backend_->silu_mul(g, u, cnt * ffn, g);
    backend_->matmul(l.down_exps[e], g, cnt, gy);
    for (int64_t i = 0; i < cnt; ++i)
      std::copy(gy + i * dim, gy + (i + 1) * dim, out + int64_t(slot[i]) * dim);
  }
  float* t = tmp_.data();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t d = 0; d < dim; ++d) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) acc += ew[r * k + j] * out[(r * k + j) * dim + d];
      t[r * dim + d] = acc;
    }
  }
}

}  // namespace cleave
