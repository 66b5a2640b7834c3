#include "actors/expert_dispatch.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>

#include "actors/expert_socket.h"
#include "schema/codec.h"

namespace cleave::actors {

void ExpertDirectory::add(ExpertRef ref) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const ExpertRef& r : refs_)
    if (r.handle == ref.handle) return;
  refs_.push_back(std::move(ref));
  size_.store(refs_.size(), std::memory_order_release);
}

std::vector<ExpertRef> ExpertDirectory::since(size_t from) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (from >= refs_.size()) return {};
  return std::vector<ExpertRef>(refs_.begin() + ptrdiff_t(from), refs_.end());
}

expert_directory_actor spawn_expert_directory(caf::actor_system& system,
                                              std::shared_ptr<ExpertDirectory> directory) {
  return system.spawn(
      [](expert_directory_actor::pointer, std::shared_ptr<ExpertDirectory> dir)
          -> expert_directory_actor::behavior_type {
        return {[dir](expert_host_atom, const expert_actor& handle, const std::string& spec,
                      const std::string& endpoint) {
          auto sets = parse_expert_sets(spec);
          if (!sets.ok() || sets->size() != 1) {
            std::fprintf(stderr, "cleave: an expert actor with the unreadable set '%s' was skipped\n",
                         spec.substr(0, 64).c_str());
            return;
          }
          dir->add(ExpertRef{handle, sets->front(), endpoint});
        }};
      },
      std::move(directory));
}

namespace {

class ActorExpertExecutor final : public ExpertExecutor {
 public:
  ActorExpertExecutor(caf::actor_system& system, std::shared_ptr<const ExpertDirectory> directory,
                      std::shared_ptr<ExpertHost> fallback, std::optional<ReplicationPolicy> replication)
      : system_(system), directory_(std::move(directory)), fallback_(std::move(fallback)),
        replication_(replication) {
    const LlamaConfig& c = fallback_->config();
    per_layer_ = experts_per_layer(c);
    routed_.assign(size_t(c.n_layers) * size_t(per_layer_), 0);
    window_expert_rows_.assign(routed_.size(), 0);
  }

  void run(int32_t layer, std::span<const ExpertWork> work) override { finish(start(layer, work)); }

  // Sends every piece to a live host and returns: the actors compute while
  // the stage goes on (micro-batch ping-pong); finish() takes the answers.
  uint64_t start(int32_t layer, std::span<const ExpertWork> work) override {
    if (directory_->size() > seen_) {  // hosts that attached since the last layer
      for (ExpertRef& r : directory_->since(seen_)) hosts_.push_back(Host{std::move(r), true, 0, {}, nullptr});
      seen_ = hosts_.size();
      window_host_rows_.resize(hosts_.size(), 0);
    }
    for (const ExpertWork& w : work) {
      routed_[size_t(layer) * size_t(per_layer_) + size_t(w.expert)] += uint64_t(w.rows);
      window_expert_rows_[size_t(layer) * size_t(per_layer_) + size_t(w.expert)] += uint64_t(w.rows);
    }
    pending_.push_back(send(layer, std::vector<ExpertWork>(work.begin(), work.end()), /*sockets=*/true));
    pending_.back().ticket = next_ticket_++;
    const uint64_t ticket = pending_.back().ticket;
    // Once per model step (n_layers layer runs) the policy may add a replica.
    if (replication_ && ++window_runs_ >= fallback_->config().n_layers) maybe_replicate();
    return ticket;
  }

  // The stage's own share (experts no live actor hosts), then the actors'
  // answers; the pieces of a host that failed go round again, to a replica
  // or at last the fallback, so the layer always completes.
  void finish(uint64_t ticket) override {
    while (!pending_.empty() && pending_.front().ticket <= ticket) {
      Round& r = pending_.front();
      const int32_t layer = r.layer;
      const auto t0 = r.t0;
      std::vector<ExpertWork> todo = collect(r);
      while (!todo.empty()) {
        // As messages: a socket's answers come in its send order, and later
        // layers' batches may be queued on it already.
        Round again = send(layer, std::move(todo), /*sockets=*/false);
        todo = collect(again);
      }
      pending_.pop_front();
      const uint64_t ns = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
      dispatch_ns_ += ns;
      times_.add(ns);
      ++layers_;
    }
  }

  std::vector<std::pair<std::string, uint64_t>> counters() const override {
    uint64_t rows = 0, alive = 0;
    for (const Host& h : hosts_) {
      rows += h.rows;
      alive += h.alive ? 1 : 0;
    }
    std::vector<std::pair<std::string, uint64_t>> out = {
            {"expert_rows", rows},
            {"expert_fallback_rows", fallback_rows_},
            {"expert_batches", dispatches_},
            {"expert_socket_batches", socket_batches_},
            {"expert_host_failures", host_failures_},
            {"expert_hosts_alive", alive},
            {"expert_layers", layers_},
            {"expert_layer_us", dispatch_ns_ / 1000},
            {"expert_layer_p50_us", times_.percentile_us(50)},
            {"expert_layer_p99_us", times_.percentile_us(99)},
            {"expert_replicas_added", replicas_added_}};
    append_routed_counters(out, routed_, per_layer_);
    return out;
  }

 private:
  struct Host {
    ExpertRef ref;
    bool alive = true;
    uint64_t rows = 0;
    std::vector<std::pair<int32_t, int32_t>> added;  // replicas (layer, expert) it took
    std::shared_ptr<ExpertSocketClient> sock;         // another process's host: its data socket
    bool holds(const LlamaConfig& c, int32_t layer, int32_t expert) const {
      return ref.set.holds(c, layer, expert) ||
             std::find(added.begin(), added.end(), std::make_pair(layer, expert)) != added.end();
    }
  };

  // Hot-expert replication over the live actors (model/expert_balance.h):
  // the actor the policy names is asked to host one more expert; once it
  // says yes, this executor shares that expert's rows with it.
  void maybe_replicate() {
    std::vector<int32_t> live;
    std::vector<uint64_t> rows;
    for (int32_t h = 0; h < int32_t(hosts_.size()); ++h)
      if (hosts_[size_t(h)].alive) {
        live.push_back(h);
        rows.push_back(window_host_rows_[size_t(h)]);
      }
    const LlamaConfig& c = fallback_->config();
    auto holds = [&](int32_t i, int32_t l, int32_t e) { return hosts_[size_t(live[size_t(i)])].holds(c, l, e); };
    if (auto move = replication_->pick(holds, rows, window_expert_rows_, c.n_layers, per_layer_)) {
      Host& h = hosts_[size_t(live[size_t(move->host)])];
      caf::scoped_actor self{system_};
      bool added = false;
      self->request(h.ref.handle, kExpertTimeout, expert_add_atom::value, move->layer, move->expert)
          .receive([&](bool ok) { added = ok; }, [&](caf::error&) {});
      if (added) {  // else the host's next batch tells whether it is gone
        h.added.emplace_back(move->layer, move->expert);
        ++replicas_added_;
      }
    }
    window_runs_ = 0;
    window_host_rows_.assign(hosts_.size(), 0);
    window_expert_rows_.assign(routed_.size(), 0);
  }

  using Handle = decltype(std::declval<caf::scoped_actor&>()->request(
      std::declval<expert_actor>(), kExpertTimeout, expert_atom::value, std::declval<Bytes>()));
  // One round of a layer's work: the batches sent (each host's share) and
  // the pieces no live host holds.
  struct Round {
    uint64_t ticket = 0;
    int32_t layer = 0;
    Clock::time_point t0;
    std::unique_ptr<caf::scoped_actor> self;  // the answers come to its mailbox
    std::vector<std::vector<ExpertWork>> share;
    std::vector<ExpertWork> rest;
    std::vector<std::pair<size_t, Handle>> sent;
    std::vector<size_t> on_socket;  // hosts whose batch went on their data socket, in send order
    std::vector<size_t> failed;     // hosts whose data socket failed at send
  };

  // The host's data socket, connected on first use; null when it has none
  // (in process) or it cannot be reached.
  ExpertSocketClient* socket_of(Host& h) {
    if (h.ref.endpoint.empty()) return nullptr;
    if (!h.sock) {
      auto c = ExpertSocketClient::connect(h.ref.endpoint, kExpertTimeout);
      if (!c.ok()) return nullptr;
      h.sock = std::move(c.value());
    }
    return h.sock.get();
  }

  // sockets: a host with a data socket gets its batch there (else, and for
  // the rounds that retry a failed host's pieces, as a CAF message).
  Round send(int32_t layer, std::vector<ExpertWork> todo, bool sockets) {
    Round r;
    r.layer = layer;
    r.t0 = Clock::now();
    r.share.resize(hosts_.size());
    for (const ExpertWork& w : todo) {
      if (w.rows == 0) continue;
      const int32_t h = pick(layer, w.expert);
      if (h < 0) {
        r.rest.push_back(w);
        continue;
      }
      hosts_[size_t(h)].rows += uint64_t(w.rows);
      window_host_rows_[size_t(h)] += uint64_t(w.rows);
      r.share[size_t(h)].push_back(w);
    }
    for (size_t h = 0; h < r.share.size(); ++h) {
      if (r.share[h].empty()) continue;
      ++dispatches_;
      Host& host = hosts_[h];
      if (sockets && !host.ref.endpoint.empty()) {
        ExpertSocketClient* sock = socket_of(host);
        if (sock && sock->send(codec::encode(batch_of(layer, r.share[h]))).ok()) {
          r.on_socket.push_back(h);
          ++socket_batches_;
        } else {
          r.failed.push_back(h);
        }
        continue;
      }
      if (!r.self) r.self = std::make_unique<caf::scoped_actor>(system_);  // only for messages
      r.sent.emplace_back(h, (*r.self)->request(host.ref.handle, kExpertTimeout, expert_atom::value,
                                                codec::encode(batch_of(layer, r.share[h]))));
    }
    return r;
  }

  // Computes the round's rest, takes its answers; returns the pieces of the
  // hosts that failed (now marked dead).
  std::vector<ExpertWork> collect(Round& r) {
    if (!r.rest.empty()) {
      Status st = fallback_->compute(r.layer, r.rest);
      CLEAVE_CHECK(st.ok());  // the fallback holds every expert
      for (const ExpertWork& w : r.rest) fallback_rows_ += uint64_t(w.rows);
    }
    std::vector<ExpertWork> failed;
    auto drop = [&](size_t h) {
      if (hosts_[h].alive) ++host_failures_;
      hosts_[h].alive = false;
      hosts_[h].sock.reset();  // later rounds' answers on it fail at once
      failed.insert(failed.end(), r.share[h].begin(), r.share[h].end());
    };
    for (size_t h : r.failed) drop(h);
    for (size_t h : r.on_socket) {
      Status st;
      if (ExpertSocketClient* sock = hosts_[h].sock.get()) {
        auto reply = sock->answer(r.t0 + kExpertTimeout);
        st = reply.ok() ? take_outputs(reply.value(), r.layer, r.share[h]) : reply.status();
      } else {
        st = Status(Code::unavailable, "its data socket failed");
      }
      if (!st.ok()) drop(h);
    }
    for (auto& [h, handle] : r.sent) {
      Status st;
      handle.receive([&](const Bytes& reply) { st = take_outputs(reply, r.layer, r.share[h]); },
                     [&](caf::error& e) { st = from_error(e); });
      if (!st.ok()) drop(h);
    }
    return failed;
  }

  int32_t pick(int32_t layer, int32_t expert) const {
    int32_t best = -1;
    const LlamaConfig& c = fallback_->config();
    for (int32_t i = 0; i < int32_t(hosts_.size()); ++i) {
      const Host& h = hosts_[size_t(i)];
      if (!h.alive || !h.holds(c, layer, expert)) continue;
      if (best < 0 || h.rows < hosts_[size_t(best)].rows) best = i;
    }
    return best;
  }

  msg::ExpertBatch batch_of(int32_t layer, const std::vector<ExpertWork>& pieces) const {
    const int64_t dim = fallback_->config().dim;
    msg::ExpertBatch b;
    b.layer = layer;
    b.dim = uint32_t(dim);
    size_t bytes = 0;
    for (const ExpertWork& w : pieces) {
      b.pieces.push_back(msg::ExpertPiece{w.expert, uint32_t(w.rows)});
      bytes += size_t(w.rows * dim) * sizeof(float);
    }
    b.data.resize(bytes);
    size_t at = 0;
    for (const ExpertWork& w : pieces) {
      const size_t n = size_t(w.rows * dim) * sizeof(float);
      std::memcpy(b.data.data() + at, w.x, n);
      at += n;
    }
    b.checksum = checksum_bytes(b.data.data(), b.data.size());
    return b;
  }

  // The answer must carry the pieces that were sent (decode checked its
  // size and checksum).
  Status take_outputs(const Bytes& reply, int32_t layer, const std::vector<ExpertWork>& pieces) const {
    auto b = codec::decode_as<msg::ExpertBatch>(reply);
    if (!b.ok()) return b.status();
    bool same = b->layer == layer && b->dim == uint32_t(fallback_->config().dim) &&
                b->pieces.size() == pieces.size();
    for (size_t i = 0; same && i < pieces.size(); ++i)
      same = b->pieces[i].expert == pieces[i].expert && int64_t(b->pieces[i].rows) == pieces[i].rows;
    if (!same) return Status(Code::invalid_argument, "an expert actor answered other pieces than it was sent");
    size_t at = 0;
    for (const ExpertWork& w : pieces) {
      const size_t n = size_t(w.rows) * b->dim * sizeof(float);
      std::memcpy(w.y, b->data.data() + at, n);
      at += n;
    }
    return Status::Ok();
  }

  caf::actor_system& system_;
  std::shared_ptr<const ExpertDirectory> directory_;
  size_t seen_ = 0;  // directory entries already in hosts_
  std::shared_ptr<ExpertHost> fallback_;
  std::vector<Host> hosts_;  // touched only by the stage's thread (forward and stats)
  std::deque<Round> pending_;  // started layers, oldest first
  uint64_t next_ticket_ = 1;
  int32_t per_layer_ = 1;
  std::vector<uint64_t> routed_;  // rows routed to [layer * per_layer + expert]
  // Replication: the policy and what its current window saw.
  std::optional<ReplicationPolicy> replication_;
  int32_t window_runs_ = 0;
  std::vector<uint64_t> window_host_rows_, window_expert_rows_;
  uint64_t replicas_added_ = 0;
  uint64_t socket_batches_ = 0;
  uint64_t fallback_rows_ = 0, dispatches_ = 0, host_failures_ = 0, layers_ = 0, dispatch_ns_ = 0;
  LayerTimes times_;
};

}  // namespace

std::shared_ptr<ExpertExecutor> make_actor_expert_executor(caf::actor_system& system,
                                                           std::shared_ptr<const ExpertDirectory> experts,
                                                           std::shared_ptr<ExpertHost> fallback,
                                                           std::optional<ReplicationPolicy> replication) {
  return std::make_shared<ActorExpertExecutor>(system, std::move(experts), std::move(fallback), replication);
}

}  // namespace cleave::actors
