// HttpServer's public surface: HttpRequest, HttpResponder::send_error,
// option checks, the descriptor limit. The connections, on Boost.Beast/Asio,
// are in http_connection.cpp.
#include "server/http_server.h"

#include <sys/resource.h>

#include <cmath>
#include <cstdint>

namespace cleave::server {

// In http_connection.cpp: binds and serves (options already validated).
Result<std::unique_ptr<HttpServer>> listen_and_serve(const HttpServerOptions& options,
                                                     HttpHandler handler);

const std::string* HttpRequest::header(std::string_view lower_name) const {
  for (const auto& [name, value] : headers)
    if (name == lower_name) return &value;
  return nullptr;
}

void HttpResponder::send_error(const ApiError& e, HttpHeaders extra) {
  send(e.status, "application/json", error_body(e), std::move(extra));
}

namespace {

Status validate(const HttpServerOptions& o) {
  auto bad = [](std::string what) { return Status(Code::invalid_argument, "http: " + what); };
  if (o.port < 0 || o.port > 65535) return bad("port " + std::to_string(o.port) + " not in [0, 65535]");
  if (o.threads < 1 || o.threads > 1024) return bad("threads " + std::to_string(o.threads) + " not in [1, 1024]");
  if (o.max_connections < 1) return bad("max_connections must be at least 1");
  if (o.max_header_bytes < 256 || o.max_header_bytes > UINT32_MAX)
    return bad("max_header_bytes " + std::to_string(o.max_header_bytes) + " not in [256, 2^32)");
  if (!(o.read_timeout_s > 0) || !std::isfinite(o.read_timeout_s))
    return bad("read_timeout_s must be a positive number of seconds");
  if (!(o.idle_timeout_s > 0) || !std::isfinite(o.idle_timeout_s))
    return bad("idle_timeout_s must be a positive number of seconds");
  if (o.max_queued_stream_bytes < 1) return bad("max_queued_stream_bytes must be at least 1");
  return Status::Ok();
}

// Every connection is a descriptor; the usual soft limit (1024) is far
// below max_connections.
void raise_descriptor_limit(int max_connections) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  rlim_t wanted = static_cast<rlim_t>(max_connections) + 64;
  if (limit.rlim_cur >= wanted || limit.rlim_cur >= limit.rlim_max) return;
  limit.rlim_cur = limit.rlim_max == RLIM_INFINITY ? wanted : limit.rlim_max;
  setrlimit(RLIMIT_NOFILE, &limit);  // best effort: connections beyond fail to accept, retried
}

}  // namespace

Result<std::unique_ptr<HttpServer>> HttpServer::start(const HttpServerOptions& options,
                                                      HttpHandler handler) {
  CLEAVE_RETURN_IF_ERROR(validate(options));
  if (!handler) return Status(Code::invalid_argument, "http: no handler");
  raise_descriptor_limit(options.max_connections);
  return listen_and_serve(options, std::move(handler));
}

}  // namespace cleave::server
