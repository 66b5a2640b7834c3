#include "bench/batched_decode.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>
#include <nlohmann/json.hpp>

#include "bench/limits.h"
#include "bench/stats.h"
#include "model/engine.h"
#include "model/make_model.h"
#include "model/scheduler.h"

namespace cleave::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// One step's time split by where it went (seconds).
struct Split {
  double step = 0, output = 0, layer_matmul = 0, attention = 0, other_ops = 0;
  double kv_write = 0;  // the part of `attention` that stores the step's K and V
  double outside() const { return step - output - layer_matmul - attention - other_ops; }
  void operator+=(const Split& o) {
    step += o.step, output += o.output, layer_matmul += o.layer_matmul;
    attention += o.attention, other_ops += o.other_ops, kv_write += o.kv_write;
  }
};

Split split_of(const ProfilingBackend& p, double step_seconds, int64_t n_vocab) {
  Split s;
  s.step = step_seconds;
  const std::string out_prefix = "matmul " + std::to_string(n_vocab) + "x";
  for (const auto& [name, t] : p.times()) {
    if (name.rfind(out_prefix, 0) == 0)
      s.output += t.seconds;
    else if (name.rfind("matmul ", 0) == 0)
      s.layer_matmul += t.seconds;
    else if (name == "attention" || name == "kv_write")
      s.attention += t.seconds, s.kv_write += name == "kv_write" ? t.seconds : 0.0;
    else
      s.other_ops += t.seconds;
  }
  return s;
}

struct BatchRun {
  double tok_s = 0;      // decode rows per second over the pure decode steps
  double mean_ctx = 0;   // mean context a decode row attended
  Split per_step;        // mean over the pure decode steps
};

// `batch` requests of `prompt` tokens at once, `generate` tokens each, greedy.
// Times the steps that are pure decode of all `batch` rows.
BatchRun run_batch(Engine& engine, int batch, int prompt, int generate) {
  const LlamaConfig& c = engine.config();
  SchedulerOptions so;
  so.max_batch_tokens = 512;
  so.max_queue = batch;
  Scheduler sched(engine, nullptr, so);
  for (int r = 0; r < batch; ++r) {
    GenerateRequest req;
    req.request_id = uint64_t(r + 1);
    for (int i = 0; i < prompt; ++i) req.prompt.push_back(3 + (i * 7919 + r * 104729) % (c.n_vocab - 3));
    req.sampling.temperature = 0;
    req.sampling.max_tokens = generate;
    req.ignore_eos = true;
    CLEAVE_CHECK(sched.submit(std::move(req)).ok());
  }
  ProfilingBackend& prof = *engine.op_profile();
  std::vector<SchedulerEvent> events;
  BatchRun out;
  int pure = 0;
  double ctx_sum = 0;
  while (!sched.idle()) {
    const SchedulerCounters before = sched.counters();
    prof.reset();
    events.clear();
    const auto t0 = Clock::now();
    CLEAVE_CHECK(sched.step(events).ok());
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    const SchedulerCounters& after = sched.counters();
    if (after.prefill_tokens == before.prefill_tokens &&
        after.decode_rows - before.decode_rows == uint64_t(batch)) {
      out.per_step += split_of(prof, dt, c.n_vocab);
      ++pure;
      // Rows attend prompt + generated so far; every row is at the same place.
      ctx_sum += double(engine.sequence_length(0));
    }
    for (const SchedulerEvent& e : events) CLEAVE_CHECK(e.kind != SchedulerEvent::Kind::failed);
  }
  CLEAVE_CHECK(pure > 0);
  out.tok_s = double(batch) * pure / out.per_step.step;
  out.mean_ctx = ctx_sum / pure;
  const double inv = 1.0 / pure;
  out.per_step.step *= inv, out.per_step.output *= inv, out.per_step.layer_matmul *= inv;
  out.per_step.attention *= inv, out.per_step.other_ops *= inv, out.per_step.kv_write *= inv;
  return out;
}

// Matrix elements a decode row multiplies: every layer matrix and the output matrix.
double row_matrix_elems(const LlamaConfig& c) {
  const double d = c.dim, q = double(c.n_heads) * c.head_dim, kv = double(c.n_kv_heads) * c.head_dim;
  double per_layer = d * q + 2 * d * kv + q * d;
  per_layer += c.n_experts ? c.n_experts_used * 3 * d * c.ffn + d * c.n_experts : 3 * d * c.ffn;
  return per_layer * c.n_layers + d * c.n_vocab;
}

}  // namespace

int run_batched_section(const BatchedOptions& o) {
  const Isa isa = detect_isa();
  json results;
  results["isa"] = isa_name(isa);
  std::map<int, double> bw, peak, i8peak;
  for (int t : o.threads) {
    bw[t] = read_bandwidth(512ull << 20, t, 10);
    peak[t] = isa == Isa::scalar ? 0 : fma_peak_gflops(isa, t);
    i8peak[t] = int8_peak_gops(t);
  }
  ModelSpec spec;
  spec.dim = 768; spec.n_layers = 12; spec.n_heads = 12; spec.n_kv_heads = 4; spec.ffn = 2048;
  spec.context = 4096;  // --prompt up to 4096 minus what is generated
  struct Row {
    std::string type, kv;
    Compute compute;
    int block_size, threads, batch;
    std::vector<BatchRun> runs;
    double weight_bytes, kv_bytes_per_pos, flops_per_row_base, attn_flops_per_ctx;
  };
  std::vector<Row> rows;
  for (const std::string& tname : o.types) {
    auto dt = dtype_from_name(tname);
    if (!dt.ok()) {
      std::fprintf(stderr, "%s\n", dt.status().to_string().c_str());
      return 2;
    }
    spec.type = *dt;
    const std::string path = o.workdir + "/100M-GQA-ctx4096-" + tname + ".gguf";
    if (!std::filesystem::exists(path)) {
      Status st = write_test_model(spec, o.vocab, path);
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", st.to_string().c_str());
        return 1;
      }
    }
    auto file = GgufFile::open(path);
    CLEAVE_CHECK(file.ok());
    for (const std::string& cname : o.computes)
    for (const std::string& kv : o.kv_types)
    for (int bs : o.block_sizes)
    for (int t : o.threads) {
      auto compute = compute_from_name(cname);
      if (!compute.ok()) {
        std::fprintf(stderr, "%s\n", compute.status().to_string().c_str());
        return 2;
      }
      if (*compute == Compute::int8 && spec.type != DType::Q8_0) continue;  // int8 is Q8_0's
      auto kvt = kv_type_from_name(kv);
      if (!kvt.ok()) {
        std::fprintf(stderr, "%s\n", kvt.status().to_string().c_str());
        return 2;
      }
      EngineOptions eo;
      eo.threads = t;
      eo.context = o.prompt + o.generate + 16;
      eo.max_seqs = *std::max_element(o.batches.begin(), o.batches.end());
      eo.profile_ops = true;
      eo.cache_type_k = eo.cache_type_v = *kvt;
      eo.block_size = bs;
      eo.compute = *compute;
      auto engine = Engine::create(*file, eo);
      if (!engine.ok()) {
        std::fprintf(stderr, "%s\n", engine.status().to_string().c_str());
        return 1;
      }
      const LlamaConfig& c = (*engine)->config();
      for (int b : o.batches) {
        std::fprintf(stderr, "batched decode: %s weights (%s), %s KV in blocks of %d, %d thread(s), batch %d\n",
                     tname.c_str(), cname.c_str(), kv.c_str(), bs, t, b);
        Row row{tname, kv, *compute, bs, t, b, {}, double((*engine)->model().weight_bytes_per_token()),
                double((*engine)->kv_layout().bytes_per_token()), 2 * row_matrix_elems(c),
                4.0 * c.n_heads * c.head_dim * c.n_layers};
        // The first run also fills the prefix cache with the prompts (later
        // runs reuse them); decode steps are timed the same in every run.
        for (int r = 0; r < o.runs; ++r) row.runs.push_back(run_batch(**engine, b, o.prompt, o.generate));
        rows.push_back(std::move(row));
      }
    }
  }
  for (int t : o.threads) {
    const double bw_after = read_bandwidth(512ull << 20, t, 10);
    const double peak_after = isa == Isa::scalar ? 0 : fma_peak_gflops(isa, t);
    const double i8_after = int8_peak_gops(t);
    results["limits"][std::to_string(t)] = {{"read_GBps_before", bw[t]}, {"read_GBps_after", bw_after},
                                            {"fma_peak_GFLOPs_before", peak[t]},
                                            {"fma_peak_GFLOPs_after", peak_after},
                                            {"int8_peak_GOPs_before", i8peak[t]},
                                            {"int8_peak_GOPs_after", i8_after}};
    bw[t] = std::max(bw[t], bw_after);
    peak[t] = std::max(peak[t], peak_after);
    i8peak[t] = std::max(i8peak[t], i8_after);
  }
  std::printf("100M GQA (dim 768, 12 layers, 12 heads, 4 kv heads, ffn 2048, vocab 32000), %d-token "
              "prompts, %d generated, greedy; median of %d runs (range)\n",
              o.prompt, o.generate, o.runs);
  for (int t : o.threads)
    std::printf("limits, %d thread(s): read %.1f GB/s, FMA peak (%s) %.1f GFLOP/s, int8 peak (VNNI) "
                "%.1f GOP/s\n", t, bw[t], isa_name(isa), peak[t], i8peak[t]);
  std::printf("\n%-9s %-5s %5s %2s %5s | %16s %9s %6s %7s %7s | %6s %6s %6s %6s %6s\n", "type", "kv", "block", "t", "batch",
              "decode tok/s", "roofline", "%", "x b=1", "ceil", "output", "layers", "attn", "ops",
              "outside");
  std::map<std::tuple<std::string, std::string, int, int>, double> base_tok_s, base_roof;
  for (const Row& row : rows) {
    std::vector<double> tok;
    for (const BatchRun& r : row.runs) tok.push_back(r.tok_s);
    const double med = median(tok);
    const double lo = *std::min_element(tok.begin(), tok.end()), hi = *std::max_element(tok.begin(), tok.end());
    const BatchRun& mid = *std::find_if(row.runs.begin(), row.runs.end(),
                                        [&](const BatchRun& r) { return r.tok_s == med; });
    // Roofline of a step of `batch` rows at the measured mean context.
    const double ctx = mid.mean_ctx;
    const double bytes = row.weight_bytes + row.batch * row.kv_bytes_per_pos * ctx;
    const double flops = row.batch * (row.flops_per_row_base + row.attn_flops_per_ctx * ctx);
    const double t_mem = bytes / (bw[row.threads] * 1e9);
    double t_fma = peak[row.threads] > 0 ? flops / (peak[row.threads] * 1e9) : 0;
    if (row.compute == Compute::int8 && i8peak[row.threads] > 0 && peak[row.threads] > 0)
      t_fma = row.batch * (row.flops_per_row_base / (i8peak[row.threads] * 1e9) +
                           row.attn_flops_per_ctx * ctx / (peak[row.threads] * 1e9));
    const double roof_tok_s = row.batch / std::max(t_mem, t_fma);
    const std::string label = row.type + (row.compute == Compute::int8 ? "+int8" : "");
    const auto key = std::make_tuple(label, row.kv, row.block_size, row.threads);
    if (row.batch == 1) base_tok_s[key] = med, base_roof[key] = roof_tok_s;
    const double speedup = base_tok_s.count(key) ? med / base_tok_s[key] : 0;
    const double ceiling = base_roof.count(key) ? roof_tok_s / base_roof[key] : 0;
    const Split& s = mid.per_step;
    auto pct = [&](double x) { return 100 * x / s.step; };
    char range[64];
    std::snprintf(range, sizeof range, "%.0f (%.0f-%.0f)", med, lo, hi);
    std::printf("%-9s %-5s %5d %2d %5d | %16s %9.0f %5.0f%% %6.2fx %6.2fx | %5.1f%% %5.1f%% %5.1f%% %5.1f%% %5.1f%%\n",
                label.c_str(), row.kv.c_str(), row.block_size, row.threads, row.batch, range, roof_tok_s, 100 * med / roof_tok_s,
                speedup, ceiling, pct(s.output), pct(s.layer_matmul), pct(s.attention), pct(s.other_ops),
                pct(s.outside()));
    json j = {{"type", row.type}, {"compute", compute_name(row.compute)}, {"kv_type", row.kv}, {"block_size", row.block_size},
              {"kv_bytes_per_token", row.kv_bytes_per_pos},
              {"prompt", o.prompt}, {"generate", o.generate}, {"threads", row.threads}, {"batch", row.batch},
              {"decode_tok_s", tok}, {"decode_tok_s_median", med}, {"roofline_tok_s", roof_tok_s},
              {"bound", t_fma > t_mem ? "fma" : "memory"}, {"mean_context", ctx},
              {"speedup_vs_batch1", speedup}, {"roofline_speedup", ceiling},
              {"step_ms", 1e3 * s.step}, {"output_ms", 1e3 * s.output},
              {"layer_matmul_ms", 1e3 * s.layer_matmul}, {"attention_ms", 1e3 * s.attention},
              {"kv_write_ms", 1e3 * s.kv_write},
              {"other_ops_ms", 1e3 * s.other_ops}, {"outside_backend_ms", 1e3 * s.outside()}};
    results["runs"].push_back(j);
  }
  std::printf("\nroofline: batch / max((weight bytes + batch x KV bytes) / read bandwidth, batch x FLOPs / "
              "FMA peak; +int8 rows: the matrices' FLOPs / int8 peak); x b=1: throughput over batch 1's; "
              "ceil: the same ratio of the rooflines.\n"
              "shares of a pure decode step: output matrix, the layers' matrices, attention + KV writes, "
              "other ops, outside the backend (sampling, scheduling).\n");
  if (!o.out_json.empty()) {
    std::ofstream(o.out_json) << results.dump(2) << "\n";
    std::printf("wrote %s\n", o.out_json.c_str());
  }
  return 0;
}

}  // namespace cleave::bench
