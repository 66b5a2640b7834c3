#include "actors/kv_socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "actors/socket_io.h"
#include "schema/codec.h"

namespace cleave {

using namespace sockio;

namespace {

constexpr char kMagic[4] = {'C', 'K', 'V', '1'};
constexpr uint32_t kMaxMetaBytes = uint32_t(16) << 20;

struct Hello {
  char magic[4];
  uint64_t request_id;
  char token[kTokenChars];
} __attribute__((packed));

struct FrameHeader {
  uint32_t meta_bytes;
  uint32_t zero;
  uint64_t data_bytes;
};

void set_timeouts(int fd, std::chrono::milliseconds t) {
  set_io_timeouts(fd, t);
  (void)configure_kv_data_socket(fd);
}

}  // namespace

std::string configure_kv_data_socket(int fd) {
  const int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  for (const char* cc : {"cubic", "reno"})  // the first the kernel lets this process use
    if (::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, socklen_t(std::strlen(cc))) == 0) break;
  char name[32] = {};
  socklen_t len = sizeof name - 1;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return "";
  return std::string(name, ::strnlen(name, len));
}

namespace {


}  // namespace

// ---- sender ----

Result<std::unique_ptr<KvSocketServer>> KvSocketServer::listen(
    const std::string& host, std::shared_ptr<KvStreamCounters> counters, int32_t corrupt_chunk,
    std::chrono::milliseconds io_timeout, std::chrono::milliseconds offer_ttl,
    std::chrono::milliseconds idle_timeout) {
  auto addr = resolve(host, 0);
  if (!addr.ok()) return addr.status();
  std::unique_ptr<KvSocketServer> s(new KvSocketServer());
  s->host_ = host.empty() ? "127.0.0.1" : host;
  s->counters_ = std::move(counters);
  s->corrupt_chunk_ = corrupt_chunk;
  s->io_timeout_ = io_timeout;
  s->offer_ttl_ = offer_ttl;
  s->idle_timeout_ = idle_timeout;
  s->listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a = addr.value();
  socklen_t len = sizeof a;
  if (s->listener_ < 0 || ::bind(s->listener_, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
      ::listen(s->listener_, 64) != 0 ||
      ::getsockname(s->listener_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    return io_status("kv data socket: cannot listen on " + s->host_);
  s->port_ = ntohs(a.sin_port);
  s->acceptor_ = std::thread([p = s.get()] { p->accept_loop(); });
  return s;
}

KvSocketServer::~KvSocketServer() {
  stop_ = true;
  if (acceptor_.joinable()) acceptor_.join();
  if (listener_ >= 0) ::close(listener_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Connection& c : connections_) ::shutdown(c.fd, SHUT_RDWR);
  }
  reap(true);
  std::unordered_map<uint64_t, Offer> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(offers_);
  }
  for (auto& [id, o] : left)
    if (o.done) o.done(false);
}

std::string KvSocketServer::offer(uint64_t request_id, Records records, int32_t first_block,
                                  uint32_t chunk_bytes, Done done) {
  Offer o;
  o.token = random_token();
  o.records = std::move(records);
  o.first_block = first_block;
  o.chunk_bytes = chunk_bytes;
  o.done = std::move(done);
  o.at = std::chrono::steady_clock::now();
  std::string token = o.token;
  Done replaced;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = offers_.find(request_id);
    if (it != offers_.end()) replaced = std::move(it->second.done);
    offers_[request_id] = std::move(o);
  }
  if (replaced) replaced(false);
  return token;
}

size_t KvSocketServer::offers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return offers_.size();
}

// Joins finished connection threads (all of them when `all`).
void KvSocketServer::reap(bool all) {
  std::list<Connection> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      auto next = std::next(it);
      if (all || it->finished) done.splice(done.end(), connections_, it);
      it = next;
    }
  }
  for (Connection& c : done) {
    if (c.thread.joinable()) c.thread.join();
    ::close(c.fd);  // here, not in the thread: the destructor may still shut it down
  }
}

void KvSocketServer::accept_loop() {
  while (!stop_) {
    pollfd p{listener_, POLLIN, 0};
    const int r = ::poll(&p, 1, 100);
    reap(false);
    // Offers nobody claimed in time end as failed.
    std::vector<Done> expired;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto limit = std::chrono::steady_clock::now() - offer_ttl_;
      for (auto it = offers_.begin(); it != offers_.end();) {
        if (it->second.at < limit) {
          expired.push_back(std::move(it->second.done));
          it = offers_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (Done& d : expired)
      if (d) d(false);
    if (r <= 0 || !(p.revents & POLLIN)) continue;
    const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_timeouts(fd, io_timeout_);
    ++accepted_;
    std::lock_guard<std::mutex> lock(mu_);
    Connection& c = connections_.emplace_back();
    c.fd = fd;
    c.thread = std::thread([this, &c] {
      serve(c.fd);
      c.finished = true;
    });
  }
}

// A connection carries streams one after the other (receivers keep it for
// their next pull from this node): it ends on the first failure, or when no
// hello comes within idle_timeout.
void KvSocketServer::serve(int fd) {
  while (!stop_) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, int(idle_timeout_.count())) <= 0 || !serve_stream(fd)) return;
  }
}

bool KvSocketServer::serve_stream(int fd) {
  Hello hello{};
  if (!recv_bytes(fd, &hello, sizeof hello, "kv data socket hello").ok() ||
      std::memcmp(hello.magic, kMagic, sizeof kMagic) != 0)
    return false;
  Offer o;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = offers_.find(hello.request_id);
    // A wrong token is refused: the connection closes, the offer stays.
    if (it == offers_.end() || !same_token(hello.token, it->second.token)) return false;
    o = std::move(it->second);
    offers_.erase(it);
  }
  KvStreamWriter writer(hello.request_id, o.records, o.first_block, o.chunk_bytes);
  bool ok = true;
  // Per chunk one sendmsg of frame header, meta and the pieces from the
  // blocks, then the checksum, taken while the kernel's copy left the chunk
  // in cache.
  ChecksumStream sum;
  std::vector<iovec> pieces, iov;
  for (uint32_t seq = 0; ok && seq < writer.n_chunks() && !stop_; ++seq) {
    msg::KvChunk meta = writer.header(seq, pieces);
    uint64_t data_bytes = 0;
    for (const iovec& p : pieces) data_bytes += p.iov_len;
    msg::KvChunk corrupt;
    uint64_t checksum = 0;
    if (int64_t(seq) == corrupt_chunk_ && data_bytes > 0) {
      corrupt = writer.chunk(seq);  // its checksum is of the good bytes
      checksum = corrupt.checksum;
      corrupt.data[0] ^= 1;
      pieces.assign(1, iovec{corrupt.data.data(), corrupt.data.size()});
    }
    const codec::Bytes encoded = codec::encode(meta);
    FrameHeader fh{uint32_t(encoded.size()), 0, data_bytes};
    iov.clear();
    iov.push_back({&fh, sizeof fh});
    iov.push_back({const_cast<char*>(encoded.data()), encoded.size()});
    iov.insert(iov.end(), pieces.begin(), pieces.end());
    ok = send_iov(fd, iov.data(), iov.size(), "kv data socket", MSG_MORE).ok();
    if (corrupt.data.empty()) {
      sum.reset();
      for (const iovec& p : pieces) sum.update(p.iov_base, p.iov_len);
      checksum = sum.digest();
    }
    iovec tail{&checksum, sizeof checksum};
    ok = ok && send_iov(fd, &tail, 1, "kv data socket").ok();
    if (ok) {
      ++counters_->chunks_sent;
      counters_->bytes_sent += data_bytes;
    }
  }
  char ack = 0;
  ok = ok && !stop_ && recv_bytes(fd, &ack, 1, "kv data socket ack").ok() && ack == 'K';
  if (ok) {
    ++counters_->transfers_sent;
    counters_->blocks_sent += uint64_t(writer.n_blocks());
  } else {
    ++counters_->transfers_aborted;
  }
  if (o.done) o.done(ok);
  return ok;
}

// ---- receiver ----

namespace {

// Data connections a receiver keeps after a stream, by sender address, for
// the next pull from that node: a fresh connection starts TCP's window
// small, which cost a third of the throughput of 64 MiB streams here.
class KeptConnections {
 public:
  ~KeptConnections() {
    for (auto& [address, fds] : idle_)
      for (int fd : fds) ::close(fd);
  }
  // An idle connection to address that the sender has not closed, or -1.
  int take(const std::string& address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(address);
    while (it != idle_.end() && !it->second.empty()) {
      const int fd = it->second.back();
      it->second.pop_back();
      char byte;
      const ssize_t r = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return fd;  // open, nothing pending
      ::close(fd);  // closed by the sender (idle timeout), or a protocol error
    }
    return -1;
  }
  void put(const std::string& address, int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int>& fds = idle_[address];
    if (fds.size() >= kMaxPerAddress) {
      ::close(fd);
      return;
    }
    fds.push_back(fd);
  }

 private:
  static constexpr size_t kMaxPerAddress = 4;
  std::mutex mu_;
  std::unordered_map<std::string, std::vector<int>> idle_;
};

KeptConnections& kept_connections() {
  static KeptConnections kept;
  return kept;
}

// One stream on a connection. `started` turns true once the sender answered
// (a connection that fails before that may just have been closed while idle).
Result<std::vector<BlockRecord>> fetch_on(int fd, const std::string& what,
                                          const std::string& token, const msg::KvPull& pull,
                                          uint64_t max_total_bytes, KvStreamCounters& counters,
                                          bool& started) {
  Hello hello{};
  std::memcpy(hello.magic, kMagic, sizeof kMagic);
  hello.request_id = pull.request_id;
  std::memcpy(hello.token, token.data(), kTokenChars);
  CLEAVE_RETURN_IF_ERROR(send_bytes(fd, &hello, sizeof hello, what));
  KvStreamAssembler assembler(pull.request_id, pull.first_block, max_total_bytes);
  codec::Bytes meta_bytes;
  std::vector<iovec> iov;
  auto rejected = [&](Status st) {
    ++counters.chunks_rejected;
    return st;
  };
  while (!assembler.complete()) {
    FrameHeader fh{};
    CLEAVE_RETURN_IF_ERROR(recv_bytes(fd, &fh, sizeof fh, what));
    started = true;
    if (fh.meta_bytes == 0 || fh.meta_bytes > kMaxMetaBytes || fh.zero != 0 ||
        fh.data_bytes > codec::kMaxKvChunkBytes)
      return rejected(Status(Code::invalid_argument, what + ": malformed chunk frame"));
    meta_bytes.resize(fh.meta_bytes);
    CLEAVE_RETURN_IF_ERROR(recv_bytes(fd, meta_bytes.data(), meta_bytes.size(), what));
    auto meta = codec::decode_as<msg::KvChunk>(meta_bytes);
    if (!meta.ok()) return rejected(meta.status());
    Status st = assembler.begin(meta.value(), fh.data_bytes);
    if (!st.ok()) return rejected(st);
    // The chunk's bytes and its checksum in one read; the assembler checks
    // them while the chunk is in cache.
    uint64_t sent_checksum = 0;
    iov.assign(assembler.pieces().begin(), assembler.pieces().end());
    iov.push_back({&sent_checksum, sizeof sent_checksum});
    CLEAVE_RETURN_IF_ERROR(recv_iov(fd, iov.data(), iov.size(), what));
    st = assembler.end(sent_checksum);
    if (!st.ok()) return rejected(st);
    ++counters.chunks_received;
    counters.bytes_received += fh.data_bytes;
  }
  auto records = assembler.take();
  if (!records.ok()) return records.status();
  const char ack = 'K';
  CLEAVE_RETURN_IF_ERROR(send_bytes(fd, &ack, 1, what));
  return records;
}

}  // namespace

Result<std::vector<BlockRecord>> fetch_kv_socket(const std::string& address,
                                                 const std::string& token,
                                                 const msg::KvPull& pull, uint64_t max_total_bytes,
                                                 KvStreamCounters& counters,
                                                 std::chrono::milliseconds io_timeout) {
  const std::string what = "kv data socket " + address + " (request " +
                           std::to_string(pull.request_id) + ")";
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || token.size() != kTokenChars)
    return Status(Code::invalid_argument, what + ": bad address or token");
  const int port = std::atoi(address.c_str() + colon + 1);
  if (port <= 0 || port > 65535) return Status(Code::invalid_argument, what + ": bad port");
  auto addr = resolve(address.substr(0, colon), uint16_t(port));
  if (!addr.ok()) return addr.status();
  auto connect = [&]() -> Result<int> {
    Fd sock{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
    if (sock.fd < 0) return io_status(what);
    set_timeouts(sock.fd, io_timeout);
    sockaddr_in a = addr.value();
    if (::connect(sock.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
      return io_status(what + ": connect");
    return std::exchange(sock.fd, -1);
  };
  // A kept connection first; one the sender closed meanwhile fails before
  // the first frame, and the stream then goes on a fresh connection.
  Fd sock{kept_connections().take(address)};
  const bool reused = sock.fd >= 0;
  if (reused) set_timeouts(sock.fd, io_timeout);
  if (!reused) {
    auto fd = connect();
    if (!fd.ok()) return fd.status();
    sock.fd = fd.value();
  }
  bool started = false;
  auto records = fetch_on(sock.fd, what, token, pull, max_total_bytes, counters, started);
  if (!records.ok() && reused && !started && records.status().code() == Code::unavailable) {
    ::close(std::exchange(sock.fd, -1));
    auto fd = connect();
    if (!fd.ok()) return fd.status();
    sock.fd = fd.value();
    records = fetch_on(sock.fd, what, token, pull, max_total_bytes, counters, started);
  }
  if (records.ok()) kept_connections().put(address, std::exchange(sock.fd, -1));
  return records;
}

// ---- jobs ----

KvSocketJobs::~KvSocketJobs() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void KvSocketJobs::run(std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_.push_back(std::move(job));
  if (idle_ >= queue_.size())
    cv_.notify_one();
  else
    threads_.emplace_back([this] { work(); });
}

void KvSocketJobs::work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stopping, nothing left
    std::function<void()> job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    job();
    lock.lock();
  }
}

}  // namespace cleave
