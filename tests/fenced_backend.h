// A Backend whose memory the host cannot touch: the CPU backend's kernels
// behind a device's contract, so the engine's device path runs (and is
// checked) on a machine without a GPU.
//
// Its memory is one reserved region kept PROT_NONE except while one of its
// own calls runs: a host read or write of an activation, a weight or the KV
// anywhere else faults, as it would on a GPU. Every op also checks that the
// pointers it is given are its memory (a host pointer handed to a device op
// is a violation, recorded by name), and upload / download count the bytes
// that cross, so a test can hold the engine to ids in and logits out.
// Header-only (the test globs compile only *.cpp). Single-threaded callers.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "storage/block.h"

namespace cleave::testing {

class FencedBackend final : public Backend {
 public:
  struct Traffic {
    uint64_t uploads = 0, upload_bytes = 0, downloads = 0, download_bytes = 0;
    // How many moves of each size in bytes (a KV block crossing shows up
    // as moves of its size).
    std::map<uint64_t, uint64_t> upload_sizes, download_sizes;
  };
  // What the backend saw; shared, so a test can read it after the engine
  // that owns the backend is gone.
  struct Log {
    Traffic traffic;
    // Ops given memory that is not this backend's, by name ("matmul x", ...).
    std::vector<std::string> violations;
    size_t live_allocations = 0;
    size_t used_bytes = 0;  // of the region (freed memory is not reused)
    uint64_t checksummed_blocks = 0;  // blocks checksum_blocks hashed where they are
  };

  explicit FencedBackend(std::unique_ptr<Backend> inner, size_t reserve = size_t(16) << 30)
      : inner_(std::move(inner)), reserve_(reserve), log_(std::make_shared<Log>()) {
    void* p = ::mmap(nullptr, reserve_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) std::abort();
    arena_ = static_cast<uint8_t*>(p);
  }
  ~FencedBackend() override { ::munmap(arena_, reserve_); }

  std::shared_ptr<Log> log() const { return log_; }

  Caps caps() const override {
    Caps c = inner_->caps();
    c.name = "fenced";
    c.host_memory = false;
    c.shareable = false;  // its arena is not shared with other processes
    return c;
  }
  bool supports(Op op, DType t) const override { return inner_->supports(op, t); }

  void* alloc(size_t bytes) override {
    if (bytes == 0) return nullptr;
    const size_t at = (used_ + 63) / 64 * 64;
    if (at + bytes > reserve_) return nullptr;
    used_ = at + bytes;
    log_->used_bytes = used_;
    live_[arena_ + at] = bytes;
    log_->live_allocations = live_.size();
    return arena_ + at;
  }
  void free(void* ptr) override {
    if (ptr && live_.erase(static_cast<uint8_t*>(ptr)) != 1) log_->violations.push_back("free");
    log_->live_allocations = live_.size();
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    check(dst, "upload dst");
    if (mine(src)) log_->violations.push_back("upload src");
    Open o(*this);
    std::memcpy(dst, src, bytes);
    ++log_->traffic.uploads;
    log_->traffic.upload_bytes += bytes;
    ++log_->traffic.upload_sizes[bytes];
  }
  void download(void* dst, const void* src, size_t bytes) override {
    check(src, "download src");
    if (mine(dst)) log_->violations.push_back("download dst");
    Open o(*this);
    std::memcpy(dst, src, bytes);
    ++log_->traffic.downloads;
    log_->traffic.download_bytes += bytes;
    ++log_->traffic.download_sizes[bytes];
  }
  void sync() override { inner_->sync(); }
  // A device's checksum op: the blocks hashed where they are.
  Status checksum_blocks(const void* data, size_t block_bytes, int64_t n, uint64_t* out) override {
    check(data, "checksum_blocks data");
    if (mine(out)) log_->violations.push_back("checksum_blocks out");
    Open o(*this);
    for (int64_t i = 0; i < n; ++i)
      out[i] = checksum_bytes(static_cast<const uint8_t*>(data) + size_t(i) * block_bytes, block_bytes);
    log_->checksummed_blocks += uint64_t(n);
    return Status::Ok();
  }
  void* alloc_pinned_host(size_t bytes) override { return inner_->alloc_pinned_host(bytes); }
  void free_pinned_host(void* ptr) override { inner_->free_pinned_host(ptr); }
  bool prepare(const WeightView& w) override {
    check(w.data, "prepare w");
    Open o(*this);
    return inner_->prepare(w);
  }

  void matmul(const WeightView& w, const float* x, int64_t n, float* y) override {
    check(w.data, "matmul w"), check(x, "matmul x"), check(y, "matmul y");
    Open o(*this);
    inner_->matmul(w, x, n, y);
  }
  void matmuls(const MatmulJob* jobs, int64_t count) override {
    for (int64_t i = 0; i < count; ++i)
      check(jobs[i].w->data, "matmuls w"), check(jobs[i].x, "matmuls x"), check(jobs[i].y, "matmuls y");
    Open o(*this);
    inner_->matmuls(jobs, count);
  }
  void rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps,
               float* y) override {
    check(x, "rmsnorm x"), check(weight, "rmsnorm weight"), check(y, "rmsnorm y");
    Open o(*this);
    inner_->rmsnorm(x, weight, n, dim, eps, y);
  }
  void rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim, const int32_t* positions,
            float freq_base) override {
    check(x, "rope x"), check(positions, "rope positions");
    Open o(*this);
    inner_->rope(x, n, n_heads, head_dim, positions, freq_base);
  }
  void softmax(float* x, int64_t n, int64_t len) override {
    check(x, "softmax x");
    Open o(*this);
    inner_->softmax(x, n, len);
  }
  void silu_mul(const float* gate, const float* up, int64_t count, float* out) override {
    check(gate, "silu_mul gate"), check(up, "silu_mul up"), check(out, "silu_mul out");
    Open o(*this);
    inner_->silu_mul(gate, up, count, out);
  }
  void embed(const WeightView& table, const int32_t* ids, int64_t n, float* out) override {
    check(table.data, "embed table"), check(ids, "embed ids"), check(out, "embed out");
    Open o(*this);
    inner_->embed(table, ids, n, out);
  }
  void topk_gating(const float* logits, int64_t n, int64_t n_expert, int64_t k, int32_t* ids,
                   float* weights) override {
    check(logits, "topk logits"), check(ids, "topk ids"), check(weights, "topk weights");
    Open o(*this);
    inner_->topk_gating(logits, n, n_expert, k, ids, weights);
  }
  void kv_write(const PagedKv& kv, int32_t layer, const float* k, const float* v,
                const AttnRow* rows, int64_t n) override {
    check(kv.data, "kv_write kv"), check(k, "kv_write k"), check(v, "kv_write v"), check(rows, "kv_write rows");
    Open o(*this);
    check_rows(rows, n, "kv_write block_table");
    inner_->kv_write(kv, layer, k, v, rows, n);
  }
  void attention(const PagedKv& kv, int32_t layer, const float* q, const AttnRow* rows, int64_t n,
                 int32_t n_heads, float scale, float* out) override {
    check(kv.data, "attention kv"), check(q, "attention q"), check(out, "attention out"),
        check(rows, "attention rows");
    Open o(*this);
    check_rows(rows, n, "attention block_table");
    inner_->attention(kv, layer, q, rows, n, n_heads, scale, out);
  }
  void layer_norm(const float* x, const float* w, const float* b, int64_t n, int64_t dim, float eps,
                  float* y) override {
    check(x, "layer_norm x"), check(w, "layer_norm w"), check(b, "layer_norm b"), check(y, "layer_norm y");
    Open o(*this);
    inner_->layer_norm(x, w, b, n, dim, eps, y);
  }
  void gelu(const float* x, int64_t count, Gelu kind, float* y) override {
    check(x, "gelu x"), check(y, "gelu y");
    Open o(*this);
    inner_->gelu(x, count, kind, y);
  }
  void add(const float* a, const float* b, int64_t count, int64_t period, float* y) override {
    check(a, "add a"), check(b, "add b"), check(y, "add y");
    Open o(*this);
    inner_->add(a, b, count, period, y);
  }
  void full_attention(const float* q, const float* k, const float* v, int64_t n_seq, int64_t T,
                      int64_t n_heads, int64_t head_dim, int64_t ld, float scale, float* out) override {
    check(q, "full_attention q"), check(k, "full_attention k"), check(v, "full_attention v");
    check(out, "full_attention out");
    Open o(*this);
    inner_->full_attention(q, k, v, n_seq, T, n_heads, head_dim, ld, scale, out);
  }
  void moe_combine(const float* y, const int32_t* rows, const float* w, int64_t n, int64_t k,
                   int64_t dim, float* out) override {
    check(y, "moe_combine y"), check(rows, "moe_combine rows"), check(w, "moe_combine w");
    check(out, "moe_combine out");
    Open o(*this);
    inner_->moe_combine(y, rows, w, n, k, dim, out);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    check(dst, "copy dst"), check(src, "copy src");
    Open o(*this);
    inner_->copy(dst, src, bytes);
  }

 private:
  // The region readable and writable for one call of ours.
  struct Open {
    explicit Open(FencedBackend& f) : f_(f) { f_.protect(PROT_READ | PROT_WRITE); }
    ~Open() { f_.protect(PROT_NONE); }
    FencedBackend& f_;
  };
  void protect(int prot) {
    const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    const size_t len = (used_ + page - 1) / page * page;
    if (len && ::mprotect(arena_, len, prot) != 0) std::abort();
  }
  bool mine(const void* p) const {
    const auto* b = static_cast<const uint8_t*>(p);
    return b >= arena_ && b < arena_ + used_;
  }
  void check(const void* p, const char* what) {
    if (p != nullptr && !mine(p)) log_->violations.push_back(what);
  }
  // Reads the rows: call it while the arena is open (they are in it, or a
  // violation was recorded and they are host memory).
  void check_rows(const AttnRow* rows, int64_t n, const char* what) {
    for (int64_t i = 0; i < n; ++i)
      if (!mine(rows[i].block_table)) {
        log_->violations.push_back(what);
        return;
      }
  }

  std::unique_ptr<Backend> inner_;
  size_t reserve_;
  uint8_t* arena_ = nullptr;
  size_t used_ = 0;
  std::map<const uint8_t*, size_t> live_;
  std::shared_ptr<Log> log_;
};

}  // namespace cleave::testing
