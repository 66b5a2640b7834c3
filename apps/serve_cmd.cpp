// cleave serve -m MODEL [--mmproj F] [--topology mono|colocated|pd] [--host H] [--port P] ...
// One process serves the OpenAI-compatible API (server/server.h) over the
// topology it runs. /health answers 503 while the model loads, then 200.
// Runs until SIGINT / SIGTERM.
#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

#include "actors/pipeline.h"
#include "apps/http_options.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

namespace cleave {
namespace {

struct ServeArgs {
  std::string model, mmproj, topology = "mono";
  int32_t threads = 0, ctx = 0, parallel = 8, ubatch = 512;
  int32_t prefill_actors = 1, decode_actors = 1, colocated_actors = 1, vision_actors = 1;
  int32_t max_pending = 1024;
  HttpArgs http;
};
ServeArgs g_serve;
std::atomic<bool> g_serve_stop{false};
void on_serve_signal(int) { g_serve_stop.store(true); }

}  // namespace
}  // namespace cleave

CLI::App* add_serve_command(CLI::App& app) {
  using cleave::g_serve;
  auto* cmd = app.add_subcommand("serve", "serve the OpenAI-compatible HTTP API over one process's topology");
  cmd->add_option("-m,--model", g_serve.model, "GGUF model file")->required()->check(CLI::ExistingFile);
  cmd->add_option("--mmproj", g_serve.mmproj, "vision encoder GGUF (image_url parts in chat)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--topology", g_serve.topology, "mono, colocated or pd")
      ->check(CLI::IsMember({"mono", "colocated", "pd"}));
  cmd->add_option("--prefill-actors", g_serve.prefill_actors, "prefill actors (pd)")->check(CLI::Range(1, 64));
  cmd->add_option("--decode-actors", g_serve.decode_actors, "decode actors (pd)")->check(CLI::Range(1, 64));
  cmd->add_option("--colocated-actors", g_serve.colocated_actors, "colocated actors (colocated)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--vision-actors", g_serve.vision_actors, "vision_encoder actors (colocated, pd)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("-t,--threads", g_serve.threads, "threads per engine (default: all cores)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("-c,--ctx-size", g_serve.ctx, "context size (0: the model's)")->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--parallel,--max-num-seqs", g_serve.parallel,
                  "sequences each engine runs at once (-np)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--ubatch-size", g_serve.ubatch, "prompt tokens per prefill step")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-pending", g_serve.max_pending,
                  "requests admitted and not finished; beyond: 503 with Retry-After")
      ->check(CLI::Range(1, 1 << 20));
  cleave::add_http_options(cmd, g_serve.http, "--port");
  return cmd;
}

int run_serve_command(CLI::App* cmd) {
  using namespace cleave;
  const ServeArgs& a = g_serve;
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "cleave: error: %s\n", st.to_string().c_str());
    return 1;
  };
  const Topology topology = *parse_topology(a.topology);
  auto given = [&](const char* flag) { return cmd->get_option(flag)->count() > 0; };
  if ((given("--prefill-actors") || given("--decode-actors")) && topology != Topology::pd)
    throw CLI::ValidationError(given("--prefill-actors") ? "--prefill-actors" : "--decode-actors",
                               "needs --topology pd");
  if (given("--colocated-actors") && topology != Topology::colocated)
    throw CLI::ValidationError("--colocated-actors", "needs --topology colocated");
  if (given("--vision-actors") && (topology == Topology::mono || a.mmproj.empty()))
    throw CLI::ValidationError("--vision-actors", "needs --mmproj and --topology colocated or pd");

  auto server = start_http(a.http);  // /health: 503 while loading
  if (!server.ok()) return fail(server.status());
  ServedFiles f;
  f.model_path = a.model;
  auto file = GgufFile::open(a.model);
  if (!file.ok()) return fail(file.status());
  f.model = std::move(*file);
  auto tok = Tokenizer::from_gguf(*f.model);
  if (!tok.ok()) return fail(tok.status());
  f.tokenizer = std::move(*tok);
  if (!a.mmproj.empty()) {
    auto mm = GgufFile::open(a.mmproj);
    if (!mm.ok()) return fail(mm.status());
    f.mmproj = std::move(*mm);
  }
  f.context = a.ctx;
  f.prefill_chunk = a.ubatch;

  PipelineOptions po;
  po.topology = topology;
  po.prefill_actors = a.prefill_actors;
  po.decode_actors = a.decode_actors;
  po.colocated_actors = a.colocated_actors;
  po.engine.threads = a.threads > 0 ? a.threads : int32_t(std::max(1u, std::thread::hardware_concurrency()));
  po.engine.context = a.ctx;
  po.engine.max_seqs = a.parallel;
  po.max_pending = a.max_pending;
  po.mmproj = f.mmproj;
  po.vision_actors = a.vision_actors;
  po.vision.threads = po.engine.threads;
  std::signal(SIGINT, on_serve_signal);
  std::signal(SIGTERM, on_serve_signal);
  auto pipeline = Pipeline::create(f.model, f.tokenizer, po);
  if (!pipeline.ok()) return fail(pipeline.status());
  Status st = serve_through(**server, a.http, f, **pipeline);
  if (!st.ok()) return fail(st);
  while (!g_serve_stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::fprintf(stderr, "cleave serve: stopping\n");
  server->reset();    // no route runs after this
  pipeline->reset();  // every request still running ends
  return 0;
}
