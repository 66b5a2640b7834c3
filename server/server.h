// `cleave serve` and a cluster head's HTTP front: the OpenAI-compatible
// routes over any Frontend (one engine, colocated, P/D, E/P/D, a cluster's
// router), for one model or several, each through its own Frontend. The
// transport (http_server.h), the request parsing and response shapes
// (openai_request.h, openai_response.h), chat templates and metrics live in
// their own files; this one owns routing, the API key and the served
// models. No CAF.
//
//   POST /v1/completions, /v1/chat/completions   (stream or not, n choices)
//   GET  /v1/models, /health, /metrics (with metrics on)
//   POST /tokenize, /detokenize                  (llama-server's bodies)
//
// A request names its model by "model" (/tokenize and /detokenize too, as
// vLLM's); none: the first served one; an unknown one: 404 model_not_found.
// /v1/models lists them all; /metrics reads every front end's stats.
//
// Every route but /health needs the API key when one is set (Authorization:
// Bearer KEY, compared in constant time). Until ready() the server answers
// /health with 503 and every other route with 503 "loading".
#pragma once

#include <functional>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "frontend/frontend.h"
#include "model/tokenizer.h"
#include "server/chat_template.h"
#include "server/http_server.h"
#include "server/openai_request.h"

namespace cleave::server {

struct ServedModel {
  std::string name;  // what /v1/models lists and requests' "model" must name
  int32_t context = 0;
  int32_t n_vocab = 0;
  std::shared_ptr<const Tokenizer> tokenizer;  // required
  std::string chat_template;                   // a chat_template_names() entry
  SpecialTokenLookup special_tokens;           // may be empty
  int32_t image_tokens = 0;                    // the vision encoder's n_patches; 0: text only
  int32_t prefill_chunk = 512;                 // prompt tokens per prefill forward
  int64_t created = 0;                         // Unix seconds (/v1/models)
};

struct ServedEntry {
  ServedModel model;
  Frontend* frontend = nullptr;  // must outlive the server
};

struct ServeOptions {
  HttpServerOptions http;
  std::string api_key;  // empty: no key needed
  bool metrics = false; // GET /metrics
  ParseOptions parse;
};

class ServerMetrics;

class Server {
 public:
  // Starts the transport: /health answers 503 until ready(). io_error when
  // the port cannot be bound.
  static Result<std::unique_ptr<Server>> start(const ServeOptions& options);
  ~Server();
  // Serves every entry; requests name one by "model" (its ServedModel::name);
  // the first entry is the default for requests that give no model. Names
  // are unique, the list non-empty and every frontend set (else abort).
  void ready(std::vector<ServedEntry> models);
  // One model: `frontend` must outlive the server.
  void ready(ServedModel model, Frontend& frontend);
  // Routes a layer above serves (the Batch API, jobs/batch_service.h):
  // every target equal to `prefix` or under `prefix/`, any method, after the
  // API key and model-loaded checks; the handler answers through `out`, from
  // any thread, and checks the content type itself. Call before ready().
  using RouteHandler = std::function<void(const HttpRequest& request, std::shared_ptr<HttpResponder> out)>;
  void add_routes(std::string prefix, RouteHandler handler);
  int port() const;
  ServerMetrics& metrics();

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Equal strings, in time that depends on the lengths only.
bool keys_equal(std::string_view a, std::string_view b);

}  // namespace cleave::server
