// Routing, the API key, and the routes that are not generation: health,
// models, metrics, tokenize and detokenize.
#include "server/server.h"

#include <algorithm>
#include <chrono>

#include "server/openai_response.h"
#include "server/server_impl.h"

namespace cleave::server {

bool keys_equal(std::string_view a, std::string_view b) {
  // Every byte of the longer one is read whatever the contents.
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= unsigned(x ^ y);
  }
  return diff == 0;
}

namespace {

struct Route {
  std::string_view path;
  std::string_view method;
};
constexpr Route kRoutes[] = {
    {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}, {"/v1/models", "GET"},
    {"/health", "GET"},          {"/metrics", "GET"},              {"/tokenize", "POST"},
    {"/detokenize", "POST"},
};

const Route* find_route(std::string_view path) {
  for (const Route& r : kRoutes)
    if (r.path == path) return &r;
  return nullptr;
}

bool is_json(const std::string* content_type) {
  if (!content_type) return false;
  std::string_view v = *content_type;
  const size_t semi = v.find(';');
  if (semi != std::string_view::npos) v = v.substr(0, semi);
  while (!v.empty() && v.back() == ' ') v.remove_suffix(1);
  std::string lower(v);
  for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  return lower == "application/json";
}

}  // namespace

void Server::Impl::reply(const std::shared_ptr<HttpResponder>& out, std::string_view route, int status,
                         std::string content_type, std::string body) {
  metrics.on_http(route, status);
  out->send(status, std::move(content_type), std::move(body));
}

void Server::Impl::reply_error(const std::shared_ptr<HttpResponder>& out, std::string_view route,
                               const ApiError& e, HttpHeaders extra) {
  metrics.on_http(route, e.status);
  out->send_error(e, std::move(extra));
}

const std::pair<std::string, Server::RouteHandler>* Server::Impl::find_extra(std::string_view target) const {
  for (const auto& e : extra_routes) {
    const std::string& p = e.first;
    if (target == p || (target.size() > p.size() && target.substr(0, p.size()) == p && target[p.size()] == '/'))
      return &e;
  }
  return nullptr;
}

bool Server::Impl::authorized(const HttpRequest& request, const std::shared_ptr<HttpResponder>& out,
                              std::string_view route) {
  if (options.api_key.empty()) return true;
  const std::string* auth = request.header("authorization");
  constexpr std::string_view kBearer = "Bearer ";
  const bool ok = auth && auth->size() >= kBearer.size() &&
                  std::string_view(*auth).substr(0, kBearer.size()) == kBearer &&
                  keys_equal(std::string_view(*auth).substr(kBearer.size()), options.api_key);
  if (!ok)
    reply_error(out, route,
                ApiError::unauthorized(auth ? "Incorrect API key provided."
                                            : "Missing API key: send Authorization: Bearer KEY."));
  return ok;
}

void Server::Impl::handle(HttpRequest request, std::shared_ptr<HttpResponder> out) {
  const Route* route = find_route(request.target);
  if (!route) {
    // extra_routes is complete once loaded is (add_routes comes before ready()).
    if (const auto* extra = loaded.load() ? find_extra(request.target) : nullptr) {
      if (!authorized(request, out, extra->first)) return;
      return extra->second(request, std::move(out));
    }
    return reply_error(out, "other",
                       ApiError::not_found("no route " + request.method + " " + request.target.substr(0, 200)));
  }
  const std::string_view name = route->path;
  if (request.method != route->method) {
    metrics.on_http(name, 405);
    return out->send_error(ApiError::method_not_allowed(std::string(name) + " takes " +
                                                        std::string(route->method) + ", not " +
                                                        request.method.substr(0, 16)),
                           {{"Allow", std::string(route->method)}});
  }
  if (name == "/health") {
    if (!loaded.load())
      return reply_error(out, name, ApiError::unavailable("Loading model"));
    return reply(out, name, 200, "application/json", "{\"status\":\"ok\"}");
  }
  if (!authorized(request, out, name)) return;
  if (!loaded.load()) return reply_error(out, name, ApiError::unavailable("Loading model"), {{"Retry-After", "1"}});
  if (route->method == std::string_view("POST") && !is_json(request.header("content-type")))
    return reply_error(out, name,
                       ApiError::unsupported_media("Content-Type must be application/json, got " +
                                                   (request.header("content-type")
                                                        ? request.header("content-type")->substr(0, 100)
                                                        : std::string("none"))));

  if (name == "/v1/completions") return generate(RequestKind::completion, request, std::move(out));
  if (name == "/v1/chat/completions") return generate(RequestKind::chat, request, std::move(out));
  if (name == "/v1/models") {
    std::vector<ModelCard> cards;
    for (const ServedEntry& e : models) {
      ModelCard card;
      card.id = e.model.name;
      card.created = e.model.created;
      card.max_model_len = e.model.context;
      cards.push_back(std::move(card));
    }
    return reply(out, name, 200, "application/json", models_response(cards));
  }
  if (name == "/metrics") {
    if (!options.metrics)
      return reply_error(out, name, ApiError::not_found("metrics are off: start the server with --metrics"));
    // Every front end once: two models may share one.
    std::vector<msg::Stats> stats;
    std::vector<Frontend*> asked;
    for (const ServedEntry& e : models) {
      if (std::find(asked.begin(), asked.end(), e.frontend) != asked.end()) continue;
      asked.push_back(e.frontend);
      for (msg::Stats& st : e.frontend->stats()) stats.push_back(std::move(st));
    }
    metrics.update_from_stats(stats);
    // vLLM's kv_cache_usage_perc: blocks running sequences hold, over every stage's pool.
    uint64_t used = 0, total = 0;
    for (const msg::Stats& st : stats) {
      used += st.get("kv_blocks_used");
      total += st.get("kv_blocks_total");
    }
    if (total > 0) metrics.set_kv_cache_usage(double(used) / double(total));
    return reply(out, name, 200, ServerMetrics::content_type(), metrics.render());
  }
  if (name == "/tokenize") {
    auto parsed = parse_tokenize_request(request.body);
    if (!parsed.ok()) return reply_error(out, name, parsed.error());
    const ServedEntry* entry = find_model(parsed->model);
    if (!entry) return reply_error(out, name, unknown_model(parsed->model));
    const Tokenizer& tok = *entry->model.tokenizer;
    const std::vector<int32_t> ids = tok.encode(parsed->content, parsed->add_special);
    return reply(out, name, 200, "application/json",
                 tokenize_response(ids, parsed->with_pieces, [&tok](int32_t t) { return tok.token_bytes(t); }));
  }
  // /detokenize: the ids are checked against the vocabulary of the model the body names.
  const ServedEntry* entry = nullptr;
  auto parsed = parse_detokenize_request(request.body, [&](const std::string& model) -> ApiResult<int32_t> {
    entry = find_model(model);
    if (!entry) return unknown_model(model);
    return entry->model.n_vocab;
  });
  if (!parsed.ok()) return reply_error(out, name, parsed.error());
  return reply(out, name, 200, "application/json",
               detokenize_response(entry->model.tokenizer->decode(parsed->tokens)));
}

Result<std::unique_ptr<Server>> Server::start(const ServeOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  Impl* raw = impl.get();
  auto http = HttpServer::start(options.http, [raw](HttpRequest request, std::shared_ptr<HttpResponder> out) {
    raw->handle(std::move(request), std::move(out));
  });
  if (!http.ok()) return http.status();
  impl->http = std::move(http.value());
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() {
  impl_->http.reset();  // joins the io threads: no route runs after this
  // Requests still running call back into impl_: end them and wait.
  // Each on the front end that admitted it.
  std::vector<std::pair<uint64_t, Frontend*>> ids;
  {
    std::lock_guard<std::mutex> lock(impl_->live_mu);
    ids.assign(impl_->live.begin(), impl_->live.end());
  }
  for (const auto& [id, frontend] : ids) (void)frontend->cancel(id);
  std::unique_lock<std::mutex> lock(impl_->live_mu);
  if (!impl_->live_cv.wait_for(lock, std::chrono::seconds(30), [&] { return impl_->live.empty(); })) {
    // A front end that never ends them: leaking beats a callback into freed memory.
    lock.unlock();
    (void)impl_.release();
  }
}

void Server::add_routes(std::string prefix, RouteHandler handler) {
  impl_->extra_routes.emplace_back(std::move(prefix), std::move(handler));
}

void Server::ready(std::vector<ServedEntry> models) {
  CLEAVE_CHECK(!models.empty());
  for (size_t i = 0; i < models.size(); ++i) {
    CLEAVE_CHECK(models[i].frontend != nullptr);
    for (size_t j = 0; j < i; ++j) CLEAVE_CHECK(models[j].model.name != models[i].model.name);
  }
  impl_->models = std::move(models);
  impl_->loaded.store(true);
}

void Server::ready(ServedModel model, Frontend& frontend) {
  std::vector<ServedEntry> models;
  models.push_back({std::move(model), &frontend});
  ready(std::move(models));
}

int Server::port() const { return impl_->http->port(); }
ServerMetrics& Server::metrics() { return impl_->metrics; }

}  // namespace cleave::server
