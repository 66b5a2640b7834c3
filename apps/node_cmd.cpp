// cleave node --topology FILE --name NODE -m MODEL [--mmproj MMPROJ] [--set k=v]...
//              [--requests IN.jsonl --out OUT.jsonl --wait-stages N]
// cleave node --join HOST:PORT --name NODE [--actors decode=2,...] -m MODEL
//              (the script and its --set values come from the head there)
// One process of a cluster (actors/node.h). The head prints
// "cleave node head listening on HOST:PORT" once it accepts joins; a worker
// prints "cleave node NAME joined HOST:PORT with N stages". Both run until
// SIGINT/SIGTERM (SIGTERM drains a worker first: its requests move to
// other stages) or, on a worker, until the head drains it (`cleave node
// drain NAME`); a worker exits 1 when the head goes away. With --requests
// the head waits for N attached stages, runs every request, writes one JSON
// line per request (in input order) and exits 0.
#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "actors/node.h"
#include "apps/http_options.h"
#include "apps/process_args.h"
#include "apps/process_topology.h"
#include "actors/topology.h"
#include "frontend/request_codec.h"
#include "model/clip.h"
#include "model/gguf.h"
#include "model/multimodal.h"
#include "model/tokenizer.h"
#include "schema/codec.h"

namespace cleave {
namespace {

struct NodeArgs {
  std::string topology, name, model, mmproj, requests, out;
  std::string join, actors, secret_file;  // --join HOST:PORT, what a node the script lacks hosts
  std::vector<std::string> sets;
  int32_t wait_stages = 1, threads = 1, ctx = 0, max_seqs = 8, expert_micro_batches = 1;
  int32_t pipeline_micro_batches = 1;
  double join_timeout_s = 30, wait_timeout_s = 60;
  bool no_rejoin = false, enable_eplb = false;
  uint32_t kv_chunk_bytes = kDefaultKvChunkBytes;
  int32_t kv_window = kDefaultKvWindow;
  bool kv_via_store = false;
  std::string kv_transport = "auto";
  int32_t kv_fault_corrupt_chunk = -1;
  bool kv_fault_corrupt_served = false;
  bool kv_fault_stale_index = false;
  bool fault_stall_attach = false;
};
NodeArgs g_args;
HttpArgs g_http;
CLI::App* g_node_cmd = nullptr;
CLI::App* g_drain_cmd = nullptr;
struct DrainArgs {
  std::string name, topology;
  std::vector<std::string> sets;
  double timeout_s = 300;
};
DrainArgs g_drain;
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};

void on_signal(int sig) {
  g_signal.store(sig);
  g_stop.store(true);
}

[[noreturn]] void fail(const Status& st) { throw std::runtime_error(st.to_string()); }

// One line per actor on stderr: what moved where (the head: router and
// store; a worker: its stages, with their KV stream counters).
void print_stats(Node& node, const std::string& name) {
  auto print = [&](const std::vector<msg::Stats>& stats) {
    for (const msg::Stats& s : stats) {
      std::string line = "cleave node " + name + ": stats " + s.actor;
      for (const auto& [k, v] : s.counters) line += " " + k + "=" + std::to_string(v);
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  };
  print(node.stats());
  // A head serving several models: the other models' routers and stores
  // (they name themselves by their model: "model:PATH/router").
  const auto models = node.model_frontends();
  for (size_t i = 1; i < models.size(); ++i) print(models[i].second->stats());
}

template <class T>
T unwrap(Result<T> r) {
  if (!r.ok()) fail(r.status());
  return std::move(*r);
}

std::map<std::string, std::string> parse_sets(const std::vector<std::string>& sets) {
  std::map<std::string, std::string> out;
  for (const std::string& s : sets) {
    const size_t eq = s.find('=');
    if (eq == std::string::npos || eq == 0)
      throw CLI::ValidationError("--set", "'" + s + "' is not key=value");
    out[s.substr(0, eq)] = s.substr(eq + 1);
  }
  return out;
}

// Runs every request (the JSONL format of frontend/request_codec.h) once
// N stages are attached, and writes one result line per request, in input
// order.
int run_requests(Node& node, const NodeArgs& a, const std::vector<GenerateRequest>& requests) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(a.wait_timeout_s * 1e3));
  int32_t attached = 0;
  while ((attached = node.stages()) < a.wait_stages) {
    if (g_stop) fail(Status(Code::aborted, "stopped by a signal"));
    if (std::chrono::steady_clock::now() >= deadline)
      fail(Status(Code::timed_out, "only " + std::to_string(attached) + " of " +
                                       std::to_string(a.wait_stages) + " stages attached after " +
                                       std::to_string(a.wait_timeout_s) + " s"));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const std::vector<Completion> done = unwrap(run_to_completion(node, requests, &g_stop, [&] {
    std::printf("cleave node head: submitted %zu requests\n", requests.size());
    std::fflush(stdout);
  }));
  std::ofstream out(a.out);
  if (!out) fail(Status(Code::io_error, "cannot write '" + a.out + "'"));
  size_t failed = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    failed += !done[i].error.ok();
    out << result_line(requests[i].request_id, done[i]) << "\n";
  }
  out.close();
  if (!out) fail(Status(Code::io_error, "cannot write '" + a.out + "'"));
  std::fprintf(stderr, "cleave node head: %zu requests, %zu failed, results in %s\n", requests.size(),
               failed, a.out.c_str());
  print_stats(node, "head");
  return 0;
}

// Destroys the node, but ends the process with `code` if that has not
// finished within a few seconds: CAF 0.17's actor_system destructor now and
// then waits forever for a detached stage actor after the connection to the
// head broke (about 1 in 15 lost-head exits here). The process is done by
// then; only its exit code is left to give.
int finish(std::unique_ptr<Node> node, int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::thread([code] {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    std::fflush(nullptr);
    std::_Exit(code);
  }).detach();
  node.reset();
  return code;
}

}  // namespace
}  // namespace cleave

CLI::App* add_node_command(CLI::App& app) {
  using cleave::g_args;
  auto* cmd = app.add_subcommand("node", "run one node of a cluster from a topology script");
  // Required unless the command is `cleave node drain` (run_node_command checks).
  cmd->add_option("--topology", g_args.topology, "Lua topology script")->check(CLI::ExistingFile);
  cmd->add_option("--name", g_args.name, "this node's name in the topology");
  cmd->add_option("-m,--model", g_args.model, "GGUF model file")->check(CLI::ExistingFile);
  cmd->add_option("--mmproj", g_args.mmproj,
                  "vision encoder GGUF: the node's vision_encoder actors run it; the head reads "
                  "images in --requests with it (node{}.mmproj in the script names it too)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", g_args.sets, "key=value visible to the script as args / param() (repeatable)");
  cmd->add_option("-t,--threads", g_args.threads, "threads per engine (the node's threads win)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("-c,--ctx-size", g_args.ctx, "context size (0: the model's)")->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--max-seqs", g_args.max_seqs, "sequences per stage engine")->check(CLI::Range(1, 4096));
  cmd->add_option("--expert-micro-batches", g_args.expert_micro_batches, cleave::kExpertMicroBatchesHelp)
      ->check(CLI::Range(1, 64));
  cmd->add_flag("--enable-eplb", g_args.enable_eplb, cleave::kEnableEplbHelp);
  cmd->add_option("--pipeline-micro-batches", g_args.pipeline_micro_batches,
                  cleave::kPipelineMicroBatchesHelp)
      ->check(CLI::Range(1, 64));
  cmd->add_option("--join", g_args.join,
                  "HOST:PORT of a running cluster's head: join it with the head's topology script and --set "
                  "values (instead of --topology)");
  cmd->add_option("--actors", g_args.actors,
                  "with --join, for a node the script does not declare: what it hosts, e.g. decode=2,prefill=1 "
                  "(prefill, decode, colocated, vision_encoder)");
  cmd->add_option("--secret-file", g_args.secret_file,
                  "with --join: the cluster secret's file (default: $CLEAVE_CLUSTER_SECRET; the head's script "
                  "does not choose where a joining node reads it)");
  cmd->add_option("--join-timeout", g_args.join_timeout_s, "worker: seconds to keep trying the head")
      ->check(CLI::Range(0.0, 3600.0));
  cmd->add_flag("--no-rejoin", g_args.no_rejoin,
                "worker: exit 1 when the head goes away (default: start again and wait --join-timeout "
                "for a restarted head)");
  cmd->add_option("--kv-chunk-bytes", g_args.kv_chunk_bytes,
                  "decode: KV bytes per chunk of the streams it pulls")
      ->check(CLI::Range(cleave::codec::kMinKvChunkBytes, cleave::codec::kMaxKvChunkBytes));
  cmd->add_option("--kv-window", g_args.kv_window, "decode: KV chunks in flight per stream")
      ->check(CLI::Range(1, cleave::codec::kMaxKvWindow));
  cmd->add_flag("--kv-via-store", g_args.kv_via_store,
                "prefill: hand KV over through the head's store only (no direct stream)");
  cmd->add_option("--kv-transport", g_args.kv_transport,
                  "KV streams between processes: auto (shared memory with a node on this host; between "
                  "GPU nodes elsewhere a device link (NCCL); else the data socket) or socket (the data "
                  "socket always; this node neither offers nor takes shared memory or device links)")
      ->check(CLI::IsMember({"auto", "socket"}));
  // Tests only (hidden): the store's answers to other stores carry a
  // flipped byte in every block, so receivers must catch it.
  cmd->add_flag("--kv-fault-corrupt-served", g_args.kv_fault_corrupt_served,
                "tests: this node's kv_store flips a byte of every block it serves to another store")
      ->group("");
  // Tests only (hidden): this node's KV sender flips a bit in every stream
  // it sends (socket: that chunk; shared memory: that block mod the blocks).
  cmd->add_option("--kv-fault-corrupt-chunk", g_args.kv_fault_corrupt_chunk,
                  "tests: this prefill node corrupts chunk N of every KV stream it sends")
      ->check(CLI::Range(0, 1 << 30))
      ->group("");
  // Tests only (hidden): the pool's index keeps naming blocks this store
  // dropped, so readers must cope with short answers.
  cmd->add_flag("--kv-fault-stale-index", g_args.kv_fault_stale_index,
                "tests: this node's kv_store never tells the pool's index what left it")
      ->group("");
  // Tests only (hidden): workers join, their stages' attach never returns.
  cmd->add_flag("--fault-stall-attach", g_args.fault_stall_attach,
                "tests: this head never answers a worker's stage attach")
      ->group("");
  cmd->add_option("--requests", g_args.requests, "head: JSONL requests to run, then exit")
      ->check(CLI::ExistingFile);
  cmd->add_option("--out", g_args.out, "head: JSONL results of --requests");
  cmd->add_option("--wait-stages", g_args.wait_stages,
                  "head: stages to wait for before --requests (in a KV pool, each with its store known)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--wait-timeout", g_args.wait_timeout_s, "head: seconds to wait for those stages")
      ->check(CLI::Range(0.0, 3600.0));
  // head: the OpenAI-compatible HTTP API in front of the cluster's router
  cleave::add_http_options(cmd, cleave::g_http, "--http-port");
  cleave::g_node_cmd = cmd;
  auto* drain = cmd->add_subcommand(
      "drain", "drain a worker of a running cluster: it takes nothing new, its requests move to other "
               "nodes with their tokens (KV from the store), then it exits 0");
  drain->add_option("name", cleave::g_drain.name, "the worker's name in the topology")->required();
  drain->add_option("--topology", cleave::g_drain.topology, "the cluster's Lua topology script (the head's address)")
      ->required()
      ->check(CLI::ExistingFile);
  drain->add_option("--set", cleave::g_drain.sets, "key=value for the script, as for the nodes (repeatable)");
  drain->add_option("--timeout", cleave::g_drain.timeout_s, "seconds to wait for the head's answer")
      ->check(CLI::Range(0.1, 3600.0));
  cleave::g_drain_cmd = drain;
  return cmd;
}

int run_node_command() {
  using namespace cleave;
  const NodeArgs& a = g_args;
  if (*g_drain_cmd) {
    for (const CLI::Option* opt : g_node_cmd->get_options())
      if (opt->count() > 0 && opt->get_name() != "--help")
        throw CLI::ValidationError(opt->get_name(), "is a node's flag; `cleave node drain` takes NAME --topology "
                                                    "--set --timeout");
    const ClusterSpec spec = unwrap(load_topology_file(g_drain.topology, parse_sets(g_drain.sets)));
    const uint64_t moved = unwrap(drain_node(spec, g_drain.name, g_drain.timeout_s));
    std::printf("cleave node drain: node %s drained, %llu requests moved to other stages\n",
                g_drain.name.c_str(), static_cast<unsigned long long>(moved));
    return 0;
  }
  const bool joining = !a.join.empty();
  if (g_node_cmd->get_option("--name")->count() == 0) throw CLI::RequiredError("--name");
  if (joining) {
    for (const char* flag : {"--topology", "--set"})
      if (g_node_cmd->get_option(flag)->count() > 0)
        throw CLI::ValidationError(flag, "does not go with --join (the head's script and --set values apply)");
  } else {
    if (g_node_cmd->get_option("--topology")->count() == 0) throw CLI::RequiredError("--topology");
    for (const char* flag : {"--actors", "--secret-file"})
      if (g_node_cmd->get_option(flag)->count() > 0)
        throw CLI::ValidationError(flag, "needs --join (a script's nodes take their actors and secret from it)");
  }
  if (a.requests.empty() != a.out.empty())
    throw CLI::ValidationError("--requests", "--requests and --out go together");
  NodeOptions o;
  std::optional<std::string> join_secret;
  if (joining) {
    const size_t colon = a.join.rfind(':');
    const std::string host = colon == std::string::npos ? "" : a.join.substr(0, colon);
    const std::string port_text = colon == std::string::npos ? "" : a.join.substr(colon + 1);
    char* end = nullptr;
    const long port = port_text.empty() ? 0 : std::strtol(port_text.c_str(), &end, 10);
    if (host.empty() || port_text.empty() || *end != '\0' || port < 1 || port > 65535)
      throw CLI::ValidationError("--join", "must be HOST:PORT with a port from 1 to 65535, got '" + a.join + "'");
    if (!a.no_rejoin && !supervised_run()) return supervise();  // a joining node is a worker
    ClusterSpec mine;  // where this node reads the secret: its own flag or environment
    mine.secret_file = a.secret_file;
    join_secret = unwrap(read_cluster_secret(mine));
    o.spec = unwrap(fetch_topology(host, int32_t(port), join_secret, a.join_timeout_s));
    const NodeSpec* declared = o.spec.find(a.name);
    if (declared && declared->head)
      throw CLI::ValidationError("--name", "'" + a.name + "' is the head of the cluster at " + a.join);
    if (!declared && a.actors.empty())
      throw CLI::ValidationError("--actors", "'" + a.name + "' is not in the head's script: say what it hosts, "
                                             "e.g. --actors decode=1");
    if (!a.actors.empty())
      if (Status st = add_joining_node(o.spec, a.name, a.actors); !st.ok()) fail(st);
  } else {
    o.spec = unwrap(load_topology_file(a.topology, parse_sets(a.sets)));
  }
  o.name = a.name;
  const NodeSpec* me = o.spec.find(a.name);
  if (me && !me->head && !a.requests.empty())
    throw CLI::ValidationError("--requests", "only the head runs requests; '" + a.name + "' is a worker");
  // The HTTP flags mean something on a serving head only.
  const bool http = g_node_cmd->get_option("--http-port")->count() > 0;
  for (const char* flag : {"--host", "--api-key", "--alias", "--chat-template", "--metrics", "--timeout",
                           "--threads-http", "--max-connections", "--batch-dir", "--media-path"})
    if (!http && g_node_cmd->get_option(flag)->count() > 0)
      throw CLI::ValidationError(flag, "needs --http-port (the head's HTTP server)");
  if (http && me && !me->head)
    throw CLI::ValidationError("--http-port", "only the head serves HTTP; '" + a.name + "' is a worker");
  if (a.no_rejoin && me && me->head)
    throw CLI::ValidationError("--no-rejoin", "only workers rejoin; '" + a.name + "' is the head");
  if (a.fault_stall_attach && !(me && me->head))
    throw CLI::ValidationError("--fault-stall-attach", "only the head answers attaches; '" + a.name + "' is a worker");
  if (http && !a.requests.empty())
    throw CLI::ValidationError("--http-port", "serves until stopped; it does not go with --requests");
  // The expert flags act on the attention side of a cluster with experts.
  for (const char* flag : {"--expert-micro-batches", "--enable-eplb"}) {
    if (g_node_cmd->get_option(flag)->count() == 0) continue;
    if (o.spec.count("expert") == 0) throw CLI::ValidationError(flag, "needs expert actors in the topology script");
    if (me && me->count("prefill") + me->count("decode") + me->count("colocated") == 0)
      throw CLI::ValidationError(flag, "'" + a.name + "' has no prefill, decode or colocated actors (the attention side)");
  }
  // Only prefill stages send KV streams.
  if (g_node_cmd->get_option("--kv-fault-corrupt-chunk")->count() > 0 && me && me->count("prefill") == 0)
    throw CLI::ValidationError("--kv-fault-corrupt-chunk",
                               "'" + a.name + "' has no prefill actors (only they send KV streams)");
  // Micro-batches are cut by a pipeline's first stage.
  if (g_node_cmd->get_option("--pipeline-micro-batches")->count() > 0 && me &&
      !(me->stage.set && me->count("stage") == 0))
    throw CLI::ValidationError("--pipeline-micro-batches",
                               "'" + a.name + "' is not a pipeline's first stage (stage{} on its prefill, "
                               "decode or colocated actor)");
  // A worker runs under a supervisor that starts it again when it loses
  // the head (apps/process_args.h): from here on this is one run.
  if (me && !me->head && !a.no_rejoin && !joining && !supervised_run()) return supervise();
  // Which model file this node runs: its node{}.model, else -m. The head
  // opens every model the cluster serves (a router and a store each).
  const std::vector<std::string> models = cluster_models(o.spec);
  auto model_path = [&](const std::string& script_model, const std::string& whose) -> std::string {
    if (!script_model.empty()) return script_model;
    if (a.model.empty())
      throw CLI::ValidationError("--model", whose + " serves the -m model (no model in its node{}): give -m");
    return a.model;
  };
  if (me && !me->model.empty() && !a.model.empty() && a.model != me->model)
    throw CLI::ValidationError("--model", "'" + a.name + "' serves model '" + me->model + "' (its node{}.model), not " +
                                              a.model + ": drop -m or make them agree");
  if (models.size() > 1 && me && me->head) {
    for (const char* flag : {"--alias", "--chat-template", "--batch-dir", "--requests", "--mmproj"})
      if (g_node_cmd->get_option(flag)->count() > 0)
        throw CLI::ValidationError(flag, "names or serves one model; this cluster serves " +
                                             std::to_string(models.size()) + " (node{}.model)");
  }
  const std::string my_model = model_path(me ? me->model : "", "'" + a.name + "'");
  o.file = unwrap(GgufFile::open(my_model));
  if (me && me->head)
    for (size_t i = 1; i < models.size(); ++i)
      o.model_files[models[i]] = unwrap(GgufFile::open(model_path(models[i], "a node")));
  auto tok = Tokenizer::from_gguf(*o.file);
  if (tok.ok()) o.tokenizer = std::move(*tok);
  // The node's vision encoder: its model's node{}.mmproj, else --mmproj.
  const std::string script_mmproj = me ? model_mmproj(o.spec, me->model) : "";
  if (!script_mmproj.empty() && !a.mmproj.empty() && a.mmproj != script_mmproj)
    throw CLI::ValidationError("--mmproj", "'" + a.name + "' serves a model whose vision encoder is '" +
                                               script_mmproj + "' (node{}.mmproj), not " + a.mmproj +
                                               ": drop --mmproj or make them agree");
  const std::string my_mmproj = script_mmproj.empty() ? a.mmproj : script_mmproj;
  int32_t image_tokens = 0;
  if (!my_mmproj.empty()) {
    o.mmproj = unwrap(GgufFile::open(my_mmproj));
    image_tokens = unwrap(ClipModel::load(o.mmproj))->config().n_patches;
    o.vision.threads = a.threads;
  }
  // A bad requests file fails before the node starts listening.
  std::vector<GenerateRequest> requests;
  if (!a.requests.empty()) {
    RequestContext rc;
    rc.tokenizer = o.tokenizer.get();
    rc.image_tokens = image_tokens;
    requests = unwrap(read_request_file(a.requests, rc));
  }
  o.engine.threads = a.threads;
  o.engine.context = a.ctx;
  o.engine.max_seqs = a.max_seqs;
  o.engine.expert_micro_batches = a.expert_micro_batches;
  o.engine.pipeline_micro_batches = a.pipeline_micro_batches;
  o.engine.cache_type_k = o.spec.cache_type_k;  // cluster-wide, from the script
  o.engine.cache_type_v = o.spec.cache_type_v;
  o.engine.block_size = o.spec.block_size;
  o.engine.compute = o.spec.compute;
  o.expert_replication = a.enable_eplb;
  o.secret = joining ? join_secret : unwrap(read_cluster_secret(o.spec));
  o.join_timeout_s = a.join_timeout_s;
  o.kv_stream.chunk_bytes = a.kv_chunk_bytes;
  o.kv_stream.window = a.kv_window;
  o.kv_stream.direct = !a.kv_via_store;
  o.kv_stream.shared_memory = a.kv_transport == "auto";
  o.kv_stream.fault_corrupt_chunk = a.kv_fault_corrupt_chunk;
  o.kv_fault_corrupt_served = a.kv_fault_corrupt_served;
  o.kv_fault_stale_index = a.kv_fault_stale_index;
  o.fault_stall_attach = a.fault_stall_attach;
  if (me && me->head && !o.secret)
    std::fprintf(stderr, "cleave node %s: no cluster secret (%s): open cluster, any node may join\n",
                 a.name.c_str(),
                 o.spec.secret_file.empty() ? (o.spec.secret_env + " is unset").c_str()
                                            : o.spec.secret_file.c_str());
  retain_freed_memory();  // KV streams reuse freed buffers (actors/kv_stream.h)

  std::shared_ptr<void> batch_api;  // after http_server, before the node
  std::unique_ptr<server::Server> http_server;
  if (http) http_server = unwrap(start_http(g_http));  // /health: 503 until the node is up
  auto started = Node::start(o);
  if (!started.ok() && lost_head_while_starting(started.status()) && !a.no_rejoin && supervised_run()) {
    // As a lost head after the start: the supervisor starts the next run.
    std::fprintf(stderr, "cleave node %s: %s; starting again to rejoin it (%g s)\n", a.name.c_str(),
                 started.status().message().c_str(), a.join_timeout_s);
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(kRunRejoins);
  }
  auto node = unwrap(std::move(started));
  // Until the node is up, SIGINT / SIGTERM end the process at once (a worker
  // dialling a head that is gone, say); from here they stop it cleanly.
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  if (node->is_head()) {
    std::printf("cleave node head listening on %s\n", node->address().c_str());
  } else {
    std::printf("cleave node %s joined %s with %d stages\n", a.name.c_str(), node->address().c_str(),
                node->stages());
  }
  std::fflush(stdout);
  if (http_server) {
    // One entry per model, the head's own first (its tokenizer is loaded).
    std::vector<ServedFrontend> served;
    for (const auto& [path, frontend] : node->model_frontends()) {
      ServedFiles f;
      f.model = path == (me ? me->model : "") ? o.file : o.model_files.at(path);
      // Each model's images go through its own vision encoder.
      if (f.model == o.file) {
        f.mmproj = o.mmproj;
      } else if (const std::string mm = model_mmproj(o.spec, path); !mm.empty()) {
        f.mmproj = unwrap(GgufFile::open(mm));
        unwrap(ClipModel::load(f.mmproj));  // a broken file fails here, not per request
      }
      if (f.model == o.file) {
        f.tokenizer = o.tokenizer;
      } else {
        auto t = Tokenizer::from_gguf(*f.model);
        if (t.ok()) f.tokenizer = std::move(*t);
      }
      f.model_path = path.empty() ? a.model : path;
      f.context = a.ctx;
      served.push_back({std::move(f), frontend});
    }
    Status st = serve_models(*http_server, g_http, served, batch_api);
    if (!st.ok()) {
      std::fprintf(stderr, "cleave: error: %s\n", st.to_string().c_str());
      http_server.reset();
      batch_api.reset();
      return finish(std::move(node), 1);
    }
  }
  try {
    if (!a.requests.empty()) {
      const int code = run_requests(*node, a, requests);
      return finish(std::move(node), code);
    }
    while (!g_stop) {
      if (node->drained()) {
        std::fprintf(stderr, "cleave node %s: drained by the head; exiting\n", a.name.c_str());
        break;
      }
      if (node->lost_head()) {
        print_stats(*node, a.name);
        if (a.no_rejoin || !supervised_run()) fail(Status(Code::unavailable, "lost the head at " + node->address()));
        if (g_stop.load()) break;  // a stop signal came: the supervisor starts no run after this one
        // The supervisor starts the next run, a fresh process that dials the
        // head for --join-timeout. No teardown here: CAF's after a broken
        // peer can hang (see finish()).
        std::fprintf(stderr, "cleave node %s: lost the head at %s; starting again to rejoin it (%g s)\n",
                     a.name.c_str(), node->address().c_str(), a.join_timeout_s);
        std::fflush(stdout);
        std::fflush(stderr);
        std::_Exit(kRunRejoins);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cleave: error: %s\n", e.what());
    http_server.reset();
    batch_api.reset();
    return finish(std::move(node), 1);
  }
  http_server.reset();  // no route runs once the node goes
  batch_api.reset();
  int code = 0;
  if (g_signal.load() == SIGTERM && !node->is_head() && !node->drained() && !node->lost_head()) {
    // SIGTERM drains a worker first: no request it serves fails.
    auto moved = node->drain();
    if (moved.ok()) {
      std::fprintf(stderr, "cleave node %s: SIGTERM: drained, %llu requests moved to other stages\n",
                   a.name.c_str(), static_cast<unsigned long long>(*moved));
    } else {
      std::fprintf(stderr, "cleave node %s: SIGTERM: the head did not drain it (%s); stopping anyway\n",
                   a.name.c_str(), moved.status().to_string().c_str());
      code = 1;
    }
  }
  print_stats(*node, a.name);  // stopped by a signal or drained: what it did, as a --requests run prints
  return finish(std::move(node), code);
}
