// The engine on the GPU (EngineOptions::device = "cuda:0"): its logits
// against the CPU engine's within a stated bound, greedy tokens equal where
// the margin allows, batch invariance bit for bit on the GPU, and decode
// throughput at batch 1 and 32 beside the measured device bandwidth.
// Without a GPU every case prints "SKIPPED: no GPU" and returns; the same
// code path runs on the CPU in tests/model/test_engine_device.cpp (a fenced
// backend), so what is left to these cases is the CUDA kernels under it.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "kernels/device_testing.h"
#include "model/clip.h"
#include "tests/cuda/gpu.h"
#include "tests/model/model_fixtures.h"

#ifdef CLEAVE_HAVE_CUDA
#include "kernels/cuda/matmul.h"
#endif

using namespace cleave;
using namespace cleave::fixtures;
using cleave::gpu_test::gpu_or_skip;

namespace {

EngineOptions on(const char* device, int32_t max_seqs = 4) {
  EngineOptions o;
  o.threads = 4;
  o.max_seqs = max_seqs;
  o.device = device;
  return o;
}

int32_t argmax(const float* v, int32_t n) { return int32_t(std::max_element(v, v + n) - v); }

// The largest logit minus the second.
float margin(const float* v, int32_t n) {
  float a = -INFINITY, b = -INFINITY;
  for (int32_t i = 0; i < n; ++i) {
    if (v[i] > a) b = a, a = v[i];
    else if (v[i] > b) b = v[i];
  }
  return a - b;
}

ModelSpec gpu_spec(DType t) {
  ModelSpec s;
  s.dim = 256; s.n_layers = 4; s.n_heads = 8; s.n_kv_heads = 4; s.ffn = 512; s.context = 512;
  s.type = t;
  return s;
}

struct Agreement {
  double worst = 0;  // max |gpu - cpu| / (1 + max |cpu logit|)
  int compared = 0, equal = 0, close_calls = 0;
};

// `steps` teacher-forced steps from the logits in lc / lg (the GPU is fed
// the CPU's greedy token so the rows stay comparable): at each, |gpu - cpu|
// <= rel (1 + max |cpu logit|), and the greedy tokens equal wherever the
// CPU's top-2 margin exceeds twice that bound.
Agreement teacher_forced(Engine& cpu, int32_t sc, Engine& gpu, int32_t sg, std::vector<float>& lc,
                         std::vector<float>& lg, float rel, int steps) {
  const int32_t V = int32_t(lc.size());
  Agreement a;
  for (int step = 0; step < steps; ++step) {
    float scale = 0, diff = 0;
    for (int32_t i = 0; i < V; ++i) {
      scale = std::max(scale, std::fabs(lc[size_t(i)]));
      diff = std::max(diff, std::fabs(lc[size_t(i)] - lg[size_t(i)]));
    }
    const float bound = rel * (1 + scale);
    CHECK(diff <= bound);
    a.worst = std::max(a.worst, double(diff / (1 + scale)));
    const int32_t tok = argmax(lc.data(), V);
    if (margin(lc.data(), V) > 2 * bound) {
      ++a.compared;
      a.equal += argmax(lg.data(), V) == tok;
      CHECK(argmax(lg.data(), V) == tok);
    } else {
      ++a.close_calls;
    }
    REQUIRE(cpu.forward({{sc, &tok, 1}}, lc.data()).ok());
    REQUIRE(gpu.forward({{sg, &tok, 1}}, lg.data()).ok());
  }
  return a;
}

}  // namespace

// Bound: both backends compute every dot product in float32, in different
// orders (the GPU's fixed per-row trees or tensor-core chunks against the
// CPU's one chain over k; the tensor cores' 3xTF32 split adds at most
// 2^-21 sum|x_k w_k|, kernels/cuda/mma_tf32.cuh). Each differs from the
// exact sum by at most about K * eps * sum|x_k w_k| (K <= 512 here: ~3e-5
// of the magnitudes); through 4 layers of 7 matmuls,
// two norms and the attention softmax the difference stays well under
// 1e-3 of the logits' scale on these random models. Asserted:
// |gpu - cpu| <= 1e-3 * (1 + max |cpu logit|) at every step, with the
// GPU fed the CPU's tokens (teacher forcing) so the rows stay comparable,
// and the greedy token equal wherever the CPU's top-2 margin exceeds twice
// that bound.
TEST_CASE("cuda engine: logits against the CPU engine, greedy tokens where the margin allows") {
  if (!gpu_or_skip()) return;
  for (DType t : {DType::F32, DType::F16, DType::Q8_0}) {
    CAPTURE(dtype_name(t));
    const std::string path = model_path(gpu_spec(t), std::string("gpu-") + dtype_name(t));
    auto cpu = make_engine(path, on("cpu"));
    auto gpu = make_engine(path, on("cuda:0"));
    const int32_t V = cpu->config().n_vocab;
    const int32_t sc = *cpu->open_sequence(), sg = *gpu->open_sequence();
    const auto prompt = prompt_of(100, 7);
    std::vector<float> lc(static_cast<size_t>(V)), lg(static_cast<size_t>(V));
    REQUIRE(cpu->forward({{sc, prompt.data(), 100}}, lc.data()).ok());
    REQUIRE(gpu->forward({{sg, prompt.data(), 100}}, lg.data()).ok());
    const Agreement a = teacher_forced(*cpu, sc, *gpu, sg, lc, lg, 1e-3f, 32);
    std::printf("cuda engine %s: max |gpu - cpu| / (1 + max|logit|) = %.2e over 32 steps; greedy equal %d/%d "
                "(%d steps inside the margin)\n",
                dtype_name(t), a.worst, a.equal, a.compared, a.close_calls);
  }
}

// F16 and Q8_0 KV caches (F16 weights): both engines store K and V rounded
// from their own float32 rows, which differ by the bound above, so a value
// near a rounding boundary may land one step apart: half an F16 ulp (2^-11
// of the value) or one Q8_0 step (1/127 of its 32-block's largest value).
// One such step moves a score or an output by at most that much of one
// term; the bounds below allow it: 2e-3 (F16 KV) and 1e-2 (Q8_0 KV) of
// (1 + max |cpu logit|), with greedy tokens equal where the CPU's margin
// exceeds twice the bound.
TEST_CASE("cuda engine: F16 and Q8_0 KV caches against the CPU engine's") {
  if (!gpu_or_skip()) return;
  const std::string path = model_path(gpu_spec(DType::F16), "gpu-F16");
  for (DType kv : {DType::F16, DType::Q8_0}) {
    CAPTURE(dtype_name(kv));
    EngineOptions oc = on("cpu"), og = on("cuda:0");
    oc.cache_type_k = oc.cache_type_v = og.cache_type_k = og.cache_type_v = kv;
    auto cpu = make_engine(path, oc);
    auto gpu = make_engine(path, og);
    const int32_t V = cpu->config().n_vocab;
    const int32_t sc = *cpu->open_sequence(), sg = *gpu->open_sequence();
    const auto prompt = prompt_of(100, 9);
    std::vector<float> lc(static_cast<size_t>(V)), lg(static_cast<size_t>(V));
    REQUIRE(cpu->forward({{sc, prompt.data(), 100}}, lc.data()).ok());
    REQUIRE(gpu->forward({{sg, prompt.data(), 100}}, lg.data()).ok());
    const Agreement a = teacher_forced(*cpu, sc, *gpu, sg, lc, lg, kv == DType::F16 ? 2e-3f : 1e-2f, 32);
    std::printf("cuda engine, %s KV: max |gpu - cpu| / (1 + max|logit|) = %.2e over 32 steps; greedy equal %d/%d\n",
                dtype_name(kv), a.worst, a.equal, a.compared);
  }
}

TEST_CASE("cuda engine: a row's bits do not depend on the batch or on chunked prefill") {
  if (!gpu_or_skip()) return;
  const std::string path = model_path(gpu_spec(DType::F16), "gpu-F16");
  auto one = make_engine(path, on("cuda:0"));
  auto many = make_engine(path, on("cuda:0"));
  const int32_t V = one->config().n_vocab;
  const std::vector<std::vector<int32_t>> prompts = {prompt_of(5, 2), prompt_of(70, 3), prompt_of(33, 4)};
  // Alone, whole prompts.
  std::vector<std::vector<float>> alone;
  for (const auto& p : prompts) {
    const int32_t s = *one->open_sequence();
    std::vector<float> lg(static_cast<size_t>(V));
    REQUIRE(one->forward({{s, p.data(), int32_t(p.size())}}, lg.data()).ok());
    for (int32_t t = 100; t < 104; ++t) REQUIRE(one->forward({{s, &t, 1}}, lg.data()).ok());
    alone.push_back(lg);
    one->close_sequence(s);
  }
  // Together: the long prompt in chunks of 16 beside the others, then
  // decode steps of all three in shuffled order.
  std::vector<int32_t> s;
  for (size_t i = 0; i < prompts.size(); ++i) s.push_back(*many->open_sequence());
  std::vector<float> lg(3 * size_t(V));
  REQUIRE(many->forward({{s[2], prompts[2].data(), 33}, {s[0], prompts[0].data(), 5},
                         {s[1], prompts[1].data(), 16}}, lg.data()).ok());
  for (int32_t at = 16; at < 70; at += 16)
    REQUIRE(many->forward({{s[1], prompts[1].data() + at, std::min(16, 70 - at)}}, lg.data()).ok());
  for (int32_t t = 100; t < 104; ++t)
    REQUIRE(many->forward({{s[(t + 1) % 3], &t, 1}, {s[t % 3], &t, 1}, {s[(t + 2) % 3], &t, 1}},
                          lg.data()).ok());
  // The last step's rows are in the order s[2], s[1], s[0] (t = 103).
  const int order[3] = {2, 1, 0};
  for (int j = 0; j < 3; ++j)
    CHECK(std::memcmp(lg.data() + size_t(j) * size_t(V), alone[size_t(order[j])].data(),
                      size_t(V) * sizeof(float)) == 0);
}

TEST_CASE("cuda engine: KV blocks exported into device memory import into another engine on the GPU") {
  if (!gpu_or_skip()) return;
  const std::string path = model_path(gpu_spec(DType::F16), "gpu-F16");
  auto src = make_engine(path, on("cuda:0"));
  auto dst = make_engine(path, on("cuda:0"));
  const int32_t V = src->config().n_vocab;
  const auto p = prompt_of(70, 6);  // 4 full blocks and 6 tokens
  const int32_t a = *src->open_sequence();
  std::vector<float> lg(static_cast<size_t>(V)), want(static_cast<size_t>(V)), got(static_cast<size_t>(V));
  REQUIRE(src->forward({{a, p.data(), 70}}, lg.data()).ok());
  auto host = src->export_blocks(a);  // through the host, hashed there
  REQUIRE(host.ok());
  const size_t n = host->size(), bb = host->front().bytes.size();
  Backend& sb = src->backend();
  void* out = sb.alloc(n * bb);
  REQUIRE(out != nullptr);
  std::vector<BlockHeader> headers;
  Status st = src->export_blocks_to(a, 0, out, headers);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  REQUIRE(headers.size() == n);
  // The device XXH3 against the host's, over the same bytes.
  for (size_t i = 0; i < n; ++i) CHECK(headers[i].checksum == (*host)[i].header.checksum);
  // One process, one GPU: the other engine's backend copies device to device.
  Backend& db = dst->backend();
  void* in = db.alloc(n * bb);
  REQUIRE(in != nullptr);
  db.copy(in, out, n * bb);
  db.sync();
  const int32_t b = *dst->open_sequence();
  uint8_t byte = 0, flipped = 0;
  db.download(&byte, static_cast<uint8_t*>(in) + bb + 7, 1);
  flipped = uint8_t(byte ^ 1);
  db.upload(static_cast<uint8_t*>(in) + bb + 7, &flipped, 1);
  CHECK(dst->import_blocks_from(b, p.data(), 70, headers, in).code() == Code::corruption);
  CHECK(dst->sequence_length(b) == 0);
  db.upload(static_cast<uint8_t*>(in) + bb + 7, &byte, 1);
  st = dst->import_blocks_from(b, p.data(), 70, headers, in);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  for (int32_t t = 200; t < 204; ++t) {
    REQUIRE(src->forward({{a, &t, 1}}, want.data()).ok());
    REQUIRE(dst->forward({{b, &t, 1}}, got.data()).ok());
    CHECK(std::memcmp(want.data(), got.data(), static_cast<size_t>(V) * sizeof(float)) == 0);
  }
  sb.free(out);
  db.free(in);
}

// Decode throughput on the 100M GQA F16 shape at batch 1 and 32, beside the
// device-to-device copy bandwidth measured in the same run: the batch-1
// roofline is the weight bytes per token over that bandwidth (goal: 70 %).
TEST_CASE("cuda engine benchmark: decode at batch 1 and 32") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
#ifdef CLEAVE_HAVE_CUDA
  const size_t bytes = size_t(1) << 30;
  void* a = gpu->alloc(bytes);
  void* b = gpu->alloc(bytes);
  REQUIRE((a && b));
  cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaDeviceSynchronize();
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  gpu->free(a);
  gpu->free(b);
  const double bw = 2.0 * double(bytes) / best;  // read + write
  ModelSpec spec;
  spec.dim = 768; spec.n_layers = 12; spec.n_heads = 12; spec.n_kv_heads = 4; spec.ffn = 2048;
  spec.context = 512; spec.type = DType::F16;
  const std::string path = model_path(spec, "gpu-100m-f16");
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const double mma_peak = cuda::measure_tf32_mma_peak(prop.multiProcessorCount, 0);
  std::printf("\ncuda engine benchmark (100M GQA F16, 128-token prompts, 64 decode steps)\n"
              "  d2d memcpy (read+write) %.0f GB/s, TF32 mma peak %.0f GFLOP/s\n", bw / 1e9,
              mma_peak / 1e9);
  // Each matmul path (kernels/cuda/matmul.h) for the whole run of an engine.
  for (bool fma : {false, true})
  for (int32_t batch : {1, 32}) {
    set_cuda_fma_matmul(fma);
    auto e = make_engine(path, on("cuda:0", batch));
    set_cuda_fma_matmul(false);
    const int32_t V = e->config().n_vocab;
    const double weight_bytes = double(e->model().weight_bytes_per_token());
    std::vector<int32_t> seqs;
    std::vector<Engine::Item> items;
    std::vector<std::vector<int32_t>> prompts;
    for (int32_t i = 0; i < batch; ++i) prompts.push_back(prompt_of(128, 10 + i));
    for (int32_t i = 0; i < batch; ++i) {
      seqs.push_back(*e->open_sequence());
      items.push_back({seqs.back(), prompts[size_t(i)].data(), 128});
    }
    std::vector<float> lg(size_t(batch) * size_t(V));
    {
      // One untimed prefill first: the first launches load the kernels.
      const int32_t warm = *e->open_sequence();
      const auto wp = prompt_of(128, 9);
      REQUIRE(e->forward({{warm, wp.data(), 128}}, lg.data()).ok());
      e->close_sequence(warm);
    }
    const auto p0 = std::chrono::steady_clock::now();
    REQUIRE(e->forward(items, lg.data()).ok());
    const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
    // 2 FLOPs per weight (F16: 2 bytes) and prompt token, attention aside.
    const double prefill_flops = 2.0 * (weight_bytes / 2) * 128.0 * batch / prefill_s;
    std::vector<int32_t> toks(size_t(batch), 0);
    const auto t0 = std::chrono::steady_clock::now();
    for (int step = 0; step < 64; ++step) {
      for (int32_t i = 0; i < batch; ++i) {
        toks[size_t(i)] = argmax(lg.data() + size_t(i) * size_t(V), V);
        items[size_t(i)] = {seqs[size_t(i)], &toks[size_t(i)], 1};
      }
      REQUIRE(e->forward(items, lg.data()).ok());
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tok_s = 64.0 * batch / s;
    const double roofline = bw / weight_bytes * batch;  // weights read once per step
    std::printf("  %-6s batch %2d: %8.0f tok/s, %.2f ms per step; weights at the copy bandwidth: %.0f tok/s (%.0f %%); "
                "prefill %.0f GFLOP/s (%.1f %% of the TF32 peak)\n",
                fma ? "fma" : "tensor", batch, tok_s, s / 64 * 1e3, roofline, 100.0 * tok_s / roofline,
                prefill_flops / 1e9, 100.0 * prefill_flops / mma_peak);
  }
#endif
}

// The vision encoder on the GPU (ClipModel::on): features against the CPU's
// within 1e-4 of their scale (float32 sums of other orders through 2 blocks
// and the projector), and an image's bits alone equal its bits in a batch.
TEST_CASE("cuda clip: features against the CPU, batch invariant on the GPU") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  ClipSpec spec;
  spec.projection_dim = 48;
  spec.mm_hidden = 80;
  const std::string path = "/tmp/cleave_cuda_clip_" + std::to_string(::getpid()) + ".gguf";
  REQUIRE(write_test_clip_model(spec, path).ok());
  auto f = GgufFile::open(path);
  REQUIRE(f.ok());
  auto clip = ClipModel::load(*f);
  REQUIRE(clip.ok());
  const int64_t n = 3;
  std::vector<float> px((*clip)->input_floats() * size_t(n));
  for (size_t i = 0; i < px.size(); ++i) px[i] = float((i * 7919) % 1000) / 250.0f - 2.0f;
  auto cpu = make_cpu_backend(4);
  std::vector<float> want((*clip)->output_floats() * size_t(n)), got(want.size()), one((*clip)->output_floats());
  REQUIRE((*clip)->encode(*cpu, px.data(), n, want.data()).ok());
  auto placed = (*clip)->on(*gpu);
  REQUIRE(placed.ok());
  REQUIRE((*placed)->encode(*gpu, px.data(), n, got.data()).ok());
  float scale = 0, diff = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::fabs(want[i]));
    diff = std::max(diff, std::fabs(want[i] - got[i]));
  }
  CHECK(diff <= 1e-4f * scale);
  std::printf("cuda clip: max |gpu - cpu| = %.2e of a scale %.2e\n", diff, scale);
  REQUIRE((*placed)->encode(*gpu, px.data() + (*clip)->input_floats(), 1, one.data()).ok());
  CHECK(std::memcmp(one.data(), got.data() + one.size(), one.size() * sizeof(float)) == 0);
}
