// The connections of HttpServer on Boost.Beast/Asio. Each connection is a
// small state machine run on its own strand: idle -> reading -> awaiting
// (the handler has the request) -> streaming -> finishing (writes drain) ->
// idle again for keep-alive, or lingering (send side shut, input drained)
// -> closed.
//
// Lifetimes: a connection is owned by its pending Asio operations only. A
// responder holds an Exchange (one per request) that names the connection
// weakly and posts to its strand; once the server stops, posts are refused,
// so a responder may outlive the server and its io_context.

// Asio's fences draw GCC 12's -Wtsan in a TSan build (an error with
// CLEAVE_WERROR); before any include, so that it covers the headers too.
#if defined(__SANITIZE_THREAD__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic ignored "-Wtsan"
#endif

#include "server/http_server.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_set>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace cleave::server {

// Binds and serves (options already validated); declared in http_server.cpp.
Result<std::unique_ptr<HttpServer>> listen_and_serve(const HttpServerOptions& options,
                                                     HttpHandler handler);

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

// Pipelined bytes buffered while a response is pending; beyond, we stop
// reading (and so stop noticing a disconnect) until the response ends.
constexpr size_t kLookaheadBytes = 64 * 1024;
// After a closing response: how long the input is drained so that closing
// does not reset the connection before the client read the answer.
constexpr double kLingerSeconds = 1.0;

class Connection;

// State shared by the server, its connections and their responders; lives
// as long as the longest of them.
struct Core {
  Core(HttpServerOptions o, HttpHandler h) : opt(std::move(o)), handler(std::move(h)) {}
  const HttpServerOptions opt;
  const HttpHandler handler;
  std::atomic<bool> stopped{false};
  std::atomic<int> posting{0};  // responders inside Exchange::post; stop waits for 0
  std::atomic<int> open{0};
  std::atomic<uint64_t> refused{0};
  std::mutex registry_mu;
  std::unordered_set<Connection*> registry;  // every live connection, for stop
};

// One request/response on a connection, as the responder sees it.
struct Exchange : std::enable_shared_from_this<Exchange> {
  Exchange(std::shared_ptr<Core> c, std::weak_ptr<Connection> conn)
      : core(std::move(c)), connection(std::move(conn)) {}

  // Runs fn(Connection&) on the connection's strand if this is still its
  // current exchange; dropped after stop or once the connection is gone.
  template <class Fn>
  void post(Fn fn);

  // The client left (or the server stops) before the end: closed, on_close once.
  void fire_close() {
    closed = true;
    std::function<void()> fn;
    {
      std::lock_guard lock(mu);
      if (close_state != CloseState::armed) return;
      close_state = CloseState::fired;
      fn = std::move(on_close);
      on_close = nullptr;
    }
    if (fn) fn();
  }
  // The response ended: on_close will never run; drop it (it may hold the responder).
  void finish() {
    std::lock_guard lock(mu);
    if (close_state == CloseState::armed) close_state = CloseState::finished;
    on_close = nullptr;
  }
  void set_on_close(std::function<void()> fn) {
    {
      std::lock_guard lock(mu);
      if (close_state == CloseState::armed) {
        on_close = std::move(fn);
        return;
      }
      if (close_state == CloseState::finished) return;
    }
    if (fn) fn();  // the client is already gone
  }

  const std::shared_ptr<Core> core;
  const std::weak_ptr<Connection> connection;
  std::atomic<bool> closed{false};
  std::mutex mu;
  enum class CloseState { armed, fired, finished } close_state = CloseState::armed;
  std::function<void()> on_close;
};

std::string clean_header_text(std::string_view s) {  // no header injection
  std::string out;
  out.reserve(s.size());
  for (char c : s)
    if (c != '\r' && c != '\n' && c != '\0') out += c;
  return out;
}

std::string_view sv(beast::string_view s) { return {s.data(), s.size()}; }

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && beast::iequals(beast::string_view(a.data(), a.size()),
                                                beast::string_view(b.data(), b.size()));
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(s));
}

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(std::shared_ptr<Core> core, tcp::socket socket, bool counted)
      : core_(std::move(core)), socket_(std::move(socket)), timer_(socket_.get_executor()),
        counted_(counted) {
    if (counted_) core_->open.fetch_add(1);
  }
  ~Connection() {
    {
      std::lock_guard lock(core_->registry_mu);
      core_->registry.erase(this);
    }
    if (counted_) core_->open.fetch_sub(1);
  }
  tcp::socket::executor_type executor() { return socket_.get_executor(); }
  const Exchange* exchange() const { return exchange_.get(); }

  // Serve requests (or, refused, answer 503 and close). On the strand.
  void start(bool refused) {
    {
      std::lock_guard lock(core_->registry_mu);
      core_->registry.insert(this);
    }
    if (core_->stopped) return close_now();  // raced with stop: its sweep may have missed us
    error_code ec;
    socket_.non_blocking(true, ec);  // watch_peer reads without blocking
    socket_.set_option(tcp::no_delay(true), ec);  // events leave at once
    if (!refused) return read_next();
    keep_alive_ = false;
    state_ = State::finishing;
    queue_response(503, "application/json",
                   error_body(ApiError::overloaded("too many open connections; retry later")),
                   {{"Retry-After", "1"}});
  }

  // The server stops, or the client is gone: close at once. On the strand.
  void close_now() {
    if (state_ == State::closed) return;
    state_ = State::closed;
    cancel_timer();
    error_code ec;
    socket_.close(ec);  // pending operations complete with operation_aborted
    if (counted_) {
      counted_ = false;
      core_->open.fetch_sub(1);
    }
    queue_.clear();
    if (auto ex = std::move(exchange_)) ex->fire_close();
  }

  // The responder's calls, on the strand, for the current exchange.
  void send(int status, std::string content_type, std::string body, HttpHeaders extra) {
    if (state_ != State::awaiting) return;
    state_ = State::finishing;
    queue_response(status, std::move(content_type), std::move(body), std::move(extra));
  }
  void start_stream(int status) {
    if (state_ != State::awaiting) return;
    state_ = State::streaming;
    chunked_ = !http10_;  // HTTP/1.0 has no chunked: the end of the stream is the close
    if (!chunked_) keep_alive_ = false;
    HttpHeaders headers = {{"Content-Type", "text/event-stream"}, {"Cache-Control", "no-cache"}};
    if (chunked_) headers.emplace_back("Transfer-Encoding", "chunked");
    enqueue(head(status, headers));
    flush();
  }
  void write_event(std::string data) {
    if (state_ != State::streaming || data.empty()) return;  // an empty chunk would end the stream
    if (queued_bytes_ + data.size() > core_->opt.max_queued_stream_bytes)
      return close_now();  // the client reads slower than we write: bounded memory
    if (chunked_) {
      char size[20];
      std::snprintf(size, sizeof size, "%zx\r\n", data.size());
      enqueue(size);
      enqueue(std::move(data));
      enqueue("\r\n");
    } else {
      enqueue(std::move(data));
    }
    flush();
  }
  void end_stream() {
    if (state_ != State::streaming) return;
    state_ = State::finishing;
    if (chunked_) enqueue("0\r\n\r\n");
    flush();
  }
  // The responder is gone without ending its response.
  void abandon() {
    if (state_ == State::awaiting)
      send(500, "application/json",
           error_body(ApiError::internal("the request handler dropped the request unanswered")),
           {});
    else if (state_ == State::streaming) {
      // Write what was queued, then close without the final chunk: a
      // truncated stream must not look complete.
      keep_alive_ = false;
      state_ = State::finishing;
      flush();
    }
  }

 private:
  enum class State { idle, reading, awaiting, streaming, finishing, lingering, closed };

  // ---- reading a request ----
  void read_next() {
    state_ = State::idle;
    if (buffer_.size() > 0) return begin_request();  // pipelined
    buffer_.shrink_to_fit();  // an idle connection holds no buffer
    arm_timer(core_->opt.idle_timeout_s);
    watch_peer();
  }

  // An async wait for readability (no buffer while idle); reads what is
  // there without blocking. While a response is pending it is how a
  // disconnect (EOF, reset) is noticed.
  void watch_peer() {
    if (watching_ || state_ == State::closed) return;
    watching_ = true;
    socket_.async_wait(tcp::socket::wait_read,
                       [self = shared_from_this()](error_code ec) { self->on_peer_readable(ec); });
  }
  void on_peer_readable(error_code ec) {
    watching_ = false;
    if (state_ != State::idle && state_ != State::awaiting && state_ != State::streaming &&
        state_ != State::finishing)
      return;  // a read of the request or the linger drain owns the socket now
    if (ec) return close_now();
    size_t available = socket_.available(ec);
    if (ec) return close_now();
    size_t n = socket_.read_some(buffer_.prepare(std::clamp<size_t>(available, 512, kLookaheadBytes)), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) return watch_peer();
    if (ec) return close_now();  // EOF or reset: the client is gone
    buffer_.commit(n);
    if (state_ == State::idle) return begin_request();
    if (buffer_.size() < kLookaheadBytes) watch_peer();
  }

  void begin_request() {
    state_ = State::reading;
    timed_out_ = false;
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(core_->opt.max_header_bytes));
    parser_->body_limit(core_->opt.max_body_bytes);
    arm_timer(core_->opt.read_timeout_s);  // headers and body, from the first byte: slowloris
    http::async_read_header(socket_, buffer_, *parser_,
                            [self = shared_from_this()](error_code ec, size_t) {
                              if (self->state_ == State::reading) self->on_header(ec);
                            });
  }

  void on_header(error_code ec) {
    if (ec) return on_read_error(ec);
    const auto& msg = parser_->get();
    if (auto te = msg.find(http::field::transfer_encoding);
        te != msg.end() && !iequals(trim(sv(te->value())), "chunked"))
      return reply_and_close({501, "unsupported Transfer-Encoding '" +
                                       std::string(te->value()) + "': only chunked is accepted",
                              "invalid_request_error", {}, "unsupported_transfer_encoding"});
    if (auto expect = msg.find(http::field::expect); expect != msg.end()) {
      if (!iequals(trim(sv(expect->value())), "100-continue"))
        return reply_and_close({417, "unsupported Expect '" + std::string(expect->value()) + "'",
                                "invalid_request_error", {}, "expectation_failed"});
      // The client waits for this before it sends the body (curl, big bodies).
      if (!parser_->is_done() && msg.version() >= 11) {
        enqueue("HTTP/1.1 100 Continue\r\n\r\n");
        flush();
      }
    }
    if (parser_->is_done()) return on_request_read();
    http::async_read(socket_, buffer_, *parser_, [self = shared_from_this()](error_code ec, size_t) {
      if (self->state_ != State::reading) return;
      if (ec) return self->on_read_error(ec);
      self->on_request_read();
    });
  }

  void on_read_error(error_code ec) {
    const auto& opt = core_->opt;
    if (timed_out_) {
      char message[80];
      std::snprintf(message, sizeof message, "request not received within %g s", opt.read_timeout_s);
      return reply_and_close({408, message, "invalid_request_error", {}, "request_timeout"});
    }
    if (ec == http::error::header_limit || ec == http::error::buffer_overflow)
      return reply_and_close({431,
                              "request headers exceed " + std::to_string(opt.max_header_bytes) +
                                  " bytes",
                              "invalid_request_error", {}, "request_header_fields_too_large"});
    if (ec == http::error::body_limit)
      return reply_and_close(ApiError::too_large(
          "request body exceeds " + std::to_string(opt.max_body_bytes) + " bytes"));
    if (ec == http::error::end_of_stream || ec == http::error::partial_message ||
        ec.category() != http::make_error_code(http::error::bad_method).category())
      return close_now();  // the client left mid-request: nobody to answer
    reply_and_close(ApiError::invalid("malformed HTTP request: " + ec.message()));
  }

  // A transport-detected error: answer it and close (the stream is no longer in sync).
  void reply_and_close(const ApiError& e) {
    parser_.reset();
    keep_alive_ = false;
    state_ = State::finishing;
    queue_response(e.status, "application/json", error_body(e), {});
  }

  void on_request_read() {
    cancel_timer();
    auto& msg = parser_->get();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    std::string_view target = sv(msg.target());
    size_t q = target.find('?');
    req.target = std::string(target.substr(0, q));
    if (q != std::string_view::npos) req.query = std::string(target.substr(q + 1));
    req.body = std::move(msg.body());
    for (const auto& field : msg) {
      std::string name(field.name_string());
      std::transform(name.begin(), name.end(), name.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      req.headers.emplace_back(std::move(name), std::string(field.value()));
    }
    keep_alive_ = msg.keep_alive();
    http10_ = msg.version() < 11;
    head_request_ = msg.method() == http::verb::head;
    parser_.reset();

    state_ = State::awaiting;
    exchange_ = std::make_shared<Exchange>(core_, weak_from_this());
    watch_peer();
    auto responder = make_responder(exchange_);
    try {
      core_->handler(std::move(req), responder);
    } catch (const std::exception& e) {
      handler_failed(e.what());
    } catch (...) {
      handler_failed("unknown exception");
    }
  }
  void handler_failed(std::string what) {
    // Posted after whatever the handler already sent: a no-op if it answered.
    exchange_->post([what = std::move(what)](Connection& c) {
      if (c.state_ == State::awaiting)
        c.send(500, "application/json",
               error_body(ApiError::internal("request handler failed: " + what)), {});
    });
  }

  // ---- writing ----
  std::string head(int status, const HttpHeaders& headers) const {
    if (status < 100 || status > 999) status = 500;
    std::string reason(http::obsolete_reason(http::int_to_status(static_cast<unsigned>(status))));
    if (reason.empty() || reason.front() == '<') reason = "Unknown";
    std::string s = http10_ ? "HTTP/1.0 " : "HTTP/1.1 ";
    s += std::to_string(status) + " " + reason + "\r\n";
    for (const auto& [name, value] : headers)
      s += clean_header_text(name) + ": " + clean_header_text(value) + "\r\n";
    if (!keep_alive_)
      s += "Connection: close\r\n";
    else if (http10_)
      s += "Connection: keep-alive\r\n";
    s += "\r\n";
    return s;
  }

  void queue_response(int status, std::string content_type, std::string body, HttpHeaders extra) {
    HttpHeaders headers = {{"Content-Type", std::move(content_type)},
                           {"Content-Length", std::to_string(body.size())}};
    for (auto& header : extra) {
      // The transport owns the framing.
      if (iequals(header.first, "content-length") || iequals(header.first, "transfer-encoding") ||
          iequals(header.first, "connection") || iequals(header.first, "content-type"))
        continue;
      headers.push_back(std::move(header));
    }
    enqueue(head(status, headers));
    if (!head_request_) enqueue(std::move(body));
    flush();
  }

  void enqueue(std::string bytes) {
    queued_bytes_ += bytes.size();
    queue_.push_back(std::move(bytes));
  }

  // One gathered write of everything queued; the next starts when it completes.
  void flush() {
    if (state_ == State::closed || writing_) return;
    if (queue_.empty()) {
      if (state_ == State::finishing) end_response();
      return;
    }
    writing_ = true;
    in_flight_.clear();
    std::swap(in_flight_, queue_);
    std::vector<asio::const_buffer> buffers;
    buffers.reserve(in_flight_.size());
    for (const auto& s : in_flight_) buffers.emplace_back(asio::buffer(s));
    // A client that stops reading must not hold the connection forever.
    if (state_ == State::streaming || state_ == State::finishing)
      arm_timer(core_->opt.idle_timeout_s);
    asio::async_write(socket_, buffers, [self = shared_from_this()](error_code ec, size_t n) {
      self->on_written(ec, n);
    });
  }
  void on_written(error_code ec, size_t n) {
    writing_ = false;
    queued_bytes_ -= std::min(queued_bytes_, n);
    in_flight_.clear();
    if (state_ == State::closed) return;
    if (ec) return close_now();
    if (queue_.empty() && state_ == State::streaming) cancel_timer();
    flush();
  }

  void end_response() {
    if (auto ex = std::move(exchange_)) ex->finish();
    queued_bytes_ = 0;
    if (keep_alive_ && !core_->stopped) return read_next();
    // Shut our side and drain theirs, so that unread request bytes do not
    // turn the close into a reset that loses the answer.
    state_ = State::lingering;
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    arm_timer(kLingerSeconds);
    drain();
  }
  void drain() {
    buffer_.clear();
    socket_.async_read_some(buffer_.prepare(1024), [self = shared_from_this()](error_code ec, size_t) {
      if (self->state_ != State::lingering) return;
      if (ec) return self->close_now();  // EOF: the client has read everything
      self->drain();
    });
  }

  // ---- one timer, its meaning given by the state ----
  void arm_timer(double s) {
    ++timer_generation_;
    timer_.expires_after(seconds(s));
    timer_.async_wait([self = shared_from_this(), generation = timer_generation_](error_code ec) {
      if (!ec && generation == self->timer_generation_) self->on_timer();
    });
  }
  void cancel_timer() {
    ++timer_generation_;
    timer_.cancel();
  }
  void on_timer() {
    if (state_ == State::reading) {
      timed_out_ = true;  // the read completes with operation_aborted and answers 408
      error_code ec;
      socket_.cancel(ec);
    } else if (state_ != State::awaiting) {
      close_now();  // idle keep-alive, a stalled write, the end of lingering
    }
  }

  static std::shared_ptr<HttpResponder> make_responder(std::shared_ptr<Exchange> ex);

  const std::shared_ptr<Core> core_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  uint64_t timer_generation_ = 0;
  bool counted_;  // in Core::open until closed
  State state_ = State::idle;
  bool watching_ = false;
  bool timed_out_ = false;
  bool keep_alive_ = true;
  bool http10_ = false;
  bool head_request_ = false;
  bool chunked_ = true;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;  // while reading a request
  std::shared_ptr<Exchange> exchange_;                             // while a response is due
  std::deque<std::string> queue_;       // waiting to be written
  std::deque<std::string> in_flight_;   // being written: alive until the write completes
  size_t queued_bytes_ = 0;             // queue_ + in_flight_
  bool writing_ = false;
};

template <class Fn>
void Exchange::post(Fn fn) {
  // Stop waits until no poster is inside, then refuses new ones: nothing
  // reaches the io_context once it is being torn down.
  core->posting.fetch_add(1);
  if (!core->stopped) {
    if (auto c = connection.lock()) {
      auto executor = c->executor();
      asio::post(executor, [c = std::move(c), self = shared_from_this(), fn = std::move(fn)]() mutable {
        if (c->exchange() == self.get()) fn(*c);
      });
    }
  }
  core->posting.fetch_sub(1);
}

class Responder final : public HttpResponder {
 public:
  explicit Responder(std::shared_ptr<Exchange> ex) : ex_(std::move(ex)) {}
  ~Responder() override {
    ex_->post([](Connection& c) { c.abandon(); });
  }
  void send(int status, std::string content_type, std::string body, HttpHeaders extra) override {
    ex_->post([status, content_type = std::move(content_type), body = std::move(body),
               extra = std::move(extra)](Connection& c) mutable {
      c.send(status, std::move(content_type), std::move(body), std::move(extra));
    });
  }
  void start_stream(int status) override {
    ex_->post([status](Connection& c) { c.start_stream(status); });
  }
  void write_event(std::string data) override {
    ex_->post([data = std::move(data)](Connection& c) mutable { c.write_event(std::move(data)); });
  }
  void end_stream() override {
    ex_->post([](Connection& c) { c.end_stream(); });
  }
  bool closed() const override { return ex_->closed || ex_->core->stopped; }
  void on_close(std::function<void()> fn) override { ex_->set_on_close(std::move(fn)); }

 private:
  const std::shared_ptr<Exchange> ex_;
};

std::shared_ptr<HttpResponder> Connection::make_responder(std::shared_ptr<Exchange> ex) {
  return std::make_shared<Responder>(std::move(ex));
}

class HttpServerImpl final : public HttpServer {
 public:
  HttpServerImpl(const HttpServerOptions& opt, HttpHandler handler)
      : core_(std::make_shared<Core>(opt, std::move(handler))),
        acceptor_(asio::make_strand(io_)),
        retry_timer_(acceptor_.get_executor()) {}

  ~HttpServerImpl() override {
    core_->stopped = true;
    while (core_->posting.load() != 0) std::this_thread::yield();
    asio::post(acceptor_.get_executor(), [this] {
      error_code ec;
      acceptor_.close(ec);
      retry_timer_.cancel();
    });
    for (auto& c : live_connections())
      asio::post(c->executor(), [c] { c->close_now(); });
    work_.reset();
    // Everything is closing, so run() returns soon; stop() is the backstop.
    {
      std::unique_lock lock(done_mu_);
      if (!done_cv_.wait_for(lock, std::chrono::seconds(3),
                             [&] { return threads_done_ == threads_.size(); }))
        io_.stop();
    }
    for (auto& t : threads_) t.join();
    // Connections the backstop left open; no io thread runs now.
    for (auto& c : live_connections()) c->close_now();
  }

  Status listen() {
    const auto& opt = core_->opt;
    const std::string where = opt.host + ":" + std::to_string(opt.port);
    error_code ec;
    auto address = asio::ip::make_address(opt.host == "localhost" ? "127.0.0.1" : opt.host, ec);
    if (ec)
      return Status(Code::invalid_argument,
                    "http: host '" + opt.host + "' is not a numeric IP address or localhost");
    tcp::endpoint endpoint(address, static_cast<unsigned short>(opt.port));
    if (acceptor_.open(endpoint.protocol(), ec) ||
        acceptor_.set_option(asio::socket_base::reuse_address(true), ec) ||
        acceptor_.bind(endpoint, ec) || acceptor_.listen(asio::socket_base::max_listen_connections, ec))
      return Status(Code::io_error, "http: cannot listen on " + where + ": " + ec.message());
    port_ = acceptor_.local_endpoint(ec).port();
    return Status::Ok();
  }

  void run() {
    accept();
    for (int i = 0; i < core_->opt.threads; ++i)
      threads_.emplace_back([this] {
        for (;;) {
          try {
            io_.run();
            break;
          } catch (...) {
            // A throwing completion handler must not take the server down.
          }
        }
        std::lock_guard lock(done_mu_);
        ++threads_done_;
        done_cv_.notify_all();
      });
  }

  int port() const override { return port_; }
  int open_connections() const override { return core_->open.load(); }
  uint64_t refused_connections() const override { return core_->refused.load(); }

 private:
  void accept() {
    acceptor_.async_accept(asio::make_strand(io_), [this](error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || core_->stopped) return;
      if (ec) {
        // Out of descriptors (EMFILE) and the like: back off instead of spinning.
        retry_timer_.expires_after(std::chrono::milliseconds(50));
        retry_timer_.async_wait([this](error_code wait_ec) {
          if (!wait_ec && !core_->stopped) accept();
        });
        return;
      }
      bool refuse = core_->open.load() >= core_->opt.max_connections;
      if (refuse) core_->refused.fetch_add(1);
      auto c = std::make_shared<Connection>(core_, std::move(socket), !refuse);
      asio::post(c->executor(), [c, refuse] { c->start(refuse); });
      accept();
    });
  }

  std::vector<std::shared_ptr<Connection>> live_connections() {
    std::vector<std::shared_ptr<Connection>> out;
    std::lock_guard lock(core_->registry_mu);
    for (Connection* c : core_->registry)
      if (auto sp = c->weak_from_this().lock()) out.push_back(std::move(sp));
    return out;  // released outside the lock: a last reference runs ~Connection, which locks
  }

  std::shared_ptr<Core> core_;
  asio::io_context io_;  // after core_, before every I/O object: destroyed after them
  asio::executor_work_guard<asio::io_context::executor_type> work_{io_.get_executor()};
  tcp::acceptor acceptor_;
  asio::steady_timer retry_timer_;
  int port_ = 0;
  std::vector<std::thread> threads_;
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  size_t threads_done_ = 0;
};

}  // namespace

Result<std::unique_ptr<HttpServer>> listen_and_serve(const HttpServerOptions& options,
                                                     HttpHandler handler) {
  auto server = std::make_unique<HttpServerImpl>(options, std::move(handler));
  CLEAVE_RETURN_IF_ERROR(server->listen());
  server->run();
  return std::unique_ptr<HttpServer>(std::move(server));
}

}  // namespace cleave::server
