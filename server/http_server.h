// The HTTP/1.1 transport of `cleave serve`: accepts connections, parses
// requests (Boost.Beast, kept out of this header), hands each one to an
// HttpHandler and writes its answer: a whole response or a Server-Sent
// Events stream. Errors the transport itself detects (malformed request,
// limits, timeouts) are answered with error_body() JSON and the connection
// closed; the handler never sees them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "server/api_error.h"

namespace cleave::server {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;   // "GET", "POST", ...
  std::string target;   // path without the query string
  std::string query;    // after '?', may be empty
  std::string body;
  HttpHeaders headers;  // names lower-cased
  const std::string* header(std::string_view lower_name) const;  // nullptr when absent
};

// One response. Thread-safe: may be called from any thread (callbacks of the
// inference front end run on other threads). Calls are posted to the
// connection in order; calls that do not fit (a second send, an event before
// start_stream, anything after the end or after the client left) are dropped.
class HttpResponder {
 public:
  virtual ~HttpResponder() = default;  // dropped unanswered: 500; mid-stream: connection closed
  // A whole response (Content-Length). extra headers e.g. {"Retry-After","1"}.
  virtual void send(int status, std::string content_type, std::string body,
                    HttpHeaders extra = {}) = 0;
  void send_error(const ApiError& e, HttpHeaders extra = {});  // error_body() as application/json
  // Server-Sent Events: the status line, "Content-Type: text/event-stream",
  // "Cache-Control: no-cache", chunked (connection-close framing for
  // HTTP/1.0), then each event as given (the caller formats "data: ...\n\n").
  virtual void start_stream(int status = 200) = 0;
  virtual void write_event(std::string data) = 0;  // queued, written in order
  virtual void end_stream() = 0;                   // after the last event
  // True once the client went away (reset, EOF while waiting or streaming,
  // write error, a stream queue over max_queued_stream_bytes) or the server stopped.
  virtual bool closed() const = 0;
  // Called once, on a server thread, when the client goes away (or the
  // server stops) before the response ended; must not block. Set it before
  // start_stream; set after the client already left, it runs at once on the
  // caller's thread. Used to cancel the request.
  virtual void on_close(std::function<void()> fn) = 0;
};

using HttpHandler = std::function<void(HttpRequest, std::shared_ptr<HttpResponder>)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";  // a numeric IPv4/IPv6 address or "localhost"
  int port = 8080;                 // 0: pick a free port
  int threads = 1;                 // io threads (--threads-http)
  int max_connections = 4096;  // beyond: the new connection gets 503 with error body + Retry-After and is closed
  size_t max_header_bytes = 16 * 1024;       // beyond: 431
  size_t max_body_bytes = 64 * 1024 * 1024;  // beyond: 413 (Content-Length checked before the body is read)
  double read_timeout_s = 30;  // a request (headers+body) not fully read this long after its first byte: 408 and close (slowloris)
  double idle_timeout_s = 60;  // a connection with no request; also a write not done in this time
  size_t max_queued_stream_bytes = 8 * 1024 * 1024;  // per connection; a client that reads slower than we write past this is closed (bounded memory)
};

class HttpServer {
 public:
  // Binds and starts serving. invalid_argument for bad options; io_error
  // naming host:port when bind/listen fails. Raises the process's
  // RLIMIT_NOFILE soft limit to the hard limit when it is below
  // max_connections + 64 (every connection is a descriptor).
  static Result<std::unique_ptr<HttpServer>> start(const HttpServerOptions& options,
                                                   HttpHandler handler);
  // Stops: closes the listener and every connection (on_close fires for
  // unfinished responses), joins the io threads. Not from a handler.
  virtual ~HttpServer() = default;
  virtual int port() const = 0;  // the bound port
  virtual int open_connections() const = 0;
  virtual uint64_t refused_connections() const = 0;  // over max_connections
};

}  // namespace cleave::server
