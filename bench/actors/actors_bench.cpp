// cleave_actors_bench: what the actor pipeline costs and what it buys.
//
//   1. Messaging overhead per decode step: median time between a request's
//      consecutive tokens (TPOT) in pd (prefill actor -> KV store -> decode
//      actor, every message Cap'n Proto) against mono (the same Scheduler on
//      a thread, no actors), at batch 1 and 32. Target: <= 3%.
//   2. Continuous batching: generated tokens/s with 32 concurrent streams
//      against one stream through a colocated actor. Target: >= 6x. The
//      physical limit beside it: batch-1 decode is bound by weight bandwidth,
//      so 32 streams can at most approach 32x until compute (FMA peak) binds.
//   3. TTFT and TPOT percentiles for a mixed load (short and long prompts
//      arriving together), colocated against pd.
//   4. Encoder disaggregation: TTFT percentiles for a mixed text and image
//      load, images encoded inline before prefill (mono) against
//      vision_encoder actors (E/P/D = pd + encoders, and colocated +
//      encoders), beside FMA peak (the encoder is compute-bound).
//   5. Attention/FFN disaggregation: decode tokens/s at batch 1, 8 and 32
//      on the 100M MoE shape, the engine computing its experts against 2
//      in-process expert hosts and 2 expert actors, beside the batch-1
//      decode limit (weight bytes per token / read bandwidth), and the mean
//      time of one layer's expert dispatch.
//
// Models are made on the spot (deterministic weights, the committed Llama-2
// vocabulary). Prints a table, and JSON with --json.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "actors/pipeline.h"
#include "bench/limits.h"
#include "kernels/backend.h"
#include "model/experts.h"
#include "model/llama.h"
#include "model/make_model.h"
#include "model/multimodal.h"

using namespace cleave;
using Clock = std::chrono::steady_clock;

namespace {

[[noreturn]] void die(const Status& st) {
  std::fprintf(stderr, "cleave_actors_bench: %s\n", st.to_string().c_str());
  std::exit(1);
}
template <class T>
T unwrap(Result<T> r) {
  if (!r.ok()) die(r.status());
  return std::move(*r);
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, size_t(p / 100.0 * double(v.size() - 1) + 0.5));
  return v[i];
}

// Token arrival times of every request in one run.
struct Trace {
  double wall_seconds = 0;
  int64_t tokens = 0;
  std::vector<double> ttft;  // seconds, per request
  std::map<uint64_t, double> ttft_of;  // by request id
  std::vector<double> tpot;  // seconds between consecutive tokens, all requests
  std::vector<msg::Stats> stats;  // every actor's counters at the end
};

Trace run_load(const std::shared_ptr<const GgufFile>& file,
               const std::shared_ptr<const Tokenizer>& tok, const PipelineOptions& options,
               const std::vector<GenerateRequest>& requests) {
  auto pipeline = unwrap(Pipeline::create(file, tok, options));
  std::mutex mu;
  std::map<uint64_t, std::vector<Clock::time_point>> arrivals;
  size_t done = 0;
  std::condition_variable cv;
  Status failure;
  const auto t0 = Clock::now();
  for (const auto& r : requests) {
    Status st = pipeline->submit(r, [&, id = r.request_id](const msg::StreamEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (e.kind == msg::StreamEvent::Kind::token) arrivals[id].push_back(Clock::now());
      if (e.kind == msg::StreamEvent::Kind::failed && failure.ok()) failure = e.error;
      if (e.kind != msg::StreamEvent::Kind::token && ++done == requests.size()) cv.notify_all();
    });
    if (!st.ok()) die(st);
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done == requests.size(); });
  if (!failure.ok()) die(failure);
  Trace t;
  t.wall_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  lock.unlock();
  t.stats = pipeline->stats();
  for (auto& [id, times] : arrivals) {
    t.tokens += int64_t(times.size());
    if (!times.empty()) t.ttft.push_back(std::chrono::duration<double>(times[0] - t0).count());
    if (!times.empty()) t.ttft_of[id] = t.ttft.back();
    for (size_t i = 1; i < times.size(); ++i)
      t.tpot.push_back(std::chrono::duration<double>(times[i] - times[i - 1]).count());
  }
  return t;
}

std::vector<GenerateRequest> uniform_requests(int n, int prompt_len, int max_tokens,
                                              int32_t n_vocab, uint64_t first_id) {
  std::vector<GenerateRequest> out;
  for (int i = 0; i < n; ++i) {
    GenerateRequest r;
    r.request_id = first_id + uint64_t(i);
    for (int t = 0; t < prompt_len; ++t) r.prompt.push_back(1 + (i * 7919 + t * 104729) % (n_vocab - 1));
    r.sampling.temperature = 0;
    r.sampling.max_tokens = max_tokens;
    r.ignore_eos = true;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cleave actor pipeline benchmark"};
  std::string workdir = "/tmp/cleave_actors_bench";
  std::string vocab = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  int steps = 64;
  int only = 0;
  bool json = false, limits = false;
  std::string limits_model;
  app.add_option("--workdir", workdir, "where the test model is written");
  app.add_option("--vocab", vocab, "GGUF vocabulary for the test model");
  app.add_option("-t,--threads", threads, "threads per engine");
  app.add_option("--steps", steps, "decode steps per request");
  app.add_flag("--json", json, "print JSON instead of tables");
  app.add_option("--only", only, "run only this section (1-5; 0: all)")->check(CLI::Range(0, 5));
  app.add_flag("--limits", limits,
               "print the read bandwidth and FMA peak of -t threads as JSON and exit (for the scripts "
               "that measure processes, e.g. experts_nodes.py)");
  app.add_option("--limits-model", limits_model, "with --limits: also the weight bytes one token reads of this GGUF")
      ->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);

  std::filesystem::create_directories(workdir);
  auto make_model = [&](DType type) {  // the 15M demo shape
    ModelSpec spec;
    spec.dim = 288, spec.n_layers = 6, spec.n_heads = 6, spec.n_kv_heads = 6, spec.ffn = 768;
    spec.context = 1024, spec.type = type, spec.seed = 7;
    const std::string path = workdir + "/bench-15m-" + dtype_name(type) + ".gguf";
    if (!std::filesystem::exists(path)) {
      Status st = write_test_model(spec, vocab, path);
      if (!st.ok()) die(st);
    }
    return path;
  };
  auto file = unwrap(GgufFile::open(make_model(DType::F16)));
  std::shared_ptr<const Tokenizer> tok = unwrap(Tokenizer::from_gguf(*file));
  const int32_t n_vocab = tok->n_vocab();

  PipelineOptions base;
  base.engine.threads = threads;
  base.engine.max_seqs = 64;
  base.engine.context = 1024;
  base.scheduler.max_batch_tokens = 512;
  nlohmann::json out;

  // 1. Messaging overhead per decode step.
  if (only == 0 || only == 1) {
  std::printf("1. decode step time (median TPOT), pd vs mono, %d steps, %d threads per engine\n",
              steps, threads);
  std::printf("%-6s %12s %12s %10s\n", "batch", "mono ms", "pd ms", "overhead");
  for (int batch : {1, 32}) {
    auto reqs = uniform_requests(batch, 16, steps, n_vocab, 1000);
    PipelineOptions mono = base, pd = base;
    mono.topology = Topology::mono;
    pd.topology = Topology::pd;
    double m = 1e9, p = 1e9;
    for (int rep = 0; rep < 3; ++rep) {  // best of 3 medians: the VM is noisy
      m = std::min(m, percentile(run_load(file, tok, mono, reqs).tpot, 50));
      p = std::min(p, percentile(run_load(file, tok, pd, reqs).tpot, 50));
    }
    const double overhead = (p - m) / m * 100;
    std::printf("%-6d %12.3f %12.3f %9.1f%%\n", batch, m * 1e3, p * 1e3, overhead);
    out["step_overhead"].push_back(
        {{"batch", batch}, {"mono_ms", m * 1e3}, {"pd_ms", p * 1e3}, {"overhead_pct", overhead}});
  }
  }

  // 2. Continuous batching throughput, beside its roofline ceiling: one
  // stream reads every weight per token (bandwidth-bound); 32 streams share
  // that read until FMA throughput binds. The ceiling is
  // 32 * t(1) / t(32) with t(n) = max(weight bytes / bandwidth,
  // n * 2 * matrix elements / FMA peak), both limits measured here.
  const Isa isa = detect_isa();
  const double bw = bench::read_bandwidth(512ull << 20, threads, 10);
  const double peak = isa == Isa::scalar ? 0 : bench::fma_peak_gflops(isa, threads);
  if (limits) {
    nlohmann::json l = {{"read_bandwidth_GBs", bw}, {"fma_peak_GFLOPs", peak}, {"threads", threads}};
    if (!limits_model.empty())
      l["weight_bytes_per_token"] =
          unwrap(LlamaModel::load(unwrap(GgufFile::open(limits_model))))->weight_bytes_per_token();
    std::printf("%s\n", l.dump().c_str());
    return 0;
  }
  if (only == 0 || only == 2) {
  std::printf("\n2. continuous batching, colocated actor: generated tokens/s (%d threads: "
              "read bandwidth %.1f GB/s, FP32 FMA peak %.1f GFLOP/s)\n",
              threads, bw, peak);
  std::printf("%-6s %12s %12s %8s %10s\n", "type", "1 stream", "32 streams", "ratio", "ceiling");
  for (DType type : {DType::F16, DType::F32}) {
    auto f = type == DType::F16 ? file : unwrap(GgufFile::open(make_model(DType::F32)));
    double elems = 0, bytes = 0;
    for (const auto& t : f->tensors()) {
      if (t.name == "token_embd.weight" || t.ne[1] <= 1) continue;  // gathered rows; norms
      elems += double(t.n_elements());
      bytes += double(t.bytes);
    }
    auto t_of = [&](int n) { return std::max(bytes / (bw * 1e9), n * 2 * elems / (peak * 1e9)); };
    const double ceiling = peak > 0 ? 32 * t_of(1) / t_of(32) : 0;
    double tps1 = 0, tps32 = 0;
    for (int streams : {1, 32}) {
      PipelineOptions col = base;
      col.topology = Topology::colocated;
      Trace t = run_load(f, tok, col, uniform_requests(streams, 16, steps, n_vocab, 2000));
      (streams == 1 ? tps1 : tps32) = double(t.tokens) / t.wall_seconds;
      std::fprintf(stderr, "  %s %2d streams: wall %.1f ms, TTFT p50 %.2f ms, TPOT p50 %.3f ms\n",
                   dtype_name(type), streams, t.wall_seconds * 1e3, percentile(t.ttft, 50) * 1e3,
                   percentile(t.tpot, 50) * 1e3);
    }
    std::printf("%-6s %8.1f t/s %8.1f t/s %7.1fx %9.1fx\n", dtype_name(type), tps1, tps32,
                tps32 / tps1, ceiling);
    out["batching"].push_back({{"type", dtype_name(type)}, {"tok_s_1", tps1}, {"tok_s_32", tps32},
                               {"ratio", tps32 / tps1}, {"roofline_ceiling", ceiling},
                               {"read_bandwidth_GBs", bw}, {"fma_peak_GFLOPs", peak}});
  }
  std::printf("  target >= 6x\n");
  }

  // 3. Mixed load: 48 requests, 3 in 4 short prompts (24 tokens), 1 in 4
  // long (384 tokens), all arriving at once.
  if (only == 0 || only == 3) {
  std::printf("\n3. mixed load (48 requests, 25%% long prompts), ms\n");
  std::printf("%-10s %9s %9s %9s %9s %9s\n", "topology", "TTFT p50", "TTFT p90", "TPOT p50",
              "TPOT p90", "TPOT p99");
  std::vector<GenerateRequest> mixed;
  for (int i = 0; i < 48; ++i) {
    auto one = uniform_requests(1, i % 4 == 3 ? 384 : 24, 32, n_vocab, 3000 + uint64_t(i));
    one[0].prefill_chunk = 128;
    mixed.push_back(one[0]);
  }
  for (Topology topo : {Topology::colocated, Topology::pd}) {
    PipelineOptions o = base;
    o.topology = topo;
    Trace t = run_load(file, tok, o, mixed);
    std::printf("%-10s %9.1f %9.1f %9.2f %9.2f %9.2f\n", topology_name(topo),
                percentile(t.ttft, 50) * 1e3, percentile(t.ttft, 90) * 1e3,
                percentile(t.tpot, 50) * 1e3, percentile(t.tpot, 90) * 1e3,
                percentile(t.tpot, 99) * 1e3);
    out["mixed"][topology_name(topo)] = {
        {"ttft_p50_ms", percentile(t.ttft, 50) * 1e3}, {"ttft_p90_ms", percentile(t.ttft, 90) * 1e3},
        {"tpot_p50_ms", percentile(t.tpot, 50) * 1e3}, {"tpot_p90_ms", percentile(t.tpot, 90) * 1e3},
        {"tpot_p99_ms", percentile(t.tpot, 99) * 1e3}};
  }
  }

  // 4. Encoder disaggregation. A CLIP encoder with LLaVA-like proportions
  // at a small scale (224 px, patch 16: 196 image tokens; width 256, 4
  // blocks) projecting into the LM's width; 48 requests arrive at once, half
  // with a distinct image (no cache hits) and half text only (24 tokens).
  if (only == 0 || only == 4) {
    ClipSpec cs;
    cs.image_size = 224, cs.patch_size = 16, cs.dim = 256, cs.n_layers = 4, cs.n_heads = 4;
    cs.ffn = 1024, cs.projection_dim = 288, cs.feature_layer = 4, cs.seed = 3;
    const std::string clip_path = workdir + "/bench-clip-224.gguf";
    if (!std::filesystem::exists(clip_path)) {
      Status st = write_test_clip_model(cs, clip_path);
      if (!st.ok()) die(st);
    }
    auto mmproj = unwrap(GgufFile::open(clip_path));
    auto clip = unwrap(ClipModel::load(mmproj));
    const double clip_gflop =  // per image: the matrices (attention scores are small here)
        2.0 * (double(clip->config().n_positions) *
                   (cs.n_layers * (4.0 * cs.dim * cs.dim + 2.0 * cs.dim * cs.ffn) +
                    3.0 * 16 * 16 * cs.dim) +
               double(clip->config().n_patches) * (cs.dim * 288.0 + 288.0 * 288.0)) / 1e9;
    std::vector<GenerateRequest> load;
    for (int i = 0; i < 48; ++i) {
      GenerateRequest r;
      if (i % 2 == 0) {
        RgbImage im;
        im.width = im.height = 224;
        im.rgb.resize(224 * 224 * 3);
        for (size_t k = 0; k < im.rgb.size(); ++k) im.rgb[k] = uint8_t((k * 2654435761u + i * 97) >> 7);
        r = unwrap(build_image_prompt(*tok, "describe the picture", {im}, clip->config().n_patches));
      } else {
        r = uniform_requests(1, 24, 32, n_vocab, 0)[0];
      }
      r.request_id = 4000 + uint64_t(i);
      r.sampling.temperature = 0;
      r.sampling.max_tokens = 32;
      r.ignore_eos = true;
      r.prefill_chunk = 128;
      load.push_back(std::move(r));
    }
    std::printf("\n4. encoder disaggregation: 48 requests at once, 24 with a 224 px image (196 tokens, "
                "%.2f GFLOP to encode each), 24 text; %d threads per engine and encoder; FP32 FMA "
                "peak %.1f GFLOP/s\n",
                clip_gflop, threads, peak);
    std::printf("%-26s %9s %9s %9s %9s %9s %9s %9s\n", "topology", "TTFT p50", "TTFT p90",
                "image p50", "image p90", "text p50", "text p90", "wall ms");
    struct Case {
      const char* name;
      Topology t;
      int encoders;
    };
    for (Case c : {Case{"mono (encode inline)", Topology::mono, 1},
                   Case{"E/P/D (pd + 1 encoder)", Topology::pd, 1},
                   Case{"colocated + 1 encoder", Topology::colocated, 1}}) {
      PipelineOptions o = base;
      o.topology = c.t;
      o.mmproj = mmproj;
      o.vision_actors = c.encoders;
      o.vision.threads = threads;
      Trace t = run_load(file, tok, o, load);
      std::vector<double> image_ttft, text_ttft;
      for (const auto& r : load)
        (r.images.empty() ? text_ttft : image_ttft).push_back(t.ttft_of.at(r.request_id));
      std::printf("%-26s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f\n", c.name,
                  percentile(t.ttft, 50) * 1e3, percentile(t.ttft, 90) * 1e3,
                  percentile(image_ttft, 50) * 1e3, percentile(image_ttft, 90) * 1e3,
                  percentile(text_ttft, 50) * 1e3, percentile(text_ttft, 90) * 1e3,
                  t.wall_seconds * 1e3);
      out["encoder_disaggregation"][c.name] = {
          {"ttft_p50_ms", percentile(t.ttft, 50) * 1e3}, {"ttft_p90_ms", percentile(t.ttft, 90) * 1e3},
          {"image_ttft_p50_ms", percentile(image_ttft, 50) * 1e3},
          {"image_ttft_p90_ms", percentile(image_ttft, 90) * 1e3},
          {"text_ttft_p50_ms", percentile(text_ttft, 50) * 1e3},
          {"text_ttft_p90_ms", percentile(text_ttft, 90) * 1e3},
          {"wall_ms", t.wall_seconds * 1e3}, {"fma_peak_GFLOPs", peak},
          {"encode_gflop_per_image", clip_gflop}};
    }
  }
  // 5. Attention/FFN disaggregation (100M MoE shape, F16, 16-token prompts):
  // batch / median TPOT; the median of 3 runs and their range.
  if (only == 0 || only == 5) {
    ModelSpec spec;
    spec.dim = 512, spec.n_layers = 6, spec.n_heads = 8, spec.n_kv_heads = 2, spec.ffn = 1024;
    spec.n_experts = 8, spec.n_experts_used = 2, spec.context = 1024, spec.type = DType::F16;
    spec.seed = 9;
    const std::string path = workdir + "/bench-100m-moe-f16.gguf";
    if (!std::filesystem::exists(path)) {
      Status st = write_test_model(spec, vocab, path);
      if (!st.ok()) die(st);
    }
    auto moe = unwrap(GgufFile::open(path));
    const double limit = bw * 1e9 / double(unwrap(LlamaModel::load(moe))->weight_bytes_per_token());
    std::printf("\n5. attention/FFN disaggregation, 100M MoE f16 (8 experts, top-2): decode tok/s, "
                "%d threads per engine and per expert host; batch-1 decode limit %.1f tok/s "
                "(read bandwidth %.1f GB/s)\n",
                threads, limit, bw);
    std::printf("%-30s %20s %20s %20s %18s\n", "where the experts run", "batch 1", "batch 8", "batch 32",
                "layer dispatch us");
    const std::vector<ExpertSet> two = {expert_set({0, 1, 2, 3}), expert_set({4, 5, 6, 7})};
    // One host: attention and the experts each have a core of the two, so
    // ping-pong has idle time to fill (with two hosts all three threads
    // already share two cores).
    const std::vector<ExpertSet> one = {ExpertSet{}};
    struct Case {
      const char* name;
      Topology t;
      std::vector<ExpertSet> experts;
      int32_t micro_batches = 1;
    };
    for (const Case& c : {Case{"mono (the engine)", Topology::mono, {}},
                          Case{"mono + 2 in-process hosts", Topology::mono, two},
                          Case{"mono + 2 hosts, 2 micro-batches", Topology::mono, two, 2},
                          Case{"colocated (the engine)", Topology::colocated, {}},
                          Case{"colocated + 2 expert actors", Topology::colocated, two},
                          Case{"colocated + 2 actors, 2 micro-b.", Topology::colocated, two, 2},
                          Case{"mono + 1 host", Topology::mono, one},
                          Case{"mono + 1 host, 2 micro-batches", Topology::mono, one, 2},
                          Case{"colocated + 1 expert actor", Topology::colocated, one},
                          Case{"colocated + 1 actor, 2 micro-b.", Topology::colocated, one, 2}}) {
      PipelineOptions o = base;
      o.topology = c.t;
      o.experts = c.experts;
      o.engine.expert_micro_batches = c.micro_batches;
      std::printf("%-30s", c.name);
      nlohmann::json row = {{"case", c.name}, {"expert_micro_batches", c.micro_batches},
                            {"decode_limit_tok_s", limit}, {"read_bandwidth_GBs", bw}};
      double dispatch_us = 0, p50_us = 0, p99_us = 0, p50_batch1 = 0, p99_batch1 = 0;
      for (int batch : {1, 8, 32}) {
        std::vector<double> runs;
        for (int rep = 0; rep < 3; ++rep) {
          Trace t = run_load(moe, tok, o, uniform_requests(batch, 16, steps, n_vocab, 5000));
          runs.push_back(batch / percentile(t.tpot, 50));
          uint64_t us = 0, layers = 0;
          for (const msg::Stats& s : t.stats) {
            us += s.get("expert_layer_us");
            layers += s.get("expert_layers");
            if (s.get("expert_layers") > 0) {
              p50_us = double(s.get("expert_layer_p50_us"));
              p99_us = double(s.get("expert_layer_p99_us"));
            }
          }
          if (layers > 0) dispatch_us = double(us) / double(layers);
        }
        if (batch == 1) p50_batch1 = p50_us, p99_batch1 = p99_us;
        std::sort(runs.begin(), runs.end());
        std::printf(" %6.1f (%5.1f-%5.1f)", runs[1], runs[0], runs[2]);
        std::fflush(stdout);
        row["tok_s_batch_" + std::to_string(batch)] = {{"median", runs[1]}, {"min", runs[0]}, {"max", runs[2]}};
      }
      std::printf(" %18.1f   p50/p99 us: batch 1 %.0f/%.0f, batch 32 %.0f/%.0f\n", dispatch_us, p50_batch1,
                  p99_batch1, p50_us, p99_us);
      row["layer_dispatch_us_batch_32"] = dispatch_us;
      row["layer_p50_us"] = {{"batch_1", p50_batch1}, {"batch_32", p50_us}};
      row["layer_p99_us"] = {{"batch_1", p99_batch1}, {"batch_32", p99_us}};
      out["expert_disaggregation"].push_back(row);
    }
  }
  // 5b. Expert balance on a skewed router (router_skew 4: expert 0's logits
  // spread 5x expert 7's): 4 in-process hosts of 2 experts each, 32
  // sequences decoding together straight on the engine; the spread
  // (std dev / mean) of rows and busy time over the hosts, without and with
  // hot-expert replication (max spread 0.1, a decision every 6 layer runs).
  if (only == 0 || only == 5) {
    ModelSpec spec;
    spec.dim = 512, spec.n_layers = 6, spec.n_heads = 8, spec.n_kv_heads = 2, spec.ffn = 1024;
    spec.n_experts = 8, spec.n_experts_used = 2, spec.context = 1024, spec.type = DType::F16;
    spec.seed = 9, spec.router_skew = 4;
    const std::string path = workdir + "/bench-100m-moe-f16-skew4.gguf";
    if (!std::filesystem::exists(path)) {
      Status st = write_test_model(spec, vocab, path);
      if (!st.ok()) die(st);
    }
    auto skewed = unwrap(GgufFile::open(path));
    std::printf("\n5b. expert balance, 100M MoE f16 with router skew 4, 4 hosts x 2 experts, 32 sequences x %d "
                "steps\n", steps);
    std::printf("%-22s %12s %12s %10s %10s\n", "", "rows spread", "busy spread", "replicas", "tok/s");
    for (bool replicate : {false, true}) {
      EngineOptions eo;
      eo.threads = threads;
      eo.max_seqs = 32;
      eo.context = 1024;
      auto engine = unwrap(Engine::create(skewed, eo));
      std::shared_ptr<ExpertPool> pool(unwrap(ExpertPool::create(skewed, threads)));
      std::vector<std::shared_ptr<ExpertHost>> hosts;
      for (int32_t h = 0; h < 4; ++h) {
        hosts.emplace_back(unwrap(ExpertHost::create(skewed, expert_set({2 * h, 2 * h + 1}), threads)));
        pool->add_host(hosts.back());
      }
      if (replicate) {
        ReplicationPolicy policy;
        policy.max_spread = 0.1;
        pool->set_replication(policy, 6);
      }
      engine->set_expert_executor(pool);
      std::vector<int32_t> seqs, next(32);
      std::vector<std::vector<int32_t>> prompts;
      std::vector<Engine::Item> items;
      for (int i = 0; i < 32; ++i) {
        seqs.push_back(unwrap(engine->open_sequence()));
        prompts.push_back(uniform_requests(1, 16, 1, n_vocab, uint64_t(i))[0].prompt);
        prompts.back()[0] = 1 + (i * 131) % (n_vocab - 1);
      }
      for (int i = 0; i < 32; ++i) items.push_back({seqs[size_t(i)], prompts[size_t(i)].data(), 16});
      std::vector<float> logits(size_t(32) * size_t(n_vocab));
      const auto t0 = Clock::now();
      for (int step = 0; step <= steps; ++step) {
        Status st = engine->forward(items, logits.data());
        if (!st.ok()) die(st);
        items.clear();
        for (int i = 0; i < 32; ++i) {
          const float* row = logits.data() + size_t(i) * size_t(n_vocab);
          next[size_t(i)] = int32_t(std::max_element(row, row + n_vocab) - row);
          items.push_back({seqs[size_t(i)], &next[size_t(i)], 1});
        }
      }
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      const ExpertPool::Stats st = pool->stats();
      std::vector<uint64_t> busy;
      for (const auto& h : hosts) busy.push_back(h->stats().busy_ns);
      const double rows_spread = load_spread(st.host_rows), busy_spread = load_spread(busy);
      std::printf("%-22s %11.1f%% %11.1f%% %10llu %10.1f\n", replicate ? "with replication" : "without",
                  rows_spread * 100, busy_spread * 100, static_cast<unsigned long long>(st.replicas_added),
                  32.0 * steps / secs);
      out["expert_balance"].push_back({{"replication", replicate}, {"rows_spread", rows_spread},
                                       {"busy_spread", busy_spread},
                                       {"replicas_added", st.replicas_added},
                                       {"tok_s", 32.0 * steps / secs}});
    }
  }
  if (json) std::cout << out.dump(2) << "\n";
  return 0;
}
