// The compute backend interface: every op the model needs, over memory the
// backend can address (host memory for the CPU backend, device memory for
// CUDA). Buffers are moved with alloc/upload/download so the same test can
// drive every backend.
//
// Batch invariance (DESIGN.md invariant 1): for every op, the result for one
// row depends only on that row's inputs, never on how many rows are in the
// call, where the row sits, or how many threads run. Implementations reduce
// in a fixed order per row and split work across threads by output rows only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "kernels/dtype.h"

namespace cleave {

// A 2-D weight matrix in its stored type: `rows` rows of `cols` elements,
// row r starting at data + r * row_bytes. GGUF ne[0] = cols, ne[1] = rows.
struct WeightView {
  DType type = DType::F32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_bytes = 0;
};

// One matmul of a group (Backend::matmuls): y = x w^T over n rows of x.
struct MatmulJob {
  const WeightView* w = nullptr;
  const float* x = nullptr;
  int64_t n = 0;
  float* y = nullptr;
};

// The paged KV cache the attention ops read and write. One block holds
// `block_size` consecutive token positions of K and V for every layer;
// each (block, layer) part is contiguous so a layer can be moved on its own.
// Layout: [block][layer][k=0|v=1][kv_head][slot] rows of head_dim elements,
// K rows in k_type and V rows in v_type (F32, F16, or Q8_0 / Q4_0 blocks
// of 32 along head_dim; llama.cpp's -ctk / -ctv).
struct PagedKv {
  uint8_t* data = nullptr;
  DType k_type = DType::F32, v_type = DType::F32;
  int32_t n_blocks = 0;
  int32_t block_size = 0;
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;

  size_t k_row_bytes() const { return dtype_row_bytes(k_type, head_dim); }
  size_t v_row_bytes() const { return dtype_row_bytes(v_type, head_dim); }
  // Bytes of one head's K (or V) rows in one (block, layer) part.
  size_t k_head_bytes() const { return size_t(block_size) * k_row_bytes(); }
  size_t v_head_bytes() const { return size_t(block_size) * v_row_bytes(); }
  size_t layer_bytes() const { return size_t(n_kv_heads) * (k_head_bytes() + v_head_bytes()); }
  size_t block_bytes() const { return layer_bytes() * n_layers; }
  // Byte offset of the row of (block, layer, k=0|v=1, head, slot).
  size_t offset(int32_t block, int32_t layer, int32_t kv, int32_t head, int32_t slot) const {
    const size_t base = size_t(block) * block_bytes() + size_t(layer) * layer_bytes();
    if (kv == 0) return base + size_t(head) * k_head_bytes() + size_t(slot) * k_row_bytes();
    return base + size_t(n_kv_heads) * k_head_bytes() + size_t(head) * v_head_bytes() +
           size_t(slot) * v_row_bytes();
  }
};
// The element types a KV cache may hold (F32, F16, Q8_0, Q4_0), and
// whether a head_dim suits them (Q8_0, Q4_0: a multiple of 32).
// invalid_argument naming the type and `what` ("cache type k") otherwise.
Status check_kv_type(DType t, int32_t head_dim, const char* what);
// -ctk / -ctv / cache_type_k spellings (llama.cpp's): f32, f16, q8_0, q4_0.
Result<DType> kv_type_from_name(const std::string& name);

// One query row of attention: the token at absolute position `pos` of a
// sequence whose blocks are block_table[0..n_blocks). It attends keys at
// positions [0, pos] (causal). Prefill passes many rows of one sequence;
// decode passes one row for each of many sequences. kv_write and attention
// take an array of them in backend memory (on a device the engine uploads
// it once per forward pass, beside the positions), each block_table too.
struct AttnRow {
  const int32_t* block_table = nullptr;  // backend-addressable memory
  int32_t n_blocks = 0;
  int32_t pos = 0;
};

enum class Op {
  matmul,
  rmsnorm,
  rope,
  softmax,
  silu_mul,
  embed,
  topk_gating,
  kv_write,
  attention,
  layer_norm,
  gelu,
  add,
  full_attention,
  moe_combine,
};

// The GELU of a vision encoder: tanh is 0.5 x (1 + tanh(sqrt(2/pi) (x +
// 0.044715 x^3))), quick is x sigmoid(1.702 x) (clip.use_gelu false).
enum class Gelu { tanh, quick };

// How matmuls over Q8_0 weights compute (--compute). exact (the default)
// widens the weights to F32 and multiplies in F32. int8 quantises each
// activation row per 32 values to int8 (f32 scale) and multiplies in
// integers, as llama.cpp computes Q8_0 (kernels/cpu/int8.h): faster, still
// batch-invariant and the same on every ISA, but not equal to exact. Other
// weight types compute exactly under either.
enum class Compute { exact, int8 };
const char* compute_name(Compute c);
// "exact" / "int8"; invalid_argument naming the value otherwise.
Result<Compute> compute_from_name(const std::string& name);

struct Caps {
  std::string name;      // "cpu", "cuda"
  std::string isa;       // "avx512", "avx2", "scalar", "sm_90"
  int threads = 1;
  Compute compute = Compute::exact;
  std::string int8_kernel;  // with Compute::int8: "avx512vnni", "avx2" or "scalar"
  // The backend's memory is the host's own (the CPU backend): callers may
  // hand its ops host pointers and read results in place. false (CUDA):
  // ops take only memory from alloc(), and the host reaches it through
  // upload() / download() alone.
  bool host_memory = true;
  // alloc_shared / open_shared work: another process on this host can map
  // this backend's memory (KV handed over without a socket).
  bool shareable = false;
};

// Memory of a backend that another process on the same host may map
// (Backend::alloc_shared): where it is here, its size, and the handle that
// names it to the other process (a printable string; it travels in a
// message).
struct SharedRegion {
  void* data = nullptr;
  size_t bytes = 0;
  std::string handle;
};

// A point-to-point link from one backend's device to a peer's in another
// process, possibly on another host (NCCL send / recv between GPUs): bytes
// sent from this backend's memory land in the peer's memory, never through
// either host. Both ends open it from one id (Backend::new_link_id on one
// end, carried to the other by the caller's control channel); rank 0 sends,
// rank 1 receives, and each send meets a recv of the same size, in order.
// Calls block: one whose peer does not join or stops midway fails after the
// timeout given to open_link (timed_out), and the link is broken from then
// on (its owner closes it).
class DeviceLink {
 public:
  virtual ~DeviceLink() = default;
  virtual Status send(const void* data, size_t bytes) = 0;
  virtual Status recv(void* data, size_t bytes) = 0;
  // From any thread: calls blocked now and every later one fail at once
  // (aborted); what a caller tearing a link down does before joining.
  virtual void abort() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Caps caps() const = 0;
  // weight_type: the weights' type; for kv_write and attention, the KV
  // cache's element type.
  virtual bool supports(Op op, DType weight_type) const = 0;

  // Memory the backend's ops can address.
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* ptr) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  virtual void sync() = 0;

  // Page-locked host memory for staging transfers to and from the backend's
  // memory (the pinned host KV tier): cudaHostAlloc for CUDA, 4096-aligned
  // host memory for the CPU backend. nullptr when out of memory.
  virtual void* alloc_pinned_host(size_t bytes) = 0;
  virtual void free_pinned_host(void* ptr) = 0;

  // Memory shared between processes on one host (Caps::shareable), for KV
  // handed from a prefill process to a decoder without a socket or, on a
  // GPU, a host copy. alloc_shared gives `bytes` of this backend's memory
  // and a handle; free_shared releases it (another process's mapping stays
  // valid until it closes it). open_shared maps the first `bytes` of
  // another process's region, read-only where the backend can say so (a
  // malformed handle or more bytes than the region has is
  // invalid_argument, a region gone not_found or unavailable);
  // close_shared(data, the same bytes) unmaps it. The CPU backend shares memfd
  // pages ("memfd:..." handles, kernels/cpu/shared_memory.h), CUDA device
  // memory through IPC handles ("cudaipc:..."). Default: unsupported.
  // (Inline: a key function here would tie every user of the interface,
  // the fuzz targets' object lists among them, to one more source file.)
  virtual Result<SharedRegion> alloc_shared(size_t bytes) {
    (void)bytes;
    return Status(Code::unsupported, "the " + caps().name + " backend cannot share memory between processes");
  }
  virtual void free_shared(const SharedRegion& region) { (void)region; }
  virtual Result<const void*> open_shared(const std::string& handle, size_t bytes) {
    (void)handle, (void)bytes;
    return Status(Code::unsupported, "the " + caps().name + " backend cannot share memory between processes");
  }
  virtual void close_shared(const void* data, size_t bytes) { (void)data, (void)bytes; }
  // XXH3-64 (seed 0) of each of n consecutive blocks of block_bytes at
  // `data` (this backend's memory) into out[0..n) on the host: the checksum
  // storage gives a block (checksum_bytes), computed where the bytes are,
  // so device memory is checked without a copy to the host. Default
  // (memory the host reads, where storage's checksum serves): unsupported.
  virtual Status checksum_blocks(const void* data, size_t block_bytes, int64_t n, uint64_t* out) {
    (void)data, (void)block_bytes, (void)n, (void)out;
    return Status(Code::unsupported, "the " + caps().name + " backend has no checksum op (the host reads its memory)");
  }

  // Device links (DeviceLink above; CUDA: NCCL, "nccl:..." ids). new_link_id
  // makes the id of a new link; open_link joins it as `rank` (0 sends, 1
  // receives), waiting at most timeout_s for the peer (timed_out, or
  // invalid_argument for a malformed id). Default: unsupported.
  virtual Result<std::string> new_link_id() {
    return Status(Code::unsupported, "the " + caps().name + " backend has no device links");
  }
  virtual Result<std::unique_ptr<DeviceLink>> open_link(const std::string& id, int rank, double timeout_s) {
    (void)id, (void)rank, (void)timeout_s;
    return Status(Code::unsupported, "the " + caps().name + " backend has no device links");
  }

  // A hint that `w` will be multiplied and its bytes stay as they are: a
  // backend that multiplies weights in another form (the CPU backend's
  // panels) makes it now, once, rather than in every matmul. Results do not
  // change. True when the backend keeps that copy and will not read w's own
  // memory in matmul again (its owner may release the pages).
  virtual bool prepare(const WeightView& w) {
    (void)w;
    return false;
  }

  // y[i][r] = sum_c x[i][c] * w[r][c] for i < n, r < w.rows.
  // x is n x w.cols, y is n x w.rows (row-major, dense).
  virtual void matmul(const WeightView& w, const float* x, int64_t n, float* y) = 0;
  // Independent matmuls (no job's y overlaps another job's x or y), each
  // with the bits matmul gives it alone. A backend may run them as one
  // parallel region rather than one after another (the CPU backend splits
  // all their panels over its threads at once: the q, k and v projections,
  // or every expert's gate and up, cost one fork and join instead of one
  // each, and the threads share out more panels).
  virtual void matmuls(const MatmulJob* jobs, int64_t count) {
    for (int64_t i = 0; i < count; ++i) matmul(*jobs[i].w, jobs[i].x, jobs[i].n, jobs[i].y);
  }
  // y[i] = x[i] / sqrt(mean(x[i]^2) + eps) * weight, for n rows of dim.
  virtual void rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps,
                       float* y) = 0;
  // In place, adjacent pairs (2j, 2j+1) of each head rotated by
  // pos * freq_base^(-2j/head_dim). x is n x n_heads x head_dim.
  virtual void rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim,
                    const int32_t* positions, float freq_base) = 0;
  // In place, softmax over each of n rows of len.
  virtual void softmax(float* x, int64_t n, int64_t len) = 0;
  // out = silu(gate) * up, elementwise over count values.
  virtual void silu_mul(const float* gate, const float* up, int64_t count, float* out) = 0;
  // out[i] = dequantised row ids[i] of table (n x table.cols).
  virtual void embed(const WeightView& table, const int32_t* ids, int64_t n, float* out) = 0;
  // Mixtral routing per row: softmax over n_expert logits, take the k largest
  // (ties: lower index first) in descending order, renormalise their weights
  // to sum to 1. ids/weights are n x k.
  virtual void topk_gating(const float* logits, int64_t n, int64_t n_expert, int64_t k,
                           int32_t* ids, float* weights) = 0;
  // Store k and v (n x n_kv_heads x head_dim) of each row at its position,
  // converted to the cache's types (F16: round to nearest even; Q8_0:
  // llama.cpp's quantize_row_q8_0 per 32 elements), so a row's stored bytes
  // depend on its values only.
  virtual void kv_write(const PagedKv& kv, int32_t layer, const float* k, const float* v,
                        const AttnRow* rows, int64_t n) = 0;
  // K and V are read in their stored types (widened exactly to F32).
  // out[i][h] = softmax(q[i][h] . K[0..pos] * scale) V, query head h reading
  // kv head h / (n_heads / n_kv_heads). Reduction runs over whole blocks of
  // absolute positions in order (online softmax), so a row's result does not
  // depend on the other rows or on how the prompt was chunked.
  // q and out are n x n_heads x head_dim.
  virtual void attention(const PagedKv& kv, int32_t layer, const float* q, const AttnRow* rows,
                         int64_t n, int32_t n_heads, float scale, float* out) = 0;

  // The vision encoder's element-wise work. Each row's (element's) result
  // depends on that row (element) only, so an image's bits do not depend on
  // the batch it runs in.
  // y[i] = (x[i] - mean(x[i])) / sqrt(var(x[i]) + eps) * w + b, for n rows
  // of dim (the population variance). y may be x.
  virtual void layer_norm(const float* x, const float* w, const float* b, int64_t n, int64_t dim,
                          float eps, float* y) = 0;
  // y = gelu(x) elementwise over count values; y may be x.
  virtual void gelu(const float* x, int64_t count, Gelu kind, float* y) = 0;
  // y[i] = a[i] + b[i % period] for i < count (period = count: two arrays;
  // period = dim: a bias on every row). count is a multiple of period; y
  // may be a.
  virtual void add(const float* a, const float* b, int64_t count, int64_t period, float* y) = 0;
  // The vision encoder's attention (full, not causal) over n_seq sequences
  // of T rows: for each sequence s, head h and row i,
  // out[s T + i][h hd, (h + 1) hd) = sum_j softmax_j(q_i . k_j * scale) v_j
  // over the sequence's rows j. q, k, v and out are (n_seq T) x ld floats,
  // each head's hd values at column h hd. A row's result depends on its own
  // sequence only.
  virtual void full_attention(const float* q, const float* k, const float* v, int64_t n_seq,
                              int64_t T, int64_t n_heads, int64_t head_dim, int64_t ld, float scale,
                              float* out) = 0;
  // The MoE combine: out[r][d] = sum over j < k, in order, of
  // w[r k + j] * y[rows[r k + j]][d] (each product rounded, then added to a
  // sum that starts at 0), for n rows of dim: expert j's output of row r
  // sits at row rows[r k + j] of y.
  virtual void moe_combine(const float* y, const int32_t* rows, const float* w, int64_t n, int64_t k,
                           int64_t dim, float* out) = 0;
  // `bytes` from src to dst, both in the backend's memory (not overlapping).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
};

enum class Isa { scalar, avx2, avx512 };
const char* isa_name(Isa isa);
// Best ISA this CPU supports (run-time detection).
Isa detect_isa();

// The CPU backend, always built. `threads` workers on its own pool (never on
// an actor scheduler's threads); isa defaults to the best this CPU supports
// and may be lowered for testing. With Compute::int8 it repacks each Q8_0
// weight matrix on first use (kept until the backend goes; the weights must
// not change meanwhile) and runs the int8 kernel of that isa (AVX-512 only
// with VNNI, else AVX2's).
std::unique_ptr<Backend> make_cpu_backend(int threads, Isa isa = detect_isa(),
                                          Compute compute = Compute::exact);
// Whether this CPU has AVX512_VNNI (the AVX-512 int8 kernel's vpdpbusd).
bool cpu_has_avx512_vnni();
namespace cpu {
struct Kernels;  // kernels/cpu/kern.h
}
// The kernel table the CPU backend runs for isa (for benchmarks that time
// one kernel alone).
const cpu::Kernels& cpu_kernels(Isa isa);

// The CUDA backend when compiled in and a GPU is present; otherwise the
// Status says why not (unavailable).
Result<std::unique_ptr<Backend>> make_cuda_backend(int device = 0);

// Where a forward pass runs (--device, a topology node's `device`).
struct Device {
  enum class Kind { cpu, cuda } kind = Kind::cpu;
  int index = 0;  // cuda:N
  std::string name() const { return kind == Kind::cpu ? "cpu" : "cuda:" + std::to_string(index); }
};
// "cpu" or "cuda:N" (N in [0, 1023], as topology scripts allow); invalid_argument naming the value otherwise.
Result<Device> parse_device(const std::string& s);
// The device's backend: the CPU backend of `threads` and `compute`, or the
// CUDA backend (unavailable, saying why, when the build or the machine has
// none; unsupported for Compute::int8, whose kernels are the CPU's).
Result<std::unique_ptr<Backend>> make_backend(const Device& device, int threads,
                                              Compute compute = Compute::exact);
// What an engine, a pipeline stage or an expert host runs on: `device`
// checked first (before a model is loaded: parse_device's error, or
// invalid_argument when a backend of its own is `given` beside a device
// other than cpu, the tests' seam), then `given`, else make_backend()'s.
// Errors say "WHO: ...".
Result<Device> device_for(const std::string& device, bool given, const std::string& who);
Result<std::shared_ptr<Backend>> backend_for(const Device& device, int threads, Compute compute,
                                             std::shared_ptr<Backend> given, const std::string& who);

}  // namespace cleave
