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
#include "apps/process_topology.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

namespace cleave {
namespace {

struct ServeArgs {
  std::string model, mmproj;
  ProcessTopologyArgs topo;
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
  cleave::add_process_topology_options(cmd, g_serve.topo);
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
  check_process_topology_flags(cmd, a.topo, !a.mmproj.empty());
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
  f.context = a.topo.ctx;
  f.prefill_chunk = a.topo.ubatch;
  if (!a.http.batch_dir.empty()) f.settings = job_settings(*f.model, f.mmproj.get(), a.topo.numerics);
  PipelineOptions po = process_pipeline_options(a.topo, f.mmproj);
  if (!a.http.batch_dir.empty()) {
    // Batches resume after a restart with their KV read back from disk.
    po.kv_dir = a.http.batch_dir + "/kv";
    po.kv_durable = true;
  }
  std::signal(SIGINT, on_serve_signal);
  std::signal(SIGTERM, on_serve_signal);
  auto pipeline = Pipeline::create(f.model, f.tokenizer, po);
  if (!pipeline.ok()) return fail(pipeline.status());
  std::shared_ptr<void> batch_api;
  Status st = serve_through(**server, a.http, f, **pipeline, batch_api);
  if (!st.ok()) return fail(st);
  while (!g_serve_stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::fprintf(stderr, "cleave serve: stopping\n");
  server->reset();    // no route runs after this
  batch_api.reset();  // the running batch stops; it continues at the next start
  pipeline->reset();  // every request still running ends
  return 0;
}
