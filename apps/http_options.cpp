#include "apps/http_options.h"

#include <cstdio>
#include <cstdlib>

#include "server/served_model.h"
#ifdef CLEAVE_HAVE_JOBS
#include "jobs/batch_service.h"
#endif

namespace cleave {

void add_http_options(CLI::App* cmd, HttpArgs& a, const std::string& port_flag) {
  cmd->add_option("--host", a.host, "address to listen on (default 127.0.0.1: this machine only)");
  cmd->add_option(port_flag, a.port, "HTTP port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", a.api_key,
                  "API key every route but /health needs (also CLEAVE_API_KEY)");
  cmd->add_option("-a,--alias,--served-model-name", a.alias, "model name the API shows and accepts");
  cmd->add_option("--chat-template", a.chat_template,
                  "built-in chat template (llama-2, chatml, llama-3, shapes, ...); default: the "
                  "model's tokenizer.chat_template");
  cmd->add_flag("--metrics", a.metrics, "serve Prometheus metrics on GET /metrics");
  cmd->add_option("--timeout", a.timeout_s, "seconds a client may take to send a request (-to)")
      ->check(CLI::Range(0.1, 86400.0));
  cmd->add_option("--threads-http", a.threads_http, "HTTP io threads")->check(CLI::Range(1, 256));
  cmd->add_option("--max-connections", a.max_connections, "open connections; beyond: 503")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--batch-dir", a.batch_dir,
                  "serve OpenAI's Batch API (/v1/files, /v1/batches); files and batches live in this "
                  "directory and survive restarts");
  cmd->add_option("--media-path,--allowed-local-media-path", a.media_path,
                  "directory whose images file:// URLs in chat may name")
      ->check(CLI::ExistingDirectory);
}

void rewrite_short_flags(int argc, char** argv, std::vector<std::string>& storage, std::vector<char*>& out) {
  storage.clear();
  for (int i = 0; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "-np") s = "--parallel";
    else if (s == "-to") s = "--timeout";
    else if (s == "-ctk") s = "--cache-type-k";
    else if (s == "-ctv") s = "--cache-type-v";
    storage.push_back(std::move(s));
  }
  out.clear();
  for (std::string& s : storage) out.push_back(s.data());
}

Result<std::unique_ptr<server::Server>> start_http(const HttpArgs& a) {
  server::ServeOptions o;
  o.http.host = a.host;
  o.http.port = a.port;
  o.http.threads = a.threads_http;
  o.http.read_timeout_s = a.timeout_s;
  o.http.max_connections = a.max_connections;
  o.http.max_body_bytes = a.max_body_bytes;
  o.api_key = a.api_key;
  if (o.api_key.empty())
    if (const char* env = std::getenv("CLEAVE_API_KEY")) o.api_key = env;
  o.metrics = a.metrics;
  o.parse.media_root = a.media_path;
  return server::Server::start(o);
}

namespace {

Result<server::ServedModel> describe(const HttpArgs& a, const ServedFiles& f) {
  server::ServedModelArgs m;
  m.model = f.model;
  m.mmproj = f.mmproj;
  m.tokenizer = f.tokenizer;
  m.name = a.alias;
  m.model_path = f.model_path;
  m.chat_template = a.chat_template;
  m.context = f.context;
  m.prefill_chunk = f.prefill_chunk;
  return server::describe_served_model(m);
}

}  // namespace

Status serve_models(server::Server& srv, const HttpArgs& a, const std::vector<ServedFrontend>& models,
                    std::shared_ptr<void>& batch_api) {
  if (models.size() == 1) return serve_through(srv, a, models[0].files, *models[0].frontend, batch_api);
  std::vector<server::ServedEntry> entries;
  std::string names;
  for (const ServedFrontend& m : models) {
    auto model = describe(a, m.files);
    if (!model.ok()) return Status(model.status().code(), m.files.model_path + ": " + model.status().message());
    for (const server::ServedEntry& e : entries)
      if (e.model.name == model->name)
        return Status(Code::invalid_argument, "two models are both named '" + model->name + "' (" +
                                                  m.files.model_path + " and another): the API could not "
                                                  "tell them apart; give one a different general.name or file name");
    names += (names.empty() ? "" : ", ") + model->name;
    entries.push_back({std::move(*model), m.frontend});
  }
  srv.ready(std::move(entries));
  std::printf("cleave serve listening on http://%s:%d (models %s)\n", a.host.c_str(), srv.port(), names.c_str());
  std::fflush(stdout);
  return Status::Ok();
}

Status serve_through(server::Server& srv, const HttpArgs& a, const ServedFiles& f, Frontend& frontend,
                     std::shared_ptr<void>& batch_api) {
  auto model = describe(a, f);
  if (!model.ok()) return model.status();
  const std::string name = model->name, tmpl = model->chat_template;
  if (!a.batch_dir.empty()) {
#ifdef CLEAVE_HAVE_JOBS
    jobs::BatchServiceOptions bo;
    bo.dir = a.batch_dir;
    bo.parse.media_root = a.media_path;
    bo.settings = f.settings;
    auto service = jobs::BatchService::open(bo);
    if (!service.ok()) return service.status();
    (*service)->attach(srv);
    (*service)->start(*model, frontend);
    batch_api = std::shared_ptr<jobs::BatchService>(std::move(service.value()));
#else
    return Status(Code::unsupported, "--batch-dir: this build has no jobs library (CLEAVE_STORAGE=OFF)");
#endif
  }
  srv.ready(std::move(*model), frontend);
  std::printf("cleave serve listening on http://%s:%d (model %s, chat template %s)\n", a.host.c_str(),
              srv.port(), name.c_str(), tmpl.c_str());
  std::fflush(stdout);
  return Status::Ok();
}

}  // namespace cleave
