#include "model/layer_compute.h"

#include <algorithm>
#include <cmath>

namespace cleave {

Result<std::vector<LayerRange>> even_cut(int32_t n_layers, int32_t stages) {
  if (stages < 1 || stages > n_layers)
    return Status(Code::invalid_argument, "pipeline of " + std::to_string(stages) +
                                              " stages: must be in [1, " +
                                              std::to_string(n_layers) + "] (the model's layers)");
  std::vector<LayerRange> out;
  int32_t first = 0;
  for (int32_t s = 0; s < stages; ++s) {
    const int32_t len = n_layers / stages + (s < n_layers % stages ? 1 : 0);
    out.push_back({first, first + len - 1});
    first += len;
  }
  return out;
}

Status check_cover(const std::vector<LayerRange>& ranges, int32_t n_layers) {
  int32_t next = 0;
  for (const LayerRange& r : ranges) {
    if (r.first > r.last)
      return Status(Code::invalid_argument, "layers " + r.to_string() + " are an empty range");
    if (r.first < 0 || r.last >= n_layers)
      return Status(Code::invalid_argument, "layers " + r.to_string() +
                                                " go past the model's layers [0, " +
                                                std::to_string(n_layers - 1) + "]");
    if (r.first > next)
      return Status(Code::invalid_argument, "layers [" + std::to_string(next) + ", " +
                                                std::to_string(r.first - 1) +
                                                "] are held by no stage (a gap before " +
                                                r.to_string() + ")");
    if (r.first < next)
      return Status(Code::invalid_argument, "layers " + r.to_string() + " overlap [" +
                                                std::to_string(r.first) + ", " +
                                                std::to_string(next - 1) + "] of the stage before");
    next = r.last + 1;
  }
  if (next < n_layers)
    return Status(Code::invalid_argument, "layers [" + std::to_string(next) + ", " +
                                              std::to_string(n_layers - 1) +
                                              "] are held by no stage (a gap at the end)");
  return Status::Ok();
}

LayerCompute::LayerCompute(const LlamaModel& model, Backend& backend)
    : model_(model),
      be_(backend),
      host_(backend.caps().host_memory),
      h_(backend), q_(backend), k_(backend), v_(backend), att_(backend), tmp_(backend),
      gate_(backend), up_(backend), last_(backend), which_(backend) {}

Status LayerCompute::reserve(int64_t n, int64_t m) {
  const LlamaConfig& c = model_.config();
  const int64_t dim = c.dim, q_dim = int64_t(c.n_heads) * c.head_dim,
                kv_dim = int64_t(c.n_kv_heads) * c.head_dim, k = std::max(1, c.n_experts_used);
  const int64_t ffn_rows = c.n_experts > 0 ? n * k : n;  // an expert may take every gathered row
  bool ok = h_.try_grow(size_t(n * dim)) && q_.try_grow(size_t(n * q_dim)) &&
            k_.try_grow(size_t(n * kv_dim)) && v_.try_grow(size_t(n * kv_dim)) &&
            att_.try_grow(size_t(n * q_dim)) && tmp_.try_grow(size_t(n * dim)) &&
            gate_.try_grow(size_t(ffn_rows * c.ffn)) && up_.try_grow(size_t(ffn_rows * c.ffn)) &&
            last_.try_grow(size_t(2 * m * dim)) && which_.try_grow(size_t(m));
  if (ok && c.n_experts > 0) {
    if (groups_.empty()) groups_.resize(1);
    FfnGroup& g = groups_[0];
    ok = ensure(g.router_logits)->try_grow(size_t(n * c.n_experts)) &&
         ensure(g.expert_ids)->try_grow(size_t(n * k)) && ensure(g.expert_w)->try_grow(size_t(n * k)) &&
         ensure(g.gather_x)->try_grow(size_t(n * k * dim)) && ensure(g.gather_y)->try_grow(size_t(n * k * dim)) &&
         ensure(g.gather_src)->try_grow(size_t(n * k)) && ensure(g.gather_at)->try_grow(size_t(n * k));
  }
  if (ok) return Status::Ok();
  return Status(Code::out_of_memory, "no room in " + be_.caps().name + " memory for the activations of " +
                                         std::to_string(n) + " rows");
}

void LayerCompute::run(const PagedKv& kv, int32_t kv_first, LayerRange layers, int64_t n,
                       const int32_t* pos, const AttnRow* rows, float* x, ExpertExecutor* experts,
                       int32_t micro_batches) {
  if (n == 0) return;
  const LlamaConfig& c = model_.config();
  const int64_t dim = c.dim, q_dim = int64_t(c.n_heads) * c.head_dim,
                kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  h_.grow(size_t(n * dim));
  q_.grow(size_t(n * q_dim));
  k_.grow(size_t(n * kv_dim));
  v_.grow(size_t(n * kv_dim));
  att_.grow(size_t(n * q_dim));
  tmp_.grow(size_t(n * dim));
  const Call call{&kv, kv_first, pos, rows, x, experts};
  // Micro-batch ping-pong: with an expert executor the rows go in mb
  // groups, and while the experts compute one group's FFN of a layer the
  // next group's attention runs here. Each row's bits do not depend on the
  // rows beside it, and the groups run each layer in row order (a row
  // attends only to positions before it), so any mb gives the same bits.
  const int64_t mb = experts ? std::clamp<int64_t>(micro_batches, 1, n) : 1;
  if (int64_t(groups_.size()) < mb) groups_.resize(size_t(mb));
  for (int64_t g = 0; g < mb; ++g) {
    groups_[size_t(g)].r0 = n * g / mb;
    groups_[size_t(g)].n = n * (g + 1) / mb - n * g / mb;
  }
  for (int32_t li = layers.first; li <= layers.last; ++li) {
    const LlamaLayer& l = model_.layer(li);
    for (int64_t g = 0; g < mb; ++g) {
      FfnGroup& grp = groups_[size_t(g)];
      if (li > layers.first) ffn_finish(call, grp);
      attend(call, l, li, grp.r0, grp.n);
      ffn_start(call, l, li, grp);
    }
  }
  for (int64_t g = 0; g < mb; ++g) ffn_finish(call, groups_[size_t(g)]);
}

void LayerCompute::logits(const float* x, const int32_t* which, int64_t m, float* out) {
  if (m == 0) return;
  const LlamaConfig& c = model_.config();
  const int64_t dim = c.dim;
  float* normed = last_.grow(size_t(2 * m * dim));
  // Rows one after another (decode: every row) are normed in place; others
  // are gathered first (an F32 "embedding" lookup: exact copies).
  bool run = true;
  int32_t top = which[0];
  for (int64_t i = 1; i < m; ++i) {
    run = run && which[i] == which[0] + i;
    top = std::max(top, which[i]);
  }
  const float* src = x + int64_t(which[0]) * dim;
  if (!run) {
    float* gathered = normed + m * dim;
    const WeightView rows{DType::F32, x, int64_t(top) + 1, dim, size_t(dim) * sizeof(float)};
    be_.embed(rows, to_backend(be_, host_, which, size_t(m), which_), m, gathered);
    src = gathered;
  }
  be_.rmsnorm(src, model_.output_norm(), m, dim, c.rms_eps, normed);
  be_.matmul(model_.output(), normed, m, out);
}

// Rows [r0, r0 + n) of layer li up to the FFN: x += attention(x), then
// h = ffn_norm(x).
void LayerCompute::attend(const Call& call, const LlamaLayer& l, int32_t li, int64_t r0, int64_t n) {
  const LlamaConfig& c = model_.config();
  const int64_t dim = c.dim, q_dim = int64_t(c.n_heads) * c.head_dim,
                kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  float* x = call.x + r0 * dim;
  float* h = h_.data() + r0 * dim;
  float* q = q_.data() + r0 * q_dim;
  float* k = k_.data() + r0 * kv_dim;
  float* v = v_.data() + r0 * kv_dim;
  float* att = att_.data() + r0 * q_dim;
  float* tmp = tmp_.data() + r0 * dim;
  const int32_t* pos = call.pos + r0;
  const AttnRow* rows = call.rows + r0;
  const int32_t kv_layer = li - call.kv_first;
  const float scale = 1.0f / std::sqrt(float(c.head_dim));
  be_.rmsnorm(x, l.attn_norm, n, dim, c.rms_eps, h);
  const MatmulJob qkv[] = {{&l.wq, h, n, q}, {&l.wk, h, n, k}, {&l.wv, h, n, v}};
  be_.matmuls(qkv, 3);
  be_.rope(q, n, c.n_heads, c.head_dim, pos, c.rope_base);
  be_.rope(k, n, c.n_kv_heads, c.head_dim, pos, c.rope_base);
  be_.kv_write(*call.kv, kv_layer, k, v, rows, n);
  be_.attention(*call.kv, kv_layer, q, rows, n, c.n_heads, scale, att);
  be_.matmul(l.wo, att, n, tmp);
  be_.add(x, tmp, n * dim, n * dim, x);
  be_.rmsnorm(x, l.ffn_norm, n, dim, c.rms_eps, h);
}

// The group's FFN input is h (rows r0..): routes it (MoE: gate, softmax,
// top-k, renormalisation) and gathers each expert's rows into one run of
// gx, then computes the experts here, or starts them on the executor.
void LayerCompute::ffn_start(const Call& call, const LlamaLayer& l, int32_t layer, FfnGroup& g) {
  const LlamaConfig& c = model_.config();
  const int64_t dim = c.dim, n = g.n;
  const float* h = h_.data() + g.r0 * dim;
  float* tmp = tmp_.data() + g.r0 * dim;
  g.work.clear();
  g.started = true;
  g.y_dev = nullptr;
  if (c.n_experts == 0) {  // dense: the FFN is expert 0, straight into tmp
    g.work.push_back(ExpertWork{0, n, h, tmp});
    if (call.experts && !host_) work_to_host(g, h, tmp, n * dim);
    if (call.experts) g.ticket = call.experts->start(layer, g.work);
    else compute_expert(be_, l, c.ffn, 0, h, n, gate_.grow(size_t(n * c.ffn)), up_.grow(size_t(n * c.ffn)), tmp);
    return;
  }
  const int64_t k = c.n_experts_used;
  float* rl = grow(g.router_logits, n * c.n_experts);
  int32_t* eid_b = grow(g.expert_ids, n * k);
  float* ew = grow(g.expert_w, n * k);
  be_.matmul(l.router, h, n, rl);
  be_.topk_gating(rl, n, c.n_experts, k, eid_b, ew);
  // The gather is planned on the host from the rows' expert ids.
  const int32_t* eid = eid_b;
  if (!host_) {
    g.ids_host.resize(size_t(n * k));
    be_.download(g.ids_host.data(), eid_b, size_t(n * k) * sizeof(int32_t));
    eid = g.ids_host.data();
  }
  g.src_host.resize(size_t(n * k));
  g.at_host.resize(size_t(n * k));
  float* gx = grow(g.gather_x, n * k * dim);
  float* gy = grow(g.gather_y, n * k * dim);
  int64_t cnt = 0;
  for (int32_t e = 0; e < c.n_experts; ++e) {
    const int64_t first = cnt;
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < k; ++j) {
        if (eid[r * k + j] != e) continue;
        g.src_host[size_t(cnt)] = int32_t(r);
        g.at_host[size_t(r * k + j)] = int32_t(cnt++);
      }
    }
    if (cnt > first) g.work.push_back(ExpertWork{e, cnt - first, gx + first * dim, gy + first * dim});
  }
  // Each expert's rows one after another in gx: exact copies of h's rows.
  const WeightView rows{DType::F32, h, n, dim, size_t(dim) * sizeof(float)};
  be_.embed(rows, to_backend(be_, host_, g.src_host.data(), size_t(cnt), *ensure(g.gather_src)), cnt, gx);
  g.at = to_backend(be_, host_, g.at_host.data(), size_t(n * k), *ensure(g.gather_at));
  g.gathered = cnt;
  if (call.experts) {
    if (!host_) work_to_host(g, gx, gy, cnt * dim);
    g.ticket = call.experts->start(layer, g.work);
  } else {
    compute_experts(be_, l, c.ffn, g.work, gate_.grow(size_t(cnt * c.ffn)), up_.grow(size_t(cnt * c.ffn)));
  }
}

void LayerCompute::work_to_host(FfnGroup& g, const float* x, float* y, int64_t count) {
  g.x_host.resize(size_t(count));
  g.y_host.resize(size_t(count));
  if (count > 0) be_.download(g.x_host.data(), x, size_t(count) * sizeof(float));
  for (ExpertWork& w : g.work) {
    w.x = g.x_host.data() + (w.x - x);
    w.y = g.y_host.data() + (w.y - y);
  }
  g.y_dev = count > 0 ? y : nullptr;
}

// Waits for the group's experts, combines them (MoE: tmp = sum_j w_j *
// expert_j(h), experts taken per row in gating order, most weight first,
// so the sum's order is fixed for every row) and adds the FFN to x.
void LayerCompute::ffn_finish(const Call& call, FfnGroup& g) {
  if (!g.started) return;
  g.started = false;
  const LlamaConfig& c = model_.config();
  const int64_t dim = c.dim, n = g.n;
  if (call.experts) call.experts->finish(g.ticket);
  if (g.y_dev) be_.upload(g.y_dev, g.y_host.data(), g.y_host.size() * sizeof(float));
  float* tmp = tmp_.data() + g.r0 * dim;
  if (c.n_experts > 0)
    be_.moe_combine(g.gather_y->data(), g.at, g.expert_w->data(), n, c.n_experts_used, dim, tmp);
  float* x = call.x + g.r0 * dim;
  be_.add(x, tmp, n * dim, n * dim, x);
}

}  // namespace cleave
