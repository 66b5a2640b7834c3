// The data socket of KV streams between processes (no CAF). CAF carries a
// stream's control messages (the pull, the offer below, the outcome); the
// bulk bytes go on a plain TCP connection of their own: CAF 0.17's BASP
// zero-fills a fresh receive buffer per message and deserialises each chunk
// into new vectors, which held KV transfer to a quarter of raw TCP.
//
// The sending process listens on its topology host (port 0). For each pull
// it offers the stream under a random 128-bit token that travels over the
// authenticated CAF channel; the receiver connects, presents request id and
// token (compared in constant time; a wrong one is refused, the connection
// closed), then reads the layer-major chunks (KvStreamWriter's, each with its
// XXH3-64 checksum) straight into the destination blocks and acknowledges
// the whole stream with one byte. The receiver keeps the connection for its
// next stream from that node (a fresh TCP connection starts with a small
// window); the sender closes it after an idle timeout or any failure. Every
// read and write has a timeout.
//
// Wire: hello "CKV1", u64 request id, 32 hex characters of token; per chunk
// u32 meta bytes, u32 0, u64 data bytes, the codec's KvChunk without data
// and checksum, the data, its XXH3-64 (u64); the ack 'K'; then the next
// hello, or the end of the connection. Native (little-endian) byte order.
// The sender writes a chunk's frame and data in one sendmsg and its
// checksum after them, the receiver reads data and checksum in one call;
// each side takes the checksum while the chunk is in cache.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "actors/kv_stream.h"

namespace cleave {

class KvSocketServer {
 public:
  using Records = KvOutbox::Records;
  // Called once per offer, from a server thread: true once the receiver
  // acknowledged the whole stream, false when it failed or expired.
  using Done = std::function<void(bool complete)>;

  // Listens on host (port 0). corrupt_chunk >= 0 (tests) flips a bit in
  // that chunk of every stream after its checksum was taken.
  static Result<std::unique_ptr<KvSocketServer>> listen(
      const std::string& host, std::shared_ptr<KvStreamCounters> counters,
      int32_t corrupt_chunk = -1, std::chrono::milliseconds io_timeout = std::chrono::seconds(5),
      std::chrono::milliseconds offer_ttl = std::chrono::seconds(30),
      std::chrono::milliseconds idle_timeout = std::chrono::seconds(30));
  ~KvSocketServer();  // closes the socket and every connection, joins the threads

  std::string address() const { return host_ + ":" + std::to_string(port_); }
  uint16_t port() const { return port_; }
  // Offers blocks [first_block, ..) of records as request_id in chunks of
  // chunk_bytes; returns the token the receiver must present (32 hex
  // characters). A new offer for the same request replaces the old one.
  std::string offer(uint64_t request_id, Records records, int32_t first_block,
                    uint32_t chunk_bytes, Done done);
  size_t offers() const;
  // Connections accepted so far (a receiver keeps one for its next streams).
  uint64_t accepted() const { return accepted_; }

 private:
  struct Offer {
    std::string token;
    Records records;
    int32_t first_block = 0;
    uint32_t chunk_bytes = 0;
    Done done;
    std::chrono::steady_clock::time_point at;
  };
  struct Connection {
    int fd = -1;
    std::thread thread;
    std::atomic<bool> finished{false};
  };
  KvSocketServer() = default;
  void accept_loop();
  void serve(int fd);
  bool serve_stream(int fd);  // false: the connection ends
  void reap(bool all);

  std::string host_;
  uint16_t port_ = 0;
  int listener_ = -1;
  std::shared_ptr<KvStreamCounters> counters_;
  int32_t corrupt_chunk_ = -1;
  std::chrono::milliseconds io_timeout_{5000}, offer_ttl_{30000}, idle_timeout_{30000};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Offer> offers_;
  std::list<Connection> connections_;  // guarded by mu_
  std::thread acceptor_;
};

// The receiving end: connects to address ("host:port"), presents the
// pull's request id and token, reads the stream into a KvStreamAssembler
// and acknowledges it. unavailable for a sender that cannot be reached or
// closes the connection early (a wrong token), timed_out for one that
// stalls longer than io_timeout, the assembler's typed errors for bad
// chunks (corruption for a checksum mismatch).
Result<std::vector<BlockRecord>> fetch_kv_socket(
    const std::string& address, const std::string& token, const msg::KvPull& pull,
    uint64_t max_total_bytes, KvStreamCounters& counters,
    std::chrono::milliseconds io_timeout = std::chrono::seconds(5));

// The options of a KV data connection (both ends; the benchmark's raw TCP
// too): no Nagle delay, and a loss-based congestion control without pacing,
// cubic or else reno, in place of a system default such as BBR: BBR's
// pacing held a fresh connection's bulk stream to about half its rate on
// loopback here (docs/PERFORMANCE.md). Returns the one in use.
std::string configure_kv_data_socket(int fd);

// Runs blocking jobs (a receiver's socket reads) on threads of their own,
// off CAF's scheduler: each job gets a thread at once (an idle one, else a
// new one: starting a thread per stream cost 0.1-0.3 ms); threads stay for
// the next jobs. Joins them when destroyed, after the queued jobs ran (every
// job is bounded by its timeouts).
class KvSocketJobs {
 public:
  ~KvSocketJobs();
  void run(std::function<void()> job);

 private:
  void work();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stop_ = false;
};

}  // namespace cleave
