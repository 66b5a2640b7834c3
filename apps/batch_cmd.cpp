// cleave run-batch -i IN.jsonl -o OUT.jsonl -m MODEL [--job-dir DIR] [topology flags]
// cleave job status DIR [--json]
// A durable batch job (jobs/job_runner.h) over one process's topology: the
// journal and the KV store live in the job directory (default OUT.job), so
// the same command, run again after a kill, continues the job.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>

#include "actors/pipeline.h"
#include "apps/process_topology.h"
#include "jobs/job_runner.h"
#include "jobs/job_status.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "server/served_model.h"

namespace cleave {
namespace {

struct BatchArgs {
  std::string input, output, model, mmproj, job_dir, media_path, alias, chat_template;
  int64_t kv_disk_mib = 0;
  ProcessTopologyArgs topo;
};
BatchArgs g_batch;
std::string g_status_dir;
bool g_status_json = false;
std::atomic<bool> g_batch_stop{false};
void on_batch_signal(int) { g_batch_stop.store(true); }

int fail(const Status& st) {
  std::fprintf(stderr, "cleave: error: %s\n", st.to_string().c_str());
  return 1;
}

}  // namespace
}  // namespace cleave

CLI::App* add_run_batch_command(CLI::App& app) {
  using cleave::g_batch;
  auto* cmd = app.add_subcommand("run-batch", "run an OpenAI batch file as a durable job (resumable after a kill)");
  cmd->add_option("-i,--input-file", g_batch.input, "OpenAI batch input (JSONL)")->required()->check(CLI::ExistingFile);
  cmd->add_option("-o,--output-file", g_batch.output, "OpenAI batch output (JSONL, appended)")->required();
  cmd->add_option("-m,--model", g_batch.model, "GGUF model file")->required()->check(CLI::ExistingFile);
  cmd->add_option("--mmproj", g_batch.mmproj, "vision encoder GGUF (image_url parts in chat)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--job-dir", g_batch.job_dir, "journal and KV of the job (default: OUTPUT.job)");
  cmd->add_option("--media-path,--allowed-local-media-path", g_batch.media_path,
                  "directory whose images file:// URLs may name")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("-a,--alias,--served-model-name", g_batch.alias,
                  "the model name bodies must give (default: general.name, else the file's stem)");
  cmd->add_option("--chat-template", g_batch.chat_template, "built-in chat template (default: the GGUF's)");
  cmd->add_option("--kv-disk-mib", g_batch.kv_disk_mib,
                  "disk the job's KV store may use (MiB; 0: 16 GiB); beyond it the least recently used "
                  "blocks (finished requests') are dropped")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30));
  cleave::add_process_topology_options(cmd, g_batch.topo);
  return cmd;
}

CLI::App* add_job_command(CLI::App& app) {
  auto* job = app.add_subcommand("job", "inspect a batch job directory");
  job->require_subcommand(1);
  auto* status = job->add_subcommand("status", "the job as OpenAI's Batch object shows it, with throughput and ETA");
  status->add_option("dir", cleave::g_status_dir, "job directory (run-batch --job-dir)")
      ->required()
      ->check(CLI::ExistingDirectory);
  status->add_flag("--json", cleave::g_status_json, "print the Batch object as JSON");
  return job;
}

int run_job_command() {
  using namespace cleave;
  auto journal = jobs::Journal::open_read_only(g_status_dir + "/journal");
  if (!journal.ok()) return fail(journal.status());
  auto meta = (*journal)->meta();
  if (!meta.ok()) return fail(meta.status());
  if (g_status_json) {
    const std::string id = "batch_" + meta->input_fingerprint.substr(0, 24);
    std::printf("%s\n", jobs::batch_object_json(*meta, id, meta->input_path, meta->output_path,
                                                g_status_dir + "/input_errors.jsonl")
                            .c_str());
  } else {
    std::printf("%s\n", jobs::job_summary(*meta).c_str());
  }
  return 0;
}

int run_run_batch_command(CLI::App* cmd) {
  using namespace cleave;
  const BatchArgs& a = g_batch;
  check_process_topology_flags(cmd, a.topo, !a.mmproj.empty());
  auto file = GgufFile::open(a.model);
  if (!file.ok()) return fail(file.status());
  std::shared_ptr<const GgufFile> model = std::move(*file);
  auto tok = Tokenizer::from_gguf(*model);
  if (!tok.ok()) return fail(tok.status());
  std::shared_ptr<const Tokenizer> tokenizer = std::move(*tok);
  std::shared_ptr<const GgufFile> mmproj;
  if (!a.mmproj.empty()) {
    auto mm = GgufFile::open(a.mmproj);
    if (!mm.ok()) return fail(mm.status());
    mmproj = std::move(*mm);
  }
  server::ServedModelArgs sm;
  sm.model = model;
  sm.mmproj = mmproj;
  sm.tokenizer = tokenizer;
  sm.name = a.alias;
  sm.model_path = a.model;
  sm.chat_template = a.chat_template;
  sm.context = a.topo.ctx;
  sm.prefill_chunk = a.topo.ubatch;
  auto served = server::describe_served_model(sm);
  if (!served.ok()) return fail(served.status());

  jobs::JobOptions jo;
  jo.job_dir = a.job_dir.empty() ? a.output + ".job" : a.job_dir;
  jo.settings = job_settings(*model, mmproj.get(), a.topo.numerics);
  jo.input_path = a.input;
  jo.output_path = a.output;
  jo.parse.media_root = a.media_path;
  jo.max_in_flight = a.topo.max_pending;
  const bool tty = ::isatty(2) == 1;
  auto last_bar = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  if (tty)
    jo.on_progress = [&](const jobs::JobMeta& m) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_bar < std::chrono::milliseconds(100) && m.status != jobs::JobStatus::completed) return;
      last_bar = now;
      std::fprintf(stderr, "%s", jobs::progress_bar(m).c_str());
      std::fflush(stderr);
    };

  PipelineOptions po = process_pipeline_options(a.topo, mmproj);
  po.kv_dir = jo.job_dir + "/kv";
  po.kv_durable = true;
  po.kv_disk_bytes = size_t(a.kv_disk_mib) << 20;
  std::signal(SIGINT, on_batch_signal);
  std::signal(SIGTERM, on_batch_signal);
  // The job first: its refusals (another input, a bad file) come before the engines start.
  auto runner = jobs::JobRunner::open(jo, std::move(*served));
  if (!runner.ok()) return fail(runner.status());
  auto pipeline = Pipeline::create(model, tokenizer, po);
  if (!pipeline.ok()) return fail(pipeline.status());
  std::fprintf(stderr, "cleave run-batch: job %s: %zu of %llu requests left (run %llu)\n", jo.job_dir.c_str(),
               (*runner)->remaining_at_open(), (unsigned long long)(*runner)->meta().total,
               (unsigned long long)(*runner)->meta().runs);
  auto done = (*runner)->run(**pipeline, &g_batch_stop);
  if (tty) std::fprintf(stderr, "\n");
  if (!done.ok()) return fail(done.status());
  std::fprintf(stderr, "cleave run-batch: %s | first new token %.3f s after start\n",
               jobs::job_summary(*done).c_str(), (*runner)->first_token_seconds());
  std::printf("%s\n", jobs::batch_object_json(*done, "batch_" + done->input_fingerprint.substr(0, 24),
                                              done->input_path, done->output_path, (*runner)->errors_path())
                          .c_str());
  return 0;
}
