#include "actors/expert_socket.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>

#include "actors/socket_io.h"

namespace cleave {

using namespace sockio;

namespace {

constexpr char kMagic[4] = {'C', 'E', 'X', '1'};
// Far above any layer's batch (rows x dim floats), far below memory.
constexpr uint64_t kMaxBatchBytes = uint64_t(1) << 30;

struct Hello {
  char magic[4];
  char token[kTokenChars];
  uint32_t index;
} __attribute__((packed));

struct AnswerHeader {
  uint32_t status;
  uint32_t zero;
  uint64_t bytes;
};

void nodelay(int fd) {
  const int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

namespace {

// A decoded batch this host can compute: its model's width, a layer the
// model has, experts the host holds.
Result<msg::ExpertBatch> checked_batch(const ExpertHost& host, const Bytes& bytes) {
  auto in = codec::decode_as<msg::ExpertBatch>(bytes);
  if (!in.ok()) return in.status();
  const LlamaConfig& c = host.config();
  if (in->dim != uint32_t(c.dim))
    return Status(Code::invalid_argument, "expert batch rows of " + std::to_string(in->dim) +
                                              " floats, the model's are " + std::to_string(c.dim));
  if (in->layer >= c.n_layers)
    return Status(Code::invalid_argument, "expert batch for layer " + std::to_string(in->layer) +
                                              " of a model with " + std::to_string(c.n_layers));
  for (const msg::ExpertPiece& p : in->pieces) CLEAVE_RETURN_IF_ERROR(host.require(int32_t(in->layer), p.expert));
  return in;
}

// The answer to `in`: piece k's rows read from y at row at[k].
Bytes answer_of(const msg::ExpertBatch& in, const float* y, const std::vector<size_t>& at) {
  msg::ExpertBatch out;
  out.layer = in.layer;
  out.dim = in.dim;
  out.pieces = in.pieces;
  out.data.resize(in.data.size());
  size_t dst = 0;
  for (size_t k = 0; k < in.pieces.size(); ++k) {
    const size_t n = size_t(in.pieces[k].rows) * in.dim * sizeof(float);
    std::memcpy(out.data.data() + dst, y + at[k] * in.dim, n);
    dst += n;
  }
  out.checksum = checksum_bytes(out.data.data(), out.data.size());
  return codec::encode(out);
}

// Batches of one layer as one: each expert's rows of every batch, in batch
// order, in one piece; answers[i] for batches[i].
Status compute_together(ExpertHost& host, const std::vector<const msg::ExpertBatch*>& batches,
                        std::vector<Bytes>& answers) {
  const int32_t layer = int32_t(batches.front()->layer);
  const size_t dim = batches.front()->dim;
  const int32_t n_experts = experts_per_layer(host.config());
  // Where each piece's rows go in the merged x: per expert, batch order.
  std::vector<std::vector<size_t>> at(batches.size());
  std::vector<int64_t> expert_rows(size_t(n_experts), 0);
  for (const msg::ExpertBatch* b : batches)
    for (const msg::ExpertPiece& p : b->pieces) expert_rows[size_t(p.expert)] += p.rows;
  std::vector<size_t> first(size_t(n_experts) + 1, 0);
  for (int32_t e = 0; e < n_experts; ++e) first[size_t(e) + 1] = first[size_t(e)] + size_t(expert_rows[size_t(e)]);
  std::vector<float> x(first.back() * dim), y(x.size());
  std::vector<size_t> fill(first.begin(), first.end() - 1);
  for (size_t i = 0; i < batches.size(); ++i) {
    size_t src = 0;
    for (const msg::ExpertPiece& p : batches[i]->pieces) {
      size_t& row = fill[size_t(p.expert)];
      at[i].push_back(row);
      std::memcpy(x.data() + row * dim, batches[i]->data.data() + src * sizeof(float), p.rows * dim * sizeof(float));
      row += p.rows;
      src += p.rows * dim;
    }
  }
  std::vector<ExpertWork> work;
  for (int32_t e = 0; e < n_experts; ++e)
    if (expert_rows[size_t(e)] > 0)
      work.push_back(ExpertWork{e, expert_rows[size_t(e)], x.data() + first[size_t(e)] * dim,
                                y.data() + first[size_t(e)] * dim});
  CLEAVE_RETURN_IF_ERROR(host.compute(layer, work));
  answers.clear();
  for (size_t i = 0; i < batches.size(); ++i) {
    answers.push_back(answer_of(*batches[i], y.data(), at[i]));
  }
  return Status::Ok();
}

}  // namespace

Result<Bytes> serve_expert_batch(ExpertHost& host, const Bytes& bytes) {
  auto in = checked_batch(host, bytes);
  if (!in.ok()) return in.status();
  std::vector<Bytes> answers;
  CLEAVE_RETURN_IF_ERROR(compute_together(host, {&in.value()}, answers));
  return std::move(answers.front());
}

// ---- server ----

struct ExpertSocketServer::Job {
  msg::ExpertBatch batch;
  Result<Bytes> answer = Status(Code::aborted, "not computed");
  bool done = false;
};

struct ExpertSocketServer::HostQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job*> waiting;
  bool busy = false;
};

// Leader and followers: the thread that finds its host idle computes its
// job together with every job of the same layer queued by then; the others
// wait for theirs to be done.
void ExpertSocketServer::run(HostQueue& q, ExpertHost& host, Job& job) {
  std::unique_lock<std::mutex> lock(q.mu);
  q.waiting.push_back(&job);
  while (!job.done) {
    if (q.busy) {
      q.cv.wait(lock);
      continue;
    }
    q.busy = true;
    if (gather_.count() > 0) {
      lock.unlock();
      std::this_thread::sleep_for(gather_);
      lock.lock();
    }
    const auto layer = q.waiting.front()->batch.layer;
    std::vector<Job*> take;
    for (auto it = q.waiting.begin(); it != q.waiting.end();) {
      if ((*it)->batch.layer != layer) {
        ++it;
        continue;
      }
      take.push_back(*it);
      it = q.waiting.erase(it);
    }
    lock.unlock();
    std::vector<const msg::ExpertBatch*> batches;
    for (Job* j : take) batches.push_back(&j->batch);
    std::vector<Bytes> answers;
    Status st = compute_together(host, batches, answers);
    for (size_t i = 0; i < take.size(); ++i) take[i]->answer = st.ok() ? Result<Bytes>(std::move(answers[i])) : st;
    if (take.size() > 1) merged_ += take.size();
    lock.lock();
    for (Job* j : take) j->done = true;
    q.busy = false;
    q.cv.notify_all();
  }
}

// ---- server ----

Result<std::unique_ptr<ExpertSocketServer>> ExpertSocketServer::listen(
    const std::string& host, std::vector<std::shared_ptr<ExpertHost>> hosts, std::chrono::milliseconds io_timeout,
    std::chrono::milliseconds gather) {
  auto addr = resolve(host, 0);
  if (!addr.ok()) return addr.status();
  std::unique_ptr<ExpertSocketServer> s(new ExpertSocketServer());
  s->host_ = host.empty() ? "127.0.0.1" : host;
  s->token_ = random_token();
  s->io_timeout_ = io_timeout;
  s->hosts_ = std::move(hosts);
  s->gather_ = gather;
  for (size_t i = 0; i < s->hosts_.size(); ++i) s->queues_.push_back(std::make_unique<HostQueue>());
  s->listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s->listener_ < 0) return io_status("expert data socket");
  const int one = 1;
  (void)::setsockopt(s->listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a = addr.value();
  socklen_t len = sizeof a;
  if (::bind(s->listener_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(s->listener_, 64) != 0 ||
      ::getsockname(s->listener_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    return io_status("expert data socket on " + s->host_);
  s->port_ = ntohs(a.sin_port);
  s->acceptor_ = std::thread([p = s.get()] { p->accept_loop(); });
  return s;
}

ExpertSocketServer::~ExpertSocketServer() {
  stop_ = true;
  if (listener_ >= 0) ::shutdown(listener_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  if (listener_ >= 0) ::close(listener_);
  std::lock_guard<std::mutex> lock(mu_);
  for (Connection& c : connections_) ::shutdown(c.fd, SHUT_RDWR);
  for (Connection& c : connections_) {
    if (c.thread.joinable()) c.thread.join();
    ::close(c.fd);
  }
}

std::string ExpertSocketServer::endpoint(size_t index) const {
  return host_ + ":" + std::to_string(port_) + "/" + token_ + "/" + std::to_string(index);
}

void ExpertSocketServer::accept_loop() {
  while (!stop_) {
    pollfd p{listener_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(mu_);
    // Threads of connections that ended are joined here, as new ones come.
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (!it->finished) {
        ++it;
        continue;
      }
      it->thread.join();
      ::close(it->fd);
      it = connections_.erase(it);
    }
    if (stop_) {
      ::close(fd);
      return;
    }
    Connection& c = connections_.emplace_back();
    c.fd = fd;
    c.thread = std::thread([this, &c] {
      serve(c.fd);
      ::shutdown(c.fd, SHUT_RDWR);  // the stage sees the end now; the fd closes at the join
      c.finished = true;
    });
  }
}

// One stage's batches, answered in order until it closes or fails. The
// hello waits io_timeout at most; between batches a connection may idle as
// long as its stage has no work.
void ExpertSocketServer::serve(int fd) {
  nodelay(fd);
  set_io_timeouts(fd, io_timeout_);
  Hello hello{};
  if (!recv_bytes(fd, &hello, sizeof hello, "expert hello").ok() || std::memcmp(hello.magic, kMagic, 4) != 0 ||
      !same_token(hello.token, token_) || hello.index >= hosts_.size())
    return;  // closing is the answer: nothing about the token leaks
  ExpertHost& host = *hosts_[hello.index];
  HostQueue& queue = *queues_[hello.index];
  Bytes in;
  while (!stop_) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, 200);
    if (ready == 0) continue;
    if (ready < 0 && errno == EINTR) continue;
    uint64_t n = 0;
    if (ready < 0 || !recv_bytes(fd, &n, sizeof n, "expert batch").ok() || n > kMaxBatchBytes) return;
    in.resize(size_t(n));
    if (!recv_bytes(fd, in.data(), in.size(), "expert batch").ok()) return;
    Result<Bytes> out = Status(Code::aborted, "");
    if (auto batch = checked_batch(host, in); batch.ok()) {
      Job job;
      job.batch = std::move(batch.value());
      run(queue, host, job);
      out = std::move(job.answer);
    } else {
      out = batch.status();
    }
    AnswerHeader h{0, 0, 0};
    std::string why;
    if (out.ok()) {
      ++batches_;
      h.bytes = out->size();
    } else {
      ++refused_;
      h.status = uint32_t(out.status().code());
      why = out.status().message();
      h.bytes = why.size();
    }
    iovec v[2] = {{&h, sizeof h},
                  {out.ok() ? static_cast<void*>(out->data()) : static_cast<void*>(why.data()), size_t(h.bytes)}};
    if (!send_iov(fd, v, 2, "expert answer").ok()) return;
  }
}

// ---- client ----

Result<std::unique_ptr<ExpertSocketClient>> ExpertSocketClient::connect(const std::string& endpoint,
                                                                        std::chrono::milliseconds io_timeout) {
  const std::string what = "expert data socket " + endpoint.substr(0, endpoint.find('/'));
  const size_t colon = endpoint.rfind(':', endpoint.find('/'));
  const size_t slash1 = endpoint.find('/');
  const size_t slash2 = slash1 == std::string::npos ? slash1 : endpoint.find('/', slash1 + 1);
  if (colon == std::string::npos || slash2 == std::string::npos || slash2 - slash1 - 1 != kTokenChars)
    return Status(Code::invalid_argument, what + ": bad endpoint");
  const int port = std::atoi(endpoint.c_str() + colon + 1);
  const long index = std::atol(endpoint.c_str() + slash2 + 1);
  if (port <= 0 || port > 65535 || index < 0) return Status(Code::invalid_argument, what + ": bad endpoint");
  auto addr = resolve(endpoint.substr(0, colon), uint16_t(port));
  if (!addr.ok()) return addr.status();
  Fd sock{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  if (sock.fd < 0) return io_status(what);
  nodelay(sock.fd);
  set_io_timeouts(sock.fd, io_timeout);
  sockaddr_in a = addr.value();
  if (::connect(sock.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return io_status(what + ": connect");
  Hello hello{};
  std::memcpy(hello.magic, kMagic, 4);
  std::memcpy(hello.token, endpoint.data() + slash1 + 1, kTokenChars);
  hello.index = uint32_t(index);
  CLEAVE_RETURN_IF_ERROR(send_bytes(sock.fd, &hello, sizeof hello, what + ": hello"));
  std::unique_ptr<ExpertSocketClient> c(new ExpertSocketClient());
  c->fd_ = std::exchange(sock.fd, -1);
  c->what_ = what;
  return c;
}

ExpertSocketClient::~ExpertSocketClient() {
  if (fd_ >= 0) ::close(fd_);
}

Status ExpertSocketClient::send(const Bytes& batch) {
  uint64_t n = batch.size();
  iovec v[2] = {{&n, sizeof n}, {const_cast<char*>(batch.data()), batch.size()}};
  return send_iov(fd_, v, 2, what_ + ": batch");
}

Result<Bytes> ExpertSocketClient::answer(std::chrono::steady_clock::time_point deadline) {
  // The whole answer must arrive by the deadline: poll for its start, then
  // the socket's own timeout bounds each read.
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, int(std::max<int64_t>(0, left.count())));
    if (ready > 0) break;
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) return Status(Code::timed_out, what_ + ": no answer within the timeout");
    return io_status(what_ + ": answer");
  }
  AnswerHeader h{};
  CLEAVE_RETURN_IF_ERROR(recv_bytes(fd_, &h, sizeof h, what_ + ": answer"));
  if (h.bytes > kMaxBatchBytes) return Status(Code::corruption, what_ + ": an answer of " + std::to_string(h.bytes) + " bytes");
  Bytes out(size_t(h.bytes), char(0));
  CLEAVE_RETURN_IF_ERROR(recv_bytes(fd_, out.data(), out.size(), what_ + ": answer"));
  if (h.status != 0)  // the host's typed error, as text: any one drops the host
    return Status(Code::unavailable, what_ + ": the host refused the batch: " + std::string(out.begin(), out.end()));
  return out;
}

}  // namespace cleave
