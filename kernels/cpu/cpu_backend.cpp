// The CPU backend: run-time ISA detection, the kernel table for that ISA, and
// the threading (work is split by output rows / heads only, never inside a
// reduction, so results do not depend on the thread count).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"
#include "kernels/device_testing.h"
#include "kernels/cpu/attention_plan.h"
#include "kernels/cpu/host_memory.h"
#include "kernels/cpu/int8.h"
#include "kernels/cpu/kern.h"
#include "kernels/cpu/packed_weights.h"
#include "kernels/cpu/panels.h"
#include "kernels/cpu/shared_memory.h"
#include "kernels/thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define CLEAVE_X86 1
#endif

namespace cleave {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "?";
}

Isa detect_isa() {
#ifdef CLEAVE_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::scalar;
  const bool osxsave = c & (1u << 27);
  const bool avx = c & (1u << 28);
  const bool fma = c & (1u << 12);
  const bool f16c = c & (1u << 29);
  if (!osxsave || !avx) return Isa::scalar;
  uint32_t xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const uint64_t xcr0 = (uint64_t(xhi) << 32) | xlo;
  const bool os_ymm = (xcr0 & 0x6) == 0x6;
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Isa::scalar;
  const bool avx2 = b & (1u << 5);
  const bool avx512f = b & (1u << 16), avx512dq = b & (1u << 17), avx512bw = b & (1u << 30),
             avx512vl = b & (1u << 31);
  if (!(os_ymm && avx2 && fma && f16c)) return Isa::scalar;
  if (os_zmm && avx512f && avx512dq && avx512bw && avx512vl) return Isa::avx512;
  return Isa::avx2;
#else
  return Isa::scalar;
#endif
}

bool cpu_has_avx512_vnni() {
#ifdef CLEAVE_X86
  if (detect_isa() != Isa::avx512) return false;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return c & (1u << 11);
#else
  return false;
#endif
}

const cpu::Kernels& cpu_kernels(Isa isa) {
  switch (isa) {
    case Isa::avx512: return cpu::kKernelsAvx512;
    case Isa::avx2: return cpu::kKernelsAvx2;
    case Isa::scalar: break;
  }
  return cpu::kKernelsScalar;
}

namespace {

// One K or V row of head_dim floats into the cache's type.
void store_kv_row(const cpu::Kernels& k, DType t, const float* x, int32_t head_dim, uint8_t* out) {
  switch (t) {
    case DType::F32: std::memcpy(out, x, size_t(head_dim) * 4); return;
    case DType::F16: k.f16_row(x, head_dim, out); return;
    case DType::Q8_0: k.q8_0_row(x, head_dim, out); return;
    case DType::Q4_0: k.q4_0_row(x, head_dim, out); return;
    case DType::BF16: break;
  }
  CLEAVE_CHECK(false);
}

// RoPE's cos and sin are kept for positions below this (1 MiB at head_dim
// 128); later positions compute theirs per row.
constexpr int64_t kRopeCachedPositions = 4096;

// Below this many multiply-adds an op runs on the calling thread only.
constexpr int64_t kMinParallelWork = 64 * 1024;
// From this many rows per thread (four of the microkernel's 12-row blocks)
// a matmul splits its x rows over the threads instead of its panels, and
// row ops split the same rows however little work they are: a prefill's
// rows then stay on the core that wrote them (a panel split has every row
// half written by each core, and a row op moved them across).
constexpr int64_t kRowSplitRows = 48;
// ... and only while the matmul's (group's) weights are at most this many
// bytes: every thread then reads all of them, which for larger matrices
// cost more than it saved (100M GQA prefill, 1.2-6.3 MB a group: 2-3 %
// slower on two threads; the 15M model's groups, 166-885 KB: 6 % faster).
constexpr size_t kRowSplitMaxWeightBytes = size_t(1) << 20;

// The int8 kernel and activation quantiser for an ISA, and the kernel's name.
struct Int8Kernels {
  cpu::Int8MatmulFn matmul;
  cpu::Int8QuantizeFn quantize;
  const char* name;
};
Int8Kernels int8_kernels_for(Isa isa) {
  if (isa == Isa::avx512 && cpu_has_avx512_vnni())
    return {cpu::int8_matmul_avx512vnni, cpu::int8_quantize_rows_avx512, "avx512vnni"};
  if (isa == Isa::avx512) return {cpu::int8_matmul_avx2, cpu::int8_quantize_rows_avx512, "avx2"};
  if (isa == Isa::avx2) return {cpu::int8_matmul_avx2, cpu::int8_quantize_rows_avx2, "avx2"};
  return {cpu::int8_matmul_scalar, cpu::int8_quantize_rows, "scalar"};
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, Isa isa, Compute compute, bool row_split)
      : isa_(isa), k_(cpu_kernels(isa)), pool_(threads < 1 ? 1 : threads), compute_(compute),
        int8_(int8_kernels_for(isa)), row_split_(row_split) {}
  ~CpuBackend() override { std::free(pack_scratch_); }

  Caps caps() const override {
    Caps c;
    c.name = "cpu";
    c.isa = isa_name(isa_);
    c.threads = pool_.threads();
    c.compute = compute_;
    if (compute_ == Compute::int8) c.int8_kernel = int8_.name;
    c.shareable = true;
    return c;
  }

  bool supports(Op op, DType t) const override {
    if (op == Op::kv_write || op == Op::attention) return kv_dtype_known(uint32_t(t));
    return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::Q8_0;
  }

  void* alloc(size_t bytes) override { return cpu::host_alloc(bytes); }
  void free(void* ptr) override { cpu::host_free(ptr); }
  // No DMA engine to serve: page-aligned memory (what cudaHostAlloc gives).
  void* alloc_pinned_host(size_t bytes) override {
    const size_t size = (bytes + 4095) / 4096 * 4096;
    return std::aligned_alloc(4096, size == 0 ? 4096 : size);
  }
  void free_pinned_host(void* ptr) override { std::free(ptr); }
  Result<SharedRegion> alloc_shared(size_t bytes) override { return memfd_alloc_shared(bytes); }
  void free_shared(const SharedRegion& region) override { memfd_free_shared(region); }
  Result<const void*> open_shared(const std::string& handle, size_t bytes) override {
    return memfd_open_shared(handle, bytes);
  }
  void close_shared(const void* data, size_t bytes) override { memfd_close_shared(data, bytes); }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void sync() override {}

  // Every matrix is multiplied from panels; a prepared one's are made once
  // (and shared with other backends over the same view), so the backend no
  // longer reads w's own bytes.
  bool prepare(const WeightView& w) override {
    if (w.rows <= 0 || w.cols <= 0 || w.data == nullptr || !supports(Op::matmul, w.type)) return false;
    prepared(w);
    return true;
  }

  void matmul(const WeightView& w, const float* x, int64_t n, float* y) override {
    const MatmulJob job{&w, x, n, y};
    matmuls(&job, 1);
  }

  // The jobs' panels, numbered one job after another, are split over the
  // threads in one region (a thread's range may span jobs). Each output is
  // still one FMA chain over k, so which thread runs a panel changes no bit.
  void matmuls(const MatmulJob* jobs, int64_t count) override {
    group_.clear();
    for (int64_t i = 0; i < count; ++i) {
      const MatmulJob& j = jobs[i];
      const WeightView& w = *j.w;
      if (j.n <= 0 || w.rows <= 0) continue;
      CLEAVE_CHECK(dtype_known(static_cast<uint32_t>(w.type)));
      CLEAVE_CHECK(w.cols > 0);
      CLEAVE_CHECK(w.cols % dtype_block_elems(w.type) == 0);
      CLEAVE_CHECK(w.row_bytes >= dtype_row_bytes(w.type, w.cols));
      if (form_for(w) == cpu::PackForm::int8) {
        matmul_int8(prepared(w), j.x, j.n, j.y);
        continue;
      }
      const int wtype = static_cast<int>(w.type);
      const size_t stride = cpu::panel_stride(wtype, w.cols);
      cpu::PanelMatmulArgs a{wtype, nullptr, stride, w.rows, w.cols, j.x, j.n, j.y};
      if (const cpu::PackedWeights* p = find_prepared(w)) {
        a.panels = p->data;
        group_.push_back(a);
      } else {  // packed into the one call-scratch: runs alone, now
        a.panels = pack_for_call(w, (w.rows + cpu::kPanel - 1) / cpu::kPanel, stride);
        run_panels(&a, 1);
      }
    }
    run_panels(group_.data(), group_.size());
  }

  void rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps,
               float* y) override {
    const cpu::Kernels& k = k_;
    rows_for(n, dim, [&](int64_t i0, int64_t i1, int) {
      for (int64_t i = i0; i < i1; ++i) k.rmsnorm_row(x + i * dim, weight, dim, eps, y + i * dim);
    });
  }

  void rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim, const int32_t* positions,
            float freq_base) override {
    CLEAVE_CHECK(head_dim % 2 == 0);
    const int64_t half = head_dim / 2;
    // Inverse frequencies depend only on (freq_base, head_dim); so do each
    // position's cos and sin, kept per position (every layer's q and k at
    // that position reuse them) up to kRopeCachedPositions.
    if (rope_base_ != freq_base || rope_dim_ != head_dim) {
      rope_freq_.resize(static_cast<size_t>(half));
      for (int64_t j = 0; j < half; ++j)
        rope_freq_[j] = std::pow(double(freq_base), -2.0 * double(j) / double(head_dim));
      rope_base_ = freq_base;
      rope_dim_ = head_dim;
      rope_table_.clear();
    }
    int32_t max_pos = -1;
    for (int64_t i = 0; i < n; ++i) max_pos = std::max(max_pos, positions[i]);
    const int64_t cached = std::min<int64_t>(int64_t(max_pos) + 1, kRopeCachedPositions);
    const int64_t have = int64_t(rope_table_.size()) / (2 * head_dim);
    if (cached > have) {
      rope_table_.resize(size_t(cached * 2 * head_dim));
      for (int64_t p = have; p < cached; ++p) rope_angles(p, half, rope_table_.data() + p * 2 * head_dim);
    }
    ensure_scratch(static_cast<size_t>(2 * head_dim));
    float* scratch = scratch_.data();
    const size_t stride = scratch_stride_;
    const float* table = rope_table_.data();
    const cpu::Kernels& k = k_;
    rows_for(n, n_heads * head_dim * 8, [&](int64_t i0, int64_t i1, int t) {
      for (int64_t i = i0; i < i1; ++i) {
        const float* cs = table + int64_t(positions[i]) * 2 * head_dim;
        if (positions[i] < 0 || positions[i] >= kRopeCachedPositions) {
          float* own = scratch + size_t(t) * stride;
          rope_angles(positions[i], half, own);
          cs = own;
        }
        k.rope_rows(x + i * n_heads * head_dim, cs, cs + head_dim, n_heads, head_dim);
      }
    });
  }

  void softmax(float* x, int64_t n, int64_t len) override {
    const cpu::Kernels& k = k_;
    rows_for(n, len * 4, [&](int64_t i0, int64_t i1, int) {
      for (int64_t i = i0; i < i1; ++i) k.softmax_row(x + i * len, len);
    });
  }

  void silu_mul(const float* gate, const float* up, int64_t count, float* out) override {
    const cpu::Kernels& k = k_;
    // Chunks of 1024 elements; every element is computed the same way anywhere.
    constexpr int64_t chunk = 1024;
    const int64_t chunks = (count + chunk - 1) / chunk;
    rows_for(chunks, chunk * 8, [&](int64_t c0, int64_t c1, int) {
      const int64_t b = c0 * chunk;
      const int64_t e = c1 * chunk < count ? c1 * chunk : count;
      k.silu_mul(gate + b, up + b, e - b, out + b);
    });
  }

  void layer_norm(const float* x, const float* w, const float* b, int64_t n, int64_t dim,
                  float eps, float* y) override {
    const cpu::Kernels& k = k_;
    rows_for(n, dim * 4, [&](int64_t i0, int64_t i1, int) {
      for (int64_t i = i0; i < i1; ++i) k.layer_norm_row(x + i * dim, w, b, dim, eps, y + i * dim);
    });
  }

  void gelu(const float* x, int64_t count, Gelu kind, float* y) override {
    const cpu::Kernels& k = k_;
    const int code = kind == Gelu::tanh ? 0 : 1;
    // Chunks of 1024 elements; every element is computed the same way anywhere.
    constexpr int64_t chunk = 1024;
    rows_for((count + chunk - 1) / chunk, chunk * 8, [&](int64_t c0, int64_t c1, int) {
      const int64_t b = c0 * chunk;
      const int64_t e = c1 * chunk < count ? c1 * chunk : count;
      k.gelu(x + b, e - b, code, y + b);
    });
  }

  void add(const float* a, const float* b, int64_t count, int64_t period, float* y) override {
    CLEAVE_CHECK(period > 0 && count % period == 0);
    const cpu::Kernels& k = k_;
    // Rows of `period`; a long plain add (period = count) in chunks of 4096.
    const int64_t len = period == count ? std::min<int64_t>(count, 4096) : period;
    const int64_t rows = (count + len - 1) / len;
    rows_for(rows, len, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t off = r * len;
        const int64_t m = std::min(len, count - off);
        k.add(a + off, period == count ? b + off : b, m, y + off);
      }
    });
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }

  // Each product rounded, then added (axpy_row), so the sum is the same on
  // every ISA and thread count.
  void moe_combine(const float* y, const int32_t* rows, const float* w, int64_t n, int64_t k,
                   int64_t dim, float* out) override {
    // Each element's sum is 0 + w0 y0 + w1 y1 + ... in j order; running j
    // outside the elements keeps that order and lets the elements vectorise.
    const cpu::Kernels& kern = k_;
    rows_for(n, k * dim, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) {
        float* o = out + r * dim;
        std::fill(o, o + dim, 0.0f);
        for (int64_t j = 0; j < k; ++j)
          kern.axpy_row(o, w[r * k + j], y + int64_t(rows[r * k + j]) * dim, dim);
      }
    });
  }

  // Per (sequence, head): scores = Q K^T on the matmul kernel (K read in
  // place as a strided F32 matrix, Q's head gathered dense), scaled,
  // softmax, then times V transposed into a dense hd x T matrix, scattered
  // back into out: each sequence alone, so no result depends on the batch.
  void full_attention(const float* q, const float* k, const float* v, int64_t n_seq, int64_t T,
                      int64_t n_heads, int64_t hd, int64_t ld, float scale, float* out) override {
    if (n_seq <= 0 || T <= 0) return;
    fa_scratch_.resize(size_t(T * T + 3 * T * hd));
    float* scores = fa_scratch_.data();
    float* qh = scores + T * T;
    float* vt = qh + T * hd;
    float* oh = vt + T * hd;
    for (int64_t s = 0; s < n_seq; ++s) {
      const int64_t base = s * T;
      for (int64_t h = 0; h < n_heads; ++h) {
        for (int64_t i = 0; i < T; ++i) {
          const float* src = q + (base + i) * ld + h * hd;
          std::copy(src, src + hd, qh + i * hd);
          for (int64_t d = 0; d < hd; ++d) vt[d * T + i] = v[(base + i) * ld + h * hd + d];
        }
        const WeightView kv{DType::F32, k + base * ld + h * hd, T, hd, size_t(ld) * sizeof(float)};
        matmul(kv, qh, T, scores);
        for (int64_t e = 0; e < T * T; ++e) scores[e] *= scale;
        softmax(scores, T, T);
        const WeightView vv{DType::F32, vt, hd, T, size_t(T) * sizeof(float)};
        matmul(vv, scores, T, oh);
        for (int64_t i = 0; i < T; ++i) std::copy(oh + i * hd, oh + (i + 1) * hd, out + (base + i) * ld + h * hd);
      }
    }
  }

  void embed(const WeightView& table, const int32_t* ids, int64_t n, float* out) override {
    for (int64_t i = 0; i < n; ++i) CLEAVE_CHECK(ids[i] >= 0 && ids[i] < table.rows);
    const int type = static_cast<int>(table.type);  // every DType is a widen_row type
    const cpu::Kernels& k = k_;
    rows_for(n, table.cols * 2, [&](int64_t i0, int64_t i1, int) {
      for (int64_t i = i0; i < i1; ++i)
        k.widen_row(type, static_cast<const uint8_t*>(table.data) + size_t(ids[i]) * table.row_bytes, table.cols,
                    out + i * table.cols);
    });
  }

  void topk_gating(const float* logits, int64_t n, int64_t n_expert, int64_t k, int32_t* ids,
                   float* weights) override {
    CLEAVE_CHECK(k >= 1 && k <= n_expert);
    ensure_scratch(static_cast<size_t>(n_expert));
    float* scratch = scratch_.data();
    const size_t stride = scratch_stride_;
    rows_for(n, n_expert * 16, [&](int64_t i0, int64_t i1, int t) {
      float* p = scratch + size_t(t) * stride;
      for (int64_t i = i0; i < i1; ++i) {
        const float* x = logits + i * n_expert;
        float m = x[0];
        for (int64_t e = 1; e < n_expert; ++e) m = x[e] > m ? x[e] : m;
        float sum = 0.0f;
        for (int64_t e = 0; e < n_expert; ++e) {
          p[e] = std::exp(x[e] - m);
          sum += p[e];
        }
        const float inv = 1.0f / sum;
        for (int64_t e = 0; e < n_expert; ++e) p[e] = p[e] * inv;
        int32_t* id = ids + i * k;
        float* w = weights + i * k;
        float wsum = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          int64_t best = -1;
          for (int64_t e = 0; e < n_expert; ++e) {
            if (p[e] < 0.0f) continue;  // taken
            if (best < 0 || p[e] > p[best]) best = e;
          }
          id[j] = static_cast<int32_t>(best);
          w[j] = p[best];
          wsum += p[best];
          p[best] = -1.0f;
        }
        const float winv = 1.0f / wsum;
        for (int64_t j = 0; j < k; ++j) w[j] = w[j] * winv;
      }
    });
  }

  void kv_write(const PagedKv& kv, int32_t layer, const float* k, const float* v,
                const AttnRow* rows, int64_t n) override {
    CLEAVE_CHECK(layer >= 0 && layer < kv.n_layers);
    CLEAVE_CHECK(check_kv_type(kv.k_type, kv.head_dim, "cache type k").ok());
    CLEAVE_CHECK(check_kv_type(kv.v_type, kv.head_dim, "cache type v").ok());
    const size_t row_elems = size_t(kv.n_kv_heads) * kv.head_dim;
    for (int64_t i = 0; i < n; ++i) {
      const AttnRow& r = rows[i];
      CLEAVE_CHECK(r.pos >= 0);
      const int32_t b = r.pos / kv.block_size;
      CLEAVE_CHECK(b < r.n_blocks);
      const int32_t blk = r.block_table[b];
      CLEAVE_CHECK(blk >= 0 && blk < kv.n_blocks);
    }
    auto slot_of = [&](int64_t i, int32_t kvi, int32_t h) {
      const AttnRow& r = rows[i];
      return kv.data + kv.offset(r.block_table[r.pos / kv.block_size], layer, kvi, h, r.pos % kv.block_size);
    };
    // The rows split over the threads (a decode step's rows land in as many
    // blocks far apart); a row's bytes depend on its values only.
    rows_for(n, int64_t(row_elems) * 32, [&](int64_t r0, int64_t r1, int) {
      for (int64_t i = r0; i < r1; ++i)
        for (int32_t h = 0; h < kv.n_kv_heads; ++h) {
          store_kv_row(k_, kv.k_type, k + i * row_elems + size_t(h) * kv.head_dim, kv.head_dim, slot_of(i, 0, h));
          store_kv_row(k_, kv.v_type, v + i * row_elems + size_t(h) * kv.head_dim, kv.head_dim, slot_of(i, 1, h));
        }
    });
  }

  void attention(const PagedKv& kv, int32_t layer, const float* q, const AttnRow* rows, int64_t n,
                 int32_t n_heads, float scale, float* out) override {
    CLEAVE_CHECK(layer >= 0 && layer < kv.n_layers);
    CLEAVE_CHECK(kv.n_kv_heads > 0 && n_heads % kv.n_kv_heads == 0);
    CLEAVE_CHECK(check_kv_type(kv.k_type, kv.head_dim, "cache type k").ok());
    CLEAVE_CHECK(check_kv_type(kv.v_type, kv.head_dim, "cache type v").ok());
    for (int64_t i = 0; i < n; ++i) {
      CLEAVE_CHECK(rows[i].pos >= 0 && rows[i].pos / kv.block_size < rows[i].n_blocks);
    }
    cpu::AttnArgs a;
    a.layer_base = kv.data + size_t(layer) * kv.layer_bytes();
    a.block_bytes = kv.block_bytes();
    a.k_head_bytes = kv.k_head_bytes();
    a.v_head_bytes = kv.v_head_bytes();
    a.v_offset = size_t(kv.n_kv_heads) * kv.k_head_bytes();
    a.k_row_bytes = kv.k_row_bytes();
    a.v_row_bytes = kv.v_row_bytes();
    a.k_type = static_cast<int>(kv.k_type);
    a.v_type = static_cast<int>(kv.v_type);
    a.block_size = kv.block_size;
    a.head_dim = kv.head_dim;
    a.group = n_heads / kv.n_kv_heads;
    a.scale = scale;
    const int T = pool_.threads();
    attn_plan_.plan(rows, n, kv.block_size, kv.n_kv_heads, n_heads, kv.head_dim, T, kMinParallelWork);
    const cpu::AttentionPlan& plan = attn_plan_;
    const int32_t hpt = plan.heads_per_task(), tpr = plan.tasks_per_group();
    ensure_scratch(CLEAVE_ATTN_SCRATCH(kv.block_size, plan.max_rows() * hpt * a.group));
    float* scratch = scratch_.data();
    const size_t stride = scratch_stride_;
    const cpu::Kernels& k = k_;
    const size_t row_elems = size_t(n_heads) * kv.head_dim;
    const size_t grp_elems = size_t(a.group) * kv.head_dim;
    auto body = [&](int64_t t0, int64_t t1, int t) {
      float* s = scratch + size_t(t) * stride;
      // A task's first kv head; `next` describes the thread's call after this one.
      const auto head_of = [&](int64_t task) { return static_cast<int32_t>(task % tpr) * hpt; };
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t g = task / tpr, i = plan.first(g);
        const int32_t h = head_of(task);
        cpu::AttnNext next{};
        if (task + 1 < t1) {
          const int64_t ng = (task + 1) / tpr, ni = plan.first(ng);
          next.block_table = rows[ni].block_table;
          next.kv_head = head_of(task + 1);
          next.n_kv = hpt;
          next.max_pos = *std::max_element(plan.positions() + ni, plan.positions() + plan.end(ng));
        }
        k.attn(&a, q + i * row_elems + h * grp_elems, int64_t(row_elems), h, hpt, rows[i].block_table,
               plan.positions() + i, int32_t(plan.end(g) - i), out + i * row_elems + h * grp_elems, s,
               next.block_table ? &next : nullptr);
      }
    };
    if (!plan.parallel()) {
      body(0, plan.tasks(), 0);
      return;
    }
    pool_.parallel_for(T, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) body(plan.bounds(int(r)), plan.bounds(int(r) + 1), int(r));
    });
  }

 private:
  // The panels of every part in one region over the threads.
  void run_panels(const cpu::PanelMatmulArgs* parts, size_t count) {
    if (count == 0) return;
    group_first_.resize(count + 1);
    group_first_[0] = 0;
    int64_t work = 0;
    // Scratch to widen narrow panels into once per pass (cpu::PanelMatmulArgs::wide).
    size_t wide_floats = 0;
    for (size_t i = 0; i < count; ++i) {
      const cpu::PanelMatmulArgs& a = parts[i];
      group_first_[i + 1] = group_first_[i] + (a.rows + cpu::kPanel - 1) / cpu::kPanel;
      work += a.n * a.rows * a.cols;
      if (a.n > 1 && a.wtype != static_cast<int>(DType::F32))
        wide_floats = std::max(wide_floats, size_t(cpu::kWidePanels) * cpu::kPanel * size_t(a.cols));
    }
    if (wide_floats) wide_floats += cpu::kWideGapFloats;
    if (wide_.size() < wide_floats * size_t(pool_.threads())) wide_.resize(wide_floats * size_t(pool_.threads()));
    const cpu::Kernels& k = k_;
    float* wide = wide_floats ? wide_.data() : nullptr;
    const int64_t* first = group_first_.data();
    auto body = [parts, count, first, &k, wide, wide_floats](int64_t p0, int64_t p1, int t) {
      size_t i = size_t(std::upper_bound(first, first + count + 1, p0) - first) - 1;
      for (; i < count && first[i] < p1; ++i) {
        cpu::PanelMatmulArgs mine = parts[i];
        if (wide && mine.n > 1 && mine.wtype != static_cast<int>(DType::F32))
          mine.wide = wide + size_t(t) * wide_floats;
        k.matmul(&mine, std::max(p0, first[i]) - first[i], std::min(p1, first[i + 1]) - first[i]);
      }
    };
    const int64_t panels = group_first_[count];
    if (work < kMinParallelWork || pool_.threads() == 1) {
      body(0, panels, 0);
      return;
    }
    bool by_rows = true;
    size_t weight_bytes = 0;
    for (size_t i = 0; i < count; ++i) {
      by_rows = by_rows && splits_by_rows(parts[i].n);
      weight_bytes += size_t(group_first_[i + 1] - group_first_[i]) * parts[i].stride;
    }
    if (!by_rows || weight_bytes > kRowSplitMaxWeightBytes) {
      pool_.parallel_for(panels, body);
      return;
    }
    // Enough rows that every thread keeps full blocks, and weights small
    // enough to read once per thread: each takes its rows (ThreadPool::split,
    // as rows_for does) of every part, all panels, so the rows it writes are
    // the rows the next row op reads on that core.
    const int T = pool_.threads();
    pool_.parallel_for(T, [parts, count, &k, wide, wide_floats, T](int64_t r0, int64_t r1, int t) {
      for (int64_t r = r0; r < r1; ++r) {
        for (size_t i = 0; i < count; ++i) {
          cpu::PanelMatmulArgs mine = parts[i];
          int64_t b, e;
          ThreadPool::split(mine.n, int(r), T, &b, &e);
          if (b == e) continue;
          mine.x += b * mine.cols;
          mine.y += b * mine.rows;
          mine.n = e - b;
          if (wide && mine.n > 1 && mine.wtype != static_cast<int>(DType::F32))
            mine.wide = wide + size_t(t) * wide_floats;
          k.matmul(&mine, 0, (mine.rows + cpu::kPanel - 1) / cpu::kPanel);
        }
      }
    });
  }

  // Whether an op over n rows splits them over the threads (rather than a
  // matmul's panels): from kRowSplitRows rows a thread.
  bool splits_by_rows(int64_t n) const { return row_split_ && n >= kRowSplitRows * pool_.threads(); }

  // The int8 path: the x rows quantised (threaded by rows), then the panels
  // split over the threads.
  void matmul_int8(const cpu::PackedWeights& p, const float* x, int64_t n, float* y) {
    const int64_t cols = p.cols, nb = cols / 32;
    xq_.resize(size_t(n * cols));
    xd_.resize(size_t(n * nb));
    xc_.resize(size_t(n * nb));
    int8_t* xq = xq_.data();
    float* xd = xd_.data();
    int32_t* xc = xc_.data();
    const cpu::Int8QuantizeFn quantize = int8_.quantize;
    rows_for(n, cols * 4, [&](int64_t i0, int64_t i1, int) {
      quantize(x + i0 * cols, i1 - i0, cols, xq + i0 * cols, xd + i0 * nb, xc + i0 * nb);
    });
    cpu::Int8MatmulArgs a{p.data, p.rows, cols, xq, xd, xc, n, y};
    const cpu::Int8MatmulFn fn = int8_.matmul;
    const int64_t panels = (p.rows + cpu::kPanelRows - 1) / cpu::kPanelRows;
    auto body = [&a, fn](int64_t p0, int64_t p1, int) { fn(&a, p0, p1); };
    if (n * p.rows * cols < kMinParallelWork || pool_.threads() == 1) {
      body(0, panels, 0);
    } else {
      pool_.parallel_for(panels, body);
    }
  }

  cpu::PackForm form_for(const WeightView& w) const {
    return compute_ == Compute::int8 && w.type == DType::Q8_0 ? cpu::PackForm::int8 : cpu::PackForm::exact;
  }

  // This backend's copy of w's panels (made, or taken from another backend's,
  // on first use). Keyed by the data address; a view of another shape at
  // that address is packed again.
  const cpu::PackedWeights& prepared(const WeightView& w) {
    if (const cpu::PackedWeights* p = find_prepared(w)) return *p;
    const cpu::PackForm form = form_for(w);
    auto packed = cpu::shared_packed(w, form, [&](uint8_t* out) {
      const auto* src = static_cast<const uint8_t*>(w.data);
      if (form == cpu::PackForm::int8) {
        cpu::int8_pack_q8_0(src, w.row_bytes, w.rows, w.cols, out);
        return;
      }
      pack_panels(w, src, out);
    });
    std::lock_guard<std::mutex> lock(prepared_mu_);
    auto& slot = prepared_[w.data];
    slot = std::move(packed);
    return *slot;
  }

  const cpu::PackedWeights* find_prepared(const WeightView& w) {
    std::lock_guard<std::mutex> lock(prepared_mu_);
    auto it = prepared_.find(w.data);
    return it != prepared_.end() && it->second->matches(w, form_for(w)) ? it->second.get() : nullptr;
  }

  // Exact panels of w into out, split over the threads.
  void pack_panels(const WeightView& w, const uint8_t* src, uint8_t* out) {
    const int wtype = static_cast<int>(w.type);
    const size_t stride = cpu::panel_stride(wtype, w.cols);
    const int64_t panels = (w.rows + cpu::kPanel - 1) / cpu::kPanel;
    auto body = [&](int64_t p0, int64_t p1, int) {
      cpu::pack_panels(wtype, src, w.row_bytes, w.rows, w.cols, p0, p1, out + size_t(p0) * stride);
    };
    if (w.rows * w.cols < kMinParallelWork || pool_.threads() == 1) {
      body(0, panels, 0);
    } else {
      pool_.parallel_for(panels, body);
    }
  }

  // An unprepared view (activations multiplied as weights, or a caller that
  // never prepares) is packed for this call only: its bytes may change.
  const uint8_t* pack_for_call(const WeightView& w, int64_t panels, size_t stride) {
    const size_t bytes = size_t(panels) * stride;
    if (bytes > pack_scratch_bytes_) {
      std::free(pack_scratch_);
      pack_scratch_bytes_ = (bytes + 63) / 64 * 64;
      pack_scratch_ = static_cast<uint8_t*>(std::aligned_alloc(64, pack_scratch_bytes_));
      CLEAVE_CHECK(pack_scratch_ != nullptr);
    }
    pack_panels(w, static_cast<const uint8_t*>(w.data), pack_scratch_);
    return pack_scratch_;
  }

  // Position p's angles (p times each inverse frequency, in double, so the
  // angle of a large position stays exact to float precision) as the
  // rope_rows kernel takes them: 2 * half floats of cos, each twice (c0, c0,
  // c1, c1, ...), then 2 * half of sin with the even lane negated (-s0, s0,
  // -s1, s1, ...).
  void rope_angles(int64_t p, int64_t half, float* out) const {
    for (int64_t j = 0; j < half; ++j) {
      const double theta = double(p) * rope_freq_[size_t(j)];
      const float c = static_cast<float>(std::cos(theta)), s = static_cast<float>(std::sin(theta));
      out[2 * j] = out[2 * j + 1] = c;
      out[2 * half + 2 * j] = -s;
      out[2 * half + 2 * j + 1] = s;
    }
  }

  // Run fn over n rows, threaded when rows * cost_per_row is large enough.
  template <class F>
  void rows_for(int64_t n, int64_t cost_per_row, F&& fn) {
    if (n <= 0) return;
    if (pool_.threads() == 1 || n == 1 || (n * cost_per_row < kMinParallelWork && !splits_by_rows(n))) {
      fn(int64_t(0), n, 0);
    } else {
      pool_.parallel_for(n, fn);
    }
  }

  // Per-thread scratch of at least `floats` floats (grown outside parallel regions).
  void ensure_scratch(size_t floats) {
    const size_t stride = (floats + 15) / 16 * 16;
    if (stride > scratch_stride_) {
      scratch_stride_ = stride;
      scratch_.assign(stride * size_t(pool_.threads()), 0.0f);
    }
  }

  Isa isa_;
  const cpu::Kernels& k_;
  ThreadPool pool_;
  std::vector<float> scratch_;
  cpu::AttentionPlan attn_plan_;  // attention: groups, tasks, each thread's range
  std::vector<float> fa_scratch_;  // full_attention: one (sequence, head) at a time
  std::vector<float> wide_;        // matmul: each thread's widened panels
  std::vector<cpu::PanelMatmulArgs> group_;  // matmuls: the jobs run as one region
  std::vector<int64_t> group_first_;         // run_panels: each part's first panel
  size_t scratch_stride_ = 0;
  std::vector<double> rope_freq_;
  std::vector<float> rope_table_;  // per position: rope_angles' 2 x head_dim floats
  float rope_base_ = 0.0f;
  int64_t rope_dim_ = 0;
  Compute compute_;
  Int8Kernels int8_;
  bool row_split_;  // splits_by_rows may answer yes (make_cpu_backend_panel_split: never)
  std::mutex prepared_mu_;
  std::unordered_map<const void*, std::shared_ptr<const cpu::PackedWeights>> prepared_;
  uint8_t* pack_scratch_ = nullptr;
  size_t pack_scratch_bytes_ = 0;
  std::vector<int8_t> xq_;
  std::vector<float> xd_;
  std::vector<int32_t> xc_;
};

}  // namespace

namespace {

// Never run code this CPU cannot execute: clamp to what it supports.
Isa supported(Isa isa) {
  const Isa best = detect_isa();
  return static_cast<int>(isa) > static_cast<int>(best) ? best : isa;
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads, Isa isa, Compute compute) {
  return std::make_unique<CpuBackend>(threads, supported(isa), compute, true);
}

std::unique_ptr<Backend> make_cpu_backend_panel_split(int threads, Isa isa, Compute compute) {
  return std::make_unique<CpuBackend>(threads, supported(isa), compute, false);
}

}  // namespace cleave
