// cleave: the command-line front end.
//   cleave generate -m MODEL.gguf -p "text" -n 64
//   cleave inspect MODEL.gguf
//   cleave make-model --out M.gguf --vocab VOCAB.gguf --dim 288 ...
//   cleave topology check|show FILE [--set key=value]...
// Exit codes: 0 ok, 1 run-time error, 2 usage error. Errors are one line.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "actors/pipeline.h"
#include "actors/topology.h"
#include "apps/process_args.h"
#include "apps/process_topology.h"
#include "frontend/request_codec.h"
#include "model/engine.h"
#include "model/generate.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/make_model.h"
#include "model/multimodal.h"
#include "model/tokenizer.h"

using namespace cleave;

// apps/node_cmd.cpp: `cleave node`.
CLI::App* add_node_command(CLI::App& app);
int run_node_command();
// apps/plan_cmd.cpp: `cleave plan`.
CLI::App* add_plan_command(CLI::App& app);
int run_plan_command();
// apps/serve_cmd.cpp: `cleave serve`; apps/http_options.h: -np, -to.
CLI::App* add_serve_command(CLI::App& app);
int run_serve_command(CLI::App* cmd);
#ifdef CLEAVE_HAVE_JOBS
CLI::App* add_run_batch_command(CLI::App& app);
int run_run_batch_command(CLI::App* cmd);
CLI::App* add_job_command(CLI::App& app);
int run_job_command();
#endif
namespace cleave {
void rewrite_short_flags(int argc, char** argv, std::vector<std::string>& storage, std::vector<char*>& out);
}

namespace {

struct RunError {
  std::string message;
};

[[noreturn]] void fail(const Status& st) { throw RunError{st.to_string()}; }

template <class T>
T unwrap(Result<T> r) {
  if (!r.ok()) fail(r.status());
  return std::move(*r);
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0 || v > INT32_MAX)
      throw CLI::ValidationError("--prompt-ids", "'" + item + "' is not a token id");
    ids.push_back(int32_t(v));
  }
  if (ids.empty()) throw CLI::ValidationError("--prompt-ids", "no token ids given");
  return ids;
}

// ---- generate ----------------------------------------------------------
struct GenerateArgs {
  std::string model, prompt, prompt_ids, logits_path, topology = "mono";
  std::string mmproj, requests, out, experts;
  std::string scheduling_policy = "fcfs";
  std::vector<std::string> images;
  int32_t n_predict = 64, threads = 0, ctx = 0, ubatch = 512;
  int32_t prefill_actors = 1, decode_actors = 1, vision_actors = 1;
  SamplingParams sampling;
  bool json = false, ignore_eos = false, no_bos = false;
  std::string request_flags_given;  // flags that set one request's fields, as given
  bool prefill_actors_given = false, decode_actors_given = false, vision_actors_given = false;
  int32_t expert_micro_batches = 1;
  bool expert_micro_batches_given = false, enable_eplb = false;
  int32_t pipeline_parallel_size = 1, pipeline_micro_batches = 1;
  bool pipeline_micro_batches_given = false;
  NumericsArgs numerics;
};

// Flags that only a topology reads are refused elsewhere, naming them.
void check_topology_flags(const GenerateArgs& a, Topology topology) {
  if ((a.prefill_actors_given || a.decode_actors_given) && topology != Topology::pd)
    throw CLI::ValidationError(a.prefill_actors_given ? "--prefill-actors" : "--decode-actors",
                               "needs --topology pd");
  if (a.vision_actors_given && topology == Topology::mono)
    throw CLI::ValidationError("--vision-actors", "needs --topology colocated or pd (mono encodes inline)");
  if (a.vision_actors_given && a.mmproj.empty())
    throw CLI::ValidationError("--vision-actors", "needs --mmproj");
  if (a.expert_micro_batches_given && a.experts.empty())
    throw CLI::ValidationError("--expert-micro-batches", kExpertMicroBatchesNeeds);
  if (a.enable_eplb && a.experts.empty()) throw CLI::ValidationError("--enable-eplb", kExpertMicroBatchesNeeds);
  if (a.pipeline_micro_batches_given && a.pipeline_parallel_size < 2)
    throw CLI::ValidationError("--pipeline-micro-batches", kPipelineMicroBatchesNeeds);
  if (a.pipeline_parallel_size > 1 && !a.experts.empty())
    throw CLI::ValidationError("--pipeline-parallel-size", kPipelineWithExperts);
}

// The same request through an actor topology: text streams as token events
// arrive; per-stage timings go to stderr (or into --json).
// With an mmproj, the request's images are encoded by vision_encoder actors.
int run_pipeline(const GenerateArgs& a, std::shared_ptr<const GgufFile> file,
                 std::shared_ptr<const Tokenizer> tok, Topology topology, const EngineOptions& eo,
                 const GenerateRequest& req, std::shared_ptr<const GgufFile> mmproj) {
  PipelineOptions po;
  po.topology = topology;
  po.prefill_actors = a.prefill_actors;
  po.decode_actors = a.decode_actors;
  po.engine = eo;
  po.mmproj = std::move(mmproj);
  po.vision_actors = a.vision_actors;
  po.vision.threads = eo.threads;
  po.experts = parse_experts_flag(a.experts);
  po.expert_replication = a.enable_eplb;
  po.pipeline_parallel_size = a.pipeline_parallel_size;
  auto pipeline = unwrap(Pipeline::create(file, tok, po));

  if (!a.json && !a.prompt.empty()) {
    std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
    std::fflush(stdout);
  }
  std::mutex mu;
  std::condition_variable cv;
  Completion c;
  const auto t0 = std::chrono::steady_clock::now();
  Status st = pipeline->submit(req, [&](const msg::StreamEvent& e) {
    std::lock_guard<std::mutex> lock(mu);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!a.json && !e.text.empty()) {
      std::fwrite(e.text.data(), 1, e.text.size(), stdout);
      std::fflush(stdout);
    }
    if (fold_event(c, e, t)) cv.notify_all();
  });
  if (!st.ok()) fail(st);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return c.done; });
  }
  if (!c.error.ok()) fail(c.error);
  if (a.json) {
    nlohmann::json j;
    j["prompt_ids"] = req.prompt;
    j["generated_ids"] = c.tokens;
    j["text"] = c.text;
    j["finish_reason"] = c.finish_reason;
    j["topology"] = topology_name(topology);
    j["timings"] = {{"ttft_seconds", c.ttft_seconds}, {"total_seconds", c.total_seconds}};
    for (const auto& [origin, s] : c.stages)
      j["stages"][origin] = {{"tokens", s.tokens}, {"seconds", s.seconds}};
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::fprintf(stderr, "\n\n%s: %zu tokens | TTFT %.1f ms | total %.1f ms | %s\n",
                 topology_name(topology), c.tokens.size(), c.ttft_seconds * 1e3,
                 c.total_seconds * 1e3, c.finish_reason.c_str());
    for (const auto& [origin, s] : c.stages)
      std::fprintf(stderr, "  stage %-16s %4d tokens %9.1f ms\n", origin.c_str(), s.tokens,
                   s.seconds * 1e3);
  }
  return 0;
}

// Reads and decodes an image file under the default limits; errors name the file.
RgbImage load_image(const std::string& path) { return unwrap(read_image_file(path)); }

// The vision encoder of --mmproj, checked against the language model's width.
std::unique_ptr<ClipModel> load_mmproj(const std::string& path, int32_t n_embd) {
  auto clip = unwrap(ClipModel::load(unwrap(GgufFile::open(path))));
  Status st = check_projector_fits(*clip, n_embd);
  if (!st.ok()) fail(st);
  return clip;
}

void check_image_usage(const GenerateArgs& a, bool has_images) {
  if (has_images && a.mmproj.empty())
    throw CLI::ValidationError("--image", "images need --mmproj (the vision encoder)");
}

int run_generate_requests(const GenerateArgs& a);

int run_generate(const GenerateArgs& a) {
  if (!a.requests.empty()) return run_generate_requests(a);
  if (a.scheduling_policy != "fcfs")  // one request: there is nothing to order
    throw CLI::ValidationError("--scheduling-policy", "needs --requests");
  if (a.prompt.empty() == a.prompt_ids.empty())
    throw CLI::ValidationError("generate", "give exactly one of -p/--prompt and --prompt-ids");
  const Topology topology = unwrap(parse_topology(a.topology));
  check_topology_flags(a, topology);
  check_image_usage(a, !a.images.empty());
  if (!a.images.empty() && a.prompt.empty())
    throw CLI::ValidationError("--image", "images need -p/--prompt (the text around them)");
  if (topology != Topology::mono && !a.logits_path.empty())
    throw CLI::ValidationError("--logits", "needs --topology mono (actor topologies return the final row only)");
  auto file = unwrap(GgufFile::open(a.model));
  EngineOptions eo;
  eo.threads = a.threads > 0 ? a.threads : int32_t(std::max(1u, std::thread::hardware_concurrency()));
  eo.context = a.ctx;
  eo.expert_micro_batches = a.expert_micro_batches;
  eo.pipeline_micro_batches = a.pipeline_micro_batches;
  apply_numerics(a.numerics, eo);
  std::unique_ptr<Engine> engine;  // the actor topologies make their own
  if (topology == Topology::mono) {
    if (a.pipeline_parallel_size > 1) {  // the later stages on threads
      auto lm = unwrap(LlamaModel::load(file));
      const std::vector<LayerRange> cut = unwrap(even_cut(lm->config().n_layers, a.pipeline_parallel_size));
      eo.last_layer = cut[0].last;
      engine = unwrap(Engine::create(file, eo));
      std::vector<std::shared_ptr<LayerStage>> later;
      for (size_t i = 1; i < cut.size(); ++i)
        later.push_back(unwrap(LayerStage::create(file, cut[i], engine->total_blocks(),
                                                  eo.block_size, eo.threads, eo.cache_type_k,
                                                  eo.cache_type_v, eo.compute, eo.device)));
      std::shared_ptr<StageLink> link = unwrap(ThreadedStageLink::create(std::move(later)));
      if (Status st = engine->set_stage_link(std::move(link)); !st.ok()) fail(st);
    } else {
      engine = unwrap(Engine::create(file, eo));
    }
  }
  if (engine && !a.experts.empty()) {  // the hosts in process
    std::shared_ptr<ExpertPool> pool = unwrap(ExpertPool::create(file, parse_experts_flag(a.experts), eo.threads,
                                                                  eo.compute, eo.device));
    if (a.enable_eplb) pool->set_replication(ReplicationPolicy{}, engine->config().n_layers);
    engine->set_expert_executor(std::move(pool));
  }

  std::shared_ptr<const Tokenizer> tok;
  auto t = Tokenizer::from_gguf(*file);
  if (t.ok()) tok = std::move(*t);
  else if (!a.prompt.empty()) fail(t.status());

  GenerateRequest req;
  double encode_seconds = 0;
  std::shared_ptr<const GgufFile> mmproj;
  if (!a.images.empty()) {
    // LLaVA-style prompt: <image> markers (or images first). mono encodes on
    // the engine's backend; the actor topologies' vision_encoder actors do.
    mmproj = unwrap(GgufFile::open(a.mmproj));
    const int32_t n_embd =
        engine ? engine->config().dim : unwrap(LlamaModel::load(file))->config().dim;
    auto clip = load_mmproj(a.mmproj, n_embd);
    std::vector<RgbImage> images;
    for (const std::string& path : a.images) images.push_back(load_image(path));
    req = unwrap(build_image_prompt(*tok, a.prompt, std::move(images), clip->config().n_patches,
                                    !a.no_bos));
    if (engine) {
      const auto t0 = std::chrono::steady_clock::now();
      Status st = encode_images(*clip, engine->backend(), n_embd, req);
      if (!st.ok()) fail(st);
      encode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  } else {
    req.prompt = a.prompt_ids.empty() ? tok->encode(a.prompt, !a.no_bos) : parse_ids(a.prompt_ids);
  }
  req.sampling = a.sampling;
  req.sampling.max_tokens = a.n_predict;
  req.prefill_chunk = a.ubatch;
  req.ignore_eos = a.ignore_eos;
  req.keep_logits = !a.logits_path.empty();

  if (topology != Topology::mono)
    return run_pipeline(a, file, std::move(tok), topology, eo, req, std::move(mmproj));

  auto on_text = [&](const std::string& piece) {
    if (a.json) return;
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  };
  if (!a.json && !a.prompt.empty()) {  // echo the prompt, as llama.cpp does
    std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
    std::fflush(stdout);
  }
  GenerateResult r = unwrap(generate(*engine, tok.get(), req, on_text));

  if (!a.logits_path.empty()) {
    std::ofstream f(a.logits_path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(r.logits.data()), std::streamsize(r.logits.size() * 4));
    if (!f) fail(Status(Code::io_error, "cannot write logits to '" + a.logits_path + "'"));
  }
  const double pf_tps = r.prefill_seconds > 0 ? r.prefill_tokens / r.prefill_seconds : 0;
  const double dc_tps = r.decode_seconds > 0 ? r.decode_tokens / r.decode_seconds : 0;
  if (a.json) {
    nlohmann::json j;
    j["prompt_ids"] = req.prompt;
    j["generated_ids"] = r.tokens;
    j["text"] = r.text;
    j["finish_reason"] = r.finish_reason;
    j["timings"] = {{"prefill_tokens", r.prefill_tokens},   {"prefill_seconds", r.prefill_seconds},
                    {"prefill_tok_per_s", pf_tps},          {"decode_tokens", r.decode_tokens},
                    {"decode_seconds", r.decode_seconds},   {"decode_tok_per_s", dc_tps},
                    {"threads", eo.threads}};
    if (!a.images.empty()) {
      j["images"] = req.images.size();
      for (const PromptImage& im : req.images) j["image_spans"].push_back({im.position, im.n_tokens});
      j["timings"]["encode_seconds"] = encode_seconds;
    }
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::fprintf(stderr, "\n\n");
    if (!a.images.empty())
      std::fprintf(stderr, "encode: %zu images, %.1f ms | ", req.images.size(), encode_seconds * 1e3);
    std::fprintf(stderr, "prefill: %d tokens, %.1f tok/s | decode: %d tokens, %.1f tok/s | %s\n",
                 r.prefill_tokens, pf_tps, r.decode_tokens, dc_tps, r.finish_reason.c_str());
  }
  return 0;
}

// ---- generate --requests -----------------------------------------------
// The JSONL format of frontend/request_codec.h (the same as `cleave node
// --requests`): each line names its own sampling; the request flags of a
// single run (-n, --temp, ...) are refused with --requests. Images are
// decoded, then encoded by the pipeline; every request runs at once.
int run_generate_requests(const GenerateArgs& a) {
  if (!a.prompt.empty() || !a.prompt_ids.empty() || !a.images.empty() || !a.logits_path.empty())
    throw CLI::ValidationError("--requests", "takes the prompts from the file: no -p, --prompt-ids, "
                                             "--image or --logits");
  if (!a.request_flags_given.empty())
    throw CLI::ValidationError("--requests", a.request_flags_given + " sets a field of one request; with "
                                             "--requests each line sets its own (\"max_tokens\", "
                                             "\"temperature\", ...)");
  const Topology topology = unwrap(parse_topology(a.topology));
  check_topology_flags(a, topology);
  auto file = unwrap(GgufFile::open(a.model));
  const int32_t threads =
      a.threads > 0 ? a.threads : int32_t(std::max(1u, std::thread::hardware_concurrency()));
  std::shared_ptr<const Tokenizer> tok;
  if (auto t = Tokenizer::from_gguf(*file); t.ok()) tok = std::move(*t);
  std::unique_ptr<ClipModel> clip;
  if (!a.mmproj.empty()) {
    auto lm = unwrap(LlamaModel::load(file));
    clip = load_mmproj(a.mmproj, lm->config().dim);
  }
  RequestContext rc;
  rc.tokenizer = tok.get();
  rc.image_tokens = clip ? clip->config().n_patches : 0;
  std::vector<GenerateRequest> requests = unwrap(read_request_file(a.requests, rc));
  const bool has_images = std::any_of(requests.begin(), requests.end(),
                                      [](const GenerateRequest& r) { return !r.images.empty(); });
  check_image_usage(a, has_images);

  size_t n_images = 0;
  std::set<std::pair<uint64_t, uint64_t>> distinct;
  for (const GenerateRequest& r : requests)
    for (const PromptImage& im : r.images) {
      ++n_images;
      distinct.insert({im.hash.lo, im.hash.hi});
    }

  // Images are encoded by the pipeline: inline before prefill in mono, by
  // vision_encoder actors in colocated and pd (E/P/D).
  PipelineOptions po;
  po.topology = topology;
  po.prefill_actors = a.prefill_actors;
  po.decode_actors = a.decode_actors;
  if (clip) {
    po.mmproj = unwrap(GgufFile::open(a.mmproj));
    po.vision_actors = a.vision_actors;
    po.vision.threads = threads;
  }
  po.engine.threads = threads;
  po.engine.context = a.ctx;
  po.engine.max_seqs = int32_t(std::min<size_t>(requests.size(), 64));
  po.engine.expert_micro_batches = a.expert_micro_batches;
  po.engine.pipeline_micro_batches = a.pipeline_micro_batches;
  apply_numerics(a.numerics, po.engine);
  po.expert_replication = a.enable_eplb;
  po.max_pending = 4096;
  po.scheduler.policy = *parse_scheduling_policy(a.scheduling_policy);  // CLI checked the spelling
  po.experts = parse_experts_flag(a.experts);
  po.pipeline_parallel_size = a.pipeline_parallel_size;
  auto pipeline = unwrap(Pipeline::create(file, tok, po));
  const auto t1 = std::chrono::steady_clock::now();
  const std::vector<Completion> done = unwrap(pipeline->run(requests));
  const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();

  std::ofstream file_out;
  if (!a.out.empty()) {
    file_out.open(a.out);
    if (!file_out) fail(Status(Code::io_error, "cannot write '" + a.out + "'"));
  }
  std::ostream& out = a.out.empty() ? std::cout : file_out;
  size_t failed = 0;
  double encode_s = 0;  // the encoder steps' time, once per step
  std::set<std::pair<std::string, double>> encoder_steps;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Completion& c = done[i];
    if (!c.encode_origin.empty() && encoder_steps.insert({c.encode_origin, c.encode_seconds}).second)
      encode_s += c.encode_seconds;
    failed += !c.error.ok();
    out << result_line(requests[i].request_id, c) << "\n";
  }
  out.flush();
  if (!out) fail(Status(Code::io_error, "cannot write the results"));
  std::fprintf(stderr,
               "%s: %zu requests (%zu failed) | encode: %zu images (%zu distinct), %.1f ms | run: %.1f ms\n",
               topology_name(topology), requests.size(), failed, n_images, distinct.size(),
               encode_s * 1e3, run_s * 1e3);
  return 0;
}

// ---- inspect -------------------------------------------------------------
std::string value_str(const GgufValue& v) {
  switch (v.type) {
    case GgufType::STRING: return "\"" + v.s + "\"";
    case GgufType::BOOL: return v.u ? "true" : "false";
    case GgufType::FLOAT32:
    case GgufType::FLOAT64: {
      std::ostringstream s;
      s << v.f;
      return s.str();
    }
    case GgufType::INT8:
    case GgufType::INT16:
    case GgufType::INT32:
    case GgufType::INT64: return std::to_string(v.i);
    case GgufType::ARRAY:
      return std::string("[") + gguf_type_name(v.array_type) + " x " +
             std::to_string(v.array_len()) + "]";
    default: return std::to_string(v.u);
  }
}

int run_inspect(const std::string& path) {
  auto file = unwrap(GgufFile::open(path));
  std::printf("file: %s\nGGUF version %u, alignment %llu, %zu bytes, %zu metadata keys, %zu tensors\n\n",
              path.c_str(), file->version(), (unsigned long long)file->alignment(),
              file->file_size(), file->metadata().size(), file->tensors().size());
  std::printf("%-48s %-8s %s\n", "key", "type", "value");
  for (const GgufKv& kv : file->metadata())
    std::printf("%-48s %-8s %s\n", kv.key.c_str(), gguf_type_name(kv.value.type),
                value_str(kv.value).c_str());
  uint64_t params = 0, bytes = 0;
  if (!file->tensors().empty()) {
    std::printf("\n%-36s %-5s %-24s %12s %12s\n", "tensor", "type", "shape (ne)", "offset", "bytes");
    for (const GgufTensorInfo& t : file->tensors()) {
      std::string shape;
      for (uint32_t i = 0; i < t.n_dims; ++i) shape += (i ? " x " : "") + std::to_string(t.ne[i]);
      std::printf("%-36s %-5s %-24s %12llu %12llu\n", t.name.c_str(), dtype_name(t.type),
                  shape.c_str(), (unsigned long long)t.offset, (unsigned long long)t.bytes);
      params += uint64_t(t.n_elements());
      bytes += t.bytes;
    }
  }
  std::printf("\nparameters: %llu (%.2f M), tensor bytes: %llu (%.2f MiB)\n",
              (unsigned long long)params, params / 1e6, (unsigned long long)bytes,
              bytes / 1048576.0);
  return 0;
}

// ---- make-model ----------------------------------------------------------
struct MakeArgs {
  ModelSpec spec;
  std::string out, vocab, type = "f32";
};

int run_make_model(MakeArgs a) {
  a.spec.type = unwrap(dtype_from_name(a.type));
  Status st = write_test_model(a.spec, a.vocab, a.out);
  if (!st.ok()) fail(st);
  std::printf("wrote %s\n", a.out.c_str());
  return 0;
}

// ---- topology -------------------------------------------------------------
//   cleave topology check FILE [--set key=value]... [-m MODEL]   "ok: 3 nodes, ..." or one error line
//   cleave topology show FILE [--set key=value]... [-m MODEL]    the placement table
// With -m, the expert placement is checked against that model too.
struct TopologyArgs {
  std::string path, model;
  std::vector<std::string> sets;
  CLI::App *check = nullptr, *show = nullptr;
};

CLI::App* add_topology_command(CLI::App& app, TopologyArgs& t) {
  auto* topo = app.add_subcommand("topology", "validate or show a Lua topology script");
  topo->require_subcommand(1);
  t.check = topo->add_subcommand("check", "validate a topology script");
  t.show = topo->add_subcommand("show", "print the placement a topology script gives");
  for (CLI::App* sub : {t.check, t.show}) {
    sub->add_option("file", t.path, "topology script (.lua)")->required()->check(CLI::ExistingFile);
    sub->add_option("--set", t.sets, "key=value for the script's args table (repeatable)");
    sub->add_option("-m,--model", t.model,
                    "GGUF model: also check that every expert of every layer has a host")
        ->check(CLI::ExistingFile);
  }
  return topo;
}

int run_topology(const TopologyArgs& t) {
  std::map<std::string, std::string> args;
  for (const std::string& kv : t.sets) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      throw CLI::ValidationError("--set", "'" + kv + "' is not key=value");
    args[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  ClusterSpec spec = unwrap(load_topology_file(t.path, args));
  if (!t.model.empty()) {
    auto model = unwrap(LlamaModel::load(unwrap(GgufFile::open(t.model))));
    if (Status st = check_topology_experts(spec, model->config()); !st.ok()) fail(st);
    if (Status st = check_topology_pipelines(spec, &model->config()); !st.ok()) fail(st);
  }
  if (*t.show)
    std::fputs(placement_table(spec).c_str(), stdout);
  else
    std::printf("ok: %s\n", topology_summary(spec).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cleave: disaggregated inference runtime"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "cleave 0.1");

  GenerateArgs g;
  auto* gen = app.add_subcommand("generate", "generate text from a prompt");
  gen->add_option("-m,--model", g.model, "GGUF model file")->required()->check(CLI::ExistingFile);
  gen->add_option("-p,--prompt", g.prompt, "prompt text");
  gen->add_option("--prompt-ids", g.prompt_ids, "prompt as comma-separated token ids");
  gen->add_option("-n,--n-predict", g.n_predict, "tokens to generate")->check(CLI::Range(0, 1 << 24));
  gen->add_option("--temp", g.sampling.temperature, "temperature (0: greedy)")->check(CLI::Range(0.0, 100.0));
  gen->add_option("-s,--seed", g.sampling.seed, "sampling seed");
  gen->add_option("--top-k", g.sampling.top_k, "top-k (0: off)")->check(CLI::Range(0, 1 << 30));
  gen->add_option("--top-p", g.sampling.top_p, "top-p (1: off)")->check(CLI::Range(0.0, 1.0));
  gen->add_option("--min-p", g.sampling.min_p, "min-p (0: off)")->check(CLI::Range(0.0, 1.0));
  gen->add_option("--repeat-penalty", g.sampling.repeat_penalty, "repetition penalty (1: off)")
      ->check(CLI::Range(0.01, 100.0));
  gen->add_option("--repeat-last-n", g.sampling.repeat_last_n, "tokens the penalty looks back")
      ->check(CLI::Range(0, 1 << 24));
  gen->add_option("--stop,-r,--reverse-prompt", g.sampling.stop, "stop string (repeatable)");
  gen->add_option("-t,--threads", g.threads, "threads (default: all cores)")->check(CLI::Range(1, 1024));
  gen->add_option("-c,--ctx-size", g.ctx, "context size (0: the model's)")->check(CLI::Range(0, 1 << 24));
  gen->add_option("--ubatch-size", g.ubatch, "prompt tokens per prefill step")->check(CLI::Range(1, 1 << 20));
  add_numerics_options(gen, g.numerics);
  gen->add_flag("--ignore-eos", g.ignore_eos, "keep generating after EOS");
  gen->add_option("--topology", g.topology, "mono, colocated or pd (prefill and decode actors)")
      ->check(CLI::IsMember({"mono", "colocated", "pd"}));
  gen->add_option("--prefill-actors", g.prefill_actors, "prefill actors (pd)")->check(CLI::Range(1, 64));
  gen->add_option("--decode-actors", g.decode_actors, "decode actors (pd)")->check(CLI::Range(1, 64));
  gen->add_option("--vision-actors", g.vision_actors,
                  "vision_encoder actors (colocated, pd: E/P/D; with --mmproj)")
      ->check(CLI::Range(1, 64));
  gen->add_option("--experts", g.experts, kExpertsHelp);
  gen->add_option("--expert-micro-batches", g.expert_micro_batches, kExpertMicroBatchesHelp)
      ->check(CLI::Range(1, 64));
  gen->add_flag("--enable-eplb", g.enable_eplb, kEnableEplbHelp);
  gen->add_option("--pipeline-parallel-size", g.pipeline_parallel_size, kPipelineParallelHelp)
      ->check(CLI::Range(1, 1024));
  gen->add_option("--pipeline-micro-batches", g.pipeline_micro_batches, kPipelineMicroBatchesHelp)
      ->check(CLI::Range(1, 64));
  gen->add_option("--scheduling-policy", g.scheduling_policy,
                  "with --requests: fcfs (arrival order; a nonzero \"priority\" is refused) or "
                  "priority (lower \"priority\" first, preempting higher values)")
      ->check(CLI::IsMember({"fcfs", "priority"}));
  gen->add_flag("--no-bos", g.no_bos, "do not add BOS to a text prompt");
  gen->add_flag("--json", g.json, "print one JSON object with ids, text and timings");
  gen->add_option("--logits", g.logits_path, "write each step's logits (float32, steps x n_vocab)");
  gen->add_option("--mmproj", g.mmproj, "vision encoder + projector GGUF (llama.cpp mmproj)")
      ->check(CLI::ExistingFile);
  gen->add_option("--image", g.images, "image file (PNG or JPEG; repeatable; <image> in the prompt "
                                       "marks where each goes, else they go first)")
      ->check(CLI::ExistingFile);
  gen->add_option("--requests", g.requests,
                  "JSONL requests to run together (one per line: id, prompt or prompt_ids, images, "
                  "max_tokens, ...); results go to --out")
      ->check(CLI::ExistingFile);
  gen->add_option("--out", g.out, "JSONL results of --requests (default: stdout)");

  std::string inspect_path;
  auto* ins = app.add_subcommand("inspect", "print a GGUF file's metadata and tensors");
  ins->add_option("model", inspect_path, "GGUF file")->required()->check(CLI::ExistingFile);

  MakeArgs mk;
  auto* make = app.add_subcommand("make-model", "write a GGUF test model with deterministic weights");
  make->add_option("-o,--out", mk.out, "output GGUF path")->required();
  make->add_option("--vocab", mk.vocab, "GGUF file whose tokenizer the model takes")->required()->check(CLI::ExistingFile);
  make->add_option("--dim", mk.spec.dim);
  make->add_option("--layers", mk.spec.n_layers);
  make->add_option("--heads", mk.spec.n_heads);
  make->add_option("--kv-heads", mk.spec.n_kv_heads);
  make->add_option("--ffn", mk.spec.ffn);
  make->add_option("--experts", mk.spec.n_experts);
  make->add_option("--experts-used", mk.spec.n_experts_used);
  make->add_option("--router-skew", mk.spec.router_skew,
                   "MoE: favour low-numbered experts (router row e scaled by 1 + S (n-1-e)/(n-1)); 0: none");
  make->add_option("--ctx", mk.spec.context);
  make->add_option("--rope-base", mk.spec.rope_base);
  make->add_option("--rms-eps", mk.spec.rms_eps);
  make->add_option("--type", mk.type, "f32, f16, bf16 or q8_0");
  make->add_option("--seed", mk.spec.seed);
  make->add_option("--name", mk.spec.name);
  make->add_flag("--tied", mk.spec.tied_output, "reuse token_embd as the output matrix");

  TopologyArgs topo_args;
  auto* topo = add_topology_command(app, topo_args);
  auto* node = add_node_command(app);  // apps/node_cmd.cpp
  auto* serve = add_serve_command(app);  // apps/serve_cmd.cpp
  auto* plan = add_plan_command(app);    // apps/plan_cmd.cpp
#ifdef CLEAVE_HAVE_JOBS
  auto* run_batch = add_run_batch_command(app);  // apps/batch_cmd.cpp
  auto* job = add_job_command(app);
#endif

  cleave::set_process_args(argc, argv);  // a worker that lost its head starts again with them
  std::vector<std::string> arg_storage;
  std::vector<char*> args;
  cleave::rewrite_short_flags(argc, argv, arg_storage, args);
  try {
    app.parse(int(args.size()), args.data());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "cleave: usage error: %s (see --help)\n", e.what());
    return 2;
  }
  for (const char* flag : {"--n-predict", "--temp", "--seed", "--top-k", "--top-p", "--min-p",
                           "--repeat-penalty", "--repeat-last-n", "--stop", "--ubatch-size",
                           "--ignore-eos", "--no-bos"})
    if (gen->get_option(flag)->count() > 0)
      g.request_flags_given += (g.request_flags_given.empty() ? "" : ", ") + std::string(flag);
  g.prefill_actors_given = gen->get_option("--prefill-actors")->count() > 0;
  g.expert_micro_batches_given = gen->get_option("--expert-micro-batches")->count() > 0;
  g.pipeline_micro_batches_given = gen->get_option("--pipeline-micro-batches")->count() > 0;
  g.decode_actors_given = gen->get_option("--decode-actors")->count() > 0;
  g.vision_actors_given = gen->get_option("--vision-actors")->count() > 0;
  try {
    if (*gen) return run_generate(g);
    if (*ins) return run_inspect(inspect_path);
    if (*make) return run_make_model(mk);
    if (*topo) return run_topology(topo_args);
    if (*node) return run_node_command();
    if (*serve) return run_serve_command(serve);
    if (*plan) return run_plan_command();
#ifdef CLEAVE_HAVE_JOBS
    if (*run_batch) return run_run_batch_command(run_batch);
    if (*job) return run_job_command();
#endif
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "cleave: usage error: %s\n", e.what());
    return 2;
  } catch (const RunError& e) {
    std::fprintf(stderr, "cleave: error: %s\n", e.message.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cleave: error: %s\n", e.what());
    return 1;
  }
  return 2;
}
