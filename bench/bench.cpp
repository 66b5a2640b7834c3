// cleave_bench: prefill and decode speed beside the machine's limits,
// measured in the same run.
//   decode limit  = memory read bandwidth / bytes read per token
//   prefill limit = FP32 FMA peak / FLOPs per token
// --encoder: vision encoder (CLIP + projector) images/s at batch 1 and 16,
// as GFLOP/s beside the FMA peak (encoders are compute-bound).
// Each model runs in a child process (this binary with --run-one) so its
// peak RSS is its own.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench/ab_bench.h"
#include "bench/attention_bench.h"
#include "bench/matmul_bench.h"
#include "bench/batched_decode.h"
#include "bench/limits.h"
#include "model/clip.h"
#include "model/engine.h"
#include "model/make_model.h"

using namespace cleave;
using bench::fma_peak_gflops;
using bench::int8_peak_gops;
using bench::read_bandwidth;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

// Fraction of the last `seconds` the CPUs were busy (from /proc/stat).
double cpu_busy(double seconds) {
  auto read = [] {
    std::ifstream f("/proc/stat");
    std::string cpu;
    uint64_t v[8] = {};
    f >> cpu;
    for (auto& x : v) f >> x;
    uint64_t idle = v[3] + v[4], total = 0;
    for (auto x : v) total += x;
    return std::pair{idle, total};
  };
  auto a = read();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  auto b = read();
  double total = double(b.second - a.second);
  return total > 0 ? 1.0 - double(b.first - a.first) / total : 0;
}

struct Shape {
  std::string name;
  ModelSpec spec;
};

std::vector<Shape> shapes(bool quick) {
  std::vector<Shape> s;
  ModelSpec m15;
  m15.dim = 288; m15.n_layers = 6; m15.n_heads = 6; m15.n_kv_heads = 6; m15.ffn = 768;
  m15.context = 1024;
  s.push_back({"15M", m15});
  if (quick) return s;
  ModelSpec gqa;
  gqa.dim = 768; gqa.n_layers = 12; gqa.n_heads = 12; gqa.n_kv_heads = 4; gqa.ffn = 2048;
  gqa.context = 1024;
  s.push_back({"100M-GQA", gqa});
  ModelSpec moe;
  moe.dim = 512; moe.n_layers = 6; moe.n_heads = 8; moe.n_kv_heads = 2; moe.ffn = 1024;
  moe.n_experts = 8; moe.n_experts_used = 2; moe.context = 1024;
  s.push_back({"100M-MoE", moe});
  return s;
}

// One model at one thread count, in this (child) process. Prints one JSON line.
int run_one(const std::string& path, int threads, int prompt_len, int decode_len, Compute compute) {
  auto file = GgufFile::open(path);
  if (!file.ok()) {
    std::fprintf(stderr, "%s\n", file.status().to_string().c_str());
    return 1;
  }
  EngineOptions o;
  o.threads = threads;
  o.context = 256;
  o.compute = compute;
  auto e = Engine::create(*file, o);
  if (!e.ok()) {
    std::fprintf(stderr, "%s\n", e.status().to_string().c_str());
    return 1;
  }
  Engine& eng = **e;
  const LlamaConfig& c = eng.config();
  std::vector<int32_t> prompt(prompt_len);
  for (int i = 0; i < prompt_len; ++i) prompt[i] = 3 + (i * 7919) % (c.n_vocab - 3);
  std::vector<float> logits(c.n_vocab);

  double prefill_best = 1e30, decode_best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    int32_t seq = *eng.open_sequence();
    double t0 = now_s();
    Status st = eng.forward({{seq, prompt.data(), prompt_len}}, logits.data());
    prefill_best = std::min(prefill_best, now_s() - t0);
    CLEAVE_CHECK(st.ok());
    t0 = now_s();
    for (int i = 0; i < decode_len; ++i) {
      int32_t tok = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      CLEAVE_CHECK(eng.forward({{seq, &tok, 1}}, logits.data()).ok());
    }
    decode_best = std::min(decode_best, now_s() - t0);
    eng.close_sequence(seq);
  }
  // Peak RSS of the timed engine, before the profiling one below adds its own.
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  // Where a prefill goes, op by op: the same prompt on an engine that times
  // every op (after the timed runs, so they are not slowed by it), the
  // fastest of three kept.
  json ops = json::object();
  {
    EngineOptions po = o;
    po.profile_ops = true;
    auto pe = Engine::create(*file, po);
    CLEAVE_CHECK(pe.ok());
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      int32_t seq = *(*pe)->open_sequence();
      ProfilingBackend& prof = *(*pe)->op_profile();
      prof.reset();
      const double t0 = now_s();
      CLEAVE_CHECK((*pe)->forward({{seq, prompt.data(), prompt_len}}, logits.data()).ok());
      const double dt = now_s() - t0;
      (*pe)->close_sequence(seq);
      if (dt >= best) continue;
      best = dt;
      ops = json::object();
      for (const auto& [name, t] : prof.times()) ops[name] = t.seconds * 1e3;
      ops["(outside ops)"] = (dt - prof.total_seconds()) * 1e3;
    }
  }
  const double kv_bytes_per_pos = 2.0 * c.n_layers * c.n_kv_heads * c.head_dim * 4;
  const double avg_ctx = prompt_len + decode_len / 2.0;
  json j;
  j["prefill_tok_s"] = prompt_len / prefill_best;
  j["decode_tok_s"] = decode_len / decode_best;
  j["bytes_per_token"] = double(eng.model().weight_bytes_per_token()) + kv_bytes_per_pos * avg_ctx;
  j["attn_flops_prefill_per_token"] = 4.0 * c.n_heads * c.head_dim * (prompt_len / 2.0) * c.n_layers;
  j["max_rss_bytes"] = double(ru.ru_maxrss) * 1024;
  j["kv_cache_bytes"] = double(eng.options().context) * kv_bytes_per_pos;
  j["isa"] = eng.backend().caps().isa;
  j["prefill_ops_ms"] = ops;
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

// Matrix elements each prompt token multiplies (for FLOPs): the layers'
// matrices; the output matrix runs for the last token only, so it is spread
// over the prompt.
double weight_elems_per_token(const ModelSpec& s, int prompt_len) {
  const double d = s.dim, hd = double(s.dim) / s.n_heads, q = s.n_heads * hd,
               kv = s.n_kv_heads * hd, f = s.ffn;
  double per_layer = d * q + 2 * d * kv + q * d;
  per_layer += s.n_experts ? s.n_experts_used * 3 * d * f + d * s.n_experts : 3 * d * f;
  return per_layer * s.n_layers + d * 32000.0 / prompt_len;  // output (vocab 32000)
}

// A generated model of one shape and weight type, in the work dir.
struct ModelFile {
  std::string name, tname, path;
  ModelSpec spec;
};

// Every shape in every type, each written to workdir when missing. 0, or the
// exit code (after printing why): 2 for an unknown type, 1 for a failed write.
int model_files(const std::vector<Shape>& shapes, const std::vector<std::string>& types,
                const std::string& vocab, const std::string& workdir, std::vector<ModelFile>* out) {
  for (const Shape& sh : shapes) {
    for (const std::string& tname : types) {
      auto dt = dtype_from_name(tname);
      if (!dt.ok()) {
        std::fprintf(stderr, "%s\n", dt.status().to_string().c_str());
        return 2;
      }
      ModelFile m{sh.name, tname, workdir + "/" + sh.name + "-" + tname + ".gguf", sh.spec};
      m.spec.type = *dt;
      if (!std::filesystem::exists(m.path)) {
        Status st = write_test_model(m.spec, vocab, m.path);
        if (!st.ok()) {
          std::fprintf(stderr, "%s\n", st.to_string().c_str());
          return 1;
        }
      }
      out->push_back(std::move(m));
    }
  }
  return 0;
}

// --ab WHAT: each model and thread count, the engine against the variant
// without the change, in one process (bench/ab_bench.h).
int run_ab_section(const std::string& what, const std::vector<Shape>& models,
                   const std::vector<std::string>& types, const std::vector<int>& threads,
                   const std::string& vocab, const std::string& workdir, int prompt, int decode, int runs,
                   const std::string& out_json) {
  json results;
  results["isa"] = isa_name(detect_isa());
  results["ab"] = what;
  std::printf("%-9s %-5s %2s | %-48s | %s\n", "model", "type", "t",
              ("prefill ms: with / without " + what + ", speedup").c_str(), "decode ms");
  std::vector<ModelFile> files;
  if (int rc = model_files(models, types, vocab, workdir, &files)) return rc;
  for (const ModelFile& m : files) {
    for (int t : threads) {
      json r;
      try {
        r = bench::run_ab(what, m.path, t, prompt, decode, runs);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s %s t=%d: %s\n", m.name.c_str(), m.tname.c_str(), t, e.what());
        return 1;
      }
      r["model"] = m.name;
      r["type"] = m.tname;
      auto cell = [](const json& j) {
        char b[128];
        std::snprintf(b, sizeof b, "%7.3f / %7.3f  %.3fx (%.3f-%.3f) %2d/%-2d",
                      j["default_ms"].get<double>(), j["variant_ms"].get<double>(),
                      j["speedup_median"].get<double>(), j["speedup_q1"].get<double>(),
                      j["speedup_q3"].get<double>(), j["default_faster"].get<int>(), j["pairs"].get<int>());
        return std::string(b);
      };
      std::printf("%-9s %-5s %2d | %s | %s\n", m.name.c_str(), m.tname.c_str(), t, cell(r["prefill"]).c_str(),
                  decode > 0 ? cell(r["decode_steps"]).c_str() : "-");
      std::fflush(stdout);
      results["runs"].push_back(r);
    }
  }
  std::ofstream(out_json) << results.dump(2) << "\n";
  std::printf("\nwrote %s\n", out_json.c_str());
  return 0;
}

json spawn_one(const std::string& self, const std::string& model, int threads, int prompt,
               int decode, const std::string& compute) {
  std::string out_path = model + "." + std::to_string(threads) + "." + compute + ".json";
  std::string cmd = "'" + self + "' --run-one '" + model + "' -t " + std::to_string(threads) +
                    " --prompt " + std::to_string(prompt) + " --decode " +
                    std::to_string(decode) + " --compute " + compute + " > '" + out_path + "'";
  int rc = std::system(cmd.c_str());
  if (rc != 0) {
    std::fprintf(stderr, "bench: child failed: %s\n", cmd.c_str());
    std::exit(1);
  }
  std::ifstream f(out_path);
  return json::parse(f);
}

}  // namespace

// FLOPs of one image through the encoder: every matrix product (2 per
// multiply-add) and attention's two T x T products; norms, GELU and softmax
// are not counted.
double encoder_flops(const ClipConfig& c) {
  const double T = c.n_positions, P = c.n_patches, d = c.dim;
  double f = 2.0 * P * d * 3 * c.patch_size * c.patch_size;    // patch embedding
  f += c.feature_layer * (2.0 * T * (4 * d * d + 2 * d * c.ffn) // q k v o, ffn up/down
                          + 4.0 * T * T * d);                   // q k^T and p v
  f += 2.0 * P * (d * c.mm_hidden + double(c.mm_hidden) * c.projection_dim);  // projector
  return f;
}

// Images/s of each encoder at batch 1 and 16 on 1 and 2 threads (best of
// several timed repetitions after a warm-up), beside the FMA peak measured in
// the same run. Each image is a different one (batching is not dedup).
int run_encoder_section(std::vector<std::string> mmprojs, const std::string& workdir,
                        const std::string& out_json) {
  // A mid-size generated encoder beside whatever --mmproj names: ViT at 224
  // px, patch 32 (49 patches), width 384, 6 blocks, projecting to 512.
  ClipSpec vit;
  vit.image_size = 224; vit.patch_size = 32; vit.dim = 384; vit.n_layers = 6; vit.n_heads = 6;
  vit.ffn = 1536; vit.projection_dim = 512; vit.feature_layer = 6;
  const std::string vit_path = workdir + "/vit-224-p32-d384.gguf";
  if (!std::filesystem::exists(vit_path)) {
    Status st = write_test_clip_model(vit, vit_path);
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.to_string().c_str());
      return 1;
    }
  }
  mmprojs.push_back(vit_path);
  const Isa isa = detect_isa();
  json results;
  results["isa"] = isa_name(isa);
  results["cpu_busy_before"] = cpu_busy(1.0);
  double peak[3] = {0, 0, 0};
  for (int t = 1; t <= 2; ++t) peak[t] = isa == Isa::scalar ? 0 : fma_peak_gflops(isa, t);
  struct Row {
    std::string name;
    int threads, batch;
    double images_s, gflops;
  };
  std::vector<Row> rows;
  for (const std::string& path : mmprojs) {
    auto file = GgufFile::open(path);
    auto clip = file.ok() ? ClipModel::load(*file) : Result<std::unique_ptr<ClipModel>>(file.status());
    if (!clip.ok()) {
      std::fprintf(stderr, "%s: %s\n", path.c_str(), clip.status().to_string().c_str());
      return 1;
    }
    const ClipModel& m = **clip;
    const double flops = encoder_flops(m.config());
    const std::string name = std::filesystem::path(path).stem().string();
    for (int t = 1; t <= 2; ++t) {
      auto backend = make_cpu_backend(t);
      for (int batch : {1, 16}) {
        // Distinct preprocessed images (values only matter for realism).
        std::vector<float> pixels(m.input_floats() * size_t(batch)), out(m.output_floats() * size_t(batch));
        for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = float((i * 2654435761u) % 2001) / 1000.f - 1.f;
        // Each timed repetition encodes the same 16 images (16 calls of 1, or
        // one of 16), so best-of-N favours neither batch size on a busy machine.
        constexpr int kImages = 16;
        auto encode_all = [&] {
          for (int first = 0; first < kImages; first += batch)
            CLEAVE_CHECK(m.encode(*backend, pixels.data(), batch, out.data()).ok());
        };
        encode_all();  // warm-up
        double best = 1e30, spent = 0;
        int reps = 0;
        for (; reps < 30 && (reps < 3 || spent < 3.0); ++reps) {
          const double t0 = now_s();
          encode_all();
          const double dt = now_s() - t0;
          best = std::min(best, dt);
          spent += dt;
        }
        const double images_s = kImages / best;
        rows.push_back({name, t, batch, images_s, images_s * flops / 1e9});
        json r = {{"encoder", name}, {"threads", t}, {"batch", batch}, {"images_s", images_s},
                  {"gflops", images_s * flops / 1e9}, {"flops_per_image", flops}, {"reps", reps},
                  {"n_patches", m.config().n_patches}, {"dim", m.config().dim},
                  {"blocks_run", m.config().feature_layer}};
        results["encoder"].push_back(r);
      }
    }
  }
  for (int t = 1; t <= 2; ++t) {
    const double after = isa == Isa::scalar ? 0 : fma_peak_gflops(isa, t);
    results["limits"][std::to_string(t)] = {{"fma_peak_GFLOPs_before", peak[t]},
                                            {"fma_peak_GFLOPs_after", after}};
    peak[t] = std::max(peak[t], after);
    results["limits"][std::to_string(t)]["fma_peak_GFLOPs"] = peak[t];
  }
  std::printf("FP32 FMA peak (%s): %.1f GFLOP/s (1 thread), %.1f GFLOP/s (2 threads)\n\n",
              isa_name(isa), peak[1], peak[2]);
  std::printf("%-24s %2s %5s | %10s %9s %6s\n", "encoder", "t", "batch", "images/s", "GFLOP/s",
              "% peak");
  for (const Row& r : rows)
    std::printf("%-24s %2d %5d | %10.1f %9.2f %5.1f%%\n", r.name.c_str(), r.threads, r.batch,
                r.images_s, r.gflops, peak[r.threads] > 0 ? 100 * r.gflops / peak[r.threads] : 0);
  std::ofstream(out_json) << results.dump(2) << "\n";
  std::printf("\nwrote %s\n", out_json.c_str());
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"cleave_bench: prefill/decode tok/s beside bandwidth and FMA limits"};
  std::string run_one_path, out_json = "bench-results.json", vocab, workdir;
  int threads = 1, prompt = 128, decode = 64;
  bool quick = false, encoder = false;
  std::vector<std::string> types = {"f32", "f16"}, mmprojs;
  app.add_option("--run-one", run_one_path, "internal: run one model in this process");
  app.add_option("-t,--threads", threads);
  app.add_option("--prompt", prompt, "prompt tokens for prefill (--batched: prompt + decode up to 4080)")
      ->check(CLI::Range(1, 4080));
  app.add_option("--decode", decode, "tokens to decode at batch 1")->check(CLI::Range(1, 200));
  app.add_option("--vocab", vocab, "vocab GGUF (default: models/vocab/ggml-vocab-llama-spm.gguf)");
  app.add_option("--types", types, "weight types to run")->delimiter(',');
  app.add_option("--workdir", workdir, "where generated models go (default: a temp dir)");
  app.add_option("--json", out_json, "where to write the results");
  app.add_flag("--quick", quick, "only the 15M model (for a smoke run)");
  app.add_flag("--encoder", encoder, "only the vision encoder section: images/s at batch 1 and 16");
  app.add_option("--mmproj", mmprojs, "--encoder: mmproj files to run beside the generated one")
      ->check(CLI::ExistingFile);
  bool batched = false;
  bench::BatchedOptions bo;
  app.add_flag("--batched", batched,
               "only the batched-decode section: batch 1/8/32/64 on the 100M GQA model beside each "
               "batch's roofline");
  app.add_option("--batches", bo.batches, "--batched: batch sizes (the first must be 1)")
      ->check(CLI::Range(1, 256))
      ->delimiter(',');
  app.add_option("--runs", bo.runs,
                 "--batched / --attention: runs per case (the median is reported)")
      ->check(CLI::Range(1, 50));
  app.add_option("--kv-types", bo.kv_types,
                 "--batched / --attention: KV cache types (-ctk / -ctv) to run")
      ->delimiter(',')
      ->check(CLI::IsMember({"f32", "f16", "q8_0", "q4_0"}));
  bool attention = false;
  bench::AttentionOptions ao;
  app.add_flag("--attention", attention,
               "only the attention section: a decode step's attention over many sequences beside "
               "the streaming and the scattered-run read bandwidth");
  app.add_option("--rows", ao.rows, "--attention: query rows (sequences) per step; --matmul: rows of x")
      ->check(CLI::Range(1, 256))
      ->delimiter(',');
  app.add_option("--context", ao.contexts, "--attention: positions each row attends")
      ->check(CLI::Range(1, 4096))
      ->delimiter(',');
  std::vector<int> block_sizes{16};
  app.add_option("--block-size", block_sizes,
                 "--batched / --attention: positions per KV block (--block-size), one or more of 8, 16, 32, 64, "
                 "128")
      ->delimiter(',');
  app.add_option("--isa", ao.isa,
                 "--attention: the kernels' instruction set, avx2 or avx512 (default: the best this CPU has; "
                 "one it lacks is refused)");
  bool matmul = false;
  app.add_flag("--matmul", matmul,
               "only the matmul section: the panel matmul on one thread, with and without widening "
               "narrow panels once per pass, beside the FMA peak");
  std::vector<std::string> computes = {"exact"};
  app.add_option("--compute", computes,
                 "exact and/or int8 (cleave's --compute; int8 runs the q8_0 weights only, its "
                 "matrix FLOPs against the measured int8 peak)")
      ->delimiter(',')
      ->check(CLI::IsMember({"exact", "int8"}));
  std::string ab;
  app.add_option("--ab", ab,
                 "only the A/B section: the engine against a variant without one change, alternating in one "
                 "process (--runs pairs, default 21): groups (independent matmuls as one region) or rows (a "
                 "prefill's rows split over the threads)");
  CLI11_PARSE(app, argc, argv);
  if (!run_one_path.empty())
    return run_one(run_one_path, threads, prompt, decode,
                   computes.size() == 1 ? *compute_from_name(computes[0]) : Compute::exact);

  if (vocab.empty()) vocab = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";
  if (workdir.empty()) workdir = (std::filesystem::temp_directory_path() / "cleave-bench").string();
  std::filesystem::create_directories(workdir);
  if (int(encoder) + int(batched) + int(attention) + int(matmul) + int(!ab.empty()) > 1) {
    std::fprintf(stderr, "--encoder, --batched, --attention, --matmul and --ab each run one section: pick one\n");
    return 2;
  }
  if (!attention && !batched && app.count("--block-size")) {
    std::fprintf(stderr, "--block-size needs --batched or --attention\n");
    return 2;
  }
  for (int bs : block_sizes)
    if (!is_kv_block_size(bs)) {
      std::fprintf(stderr, "--block-size takes %s, not %d\n", kKvBlockSizeList, bs);
      return 2;
    }
  ao.block_sizes = bo.block_sizes = block_sizes;
  if (!attention && app.count("--isa")) {
    std::fprintf(stderr, "--isa needs --attention\n");
    return 2;
  }
  if (!ab.empty()) {
    if (ab != "groups" && ab != "rows") {
      std::fprintf(stderr, "--ab takes groups or rows, not '%s'\n", ab.c_str());
      return 2;
    }
    for (const char* f : {"--batches", "--compute", "--mmproj", "--kv-types", "--rows", "--context"})
      if (app.count(f)) {
        std::fprintf(stderr, "%s does not apply to --ab\n", f);
        return 2;
      }
    if (!app.count("--types")) types = {"f16"};
    const std::vector<int> ts = app.count("--threads") ? std::vector<int>{threads} : std::vector<int>{1, 2};
    return run_ab_section(ab, shapes(quick), types, ts, vocab, workdir, prompt,
                              app.count("--decode") ? decode : 8, app.count("--runs") ? bo.runs : 21, out_json);
  }
  if (matmul) {
    for (const char* f : {"--batches", "--compute", "--prompt", "--decode", "--quick", "--mmproj", "--vocab",
                          "--workdir", "--threads", "--kv-types", "--context"})
      if (app.count(f)) {
        std::fprintf(stderr, "%s does not apply to --matmul\n", f);
        return 2;
      }
    bench::MatmulOptions mo;
    mo.out_json = out_json;
    if (app.count("--runs")) mo.runs = bo.runs;
    if (app.count("--rows")) mo.rows = ao.rows;
    if (app.count("--types")) {
      mo.types.clear();
      for (const std::string& t : types) {
        if (t != "f16" && t != "q8_0") {
          std::fprintf(stderr, "--matmul: --types takes f16 and q8_0, not '%s'\n", t.c_str());
          return 2;
        }
        mo.types.push_back(t);
      }
    }
    return bench::run_matmul_section(mo);
  }
  if (encoder) return run_encoder_section(mmprojs, workdir, out_json);
  if (!attention && (app.count("--rows") || app.count("--context"))) {
    std::fprintf(stderr, "--rows needs --attention or --matmul, --context needs --attention\n");
    return 2;
  }
  if (attention) {
    for (const char* f : {"--batches", "--types", "--compute", "--prompt", "--decode", "--quick",
                          "--mmproj", "--vocab", "--workdir"})
      if (app.count(f)) {
        std::fprintf(stderr, "%s does not apply to --attention\n", f);
        return 2;
      }
    ao.out_json = out_json;
    if (app.count("--kv-types")) ao.kv_types = bo.kv_types;
    if (app.count("--threads")) ao.threads = {threads};
    if (app.count("--runs")) ao.runs = bo.runs;
    return bench::run_attention_section(ao);
  }
  if (!batched && prompt > 200) {
    std::fprintf(stderr, "--prompt above 200 needs --batched\n");
    return 2;
  }
  if (batched) {
    if (bo.batches.empty() || bo.batches.front() != 1) {
      std::fprintf(stderr, "--batches: the first batch must be 1 (the others are compared with it)\n");
      return 2;
    }
    bo.vocab = vocab;
    bo.workdir = workdir;
    bo.out_json = out_json;
    if (app.count("--types")) bo.types = types;
    if (app.count("--threads")) bo.threads = {threads};
    bo.computes = computes;
    bo.prompt = app.count("--prompt") ? prompt : 128;
    bo.generate = app.count("--decode") ? decode : 64;
    if (bo.prompt + bo.generate > 4080) {
      std::fprintf(stderr, "--prompt + --decode must stay within 4080 (the model's 4096 positions)\n");
      return 2;
    }
    return bench::run_batched_section(bo);
  }
  const std::string self = std::filesystem::canonical("/proc/self/exe").string();

  double busy = cpu_busy(1.0);
  if (busy > 0.10)
    std::fprintf(stderr, "WARNING: the machine is %.0f%% busy; 2-thread figures will be low\n",
                 busy * 100);
  const Isa isa = detect_isa();
  json results;
  results["cpu_busy_before"] = busy;
  results["isa"] = isa_name(isa);
  results["hardware_threads"] = std::thread::hardware_concurrency();
  // Limits before and after the runs; each is the best the machine showed
  // (interference can only lower a measured limit), and a large move between
  // the two means the machine was not idle.
  double bw[3], peak[3], i8peak[3];
  for (int t = 1; t <= 2; ++t) {
    bw[t] = read_bandwidth(512ull << 20, t, 10);
    peak[t] = isa == Isa::scalar ? 0 : fma_peak_gflops(isa, t);
    i8peak[t] = int8_peak_gops(t);
  }
  struct Run {
    json r;
    ModelSpec spec;
    double file_bytes;
  };
  std::vector<Run> runs;
  std::vector<ModelFile> files;
  if (int rc = model_files(shapes(quick), types, vocab, workdir, &files)) return rc;
  for (const ModelFile& m : files) {
    for (const std::string& compute : computes) {
      if (compute == "int8" && m.spec.type != DType::Q8_0) continue;  // int8 is Q8_0's
      for (int t = 1; t <= 2; ++t) {
        std::fprintf(stderr, "running %s %s (%s) on %d thread(s)\n", m.name.c_str(), m.tname.c_str(),
                     compute.c_str(), t);
        json r = spawn_one(self, m.path, t, prompt, decode, compute);
        r["model"] = m.name;
        r["type"] = m.tname;
        r["compute"] = compute;
        r["threads"] = t;
        runs.push_back({r, m.spec, double(std::filesystem::file_size(m.path))});
      }
    }
  }
  for (int t = 1; t <= 2; ++t) {
    const double bw_after = read_bandwidth(512ull << 20, t, 10);
    const double peak_after = isa == Isa::scalar ? 0 : fma_peak_gflops(isa, t);
    const double i8_after = int8_peak_gops(t);
    results["limits"][std::to_string(t)] = {{"read_GBps_before", bw[t]},
                                            {"read_GBps_after", bw_after},
                                            {"fma_peak_GFLOPs_before", peak[t]},
                                            {"fma_peak_GFLOPs_after", peak_after},
                                            {"int8_peak_GOPs_before", i8peak[t]},
                                            {"int8_peak_GOPs_after", i8_after}};
    i8peak[t] = std::max(i8peak[t], i8_after);
    if (std::abs(bw_after - bw[t]) > 0.15 * std::max(bw[t], bw_after))
      std::fprintf(stderr,
                   "WARNING: %d-thread read bandwidth moved from %.1f to %.1f GB/s during the "
                   "run; the machine was not idle, rerun\n",
                   t, bw[t], bw_after);
    bw[t] = std::max(bw[t], bw_after);
    peak[t] = std::max(peak[t], peak_after);
    results["limits"][std::to_string(t)]["read_GBps"] = bw[t];
    results["limits"][std::to_string(t)]["fma_peak_GFLOPs"] = peak[t];
  }

  std::printf("memory read bandwidth: %.1f GB/s (1 thread), %.1f GB/s (2 threads)\n", bw[1], bw[2]);
  std::printf("FP32 FMA peak (%s): %.1f GFLOP/s (1 thread), %.1f GFLOP/s (2 threads)\n",
              isa_name(isa), peak[1], peak[2]);
  std::printf("int8 peak (VNNI): %.1f GOP/s (1 thread), %.1f GOP/s (2 threads)\n\n", i8peak[1], i8peak[2]);
  std::printf("%-9s %-9s %2s | %9s %9s %6s | %9s %9s %6s | %8s %8s | prefill: %6s %6s %6s\n", "model",
              "type", "t", "prefill", "limit", "%", "decode", "limit", "%", "RSS MiB", "budget", "matmul",
              "attn", "other");
  for (Run& run : runs) {
    json& r = run.r;
    const int t = r["threads"].get<int>();
    const double decode_limit = bw[t] * 1e9 / r["bytes_per_token"].get<double>();
    const double flops = 2 * weight_elems_per_token(run.spec, prompt) +
                         r["attn_flops_prefill_per_token"].get<double>();
    double prefill_limit = peak[t] * 1e9 / flops;
    const bool int8 = r["compute"].get<std::string>() == "int8";
    if (int8 && i8peak[t] > 0)  // the matrices at the int8 peak, attention at the FMA peak
      prefill_limit = 1.0 / (2 * weight_elems_per_token(run.spec, prompt) / (i8peak[t] * 1e9) +
                             r["attn_flops_prefill_per_token"].get<double>() / (peak[t] * 1e9));
    const double budget = run.file_bytes + r["kv_cache_bytes"].get<double>() + 64.0 * 1048576;
    r["decode_limit_tok_s"] = decode_limit;
    r["prefill_limit_tok_s"] = prefill_limit;
    r["flops_per_token"] = flops;
    r["file_bytes"] = run.file_bytes;
    r["rss_budget_bytes"] = budget;
    results["runs"].push_back(r);
    const std::string label = r["type"].get<std::string>() + (int8 ? "+int8" : "");
    // The profiled prefill's shares: matrices, attention (with its K/V
    // writes), and the rest (row ops and what runs between ops).
    double mm = 0, attn = 0, all = 0;
    for (const auto& [name, ms] : r["prefill_ops_ms"].items()) {
      const double v = ms.get<double>();
      all += v;
      if (name.rfind("matmul", 0) == 0) mm += v;
      else if (name == "attention" || name == "kv_write" || name == "full_attention") attn += v;
    }
    all = std::max(all, 1e-12);
    std::printf("%-9s %-9s %2d | %9.1f %9.1f %5.0f%% | %9.1f %9.1f %5.0f%% | %8.1f %8.1f |          %5.1f%% %5.1f%% %5.1f%%\n",
                r["model"].get<std::string>().c_str(), label.c_str(), t,
                r["prefill_tok_s"].get<double>(), prefill_limit,
                100 * r["prefill_tok_s"].get<double>() / prefill_limit,
                r["decode_tok_s"].get<double>(), decode_limit,
                100 * r["decode_tok_s"].get<double>() / decode_limit,
                r["max_rss_bytes"].get<double>() / 1048576, budget / 1048576, 100 * mm / all,
                100 * attn / all, 100 * (all - mm - attn) / all);
  }
  std::ofstream(out_json) << results.dump(2) << "\n";
  std::printf("\nwrote %s\n", out_json.c_str());
  return 0;
}
