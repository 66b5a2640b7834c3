// The HTTP server's flags, shared by `cleave serve` and `cleave node
// --http-port` (llama-server's spellings, vLLM's as aliases).
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "frontend/frontend.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "server/server.h"

namespace cleave {

struct HttpArgs {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;   // also from CLEAVE_API_KEY
  std::string alias;     // -a/--alias, --served-model-name
  std::string chat_template;
  bool metrics = false;
  double timeout_s = 600;  // llama-server's -to: the read timeout of a request
  int threads_http = 1;
  int max_connections = 4096;
  size_t max_body_bytes = 64 << 20;
  std::string batch_dir;   // the Batch API's files and batches (empty: no Batch API)
  std::string media_path;  // file:// images allowed under it (chat and batch lines)
};

// port_flag: "--port" for serve, "--http-port" for node.
void add_http_options(CLI::App* cmd, HttpArgs& args, const std::string& port_flag);

// llama-server's multi-letter single-dash flags (-np, -to, -ctk, -ctv) that CLI11 cannot
// declare: rewritten to their long forms before parsing.
void rewrite_short_flags(int argc, char** argv, std::vector<std::string>& storage,
                         std::vector<char*>& out);

struct ServedFiles {
  std::shared_ptr<const GgufFile> model, mmproj;
  std::shared_ptr<const Tokenizer> tokenizer;
  std::string model_path;
  int32_t context = 0, prefill_chunk = 512;
  // The Batch API's jobs::JobOptions::settings (empty: a batch continued
  // after a restart is not checked against the settings it ran with).
  std::string settings;
};

// Starts the HTTP server (answering /health with 503 until serve() is
// called) on the flags' address; errors are Status (the port taken, ...).
Result<std::unique_ptr<server::Server>> start_http(const HttpArgs& args);
// Describes the model (chat template checked) and starts serving through
// `frontend`; prints "cleave serve listening on http://HOST:PORT". With
// --batch-dir, the Batch API (jobs/batch_service.h) runs its batches through
// the same front end: `batch_api` then holds it; release it after the
// server and before the front end.
Status serve_through(server::Server& server, const HttpArgs& args, const ServedFiles& files,
                     Frontend& frontend, std::shared_ptr<void>& batch_api);

// Several models, each through its own front end (a cluster head's routers,
// Node::model_frontends); requests name them by "model", the first is the
// default. One model is serve_through. invalid_argument when two models get
// the same name; the flags that name one model (--alias, --chat-template,
// --batch-dir) are the caller's to refuse.
struct ServedFrontend {
  ServedFiles files;
  Frontend* frontend = nullptr;
};
Status serve_models(server::Server& server, const HttpArgs& args, const std::vector<ServedFrontend>& models,
                    std::shared_ptr<void>& batch_api);

}  // namespace cleave
