// The CUDA backend: every op of kernels/backend.h on device memory.
//
// Batch invariance (DESIGN.md invariant 1): each output value is reduced in an
// order that depends only on the shapes of its own inputs (k, dim, head_dim,
// block_size), never on n, on where the row sits in the batch, or on the
// launch configuration. Concretely:
//  - matmul (kernels/cuda/matmul.cu): one warp per output feature, each
//    lane's chunks in ascending order, a fixed xor-butterfly; the x-row tile
//    never changes a result.
//  - rmsnorm, softmax: one 256-thread block per row, per-thread strided
//    partials, fixed warp-then-block tree.
//  - attention: one block per (row, head); whole KV blocks in absolute
//    position order, online softmax rescaled once per block.
// All arithmetic uses IEEE division/sqrt/expf (no fast math).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <memory>
#include <string>

// nvcc's front end flags `status_ = Status(...)` in common/status.h (a
// [[nodiscard]] class type returned by value) though g++ does not.
#pragma nv_diag_suppress 2810
#include "kernels/backend.h"
#pragma nv_diag_default 2810
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ipc.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/nccl_link.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/weights.cuh"
#include "kernels/cuda/vision_ops.h"
#include "kernels/device_testing.h"

namespace cleave {
namespace {

using cuda::block_max;
using cuda::fail;
using cuda::block_sum;
using cuda::warp_max;
using cuda::warp_sum;
using cuda::bf16_bits_to_f32;
using cuda::f16_bits_to_f32;
using cuda::load_w;

constexpr int kWarp = 32;
constexpr int kRowThreads = 256;  // threads per block for row-wise reductions
constexpr int kAttnThreads = 128;

// ------------------------------------------------------------ row ops --

__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ weight, int64_t dim,
                   float eps, float* __restrict__ y) {
  __shared__ float sh[kWarp];
  const int64_t i = blockIdx.x;
  const float* xr = x + i * dim;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) ss = fmaf(xr[c], xr[c], ss);
  ss = block_sum(ss, sh);
  const float scale = 1.0f / sqrtf(ss / float(dim) + eps);
  float* yr = y + i * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) yr[c] = xr[c] * scale * weight[c];
}

__global__ void __launch_bounds__(kRowThreads) softmax_kernel(float* __restrict__ x, int64_t len) {
  __shared__ float sh[kWarp];
  float* xr = x + int64_t(blockIdx.x) * len;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < len; c += blockDim.x) m = fmaxf(m, xr[c]);
  m = block_max(m, sh);
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < len; c += blockDim.x) {
    const float e = expf(xr[c] - m);
    xr[c] = e;
    s += e;
  }
  s = block_sum(s, sh);
  for (int64_t c = threadIdx.x; c < len; c += blockDim.x) xr[c] = xr[c] / s;
}

// One thread per (row, head, pair). theta = pos * base^(-2j/head_dim) in
// double, so large positions keep their angle accurate.
__global__ void rope_kernel(float* __restrict__ x, int64_t n, int64_t n_heads, int64_t head_dim,
                            const int32_t* __restrict__ positions, double log_base) {
  const int64_t half = head_dim / 2;
  const int64_t total = n * n_heads * half;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % half;
    const int64_t rh = idx / half;  // row * n_heads + head
    const int64_t i = rh / n_heads;
    const double freq = exp(-double(2 * j) / double(head_dim) * log_base);
    const double theta = double(positions[i]) * freq;
    double sn, cs;
    sincos(theta, &sn, &cs);
    const float c = float(cs), s = float(sn);
    float* p = x + rh * head_dim + 2 * j;
    const float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
  }
}

__global__ void silu_mul_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                                int64_t count, float* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void embed_kernel(DType type, const uint8_t* __restrict__ table, size_t row_bytes,
                             int64_t cols, const int32_t* __restrict__ ids,
                             float* __restrict__ out) {
  const int64_t i = blockIdx.x;
  const uint8_t* row = table + int64_t(ids[i]) * row_bytes;
  float* o = out + i * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v;
    switch (type) {
      case DType::F32: v = load_w<DType::F32>(row, c); break;
      case DType::F16: v = load_w<DType::F16>(row, c); break;
      case DType::BF16: v = load_w<DType::BF16>(row, c); break;
      default: {
        const uint8_t* blk = row + (c / kQ8Block) * kQ8BlockBytes;
        const float d = f16_bits_to_f32(uint32_t(blk[0]) | (uint32_t(blk[1]) << 8));
        v = d * float(int8_t(blk[2 + c % kQ8Block]));
      }
    }
    o[c] = v;
  }
}

// One thread per row: softmax over the experts (sequential, fixed order),
// then k rounds of selection under the total order (p desc, index asc).
__global__ void topk_gating_kernel(const float* __restrict__ logits, int64_t n, int64_t n_expert,
                                   int64_t k, int32_t* __restrict__ ids,
                                   float* __restrict__ weights) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float* l = logits + i * n_expert;
  float m = -INFINITY;
  for (int64_t e = 0; e < n_expert; ++e) m = fmaxf(m, l[e]);
  float s = 0.0f;
  for (int64_t e = 0; e < n_expert; ++e) s += expf(l[e] - m);
  float prev_p = INFINITY;
  int64_t prev_id = -1;
  float sel_sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    float best_p = -1.0f;
    int64_t best = -1;
    for (int64_t e = 0; e < n_expert; ++e) {
      const float p = expf(l[e] - m) / s;
      const bool after_prev = p < prev_p || (p == prev_p && e > prev_id);
      if (after_prev && p > best_p) {  // strict: ties keep the lower index
        best_p = p;
        best = e;
      }
    }
    ids[i * k + j] = int32_t(best);
    weights[i * k + j] = best_p;
    sel_sum += best_p;
    prev_p = best_p;
    prev_id = best;
  }
  for (int64_t j = 0; j < k; ++j) weights[i * k + j] = weights[i * k + j] / sel_sum;
}

// PagedKv as the kernels address it: K rows in k_type, V rows in v_type
// (F32, F16, Q8_0 or Q4_0), laid out as PagedKv::offset lays them.
struct KvDev {
  uint8_t* data;
  int32_t n_blocks, block_size, n_layers, n_kv_heads, head_dim;
  DType k_type, v_type;
  size_t k_row, v_row;  // bytes of one K / V row
  __device__ uint8_t* row(int32_t block, int32_t layer, int32_t kv, int32_t head, int32_t slot) const {
    const size_t layer_bytes = size_t(n_kv_heads) * block_size * (k_row + v_row);
    const size_t base = size_t(block) * layer_bytes * n_layers + size_t(layer) * layer_bytes;
    if (kv == 0) return data + base + (size_t(head) * block_size + slot) * k_row;
    return data + base + size_t(n_kv_heads) * block_size * k_row + (size_t(head) * block_size + slot) * v_row;
  }
};

KvDev to_dev(const PagedKv& kv) {
  return KvDev{kv.data,    kv.n_blocks, kv.block_size,    kv.n_layers,     kv.n_kv_heads,
               kv.head_dim, kv.k_type,  kv.v_type,        kv.k_row_bytes(), kv.v_row_bytes()};
}

// Element c of a stored row, widened exactly to F32 (Q8_0: d x q, both
// exact in F32, as the CPU backend widens).
// An F32 row after Q8_0 rows (34 bytes each) may sit off a 4-byte boundary
// (an odd block size): then it is read and written byte-wise.
__device__ __forceinline__ float load_kv(const uint8_t* row, DType t, int32_t c) {
  if (t == DType::F32) {
    if ((reinterpret_cast<uintptr_t>(row) & 3) == 0) return reinterpret_cast<const float*>(row)[c];
    float f;
    memcpy(&f, row + size_t(c) * 4, 4);
    return f;
  }
  if (t == DType::F16) return __half2float(reinterpret_cast<const __half*>(row)[c]);
  if (t == DType::Q4_0) {  // f16 scale, value j in the low nibble of byte j, j + 16 in the high one
    const uint8_t* b = row + size_t(c / 32) * 18;
    const int q = (b[2 + c % 16] >> (c % 32 < 16 ? 0 : 4)) & 15;
    return __half2float(*reinterpret_cast<const __half*>(b)) * float(q - 8);
  }
  const uint8_t* b = row + size_t(c / 32) * 34;  // Q8_0: f16 scale, 32 int8
  return __half2float(*reinterpret_cast<const __half*>(b)) * float(int8_t(b[2 + c % 32]));
}

// Stores element c of a row. Q8_0 is llama.cpp's quantize_row_q8_0, as the
// CPU backend's (kernels/dtype.cpp): each 32-element block's lanes are one
// warp (head_dim and the thread count are multiples of 32), amax by a
// warp max, d = amax / 127, q = roundf(x / d) as x * (1 / d), d stored as
// F16 rounded to nearest even: the same bytes as the CPU's.
__device__ __forceinline__ void store_kv(uint8_t* row, DType t, int32_t c, float x) {
  if (t == DType::F32) {
    if ((reinterpret_cast<uintptr_t>(row) & 3) == 0) reinterpret_cast<float*>(row)[c] = x;
    else memcpy(row + size_t(c) * 4, &x, 4);
  } else if (t == DType::F16) {
    reinterpret_cast<__half*>(row)[c] = __float2half_rn(x);
  } else if (t == DType::Q4_0) {
    // quantize_row_q4_0 (kernels/dtype.cpp): the block's first element of
    // largest |x| (the lowest lane among the equal), d = that / -8, q =
    // min(15, trunc(x / d + 8.5)) (NaN: 0), lanes j and j + 16 in byte j.
    const float amax = warp_max(fabsf(x));
    int first = fabsf(x) == amax ? int(c % 32) : 32;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, off));
    const float m = __shfl_sync(0xffffffffu, x, first & 31);
    const float d = __fdiv_rn(amax == 0.0f ? 0.0f : m, -8.0f);  // zeros: the formula's +0, whatever -0s
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    const float tq = __fadd_rn(__fmul_rn(x, id), 8.5f);
    const int q = tq >= 0.0f ? (tq < 16.0f ? int(tq) : 15) : 0;
    const int hi = __shfl_down_sync(0xffffffffu, q, 16);
    uint8_t* b = row + size_t(c / 32) * 18;
    if (c % 32 == 0) *reinterpret_cast<__half*>(b) = __float2half_rn(d);
    if (c % 32 < 16) b[2 + c % 32] = uint8_t(q | (hi << 4));
  } else {
    const float amax = warp_max(fabsf(x));
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    uint8_t* b = row + size_t(c / 32) * 34;
    if (c % 32 == 0) *reinterpret_cast<__half*>(b) = __float2half_rn(d);
    b[2 + c % 32] = uint8_t(int8_t(roundf(__fmul_rn(x, id))));
  }
}

// grid (n, n_kv_heads)
__global__ void kv_write_kernel(KvDev kv, int32_t layer, const float* __restrict__ k,
                                const float* __restrict__ v, const AttnRow* __restrict__ rows) {
  const int64_t i = blockIdx.x;
  const int32_t h = blockIdx.y;
  const AttnRow row = rows[i];
  const int32_t blk = row.block_table[row.pos / kv.block_size];
  const int32_t slot = row.pos % kv.block_size;
  const int32_t hd = kv.head_dim;
  uint8_t* kd = kv.row(blk, layer, 0, h, slot);
  uint8_t* vd = kv.row(blk, layer, 1, h, slot);
  const int64_t src = (i * kv.n_kv_heads + h) * hd;
  for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) {
    store_kv(kd, kv.k_type, c, k[src + c]);
    store_kv(vd, kv.v_type, c, v[src + c]);
  }
}

// grid (n, n_heads), kAttnThreads threads. Shared: q[hd] acc[hd] s[bs] p[bs].
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(KvDev kv, int32_t layer, const float* __restrict__ q,
                     const AttnRow* __restrict__ rows, int32_t n_heads, float scale,
                     float* __restrict__ out) {
  extern __shared__ float sm[];
  const int32_t hd = kv.head_dim, bs = kv.block_size;
  float* qs = sm;
  float* acc = qs + hd;
  float* s = acc + hd;
  float* p = s + bs;
  const int64_t i = blockIdx.x;
  const int32_t h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  const AttnRow row = rows[i];
  const int32_t kh = h / (n_heads / kv.n_kv_heads);
  const float* qrow = q + (i * n_heads + h) * hd;
  for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) {
    qs[c] = qrow[c];
    acc[c] = 0.0f;
  }
  __syncthreads();
  float m = -INFINITY, l = 0.0f;
  const int32_t nblk = row.pos / bs + 1;
  for (int32_t b = 0; b < nblk; ++b) {
    const int32_t blk = row.block_table[b];
    const uint8_t* kb = kv.row(blk, layer, 0, kh, 0);
    const uint8_t* vb = kv.row(blk, layer, 1, kh, 0);
    const int32_t valid = min(bs, row.pos - b * bs + 1);
    for (int32_t j = warp; j < valid; j += nwarps) {
      const uint8_t* kr = kb + size_t(j) * kv.k_row;
      float d = 0.0f;
      for (int32_t c = lane; c < hd; c += kWarp) d = fmaf(qs[c], load_kv(kr, kv.k_type, c), d);
      d = warp_sum(d);
      if (lane == 0) s[j] = d * scale;
    }
    __syncthreads();
    float mb = m;
    for (int32_t j = 0; j < valid; ++j) mb = fmaxf(mb, s[j]);
    const float corr = expf(m - mb);  // 0 for the first block (m = -inf)
    for (int32_t j = threadIdx.x; j < valid; j += blockDim.x) p[j] = expf(s[j] - mb);
    __syncthreads();
    l *= corr;
    for (int32_t j = 0; j < valid; ++j) l += p[j];
    for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) {
      float a = acc[c] * corr;
      for (int32_t j = 0; j < valid; ++j) a = fmaf(p[j], load_kv(vb + size_t(j) * kv.v_row, kv.v_type, c), a);
      acc[c] = a;
    }
    m = mb;
    __syncthreads();  // s and p are rewritten by the next block
  }
  float* o = out + (i * n_heads + h) * hd;
  for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) o[c] = acc[c] / l;
}

// ------------------------------------------------------------- backend --

int grid_for(int64_t count, int threads, int max_blocks) {
  int64_t b = (count + threads - 1) / threads;
  if (b < 1) b = 1;
  return int(b < max_blocks ? b : max_blocks);
}

// out[r][d] = sum_j w[r k + j] * y[rows[r k + j]][d], j in order, each
// product rounded before the add (as the CPU backend computes it).
__global__ void moe_combine_kernel(const float* __restrict__ y, const int32_t* __restrict__ rows,
                                   const float* __restrict__ w, int64_t k, int64_t dim, int64_t count,
                                   float* __restrict__ out) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / dim, d = e % dim;
    float acc = 0.0f;
    for (int64_t j = 0; j < k; ++j)
      acc = __fadd_rn(acc, __fmul_rn(w[r * k + j], y[int64_t(rows[r * k + j]) * dim + d]));
    out[e] = acc;
  }
}

// All ops are queued on one blocking stream and return without waiting;
// upload/download/sync/free wait for it. Not safe to call from two threads at
// once (the row staging ring is per backend); use one backend per thread.
class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const cudaDeviceProp& prop) : device_(device) {
    sm_count_ = prop.multiProcessorCount;
    isa_ = "sm_" + std::to_string(prop.major) + std::to_string(prop.minor);
    // TF32 mma needs sm_80; the choice holds for the backend's life, so every
    // matmul of this backend runs one kernel whatever its n.
    tensor_cores_ = prop.major >= 8 && !cuda_fma_matmul();
    CLEAVE_CUDA_CHECK(cudaSetDevice(device_));
    // A blocking stream: work on the legacy default stream (cudaMemcpy,
    // events recorded on stream 0) stays ordered with it.
    CLEAVE_CUDA_CHECK(cudaStreamCreate(&stream_));
  }
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  Caps caps() const override {
    Caps c;
    c.name = "cuda";
    c.isa = isa_;
    c.threads = sm_count_;
    c.host_memory = false;
    c.shareable = true;
    return c;
  }
  // The KV kernels store and read F32, F16, Q8_0 and Q4_0 caches (the CPU's).
  bool supports(Op op, DType t) const override {
    if (op == Op::kv_write || op == Op::attention) return kv_dtype_known(uint32_t(t));
    return dtype_known(static_cast<uint32_t>(t));
  }

  // nullptr when the device is out of memory; any other error aborts.
  void* alloc(size_t bytes) override {
    use();
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;
    }
    CLEAVE_CUDA_CHECK(err);
    return p;
  }
  void free(void* ptr) override {
    if (!ptr) return;
    use();
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    CLEAVE_CUDA_CHECK(cudaFree(ptr));
  }
  // nullptr when out of (page-lockable) host memory; any other error aborts.
  void* alloc_pinned_host(size_t bytes) override {
    use();
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;
    }
    CLEAVE_CUDA_CHECK(err);
    return p;
  }
  void free_pinned_host(void* ptr) override {
    if (!ptr) return;
    use();
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));  // no copy may still read it
    CLEAVE_CUDA_CHECK(cudaFreeHost(ptr));
  }
  Result<SharedRegion> alloc_shared(size_t bytes) override { return cuda::ipc_alloc(device_, bytes); }
  void free_shared(const SharedRegion& region) override { cuda::ipc_free(device_, region); }
  Result<const void*> open_shared(const std::string& handle, size_t bytes) override {
    return cuda::ipc_open(device_, handle, bytes);
  }
  void close_shared(const void* data, size_t bytes) override {
    (void)bytes;
    cuda::ipc_close(device_, data);
  }
  Result<std::string> new_link_id() override { return cuda::nccl_link_id(); }
  Result<std::unique_ptr<DeviceLink>> open_link(const std::string& id, int rank, double timeout_s) override {
    return cuda::nccl_open_link(device_, id, rank, timeout_s);
  }
  Status checksum_blocks(const void* data, size_t block_bytes, int64_t n, uint64_t* out) override {
    use();
    cuda::checksum_blocks(data, block_bytes, n, out, stream_);
    return Status::Ok();
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use();
    CLEAVE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use();
    CLEAVE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void sync() override {
    use();
    CLEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void matmul(const WeightView& w, const float* x, int64_t n, float* y) override {
    if (n <= 0 || w.rows <= 0) return;
    use();
    if (w.cols <= 0) {
      CLEAVE_CUDA_CHECK(cudaMemsetAsync(y, 0, size_t(n * w.rows) * sizeof(float), stream_));
      return;
    }
    if (tensor_cores_)
      cuda::launch_matmul_tc(w, x, n, y, sm_count_, stream_);
    else
      cuda::launch_matmul(w, x, n, y, sm_count_, stream_);
  }

  void rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps,
               float* y) override {
    if (n <= 0 || dim <= 0) return;
    use();
    rmsnorm_kernel<<<grid1d(n), kRowThreads, 0, stream_>>>(x, weight, dim, eps, y);
    CLEAVE_CUDA_CHECK_LAUNCH("rmsnorm_kernel");
  }

  void rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim, const int32_t* positions,
            float freq_base) override {
    const int64_t total = n * n_heads * (head_dim / 2);
    if (total <= 0) return;
    use();
    rope_kernel<<<grid_for(total, 256, sm_count_ * 16), 256, 0, stream_>>>(
        x, n, n_heads, head_dim, positions, std::log(double(freq_base)));
    CLEAVE_CUDA_CHECK_LAUNCH("rope_kernel");
  }

  void softmax(float* x, int64_t n, int64_t len) override {
    if (n <= 0 || len <= 0) return;
    use();
    softmax_kernel<<<grid1d(n), kRowThreads, 0, stream_>>>(x, len);
    CLEAVE_CUDA_CHECK_LAUNCH("softmax_kernel");
  }

  void silu_mul(const float* gate, const float* up, int64_t count, float* out) override {
    if (count <= 0) return;
    use();
    silu_mul_kernel<<<grid_for(count, 256, sm_count_ * 16), 256, 0, stream_>>>(gate, up, count,
                                                                               out);
    CLEAVE_CUDA_CHECK_LAUNCH("silu_mul_kernel");
  }

  void layer_norm(const float* x, const float* w, const float* b, int64_t n, int64_t dim,
                  float eps, float* y) override {
    if (n <= 0 || dim <= 0) return;
    use();
    cuda::launch_layer_norm(x, w, b, grid1d(n), dim, eps, y, stream_);
  }

  void gelu(const float* x, int64_t count, Gelu kind, float* y) override {
    if (count <= 0) return;
    use();
    cuda::launch_gelu(x, count, kind == Gelu::tanh, y, sm_count_, stream_);
  }

  void add(const float* a, const float* b, int64_t count, int64_t period, float* y) override {
    if (count <= 0) return;
    if (period <= 0 || count % period != 0) fail("add: count is not a multiple of period");
    use();
    cuda::launch_add(a, b, count, period, y, sm_count_, stream_);
  }

  void full_attention(const float* q, const float* k, const float* v, int64_t n_seq, int64_t T,
                      int64_t n_heads, int64_t head_dim, int64_t ld, float scale, float* out) override {
    if (n_seq <= 0 || T <= 0 || n_heads <= 0) return;
    // The scores of a row live in shared memory (48 KiB without opting in).
    if (T > 12000) fail("full_attention: more than 12000 rows per sequence");
    if (n_seq * T * n_heads > 0x7fffffff) fail("full_attention: too many (row, head) blocks for one launch");
    use();
    cuda::launch_full_attention(q, k, v, n_seq, T, n_heads, head_dim, ld, scale, out, stream_);
  }

  void moe_combine(const float* y, const int32_t* rows, const float* w, int64_t n, int64_t k,
                   int64_t dim, float* out) override {
    if (n <= 0 || dim <= 0) return;
    use();
    const int64_t count = n * dim;
    moe_combine_kernel<<<unsigned(std::min<int64_t>((count + 255) / 256, 65535)), 256, 0, stream_>>>(
        y, rows, w, k, dim, count, out);
    CLEAVE_CUDA_CHECK_LAUNCH("moe_combine_kernel");
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use();
    CLEAVE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }

  void embed(const WeightView& table, const int32_t* ids, int64_t n, float* out) override {
    if (n <= 0 || table.cols <= 0) return;
    use();
    check_type(table.type);
    embed_kernel<<<grid1d(n), 256, 0, stream_>>>(table.type,
                                                  static_cast<const uint8_t*>(table.data),
                                                  table.row_bytes, table.cols, ids, out);
    CLEAVE_CUDA_CHECK_LAUNCH("embed_kernel");
  }

  void topk_gating(const float* logits, int64_t n, int64_t n_expert, int64_t k, int32_t* ids,
                   float* weights) override {
    if (n <= 0 || k <= 0) return;
    if (k > n_expert) fail("topk_gating: k > n_expert");
    use();
    topk_gating_kernel<<<unsigned((n + 127) / 128), 128, 0, stream_>>>(logits, n, n_expert, k,
                                                                        ids, weights);
    CLEAVE_CUDA_CHECK_LAUNCH("topk_gating_kernel");
  }

  void kv_write(const PagedKv& kv, int32_t layer, const float* k, const float* v,
                const AttnRow* rows, int64_t n) override {
    if (n <= 0) return;
    check_kv(kv, "kv_write");
    use();
    const int threads = kv.head_dim >= 256 ? 256 : ((kv.head_dim + 31) / 32) * 32;
    kv_write_kernel<<<dim3(unsigned(n), unsigned(kv.n_kv_heads)), threads, 0, stream_>>>(
        to_dev(kv), layer, k, v, rows);
    CLEAVE_CUDA_CHECK_LAUNCH("kv_write_kernel");
  }

  void attention(const PagedKv& kv, int32_t layer, const float* q, const AttnRow* rows, int64_t n,
                 int32_t n_heads, float scale, float* out) override {
    if (n <= 0 || n_heads <= 0) return;
    if (kv.n_kv_heads <= 0 || n_heads % kv.n_kv_heads != 0)
      fail("attention: n_heads is not a multiple of n_kv_heads");
    check_kv(kv, "attention");
    use();
    const size_t smem = (size_t(2) * kv.head_dim + size_t(2) * kv.block_size) * sizeof(float);
    if (smem > 48 * 1024) fail("attention: head_dim/block_size too large for shared memory");
    attention_kernel<<<dim3(unsigned(n), unsigned(n_heads)), kAttnThreads, smem, stream_>>>(
        to_dev(kv), layer, q, rows, n_heads, scale, out);
    CLEAVE_CUDA_CHECK_LAUNCH("attention_kernel");
  }

 private:
  void use() const { CLEAVE_CUDA_CHECK(cudaSetDevice(device_)); }

  static unsigned grid1d(int64_t n) {
    if (n > 0x7fffffff) fail("too many rows for one launch");
    return unsigned(n);
  }

  static void check_kv(const PagedKv& kv, const char* op) {
    for (DType t : {kv.k_type, kv.v_type}) {
      if (!kv_dtype_known(uint32_t(t)))
        fail((std::string(op) + ": a KV cache type the cuda backend does not store").c_str());
      if ((t == DType::Q8_0 || t == DType::Q4_0) && kv.head_dim % 32 != 0)
        fail((std::string(op) + ": a Q8_0 or Q4_0 KV cache needs head_dim a multiple of 32").c_str());
    }
  }

  static void check_type(DType t) {
    if (!dtype_known(static_cast<uint32_t>(t))) fail("unknown weight type");
  }

  int device_ = 0;
  int sm_count_ = 0;
  bool tensor_cores_ = false;
  std::string isa_;
  cudaStream_t stream_ = nullptr;
};

std::string cuda_error(const char* call, cudaError_t err) {
  return std::string(call) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

}  // namespace

Result<std::unique_ptr<Backend>> make_cuda_backend(int device) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear, so later CUDA calls do not see it
    // "No GPU" only when there is none (or no driver); anything else is a
    // broken CUDA install or device, and says so.
    const bool none = err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver;
    return Status(Code::unavailable, std::string("cuda backend: ") +
                                         (none ? "no GPU: " : "CUDA start-up failed: ") +
                                         cuda_error("cudaGetDeviceCount", err));
  }
  if (count <= 0) return Status(Code::unavailable, "cuda backend: no GPU: device count is 0");
  if (device < 0 || device >= count)
    return Status(Code::invalid_argument, "cuda backend: device " + std::to_string(device) +
                                              " out of range (" + std::to_string(count) +
                                              " devices)");
  err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status(Code::unavailable, "cuda backend: " + cuda_error("cudaSetDevice", err));
  }
  cudaDeviceProp prop;
  std::memset(&prop, 0, sizeof(prop));
  err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status(Code::unavailable,
                  "cuda backend: " + cuda_error("cudaGetDeviceProperties", err));
  }
  return std::unique_ptr<Backend>(new CudaBackend(device, prop));
}

}  // namespace cleave
