#include "model/layer_stage.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <string>

#include "storage/block.h"

namespace cleave {

StageBatchData to_batch_data(const StageRows& rows, int32_t dim) {
  StageBatchData d;
  d.positions.assign(rows.positions, rows.positions + rows.n);
  d.row_table.resize(size_t(rows.n));
  std::map<const int32_t*, int32_t> seen;  // a sequence's rows share its table
  for (int64_t r = 0; r < rows.n; ++r) {
    const AttnRow& a = rows.rows[r];
    auto [it, fresh] = seen.emplace(a.block_table, int32_t(d.tables.size()));
    if (fresh) d.tables.emplace_back(a.block_table, a.block_table + a.n_blocks);
    // Rows of one sequence in one batch see its table at its full length.
    if (int32_t(d.tables[size_t(it->second)].size()) < a.n_blocks)
      d.tables[size_t(it->second)].assign(a.block_table, a.block_table + a.n_blocks);
    d.row_table[size_t(r)] = it->second;
  }
  d.logit_rows = rows.logit_rows;
  d.x.assign(rows.x, rows.x + rows.n * dim);
  return d;
}

Result<std::unique_ptr<LayerStage>> LayerStage::create(std::shared_ptr<const GgufFile> file,
                                                       LayerRange layers, int32_t kv_blocks,
                                                       int32_t block_size, int32_t threads,
                                                       DType cache_type_k, DType cache_type_v,
                                                       Compute compute, const std::string& device,
                                                       std::shared_ptr<Backend> backend) {
  if (!file) return Status(Code::invalid_argument, "stage: no model file");
  auto where = device_for(device, bool(backend), "stage");
  if (!where.ok()) return where.status();
  const uint64_t model_fp = checksum_bytes(file->data(), file->file_size());
  file->release_resident_pages();  // keep only this stage's layers resident
  auto model = LlamaModel::load(std::move(file));
  if (!model.ok()) return model.status();
  const LlamaConfig& c = (*model)->config();
  if (layers.first < 1 || layers.last < layers.first || layers.last >= c.n_layers)
    return Status(Code::invalid_argument,
                  "stage: layers " + layers.to_string() + " must lie in [1, " +
                      std::to_string(c.n_layers - 1) +
                      "] (layer 0 and the embeddings are the first stage's)");
  if (kv_blocks < 1 || block_size < 1)
    return Status(Code::invalid_argument, "stage: kv_blocks and block_size must be positive");
  if (threads < 1 || threads > 1024)
    return Status(Code::invalid_argument,
                  "stage: threads = " + std::to_string(threads) + " must be in [1, 1024]");
  CLEAVE_RETURN_IF_ERROR(check_kv_type(cache_type_k, c.head_dim, "stage: cache type k"));
  CLEAVE_RETURN_IF_ERROR(check_kv_type(cache_type_v, c.head_dim, "stage: cache type v"));
  CLEAVE_RETURN_IF_ERROR(check_compute(compute, **model, "stage"));
  auto s = std::unique_ptr<LayerStage>(new LayerStage());
  s->model_ = std::move(*model);
  auto on = backend_for(*where, threads, compute, std::move(backend), "stage");
  if (!on.ok()) return on.status();
  s->backend_ = std::move(on.value());
  s->host_ = s->backend_->caps().host_memory;
  for (const auto& [t, what] : {std::pair{cache_type_k, "k"}, std::pair{cache_type_v, "v"}})
    if (!s->backend_->supports(Op::kv_write, t) || !s->backend_->supports(Op::attention, t))
      return Status(Code::unsupported, std::string("stage: cache type ") + what + " " + dtype_name(t) +
                                           " is not supported by the " + s->backend_->caps().name + " backend");
  if (!s->host_) {
    // Its layers' weights once, in their stored types (and the output head
    // on the last stage).
    auto copies = s->model_->upload(*s->backend_, layers.first, layers.last, layers.last == c.n_layers - 1);
    if (!copies.ok()) return Status(copies.status().code(), "stage: " + copies.status().message());
    s->weights_ = std::move(copies.value());
  }
  Backend& be = *s->backend_;
  s->tables_dev_ = std::make_unique<BackendBuffer<int32_t>>(be);
  s->pos_dev_ = std::make_unique<BackendBuffer<int32_t>>(be);
  s->rows_dev_ = std::make_unique<BackendBuffer<AttnRow>>(be);
  s->x_dev_ = std::make_unique<BackendBuffer<float>>(be);
  s->out_dev_ = std::make_unique<BackendBuffer<float>>(be);
  s->compute_ = std::make_unique<LayerCompute>(*s->model_, *s->backend_);
  s->model_->prepare(*s->backend_, layers.first, layers.last, LlamaModel::Matrices::dense,
                     layers.last == c.n_layers - 1);
  s->layers_ = layers;
  s->model_fp_ = compute_fingerprint(model_fp, compute);
  s->kv_.k_type = cache_type_k;
  s->kv_.v_type = cache_type_v;
  s->kv_.block_size = block_size;
  s->kv_.n_layers = layers.count();
  s->kv_.n_kv_heads = c.n_kv_heads;
  s->kv_.head_dim = c.head_dim;
  s->kv_.n_blocks = kv_blocks;
  s->kv_.data = static_cast<uint8_t*>(s->backend_->alloc(s->slice_bytes() * size_t(kv_blocks)));
  if (s->kv_.data == nullptr)
    return Status(Code::out_of_memory, "stage: cannot allocate " + std::to_string(kv_blocks) +
                                           " KV blocks of " + std::to_string(s->slice_bytes()) +
                                           " bytes");
  return s;
}

LayerStage::~LayerStage() {
  // Buffers and weight copies go before the backend's KV and the backend.
  tables_dev_.reset(), pos_dev_.reset(), rows_dev_.reset(), x_dev_.reset(), out_dev_.reset();
  compute_.reset();
  weights_.reset();
  if (backend_ && kv_.data) backend_->free(kv_.data);
}

LayerStage::Stats LayerStage::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

Status LayerStage::check(std::span<const int32_t> ids) const {
  for (int32_t id : ids)
    if (id < 0 || id >= kv_.n_blocks)
      return Status(Code::invalid_argument, "stage " + layers_.to_string() + ": block id " +
                                                std::to_string(id) + " is outside its " +
                                                std::to_string(kv_.n_blocks) + " KV blocks");
  return Status::Ok();
}

Status LayerStage::run(const StageBatchData& b, std::vector<float>& out) {
  const LlamaConfig& c = model_->config();
  const int64_t n = int64_t(b.positions.size());
  const std::string who = "stage " + layers_.to_string() + ": ";
  if (int64_t(b.row_table.size()) != n || int64_t(b.x.size()) != n * c.dim)
    return Status(Code::invalid_argument,
                  who + "a batch of " + std::to_string(n) + " positions needs as many table "
                        "indices and " + std::to_string(n * c.dim) + " floats; it has " +
                        std::to_string(b.row_table.size()) + " and " + std::to_string(b.x.size()));
  for (const std::vector<int32_t>& t : b.tables) CLEAVE_RETURN_IF_ERROR(check(t));
  rows_.resize(size_t(n));
  for (int64_t r = 0; r < n; ++r) {
    const int32_t t = b.row_table[size_t(r)], pos = b.positions[size_t(r)];
    if (t < 0 || size_t(t) >= b.tables.size())
      return Status(Code::invalid_argument, who + "row " + std::to_string(r) + " names table " +
                                                std::to_string(t) + " of " +
                                                std::to_string(b.tables.size()));
    const std::vector<int32_t>& table = b.tables[size_t(t)];
    if (pos < 0 || int64_t(pos) >= int64_t(table.size()) * kv_.block_size)
      return Status(Code::invalid_argument,
                    who + "row " + std::to_string(r) + " at position " + std::to_string(pos) +
                        " lies past its table of " + std::to_string(table.size()) + " blocks");
    rows_[size_t(r)] = AttnRow{table.data(), int32_t(table.size()), pos};
  }
  for (size_t i = 0; i < b.logit_rows.size(); ++i)
    if (b.logit_rows[i] < 0 || b.logit_rows[i] >= n || (i && b.logit_rows[i] <= b.logit_rows[i - 1]))
      return Status(Code::invalid_argument, who + "logit rows must be ascending rows of the batch");
  const auto t0 = std::chrono::steady_clock::now();
  if (host_) {
    x_.assign(b.x.begin(), b.x.end());
    compute_->run(kv_, layers_.first, layers_, n, b.positions.data(), rows_.data(), x_.data(),
                  nullptr, 1);
    if (last()) {
      out.resize(b.logit_rows.size() * size_t(c.n_vocab));
      compute_->logits(x_.data(), b.logit_rows.data(), int64_t(b.logit_rows.size()), out.data());
    } else {
      out.swap(x_);
    }
  } else {
    CLEAVE_RETURN_IF_ERROR(run_on_device(b, out));
  }
  const uint64_t ns = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - t0)
                                   .count());
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.batches;
  stats_.rows += uint64_t(n);
  stats_.busy_ns += ns;
  return Status::Ok();
}

// The rows' tables, rows, positions and hidden states up (rows_ already
// checked, pointing into b.tables), the layers, and the output down; every
// buffer reserved first, so a device without room refuses the batch.
Status LayerStage::run_on_device(const StageBatchData& b, std::vector<float>& out) {
  const LlamaConfig& c = model_->config();
  const int64_t n = int64_t(b.positions.size()), m = int64_t(b.logit_rows.size());
  tables_.clear();
  std::vector<size_t> table_at(b.tables.size());
  for (size_t t = 0; t < b.tables.size(); ++t) {
    table_at[t] = tables_.size();
    tables_.insert(tables_.end(), b.tables[t].begin(), b.tables[t].end());
  }
  const bool room = compute_->reserve(n, std::max<int64_t>(m, 1)).ok() && x_dev_->try_grow(size_t(n * c.dim)) &&
                    pos_dev_->try_grow(size_t(n)) && rows_dev_->try_grow(size_t(n)) &&
                    tables_dev_->try_grow(std::max<size_t>(tables_.size(), 1)) &&
                    (!last() || out_dev_->try_grow(size_t(std::max<int64_t>(m, 1) * c.n_vocab)));
  if (!room)
    return Status(Code::out_of_memory, "stage " + layers_.to_string() + ": a batch of " + std::to_string(n) +
                                           " rows does not fit the " + backend_->caps().name +
                                           " backend's memory beside its weights and KV");
  const int32_t* tables = to_backend(*backend_, false, tables_.data(), tables_.size(), *tables_dev_);
  for (int64_t r = 0; r < n; ++r) rows_[size_t(r)].block_table = tables + table_at[size_t(b.row_table[size_t(r)])];
  const AttnRow* rows = to_backend(*backend_, false, rows_.data(), size_t(n), *rows_dev_);
  const int32_t* pos = to_backend(*backend_, false, b.positions.data(), size_t(n), *pos_dev_);
  float* x = x_dev_->grow(size_t(n * c.dim));
  backend_->upload(x, b.x.data(), b.x.size() * sizeof(float));
  compute_->run(kv_, layers_.first, layers_, n, pos, rows, x, nullptr, 1);
  if (last()) {
    out.resize(size_t(m) * size_t(c.n_vocab));
    if (m == 0) return Status::Ok();
    float* logits = out_dev_->grow(size_t(m * c.n_vocab));
    compute_->logits(x, b.logit_rows.data(), m, logits);
    backend_->download(out.data(), logits, out.size() * sizeof(float));
  } else {
    out.resize(size_t(n * c.dim));
    backend_->download(out.data(), x, out.size() * sizeof(float));
  }
  return Status::Ok();
}

Status LayerStage::copy_block(int32_t src, int32_t dst) {
  const int32_t ids[2] = {src, dst};
  CLEAVE_RETURN_IF_ERROR(check(ids));
  backend_->copy(kv_.data + size_t(dst) * kv_.block_bytes(), kv_.data + size_t(src) * kv_.block_bytes(),
                 slice_bytes());
  return Status::Ok();
}

Status LayerStage::read_blocks(std::span<const int32_t> ids, uint8_t* out) const {
  CLEAVE_RETURN_IF_ERROR(check(ids));
  for (size_t i = 0; i < ids.size(); ++i)
    backend_->download(out + i * slice_bytes(), kv_.data + size_t(ids[i]) * kv_.block_bytes(),
                       slice_bytes());
  return Status::Ok();
}

Status LayerStage::write_blocks(std::span<const int32_t> ids, const uint8_t* in) {
  CLEAVE_RETURN_IF_ERROR(check(ids));
  for (size_t i = 0; i < ids.size(); ++i)
    backend_->upload(kv_.data + size_t(ids[i]) * kv_.block_bytes(), in + i * slice_bytes(),
                     slice_bytes());
  return Status::Ok();
}

// ---- ThreadedStageLink ----

Result<std::unique_ptr<ThreadedStageLink>> ThreadedStageLink::create(
    std::vector<std::shared_ptr<LayerStage>> stages) {
  if (stages.empty()) return Status(Code::invalid_argument, "pipeline link: no stages");
  for (size_t i = 0; i < stages.size(); ++i) {
    if (!stages[i]) return Status(Code::invalid_argument, "pipeline link: a null stage");
    if (i && stages[i]->layers().first != stages[i - 1]->layers().last + 1)
      return Status(Code::invalid_argument, "pipeline link: stage " + stages[i]->layers().to_string() +
                                                " does not follow " +
                                                stages[i - 1]->layers().to_string());
    if (i && (stages[i]->kv_blocks() != stages[0]->kv_blocks() ||
              stages[i]->model_fingerprint() != stages[0]->model_fingerprint()))
      return Status(Code::invalid_argument,
                    "pipeline link: stages of different models or KV pools");
  }
  if (!stages.back()->last())
    return Status(Code::invalid_argument, "pipeline link: the last stage " +
                                              stages.back()->layers().to_string() +
                                              " does not end at the model's last layer");
  auto link = std::unique_ptr<ThreadedStageLink>(new ThreadedStageLink());
  link->n_vocab_ = stages[0]->config().n_vocab;
  link->lanes_.resize(stages.size());
  for (size_t i = 0; i < stages.size(); ++i) link->lanes_[i].stage = std::move(stages[i]);
  for (size_t i = 0; i < link->lanes_.size(); ++i)
    link->lanes_[i].thread = std::thread([l = link.get(), i] { l->lane_loop(i); });
  return link;
}

ThreadedStageLink::~ThreadedStageLink() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (Lane& l : lanes_)
    if (l.thread.joinable()) l.thread.join();
}

int32_t ThreadedStageLink::first_layer() const { return lanes_.front().stage->layers().first; }

void ThreadedStageLink::lane_loop(size_t i) {
  Lane& lane = lanes_[i];
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !lane.queue.empty(); });
    if (stop_) return;
    std::shared_ptr<Job> job = lane.queue.front();
    lane.queue.pop_front();
    ++busy_;
    lock.unlock();
    if (job->status.ok()) {
      job->status = lane.stage->run(job->batch, job->out);
      if (job->status.ok() && i + 1 < lanes_.size()) job->batch.x.swap(job->out);
    }
    lock.lock();
    --busy_;
    // A failed job skips the later stages: its error is its answer.
    if (i + 1 < lanes_.size() && job->status.ok()) lanes_[i + 1].queue.push_back(job);
    else done_.push_back(job);
    cv_.notify_all();
  }
}

Result<uint64_t> ThreadedStageLink::start(const StageRows& rows) {
  auto job = std::make_shared<Job>();
  job->batch = to_batch_data(rows, lanes_.front().stage->config().dim);
  std::lock_guard<std::mutex> lock(mu_);
  job->ticket = next_ticket_++;
  started_.push_back(job);
  lanes_.front().queue.push_back(job);
  cv_.notify_all();
  return job->ticket;
}

Status ThreadedStageLink::finish(uint64_t ticket, float* logits) {
  std::unique_lock<std::mutex> lock(mu_);
  if (started_.empty() || started_.front()->ticket != ticket)
    return Status(Code::invalid_argument, "pipeline link: ticket " + std::to_string(ticket) +
                                              " finished out of order");
  std::shared_ptr<Job> job = started_.front();
  started_.pop_front();
  cv_.wait(lock, [&] { return std::find(done_.begin(), done_.end(), job) != done_.end(); });
  done_.erase(std::find(done_.begin(), done_.end(), job));
  lock.unlock();
  if (!job->status.ok()) return job->status;
  std::copy(job->out.begin(), job->out.end(), logits);
  return Status::Ok();
}

void ThreadedStageLink::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    if (busy_ != 0) return false;
    for (const Lane& l : lanes_)
      if (!l.queue.empty()) return false;
    return true;
  });
}

Status ThreadedStageLink::copy_block(int32_t src, int32_t dst) {
  wait_idle();
  for (Lane& l : lanes_) CLEAVE_RETURN_IF_ERROR(l.stage->copy_block(src, dst));
  return Status::Ok();
}

Status ThreadedStageLink::read_blocks(std::span<const int32_t> ids, uint8_t* out) {
  wait_idle();
  // out: per block, the stages' slices one after another (layer order).
  size_t per_block = 0;
  for (const Lane& l : lanes_) per_block += l.stage->slice_bytes();
  std::vector<uint8_t> buf;
  size_t offset = 0;
  for (const Lane& l : lanes_) {
    const size_t sb = l.stage->slice_bytes();
    buf.resize(ids.size() * sb);
    CLEAVE_RETURN_IF_ERROR(l.stage->read_blocks(ids, buf.data()));
    for (size_t i = 0; i < ids.size(); ++i)
      std::memcpy(out + i * per_block + offset, buf.data() + i * sb, sb);
    offset += sb;
  }
  return Status::Ok();
}

Status ThreadedStageLink::write_blocks(std::span<const int32_t> ids, const uint8_t* in) {
  wait_idle();
  size_t per_block = 0;
  for (const Lane& l : lanes_) per_block += l.stage->slice_bytes();
  std::vector<uint8_t> buf;
  size_t offset = 0;
  for (Lane& l : lanes_) {
    const size_t sb = l.stage->slice_bytes();
    buf.resize(ids.size() * sb);
    for (size_t i = 0; i < ids.size(); ++i)
      std::memcpy(buf.data() + i * sb, in + i * per_block + offset, sb);
    CLEAVE_RETURN_IF_ERROR(l.stage->write_blocks(ids, buf.data()));
    offset += sb;
  }
  return Status::Ok();
}

std::vector<std::pair<std::string, uint64_t>> ThreadedStageLink::counters() const {
  std::vector<std::pair<std::string, uint64_t>> out;
  for (size_t i = 0; i < lanes_.size(); ++i) {
    const LayerStage::Stats s = lanes_[i].stage->stats();
    const std::string p = "pipeline_stage" + std::to_string(i + 1) + "_";
    out.emplace_back(p + "batches", s.batches);
    out.emplace_back(p + "rows", s.rows);
    out.emplace_back(p + "busy_us", s.busy_ns / 1000);
  }
  return out;
}

}  // namespace cleave
