// The data socket of expert batches between processes (no CAF). An
// attention stage's per-layer round trip is latency-bound: through CAF's
// middleman one layer's batch took about 0.5 ms at batch 1 where a loopback
// TCP echo of the same bytes takes 20 us (bench/actors/experts_nodes.py),
// so the batches go on a plain TCP connection per (stage, expert host),
// as the KV streams' bulk bytes do. CAF still carries the control: the
// expert actor attaches through the head with this socket's endpoint, and
// replicas are added by message.
//
// A process hosting expert actors listens on its topology host (port 0)
// under one random 128-bit token, which travels over the authenticated CAF
// channel inside the endpoint "HOST:PORT/TOKEN/INDEX" (INDEX: which of the
// process's expert hosts). The stage connects, presents the token and the
// index (compared in constant time; a wrong one closes the connection),
// then sends batches and reads their answers in order: several may be in
// flight (micro-batch ping-pong), each answered before the next is read.
//
// Batches of one layer that reach a host while it computes (from several
// attention stages, each on its own connection) are computed together:
// one matmul per expert over all their rows, then split back. The kernels
// are batch invariant, so each answer has the bits it would have alone.
//
// Wire: hello "CEX1", 32 hex characters of token, u32 index; per batch u64
// bytes and the codec's ExpertBatch (its XXH3-64 checksum inside); per
// answer u32 status (0: ok, else a Code), u64 bytes and the answer's
// ExpertBatch (or the error message). Native (little-endian) byte order.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "model/experts.h"
#include "schema/codec.h"

namespace cleave {

using codec::Bytes;

// One batch through a host: decode (size and checksum checked), compute,
// encode the answer. invalid_argument for a batch of another model's width,
// a layer past the model, or an expert the host does not hold.
Result<Bytes> serve_expert_batch(ExpertHost& host, const Bytes& batch);

class ExpertSocketServer {
 public:
  // gather (tests): how long the first batch waits for others before its
  // host computes; 0 in service (only batches that arrive while the host
  // is busy are merged, so none waits for company).
  static Result<std::unique_ptr<ExpertSocketServer>> listen(
      const std::string& host, std::vector<std::shared_ptr<ExpertHost>> hosts,
      std::chrono::milliseconds io_timeout = std::chrono::seconds(5),
      std::chrono::milliseconds gather = std::chrono::milliseconds(0));
  ~ExpertSocketServer();  // closes the socket and every connection, joins the threads

  // What a stage needs to reach hosts[index].
  std::string endpoint(size_t index) const;
  uint64_t batches() const { return batches_.load(); }
  uint64_t refused() const { return refused_.load(); }
  // Batches computed together with at least one other.
  uint64_t merged() const { return merged_.load(); }

 private:
  ExpertSocketServer() = default;
  void accept_loop();
  void serve(int fd);
  struct Job;
  struct HostQueue;
  // Computes job with whatever else of its layer is queued on its host.
  void run(HostQueue& q, ExpertHost& host, Job& job);
  struct Connection {
    int fd = -1;
    std::thread thread;
    std::atomic<bool> finished{false};
  };

  std::string host_, token_;
  uint16_t port_ = 0;
  int listener_ = -1;
  std::chrono::milliseconds io_timeout_{5000};
  std::chrono::milliseconds gather_{0};
  std::vector<std::shared_ptr<ExpertHost>> hosts_;
  std::vector<std::unique_ptr<HostQueue>> queues_;  // one per host
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> batches_{0}, refused_{0}, merged_{0};
  std::mutex mu_;  // connections_
  std::list<Connection> connections_;
  std::thread acceptor_;
};

// A stage's connection to one expert host. send() writes a batch; answer()
// reads the oldest unanswered one. Any failure (refused hello, closed,
// timed out, an error answer) is returned and leaves the connection
// unusable: the caller drops the host.
class ExpertSocketClient {
 public:
  // invalid_argument for an endpoint that does not parse; unavailable when
  // the connection or the hello fails.
  static Result<std::unique_ptr<ExpertSocketClient>> connect(
      const std::string& endpoint, std::chrono::milliseconds io_timeout = std::chrono::seconds(5));
  ~ExpertSocketClient();

  Status send(const Bytes& batch);
  // Waits until `deadline` at most.
  Result<Bytes> answer(std::chrono::steady_clock::time_point deadline);

 private:
  ExpertSocketClient() = default;
  int fd_ = -1;
  std::string what_;
};

}  // namespace cleave
