// The actors of the colocated and pd topologies, and the Pipeline that owns
// them. The only translation unit that includes CAF (each one costs 10-15 s
// and ~0.5 GiB to compile).
//
// Messages are (atom, Cap'n Proto bytes). Behaviours unpack the bytes, call
// the plain class their state owns (StageCore, TieredStore, the router's
// tables), and turn Status into caf::error (category "cleave", the Code as
// error code, the message as context) or into stream events.
//
//   client --submit--> router --submit/handoff--> stage (prefill | decode | colocated)
//   a request whose images lack embeddings goes first: router --encode-->
//   vision_encoder (least loaded), whose reply (the embeddings) the router
//   puts into the request before it goes on to a stage
//   stage --event--> router (token / finished / failed) --> client callback
//   prefill --handoff (+ its kv_sender)--> router --handoff--> decode, and
//   prefill --kv_put--> kv_store at the same time (the copy for re-placement)
//   decode --kv_fetch--> its kv_receiver --kv_pull--> the prefill's kv_sender
//   kv_sender --kv_chunk (acked, a bounded window in flight)--> kv_receiver
//   decode resumes from the streamed blocks (or, when the stream fails, from
//   --kv_get--> kv_store); --kv_put--> newly filled blocks
//
// Nodes (actors/node.h, at the end of this file) spread the same actors over
// processes: the head publishes a join actor through CAF's middleman, workers
// join it and attach their stages to the head's router.
//
// Stage actors run detached (Engine::forward blocks) and drive their
// scheduler with step messages to themselves, so every other message is
// handled between two forward passes.
#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "actors/actor_pipeline.h"
#include "actors/kv_socket.h"
#include "actors/kv_stream.h"
#include "actors/node.h"
#include "actors/stage_core.h"
#include "model/vision_encoder.h"
#include "schema/codec.h"
#include "storage/memory_tier.h"
#include "storage/tiered_store.h"
#ifdef CLEAVE_HAVE_ROCKSDB
#include "storage/rocksdb_tier.h"
#endif

namespace cleave {
namespace {

using Bytes = std::vector<char>;
using Clock = std::chrono::steady_clock;

using submit_atom = caf::atom_constant<caf::atom("submit")>;
using handoff_atom = caf::atom_constant<caf::atom("handoff")>;
using cancel_atom = caf::atom_constant<caf::atom("cancel")>;
using step_atom = caf::atom_constant<caf::atom("step")>;
using stats_atom = caf::atom_constant<caf::atom("stats")>;
using event_atom = caf::atom_constant<caf::atom("event")>;
using kv_put_atom = caf::atom_constant<caf::atom("kv_put")>;
using kv_get_atom = caf::atom_constant<caf::atom("kv_get")>;
using tick_atom = caf::atom_constant<caf::atom("tick")>;
using attach_atom = caf::atom_constant<caf::atom("attach")>;
using shutdown_atom = caf::atom_constant<caf::atom("shutdown")>;
using kv_pull_atom = caf::atom_constant<caf::atom("kv_pull")>;
using kv_chunk_atom = caf::atom_constant<caf::atom("kv_chunk")>;
using kv_fetch_atom = caf::atom_constant<caf::atom("kv_fetch")>;
using encode_atom = caf::atom_constant<caf::atom("encode")>;
using kv_socket_atom = caf::atom_constant<caf::atom("kv_socket")>;
using kv_done_atom = caf::atom_constant<caf::atom("kv_done")>;

// Timeouts of every request between actors: nothing waits forever.
constexpr auto kKvTimeout = std::chrono::seconds(10);
constexpr auto kStageTimeout = std::chrono::seconds(30);
constexpr auto kClientTimeout = std::chrono::seconds(10);
constexpr auto kTickInterval = std::chrono::milliseconds(200);
// KV streams: a stream that makes no progress this long fails (the decoder
// then reads the store); a whole fetch is bounded too; a prefill keeps a
// finished request's KV for its decoder's pull this long.
constexpr auto kKvStallTimeout = std::chrono::seconds(5);
constexpr auto kKvFetchTimeout = std::chrono::seconds(30);
constexpr auto kKvOutboxTtl = std::chrono::seconds(30);
constexpr auto kKvOutboxSweep = std::chrono::seconds(1);
constexpr uint64_t kKvMaxStreamBytes = uint64_t(1) << 30;

using kv_store_actor = caf::typed_actor<caf::replies_to<kv_put_atom, Bytes>::with<Bytes>,
                                        caf::replies_to<kv_get_atom, Bytes>::with<Bytes>,
                                        caf::replies_to<stats_atom>::with<Bytes>>;

// A decode stage's end of KV streams. fetch (from its stage: a KvPull, the
// prefill's kv_sender and the "host:port" its node listens on) answers once the stream is complete and in the
// stage's KvInbox (true) or has failed (false, or an error: the stage reads
// the store instead); chunk (from the sender) answers the chunk's seq: the
// ack that lets the sender send another.
// kv_done (from its own socket thread): the stream of that request on the
// data socket ended (the outcome waits in the socket results).
using kv_receiver_actor =
    caf::typed_actor<caf::replies_to<kv_fetch_atom, Bytes, caf::actor, std::string>::with<bool>,
                     caf::replies_to<kv_chunk_atom, Bytes>::with<uint32_t>,
                     caf::reacts_to<kv_done_atom, uint64_t>, caf::reacts_to<tick_atom>>;

// A prefill stage's end: pull (KvPull, where to send) answers the number of
// chunks and streams them to the receiver over CAF; socket (KvPull) offers
// the stream on the sender's data socket (actors/kv_socket.h) and answers
// its "host:port" and the stream's token ("" when there is nothing to send).
using kv_sender_actor =
    caf::typed_actor<caf::replies_to<kv_pull_atom, Bytes, kv_receiver_actor>::with<uint32_t>,
                     caf::replies_to<kv_socket_atom, Bytes>::with<std::string, std::string>,
                     caf::reacts_to<tick_atom>>;

// submit: GenerateRequest; handoff: Handoff, with the kv_sender to pull the
// KV from or without (then from the store) (the answer is admission only;
// the outcome arrives as events).
using stage_actor = caf::typed_actor<caf::replies_to<submit_atom, Bytes>::with<bool>,
                                     caf::replies_to<handoff_atom, Bytes>::with<bool>,
                                     caf::replies_to<handoff_atom, Bytes, kv_sender_actor>::with<bool>,
                                     caf::reacts_to<cancel_atom, uint64_t>,
                                     caf::reacts_to<step_atom>,
                                     caf::replies_to<stats_atom>::with<Bytes>>;

// encode: EncodeRequest -> ImageEmbeddings (or a typed error for that
// request alone); requests that arrive between two steps are batched.
using vision_encoder_actor = caf::typed_actor<caf::replies_to<encode_atom, Bytes>::with<Bytes>,
                                              caf::reacts_to<step_atom>,
                                              caf::replies_to<stats_atom>::with<Bytes>>;

// submit: GenerateRequest from the client (admission); event: StreamEvent
// and handoff: Handoff from stages; attach: a stage and its kind, or a
// vision encoder.
using router_actor =
    caf::typed_actor<caf::replies_to<submit_atom, Bytes>::with<bool>,
                     caf::reacts_to<event_atom, Bytes>, caf::reacts_to<handoff_atom, Bytes>,
                     caf::reacts_to<handoff_atom, Bytes, kv_sender_actor>,
                     caf::replies_to<attach_atom, std::string, stage_actor>::with<bool>,
                     caf::replies_to<attach_atom, std::string, vision_encoder_actor>::with<bool>,
                     caf::reacts_to<tick_atom>, caf::replies_to<shutdown_atom>::with<bool>,
                     caf::replies_to<stats_atom>::with<Bytes>>;

// ---- Status <-> caf::error ----

const caf::atom_value kCleaveCategory = caf::atom("cleave");

caf::error to_error(const Status& st) {
  return caf::error(static_cast<uint8_t>(st.code()), kCleaveCategory,
                    caf::make_message(st.message()));
}

Status from_error(const caf::error& e) {
  if (!e) return Status::Ok();
  if (e.category() == kCleaveCategory) {
    std::string what;
    if (e.context().match_elements<std::string>()) what = e.context().get_as<std::string>(0);
    return Status(static_cast<Code>(e.code()), what);
  }
  if (e.category() == caf::atom("system")) {
    auto sec = static_cast<caf::sec>(e.code());
    if (sec == caf::sec::request_timeout) return Status(Code::timed_out, "actor request timed out");
    return Status(Code::unavailable, "actor system: " + caf::to_string(sec));
  }
  return Status(Code::unavailable, "actor error " + std::to_string(e.code()) + " in category " +
                                       caf::to_string(e.category()));
}

Bytes encode_stats(std::string actor, std::vector<std::pair<std::string, uint64_t>> counters) {
  msg::Stats s;
  s.actor = std::move(actor);
  s.counters = std::move(counters);
  return codec::encode(s);
}

// ---- kv_store ----

struct KvStoreState {
  std::shared_ptr<TieredStore> store;
  uint64_t puts = 0, gets = 0, blocks_stored = 0, blocks_rejected = 0, blocks_served = 0;
  uint64_t bad_messages = 0;
  static inline const char* name = "cleave.kv_store";
};

kv_store_actor::behavior_type kv_store_fn(kv_store_actor::stateful_pointer<KvStoreState> self,
                                          std::shared_ptr<TieredStore> store) {
  self->state.store = std::move(store);
  return {
      [=](kv_put_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto& s = self->state;
        auto put = codec::decode_as<msg::KvPut>(bytes);
        if (!put.ok()) {
          ++s.bad_messages;
          return to_error(put.status());
        }
        ++s.puts;
        msg::KvAck ack;
        for (const BlockRecord& r : put->blocks) {
          Status st = s.store->put(r);
          if (st.ok()) {
            ++ack.stored;
          } else {
            if (ack.rejected++ == 0) ack.first_error = st;
          }
        }
        s.blocks_stored += uint64_t(ack.stored);
        s.blocks_rejected += uint64_t(ack.rejected);
        return codec::encode(ack);
      },
      [=](kv_get_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto& s = self->state;
        auto get = codec::decode_as<msg::KvGet>(bytes);
        if (!get.ok()) {
          ++s.bad_messages;
          return to_error(get.status());
        }
        ++s.gets;
        msg::KvBlocks reply;
        for (const BlockKey& key : get->keys) {  // the longest leading run
          auto r = s.store->get(key);
          if (!r.ok()) break;
          reply.blocks.push_back(std::move(r.value()));
        }
        s.blocks_served += reply.blocks.size();
        return codec::encode(reply);
      },
      [=](stats_atom) -> Bytes {
        auto& s = self->state;
        StoreCounters c = s.store->counters();
        uint64_t hits = 0;
        for (uint64_t h : c.hits) hits += h;
        return encode_stats("kv_store", {{"kv_puts", s.puts},
                                         {"kv_gets", s.gets},
                                         {"kv_blocks_stored", s.blocks_stored},
                                         {"kv_blocks_rejected", s.blocks_rejected},
                                         {"kv_blocks_served", s.blocks_served},
                                         {"store_hits", hits},
                                         {"store_misses", c.misses},
                                         {"store_drops", c.drops},
                                         {"store_corrupt_detected", c.corrupt_detected},
                                         {"failures", s.bad_messages}});
      },
  };
}

// ---- KV streams: kv_sender (beside a prefill stage), kv_receiver (beside a decoder) ----

struct KvSenderState {
  std::shared_ptr<KvOutbox> outbox;
  std::shared_ptr<KvStreamCounters> counters;
  int32_t corrupt_chunk = -1;
  std::string host;  // where the data socket listens ("": no data socket)
  std::unique_ptr<KvSocketServer> socket;  // opened at the first offer
  static inline const char* name = "cleave.kv_sender";
};
using kv_sender_pointer = kv_sender_actor::stateful_pointer<KvSenderState>;

struct SendTransfer {
  SendTransfer(KvStreamWriter w, kv_receiver_actor r, int32_t win)
      : writer(std::move(w)), to(std::move(r)), window(uint32_t(win)) {}
  KvStreamWriter writer;
  kv_receiver_actor to;
  uint32_t window, next = 0, acked = 0;
  bool failed = false;
};

// Sends chunks while fewer than `window` wait for their ack; each ack sends
// the next, so a slow receiver holds the sender to `window` chunks in flight.
void send_chunks(kv_sender_pointer self, std::shared_ptr<SendTransfer> t, uint64_t id) {
  auto& s = self->state;
  while (!t->failed && t->next < t->writer.n_chunks() && t->next - t->acked < t->window) {
    msg::KvChunk c = t->writer.chunk(t->next++);
    if (int64_t(c.seq) == s.corrupt_chunk && !c.data.empty()) c.data[0] ^= 1;
    ++s.counters->chunks_sent;
    s.counters->bytes_sent += c.data.size();
    self->request(t->to, kKvTimeout, kv_chunk_atom::value, codec::encode(c))
        .then(
            [=](uint32_t) {
              auto& s = self->state;
              if (t->failed) return;
              if (++t->acked < t->writer.n_chunks()) return send_chunks(self, t, id);
              ++s.counters->transfers_sent;
              s.counters->blocks_sent += uint64_t(t->writer.n_blocks());
              s.outbox->erase(id);
            },
            [=](caf::error&) {
              if (t->failed) return;
              t->failed = true;  // the receiver refused a chunk or went away
              ++self->state.counters->transfers_aborted;
            });
  }
}

kv_sender_actor::behavior_type kv_sender_fn(kv_sender_pointer self, std::shared_ptr<KvOutbox> outbox,
                                            std::shared_ptr<KvStreamCounters> counters,
                                            int32_t corrupt_chunk, std::string host) {
  self->state.outbox = std::move(outbox);
  self->state.counters = std::move(counters);
  self->state.corrupt_chunk = corrupt_chunk;
  self->state.host = std::move(host);
  self->delayed_send(caf::actor_cast<kv_sender_actor>(self), kKvOutboxSweep, tick_atom::value);
  return {
      [=](kv_pull_atom, const Bytes& bytes, kv_receiver_actor to) -> caf::result<uint32_t> {
        auto& s = self->state;
        auto pull = codec::decode_as<msg::KvPull>(bytes);
        if (!pull.ok()) return to_error(pull.status());
        auto records = s.outbox->get(pull->request_id);
        if (!records)
          return to_error(Status(Code::not_found, "no KV kept for request " +
                                                      std::to_string(pull->request_id)));
        if (size_t(pull->first_block) > records->size())
          return to_error(Status(Code::invalid_argument,
                                 "pull from block " + std::to_string(pull->first_block) + " of " +
                                     std::to_string(records->size())));
        auto t = std::make_shared<SendTransfer>(
            KvStreamWriter(pull->request_id, records, pull->first_block, pull->chunk_bytes),
            std::move(to), pull->window);
        const uint32_t n = t->writer.n_chunks();
        if (n == 0) {
          s.outbox->erase(pull->request_id);
          return n;
        }
        send_chunks(self, t, pull->request_id);
        return n;
      },
      [=](kv_socket_atom, const Bytes& bytes) -> caf::result<std::string, std::string> {
        auto& s = self->state;
        auto pull = codec::decode_as<msg::KvPull>(bytes);
        if (!pull.ok()) return to_error(pull.status());
        if (Status v = validate_kv_stream_options(pull->chunk_bytes, pull->window); !v.ok())
          return to_error(v);
        const uint64_t id = pull->request_id;
        auto records = s.outbox->get(id);
        if (!records)
          return to_error(Status(Code::not_found, "no KV kept for request " + std::to_string(id)));
        if (size_t(pull->first_block) > records->size())
          return to_error(Status(Code::invalid_argument,
                                 "pull from block " + std::to_string(pull->first_block) + " of " +
                                     std::to_string(records->size())));
        if (size_t(pull->first_block) == records->size()) {
          s.outbox->erase(id);
          return caf::result<std::string, std::string>(std::string(), std::string());
        }
        if (s.host.empty())
          return to_error(Status(Code::unsupported, "this KV sender has no data socket"));
        if (!s.socket) {
          auto server = KvSocketServer::listen(s.host, s.counters, s.corrupt_chunk);
          if (!server.ok()) return to_error(server.status());
          s.socket = std::move(server.value());
        }
        std::weak_ptr<KvOutbox> outbox = s.outbox;
        const std::string token = s.socket->offer(
            id, records, pull->first_block, pull->chunk_bytes, [outbox, id](bool complete) {
              if (auto o = outbox.lock(); o && complete) o->erase(id);
            });
        return caf::result<std::string, std::string>(s.socket->address(), token);
      },
      [=](tick_atom) {
        self->state.outbox->expire(kKvOutboxTtl);
        self->delayed_send(caf::actor_cast<kv_sender_actor>(self), kKvOutboxSweep, tick_atom::value);
      },
  };
}

struct KvReceiverState {
  struct Transfer {
    std::unique_ptr<KvStreamAssembler> assembler;
    caf::actor_addr sender;
    caf::typed_response_promise<bool> done;
    Clock::time_point last_progress;
    bool on_socket = false;  // the socket's own timeouts bound it, not the tick
  };
  std::shared_ptr<KvInbox> inbox;
  std::shared_ptr<KvStreamCounters> counters;
  std::unordered_map<uint64_t, Transfer> transfers;
  std::unordered_set<std::string> connected;  // nodes this one reaches directly
  std::shared_ptr<KvInbox> socket_results;  // outcomes of data socket streams, until kv_done
  // Last member: destroyed first, joining the socket threads before the rest goes.
  std::unique_ptr<KvSocketJobs> socket_jobs = std::make_unique<KvSocketJobs>();
  static inline const char* name = "cleave.kv_receiver";
};
using kv_receiver_pointer = kv_receiver_actor::stateful_pointer<KvReceiverState>;

// Hands the outcome to the stage (inbox + the fetch's answer).
void end_transfer(kv_receiver_pointer self, uint64_t id, Result<std::vector<BlockRecord>> result) {
  auto& s = self->state;
  auto it = s.transfers.find(id);
  if (it == s.transfers.end()) return;
  const bool ok = result.ok();
  if (ok) {
    ++s.counters->transfers_received;
    s.counters->blocks_received += result->size();
  } else {
    ++s.counters->transfers_failed;
  }
  auto done = it->second.done;
  s.transfers.erase(it);
  s.inbox->put(id, std::move(result));
  done.deliver(ok);
}

// Ends every stream from one sender (it went down, or sent garbage).
void end_transfers_from(kv_receiver_pointer self, const caf::actor_addr& sender, const Status& why) {
  std::vector<uint64_t> cut;
  for (auto& [id, t] : self->state.transfers)
    if (t.sender == sender) cut.push_back(id);
  for (uint64_t id : cut) end_transfer(self, id, why);
}

kv_receiver_actor::behavior_type kv_receiver_fn(kv_receiver_pointer self,
                                                std::shared_ptr<KvInbox> inbox,
                                                std::shared_ptr<KvStreamCounters> counters) {
  self->state.inbox = std::move(inbox);
  self->state.counters = std::move(counters);
  self->state.socket_results = std::make_shared<KvInbox>();
  self->set_down_handler([=](caf::down_msg& dm) {
    end_transfers_from(self, dm.source, Status(Code::unavailable, "the KV sender went down"));
  });
  self->delayed_send(caf::actor_cast<kv_receiver_actor>(self), kTickInterval, tick_atom::value);
  return {
      [=](kv_fetch_atom, const Bytes& bytes, caf::actor from,
          const std::string& address) -> caf::result<bool> {
        auto& s = self->state;
        auto pull = codec::decode_as<msg::KvPull>(bytes);
        if (!pull.ok()) return to_error(pull.status());
        const uint64_t id = pull->request_id;
        if (s.transfers.count(id))
          return to_error(Status(Code::invalid_argument,
                                 "a KV stream for request " + std::to_string(id) + " is running"));
        KvReceiverState::Transfer t;
        t.assembler = std::make_unique<KvStreamAssembler>(id, pull->first_block, kKvMaxStreamBytes);
        t.sender = from.address();
        t.done = self->make_response_promise<bool>();
        t.last_progress = Clock::now();
        auto done = t.done;
        s.transfers.emplace(id, std::move(t));
        self->monitor(from);
        auto start_chunks = [=] {
          self->request(caf::actor_cast<kv_sender_actor>(from), kKvTimeout, kv_pull_atom::value,
                        bytes, caf::actor_cast<kv_receiver_actor>(self))
              .then(
                  [=](uint32_t n_chunks) {
                    if (n_chunks == 0) end_transfer(self, id, std::vector<BlockRecord>{});
                  },
                  [=](caf::error& e) { end_transfer(self, id, from_error(e)); });
        };
        // A sender in another process: the bytes come on its data socket,
        // read on a thread of ours; a sender without one streams over CAF.
        if (from.node() != self->node()) {
          self->request(caf::actor_cast<kv_sender_actor>(from), kKvTimeout, kv_socket_atom::value,
                        bytes)
              .then(
                  [=](const std::string& where, const std::string& token) {
                    auto& s = self->state;
                    auto it = s.transfers.find(id);
                    if (it == s.transfers.end()) return;
                    if (where.empty()) return end_transfer(self, id, std::vector<BlockRecord>{});
                    it->second.on_socket = true;
                    auto results = s.socket_results;
                    auto counters = s.counters;
                    auto me = caf::actor_cast<kv_receiver_actor>(self);
                    const msg::KvPull p = pull.value();
                    s.socket_jobs->run([=] {
                      results->put(id, fetch_kv_socket(where, token, p, kKvMaxStreamBytes,
                                                       *counters));
                      caf::anon_send(me, kv_done_atom::value, id);
                    });
                  },
                  [=](caf::error& e) {
                    if (from_error(e).code() == Code::unsupported) return start_chunks();
                    end_transfer(self, id, from_error(e));
                  });
          return done;
        }
        auto start = start_chunks;
        // A sender on a node this one reaches only through the head: connect
        // to it first, so the chunks go worker to worker (CAF routes by the
        // direct connection once there is one). Failing that, through the head.
        const size_t colon = address.rfind(':');
        if (from.node() == self->node() || s.connected.count(address) || colon == std::string::npos) {
          start();
        } else {
          const int port = std::atoi(address.c_str() + colon + 1);
          self->request(self->system().middleman().actor_handle(), kKvTimeout,
                        caf::connect_atom::value, address.substr(0, colon), uint16_t(port))
              .then(
                  [=](const caf::node_id&, const caf::strong_actor_ptr&,
                      const std::set<std::string>&) {
                    self->state.connected.insert(address);
                    start();
                  },
                  [=](caf::error&) { start(); });
        }
        return done;
      },
      [=](kv_chunk_atom, const Bytes& bytes) -> caf::result<uint32_t> {
        auto& s = self->state;
        auto chunk = codec::decode_as<msg::KvChunk>(bytes);
        if (!chunk.ok()) {
          // Unreadable: end whatever this sender streams to us.
          ++s.counters->chunks_rejected;
          end_transfers_from(self, caf::actor_cast<caf::actor_addr>(self->current_sender()),
                             chunk.status());
          return to_error(chunk.status());
        }
        const uint64_t id = chunk->request_id;
        auto it = s.transfers.find(id);
        if (it == s.transfers.end())
          return to_error(Status(Code::not_found, "no KV stream expected for request " +
                                                      std::to_string(id)));
        KvStreamAssembler& a = *it->second.assembler;
        Status st = a.add(chunk.value());
        if (!st.ok()) {
          ++s.counters->chunks_rejected;
          end_transfer(self, id, st);
          return to_error(st);
        }
        ++s.counters->chunks_received;
        s.counters->bytes_received += chunk->data.size();
        it->second.last_progress = Clock::now();
        if (a.complete()) end_transfer(self, id, a.take());
        return chunk->seq;
      },
      [=](kv_done_atom, uint64_t id) {
        // A transfer ended meanwhile (its sender went down) is gone: end_transfer ignores it.
        end_transfer(self, id, self->state.socket_results->take(id));
      },
      [=](tick_atom) {
        const auto now = Clock::now();
        std::vector<uint64_t> stalled;
        for (auto& [id, t] : self->state.transfers)
          if (!t.on_socket && now - t.last_progress > kKvStallTimeout) stalled.push_back(id);
        for (uint64_t id : stalled)
          end_transfer(self, id, Status(Code::timed_out, "the KV stream of request " +
                                                             std::to_string(id) + " stalled"));
        self->delayed_send(caf::actor_cast<kv_receiver_actor>(self), kTickInterval,
                           tick_atom::value);
      },
  };
}

// ---- vision_encoder ----

struct VisionState {
  struct Job {
    msg::EncodeRequest request;
    caf::typed_response_promise<Bytes> reply;
  };
  std::shared_ptr<VisionEncoder> encoder;
  std::string origin;  // "vision_encoder/0", "NODE/vision_encoder/0"
  std::vector<Job> queue;
  bool step_queued = false;
  uint64_t requests = 0, replies = 0, failed = 0, bad_messages = 0, steps = 0;
  static inline const char* name = "cleave.vision_encoder";
};
using vision_pointer = vision_encoder_actor::stateful_pointer<VisionState>;

// Encodes every request that arrived since the last step in one batch and
// answers each (the encoder fails a bad request alone).
void run_encode_step(vision_pointer self) {
  auto& s = self->state;
  s.step_queued = false;
  std::vector<VisionState::Job> jobs;
  jobs.swap(s.queue);
  std::vector<std::vector<PromptImage>*> groups;
  std::vector<uint64_t> ids;
  for (auto& j : jobs) {
    groups.push_back(&j.request.images);
    ids.push_back(j.request.request_id);
  }
  const auto t0 = Clock::now();
  const std::vector<Status> status = s.encoder->encode(groups, ids);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ++s.steps;
  for (size_t k = 0; k < jobs.size(); ++k) {
    if (!status[k].ok()) {
      ++s.failed;
      jobs[k].reply.deliver(to_error(status[k]));
      continue;
    }
    msg::ImageEmbeddings m;
    m.request_id = ids[k];
    m.images = std::move(jobs[k].request.images);
    for (PromptImage& im : m.images) im.image.rgb = {};  // the router has them
    m.origin = s.origin;
    m.seconds = seconds;
    ++s.replies;
    jobs[k].reply.deliver(codec::encode(m));
  }
}

vision_encoder_actor::behavior_type vision_encoder_fn(vision_pointer self,
                                                      std::shared_ptr<VisionEncoder> encoder,
                                                      std::string origin) {
  self->state.encoder = std::move(encoder);
  self->state.origin = std::move(origin);
  return {
      [=](encode_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto& s = self->state;
        auto request = codec::decode_as<msg::EncodeRequest>(bytes);
        if (!request.ok()) {
          ++s.bad_messages;
          return to_error(request.status());
        }
        ++s.requests;
        auto reply = self->make_response_promise<Bytes>();
        s.queue.push_back({std::move(request.value()), reply});
        if (!s.step_queued) {  // after the messages already queued
          s.step_queued = true;
          self->send(caf::actor_cast<vision_encoder_actor>(self), step_atom::value);
        }
        return reply;
      },
      [=](step_atom) { run_encode_step(self); },
      [=](stats_atom) -> Bytes {
        auto& s = self->state;
        const VisionEncoderCounters c = s.encoder->counters();
        return encode_stats(s.origin, {{"requests", s.requests},
                                       {"replies", s.replies},
                                       {"failures", s.failed + s.bad_messages},
                                       {"bad_messages", s.bad_messages},
                                       {"steps", s.steps},
                                       {"images", c.images},
                                       {"cache_hits", c.cache_hits},
                                       {"cache_misses", c.cache_misses},
                                       {"cache_evictions", c.cache_evictions},
                                       {"cache_entries", c.cache_entries},
                                       {"cache_bytes", c.cache_bytes},
                                       {"batches", c.batches},
                                       {"encode_us", uint64_t(c.encode_seconds * 1e6)}});
      },
  };
}

// ---- stage: prefill, decode or colocated ----

struct StageState {
  std::shared_ptr<StageCore> core;
  std::string kind;
  router_actor router;
  kv_store_actor kv;
  bool persist = false;      // send newly filled full blocks to the store
  bool step_queued = false;  // a step message is in the mailbox
  std::unordered_set<uint64_t> awaiting_kv;  // resumes waiting for their blocks
  // KV streams: a prefill's outbox and kv_sender, a decoder's inbox and
  // kv_receiver (each linked to the stage: they go down with it).
  KvStreamOptions stream;
  std::shared_ptr<KvStreamCounters> stream_counters = std::make_shared<KvStreamCounters>();
  std::shared_ptr<KvOutbox> outbox;
  kv_sender_actor sender;
  std::shared_ptr<KvInbox> inbox;
  kv_receiver_actor receiver;
  uint64_t requests = 0, resumes = 0, tokens = 0, finished = 0, failed = 0, handoffs = 0;
  uint64_t kv_blocks_put = 0, kv_blocks_got = 0, kv_errors = 0, bad_messages = 0;
  static inline const char* name = "cleave.stage";
};
using stage_pointer = stage_actor::stateful_pointer<StageState>;

void kick(stage_pointer self) {
  auto& s = self->state;
  if (s.step_queued || !s.core->has_work()) return;
  s.step_queued = true;
  self->send(caf::actor_cast<stage_actor>(self), step_atom::value);
}

void send_event(stage_pointer self, const msg::StreamEvent& e) {
  auto& s = self->state;
  if (e.kind == msg::StreamEvent::Kind::token) ++s.tokens;
  if (e.kind == msg::StreamEvent::Kind::finished) ++s.finished;
  if (e.kind == msg::StreamEvent::Kind::failed) ++s.failed;
  self->send(s.router, event_atom::value, codec::encode(e));
}

void fail_request(stage_pointer self, uint64_t id, Status why) {
  msg::StreamEvent e;
  e.kind = msg::StreamEvent::Kind::failed;
  e.request_id = id;
  e.error = std::move(why);
  e.origin = self->state.core->name();
  send_event(self, e);
}

// Prefill: the KV goes to the store first, then the Handoff (keys only) to
// the router. A failed put still hands off: the decoder recomputes.
void publish_handoff(stage_pointer self, SchedulerEvent&& e) {
  auto& s = self->state;
  msg::Handoff h;
  h.request = std::move(e.request);
  h.generated = std::move(e.generated);
  h.n_kv_tokens = e.n_kv_tokens;
  for (const BlockRecord& r : e.blocks) h.kv_keys.push_back(r.header.key);
  if (s.sender) h.kv_source = s.stream.node_address;
  Bytes handoff = codec::encode(h);
  ++s.handoffs;
  if (e.blocks.empty()) {
    self->send(s.router, handoff_atom::value, std::move(handoff));
    return;
  }
  msg::KvPut put;
  const bool direct = bool(s.sender);
  if (direct) {
    // The decoder pulls from the outbox; the store's copy (for a
    // re-placement) goes at the same time and delays nothing.
    auto records = std::make_shared<const std::vector<BlockRecord>>(std::move(e.blocks));
    s.outbox->put(h.request.request_id, records);
    self->send(s.router, handoff_atom::value, handoff, s.sender);
    put.blocks = *records;
  } else {
    put.blocks = std::move(e.blocks);
  }
  const uint64_t n = put.blocks.size();
  self->request(s.kv, kKvTimeout, kv_put_atom::value, codec::encode(put))
      .then(
          [=](const Bytes& reply) {
            auto ack = codec::decode_as<msg::KvAck>(reply);
            if (ack.ok()) self->state.kv_blocks_put += uint64_t(ack->stored);
            if (!ack.ok() || ack->stored != int32_t(n)) ++self->state.kv_errors;
            if (!direct) self->send(self->state.router, handoff_atom::value, handoff);
          },
          [=](caf::error&) {
            ++self->state.kv_errors;
            if (!direct) self->send(self->state.router, handoff_atom::value, handoff);
          });
}

void persist_new_blocks(stage_pointer self) {
  auto& s = self->state;
  std::vector<BlockRecord> blocks = s.core->take_new_blocks();
  if (blocks.empty()) return;
  msg::KvPut put;
  put.blocks = std::move(blocks);
  self->request(s.kv, kKvTimeout, kv_put_atom::value, codec::encode(put))
      .then(
          [=](const Bytes& reply) {
            auto ack = codec::decode_as<msg::KvAck>(reply);
            if (ack.ok()) self->state.kv_blocks_put += uint64_t(ack->stored);
            if (!ack.ok() || ack->rejected > 0) ++self->state.kv_errors;
          },
          [=](caf::error&) { ++self->state.kv_errors; });
}

void run_step(stage_pointer self) {
  auto& s = self->state;
  s.step_queued = false;
  std::vector<SchedulerEvent> events;
  const auto t0 = std::chrono::steady_clock::now();
  Status st = s.core->step(events);  // on an engine error the events fail every running request
  (void)st;
  const double step_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (SchedulerEvent& e : events) {
    if (e.kind == SchedulerEvent::Kind::handoff) {
      publish_handoff(self, std::move(e));
      continue;
    }
    msg::StreamEvent m = to_stream_event(e, s.core->name());
    m.stage_seconds = step_seconds;
    send_event(self, m);
  }
  if (s.persist) persist_new_blocks(self);
  kick(self);
}

// blocks hold KV from block first_block on; this engine caches the ones before.
void finish_resume(stage_pointer self, std::shared_ptr<msg::Handoff> h,
                   std::vector<BlockRecord> blocks, int32_t first_block) {
  auto& s = self->state;
  const uint64_t id = h->request.request_id;
  if (s.awaiting_kv.erase(id) == 0) return;  // cancelled meanwhile
  Status st = s.core->resume(std::move(h->request), std::move(h->generated), std::move(blocks),
                             first_block);
  if (!st.ok()) fail_request(self, id, st);
  kick(self);
}

// The blocks from first_block on, from the store (the longest run it has).
void fetch_from_store(stage_pointer self, std::shared_ptr<msg::Handoff> h,
                      std::vector<BlockKey> keys, int32_t first_block) {
  auto& s = self->state;
  msg::KvGet get;
  get.keys.assign(keys.begin() + first_block, keys.end());
  if (get.keys.empty()) return finish_resume(self, h, {}, first_block);
  self->request(s.kv, kKvTimeout, kv_get_atom::value, codec::encode(get))
      .then(
          [=](const Bytes& reply) {
            auto blocks = codec::decode_as<msg::KvBlocks>(reply);
            if (!blocks.ok()) ++self->state.kv_errors;
            if (blocks.ok()) self->state.kv_blocks_got += blocks->blocks.size();
            finish_resume(self, h,
                          blocks.ok() ? std::move(blocks->blocks) : std::vector<BlockRecord>{},
                          first_block);
          },
          [=](caf::error&) {
            ++self->state.kv_errors;
            finish_resume(self, h, {}, first_block);  // recompute what is not cached
          });
}

// A handed-off request: the decoder skips the leading blocks its prefix
// cache holds (incremental), streams the rest from the prefill's kv_sender
// when there is one, else (or when the stream fails) reads the store.
caf::result<bool> accept_handoff(stage_pointer self, const Bytes& bytes,
                                 const kv_sender_actor* source) {
  auto& s = self->state;
  auto decoded = codec::decode_as<msg::Handoff>(bytes);
  if (!decoded.ok()) {
    ++s.bad_messages;
    return to_error(decoded.status());
  }
  auto h = std::make_shared<msg::Handoff>(std::move(decoded.value()));
  Engine& engine = s.core->engine();
  Status valid = validate_request(h->request, engine.context(), engine.config().n_vocab);
  if (!valid.ok()) return to_error(valid);
  ++s.resumes;
  const uint64_t id = h->request.request_id;
  s.awaiting_kv.insert(id);
  if (!h->blocks.empty()) {  // KV inline
    std::vector<BlockRecord> blocks = std::move(h->blocks);
    finish_resume(self, h, std::move(blocks), 0);
    return true;
  }
  std::vector<BlockKey> keys =
      h->kv_keys.empty() ? s.core->resume_keys(h->request, h->generated) : h->kv_keys;
  const int32_t first = engine.cached_leading_blocks(keys);
  s.stream_counters->blocks_skipped += uint64_t(first);
  if (!source || !s.receiver || size_t(first) == keys.size()) {
    fetch_from_store(self, h, std::move(keys), first);
    return true;
  }
  msg::KvPull pull;
  pull.request_id = id;
  pull.first_block = first;
  pull.chunk_bytes = s.stream.chunk_bytes;
  pull.window = s.stream.window;
  auto on_failure = [=](std::vector<BlockKey> keys) {
    self->state.inbox->erase(id);
    fetch_from_store(self, h, std::move(keys), first);
  };
  self->request(s.receiver, kKvFetchTimeout, kv_fetch_atom::value, codec::encode(pull),
                caf::actor_cast<caf::actor>(*source), h->kv_source)
      .then(
          [=](bool complete) {
            auto blocks = self->state.inbox->take(id);
            if (!complete || !blocks.ok()) return on_failure(keys);
            finish_resume(self, h, std::move(blocks.value()), first);
          },
          [=](caf::error&) { on_failure(keys); });
  return true;
}

stage_actor::behavior_type stage_fn(stage_pointer self, std::shared_ptr<StageCore> core,
                                    std::string kind, router_actor router, kv_store_actor kv,
                                    bool persist, KvStreamOptions stream) {
  auto& s = self->state;
  s.core = std::move(core);
  s.kind = std::move(kind);
  s.router = std::move(router);
  s.kv = std::move(kv);
  s.persist = persist;
  s.stream = stream;
  if (stream.direct && s.kind == "prefill") {
    s.outbox = std::make_shared<KvOutbox>();
    // The data socket listens on the node's host (in-process pipelines have none: CAF only).
    const size_t colon = stream.node_address.rfind(':');
    s.sender = self->spawn<caf::linked>(
        kv_sender_fn, s.outbox, s.stream_counters, stream.fault_corrupt_chunk,
        colon == std::string::npos ? std::string() : stream.node_address.substr(0, colon));
  } else if (s.kind != "prefill") {
    s.inbox = std::make_shared<KvInbox>();
    s.receiver = self->spawn<caf::linked>(kv_receiver_fn, s.inbox, s.stream_counters);
  }
  return {
      [=](submit_atom, const Bytes& bytes) -> caf::result<bool> {
        auto& s = self->state;
        auto request = codec::decode_as<GenerateRequest>(bytes);
        if (!request.ok()) {
          ++s.bad_messages;
          return to_error(request.status());
        }
        Status st = s.core->submit(std::move(request.value()));
        if (!st.ok()) return to_error(st);
        ++s.requests;
        kick(self);
        return true;
      },
      [=](handoff_atom, const Bytes& bytes) -> caf::result<bool> {
        return accept_handoff(self, bytes, nullptr);
      },
      [=](handoff_atom, const Bytes& bytes, kv_sender_actor source) -> caf::result<bool> {
        return accept_handoff(self, bytes, &source);
      },
      [=](cancel_atom, uint64_t id) {
        self->state.awaiting_kv.erase(id);
        self->state.core->cancel(id);
      },
      [=](step_atom) { run_step(self); },
      [=](stats_atom) -> Bytes {
        auto& s = self->state;
        msg::Stats st = s.core->stats();
        st.counters.insert(st.counters.begin(),
                           {{"requests", s.requests},
                            {"resumes", s.resumes},
                            {"tokens", s.tokens},
                            {"finished", s.finished},
                            {"failures", s.failed + s.bad_messages + s.kv_errors},
                            {"failed_requests", s.failed},
                            {"bad_messages", s.bad_messages},
                            {"kv_errors", s.kv_errors},
                            {"handoffs", s.handoffs},
                            {"kv_blocks_put", s.kv_blocks_put},
                            {"kv_blocks_got", s.kv_blocks_got},
                            {"kv_blocks_moved", s.kv_blocks_put + s.kv_blocks_got}});
        for (auto& c : s.stream_counters->snapshot()) st.counters.push_back(std::move(c));
        return codec::encode(st);
      },
  };
}

// ---- router ----

// Request id -> the client's callback; events are delivered on the router's
// thread.
class EventSinks {
 public:
  bool add(uint64_t id, EventCallback cb) {
    std::lock_guard<std::mutex> lock(mu_);
    return map_.emplace(id, std::make_shared<EventCallback>(std::move(cb))).second;
  }
  void remove(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    map_.erase(id);
  }
  void emit(const msg::StreamEvent& e) {
    std::shared_ptr<EventCallback> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(e.request_id);
      if (it == map_.end()) return;
      cb = it->second;
      if (e.kind != msg::StreamEvent::Kind::token) map_.erase(it);
    }
    (*cb)(e);
  }

 private:
  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<EventCallback>> map_;
};

struct RouterConfig {
  bool disaggregated = false;  // pd: entry = prefill, continue = decode
  int32_t max_pending = 1024;
  int32_t block_size = 16;
  double request_timeout_s = 300;
};

struct RouterState {
  struct Stage {
    stage_actor handle;
    caf::actor_addr addr;
    std::string kind;
    bool entry = false, cont = false;  // takes new requests / handoffs
    bool alive = true;
    int32_t in_flight = 0;
  };
  struct Encoder {
    vision_encoder_actor handle;
    caf::actor_addr addr;
    bool alive = true;
    int32_t in_flight = 0;
  };
  struct Pending {
    GenerateRequest request;  // kept to re-place it
    std::vector<int32_t> generated;
    int32_t stage = -1;
    int32_t encoder = -1;     // the vision encoder it waits for
    bool continuing = false;  // handed off (or re-placed with tokens)
    Clock::time_point last_progress;
    std::string encode_origin;  // reported with the first token
    double encode_seconds = 0;
  };
  RouterConfig config;
  std::shared_ptr<EventSinks> sinks;
  kv_store_actor kv;
  bool kv_alive = true;
  bool closed = false;
  std::vector<Stage> stages;
  std::vector<Encoder> encoders;
  std::unordered_map<uint64_t, Pending> pending;
  std::unordered_map<uint64_t, int32_t> affinity;  // first prompt block -> entry stage
  uint64_t requests = 0, admitted = 0, rejected_busy = 0, rejected_unavailable = 0;
  uint64_t finished = 0, failed = 0, tokens = 0, handoffs = 0, direct_handoffs = 0, replacements = 0;
  uint64_t stage_downs = 0, timeouts = 0, stray_events = 0, bad_messages = 0;
  uint64_t encodes = 0, encoder_downs = 0, encode_replacements = 0;
  static inline const char* name = "cleave.router";
};
using router_pointer = router_actor::stateful_pointer<RouterState>;

// FNV-1a over the first full block of the prompt: what prefix affinity keys on.
bool first_block_hash(const GenerateRequest& r, int32_t block_size, uint64_t& out) {
  if (int32_t(r.prompt.size()) <= block_size) return false;  // nothing reusable
  uint64_t h = 1469598103934665603ull;
  for (int32_t i = 0; i < block_size; ++i) {
    h ^= uint32_t(r.prompt[size_t(i)]);
    h *= 1099511628211ull;
  }
  out = h;
  return true;
}

bool any_alive(const RouterState& s, bool entry) {
  for (const auto& st : s.stages)
    if (st.alive && (entry ? st.entry : st.cont)) return true;
  return false;
}

// Least loaded live stage of the role; the affinity stage when its load is
// close to the least.
int32_t pick_stage(const RouterState& s, bool entry, int32_t preferred) {
  constexpr int32_t kAffinitySlack = 4;
  int32_t best = -1;
  for (int32_t i = 0; i < int32_t(s.stages.size()); ++i) {
    const auto& st = s.stages[size_t(i)];
    if (!st.alive || !(entry ? st.entry : st.cont)) continue;
    if (best < 0 || st.in_flight < s.stages[size_t(best)].in_flight) best = i;
  }
  if (best >= 0 && preferred >= 0 && preferred < int32_t(s.stages.size())) {
    const auto& p = s.stages[size_t(preferred)];
    if (p.alive && (entry ? p.entry : p.cont) &&
        p.in_flight <= s.stages[size_t(best)].in_flight + kAffinitySlack)
      return preferred;
  }
  return best;
}

void leave_stage(RouterState& s, RouterState::Pending& p) {
  if (p.stage >= 0 && s.stages[size_t(p.stage)].in_flight > 0) --s.stages[size_t(p.stage)].in_flight;
}

void leave_encoder(RouterState& s, RouterState::Pending& p) {
  if (p.encoder >= 0 && s.encoders[size_t(p.encoder)].in_flight > 0)
    --s.encoders[size_t(p.encoder)].in_flight;
  p.encoder = -1;
}

bool needs_encoding(const GenerateRequest& r) {
  for (const PromptImage& im : r.images)
    if (im.embeddings.empty()) return true;
  return false;
}

bool any_encoder_alive(const RouterState& s) {
  for (const auto& e : s.encoders)
    if (e.alive) return true;
  return false;
}

void finish(router_pointer self, uint64_t id, const msg::StreamEvent& e) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end()) return;
  leave_stage(s, it->second);
  leave_encoder(s, it->second);
  s.pending.erase(it);
  if (e.kind == msg::StreamEvent::Kind::finished) ++s.finished;
  else ++s.failed;
  s.sinks->emit(e);
}

// Fails a pending request and tells its stage to drop it.
void fail(router_pointer self, uint64_t id, Status why) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end()) return;
  const int32_t stage = it->second.stage;
  if (stage >= 0 && s.stages[size_t(stage)].alive)
    self->send(s.stages[size_t(stage)].handle, cancel_atom::value, id);
  msg::StreamEvent e;
  e.kind = msg::StreamEvent::Kind::failed;
  e.request_id = id;
  e.error = std::move(why);
  e.origin = "router";
  finish(self, id, e);
}

// The answer of a stage to submit / handoff: a typed error fails the
// request; a stage that went down is handled by the down handler.
void on_stage_error(router_pointer self, uint64_t id, int32_t stage, const caf::error& err) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end() || it->second.stage != stage) return;
  if (!s.stages[size_t(stage)].alive) return;
  if (err.category() == caf::atom("system") &&
      static_cast<caf::sec>(err.code()) == caf::sec::request_receiver_down)
    return;  // the down message re-places it
  fail(self, id, from_error(err));
}

void place_entry(router_pointer self, uint64_t id) {
  auto& s = self->state;
  auto& p = s.pending.at(id);
  uint64_t h = 0;
  const bool has_block = first_block_hash(p.request, s.config.block_size, h);
  int32_t preferred = -1;
  if (has_block) {
    auto a = s.affinity.find(h);
    if (a != s.affinity.end()) preferred = a->second;
  }
  const int32_t i = pick_stage(s, true, preferred);
  if (i < 0) {
    ++s.rejected_unavailable;
    return fail(self, id, Status(Code::unavailable, "no live prefill or colocated actor"));
  }
  if (has_block) s.affinity[h] = i;
  p.stage = i;
  p.continuing = false;
  ++s.stages[size_t(i)].in_flight;
  self->request(s.stages[size_t(i)].handle, kStageTimeout, submit_atom::value,
                codec::encode(p.request))
      .then([](bool) {}, [=](caf::error& err) { on_stage_error(self, id, i, err); });
}

// With a source, the decoder pulls the KV from that prefill's kv_sender.
void place_continue(router_pointer self, uint64_t id, Bytes handoff,
                    const kv_sender_actor* source = nullptr) {
  auto& s = self->state;
  auto& p = s.pending.at(id);
  const int32_t i = pick_stage(s, false, -1);
  if (i < 0) {
    ++s.rejected_unavailable;
    return fail(self, id, Status(Code::unavailable, "no live decode actor"));
  }
  p.stage = i;
  p.continuing = true;
  p.last_progress = Clock::now();
  ++s.stages[size_t(i)].in_flight;
  auto on_error = [=](caf::error& err) { on_stage_error(self, id, i, err); };
  const stage_actor& stage = s.stages[size_t(i)].handle;
  if (source) {
    ++s.direct_handoffs;
    self->request(stage, kStageTimeout, handoff_atom::value, std::move(handoff), *source)
        .then([](bool) {}, on_error);
  } else {
    self->request(stage, kStageTimeout, handoff_atom::value, std::move(handoff))
        .then([](bool) {}, on_error);
  }
}

void on_embeddings(router_pointer self, uint64_t id, int32_t encoder, const Bytes& reply);

// The request's images that lack embeddings go to the least loaded live
// encoder; its reply puts them into the request, which then goes on to a
// stage (place_entry).
void place_encode(router_pointer self, uint64_t id) {
  auto& s = self->state;
  auto& p = s.pending.at(id);
  int32_t best = -1;
  for (int32_t i = 0; i < int32_t(s.encoders.size()); ++i) {
    const auto& e = s.encoders[size_t(i)];
    if (e.alive && (best < 0 || e.in_flight < s.encoders[size_t(best)].in_flight)) best = i;
  }
  if (best < 0) {
    ++s.rejected_unavailable;
    return fail(self, id, Status(Code::unavailable, "no live vision_encoder actor"));
  }
  p.encoder = best;
  p.last_progress = Clock::now();
  ++s.encoders[size_t(best)].in_flight;
  ++s.encodes;
  msg::EncodeRequest m;
  m.request_id = id;
  for (const PromptImage& im : p.request.images)
    if (im.embeddings.empty()) m.images.push_back(im);
  // The answer comes after the encoder's queue and its batch: bounded by
  // the request's own timeout, not a stage's admission timeout.
  const auto limit = std::chrono::duration_cast<caf::timespan>(
      std::chrono::duration<double>(s.config.request_timeout_s));
  self->request(s.encoders[size_t(best)].handle, limit, encode_atom::value, codec::encode(m))
      .then([=](const Bytes& reply) { on_embeddings(self, id, best, reply); },
            [=](caf::error& err) {
              auto& s = self->state;
              auto it = s.pending.find(id);
              if (it == s.pending.end() || it->second.encoder != best) return;
              if (!s.encoders[size_t(best)].alive) return;
              if (err.category() == caf::atom("system") &&
                  static_cast<caf::sec>(err.code()) == caf::sec::request_receiver_down)
                return;  // the down message re-places it
              fail(self, id, from_error(err));
            });
}

void on_embeddings(router_pointer self, uint64_t id, int32_t encoder, const Bytes& reply) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end() || it->second.encoder != encoder) {
    ++s.stray_events;  // failed or re-placed meanwhile
    return;
  }
  auto& p = it->second;
  leave_encoder(s, p);
  auto m = codec::decode_as<msg::ImageEmbeddings>(reply);
  if (!m.ok()) {
    ++s.bad_messages;
    return fail(self, id, m.status());
  }
  size_t k = 0;
  for (const PromptImage& im : p.request.images) {
    if (!im.embeddings.empty()) continue;
    if (k >= m->images.size() || !(m->images[k].hash == im.hash) ||
        m->images[k].n_tokens != im.n_tokens)
      break;
    ++k;
  }
  if (k != m->images.size() || m->request_id != id)
    return fail(self, id, Status(Code::corruption, "the vision encoder's answer for request " +
                                                       std::to_string(id) +
                                                       " does not match its images"));
  k = 0;
  for (PromptImage& im : p.request.images) {
    if (!im.embeddings.empty()) continue;
    im.embeddings = std::move(m->images[k++].embeddings);
    im.image.rgb = {};  // encoded: the pixels are not needed any more
  }
  p.encode_origin = m->origin;
  p.encode_seconds = m->seconds;
  p.last_progress = Clock::now();
  place_entry(self, id);
}

void on_encoder_down(router_pointer self, int32_t index) {
  auto& s = self->state;
  s.encoders[size_t(index)].alive = false;
  s.encoders[size_t(index)].in_flight = 0;
  ++s.encoder_downs;
  std::vector<uint64_t> affected;
  for (auto& [id, p] : s.pending)
    if (p.encoder == index) affected.push_back(id);
  std::sort(affected.begin(), affected.end());
  for (uint64_t id : affected) {
    s.pending.at(id).encoder = -1;
    ++s.encode_replacements;
    place_encode(self, id);  // on another encoder, or unavailable
  }
}

// The pending entry when the message comes from the stage the request is on.
RouterState::Pending* from_current_stage(router_pointer self, uint64_t id) {
  auto& s = self->state;
  auto it = s.pending.find(id);
  if (it == s.pending.end() || it->second.stage < 0) return nullptr;
  auto sender = caf::actor_cast<caf::actor_addr>(self->current_sender());
  if (sender != s.stages[size_t(it->second.stage)].addr) return nullptr;
  return &it->second;
}

void on_stage_down(router_pointer self, int32_t index) {
  auto& s = self->state;
  auto& dead = s.stages[size_t(index)];
  dead.alive = false;
  dead.in_flight = 0;
  ++s.stage_downs;
  std::vector<uint64_t> affected;
  for (auto& [id, p] : s.pending)
    if (p.stage == index) affected.push_back(id);
  std::sort(affected.begin(), affected.end());
  // pd with no decoder left: nothing admitted can finish; fail it all now.
  if (dead.cont && !any_alive(s, false)) {
    std::vector<uint64_t> all;
    for (auto& [id, p] : s.pending) all.push_back(id);
    for (uint64_t id : all) fail(self, id, Status(Code::unavailable, "no live decode actor"));
    return;
  }
  for (uint64_t id : affected) {
    auto& p = s.pending.at(id);
    p.stage = -1;
    ++s.replacements;
    if (!p.continuing && p.generated.empty()) {
      place_entry(self, id);
    } else {
      msg::Handoff h;
      h.request = p.request;
      h.generated = p.generated;
      place_continue(self, id, codec::encode(h));
    }
  }
}

// A prefill's hand-off: on to a decoder (which pulls the KV from source
// when there is one).
void on_handoff(router_pointer self, const Bytes& bytes, const kv_sender_actor* source) {
  auto& s = self->state;
  auto h = codec::decode_as<msg::Handoff>(bytes);
  if (!h.ok()) {
    ++s.bad_messages;
    return;
  }
  const uint64_t id = h->request.request_id;
  RouterState::Pending* p = from_current_stage(self, id);
  if (!p) {
    ++s.stray_events;
    return;
  }
  ++s.handoffs;
  leave_stage(s, *p);
  p->stage = -1;
  place_continue(self, id, bytes, source);
}

router_actor::behavior_type router_fn(router_pointer self, RouterConfig config,
                                      std::shared_ptr<EventSinks> sinks, kv_store_actor kv) {
  auto& s = self->state;
  s.config = config;
  s.sinks = std::move(sinks);
  s.kv = kv;
  self->monitor(kv);
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& s = self->state;
    if (dm.source == s.kv.address()) {
      s.kv_alive = false;
      return;
    }
    for (int32_t i = 0; i < int32_t(s.stages.size()); ++i)
      if (s.stages[size_t(i)].alive && s.stages[size_t(i)].addr == dm.source)
        return on_stage_down(self, i);
    for (int32_t i = 0; i < int32_t(s.encoders.size()); ++i)
      if (s.encoders[size_t(i)].alive && s.encoders[size_t(i)].addr == dm.source)
        return on_encoder_down(self, i);
  });
  self->send(caf::actor_cast<router_actor>(self), tick_atom::value);
  return {
      [=](submit_atom, const Bytes& bytes) -> caf::result<bool> {
        auto& s = self->state;
        ++s.requests;
        auto request = codec::decode_as<GenerateRequest>(bytes);
        if (!request.ok()) {
          ++s.bad_messages;
          return to_error(request.status());
        }
        const uint64_t id = request->request_id;
        if (s.closed) return to_error(Status(Code::unavailable, "pipeline is shutting down"));
        if (int32_t(s.pending.size()) >= s.config.max_pending) {
          ++s.rejected_busy;
          return to_error(Status(Code::busy, "max_pending (" + std::to_string(s.config.max_pending) +
                                                 ") requests in flight"));
        }
        if (s.pending.count(id))
          return to_error(Status(Code::invalid_argument,
                                 "request id " + std::to_string(id) + " is already in flight"));
        if (!any_alive(s, true) || !any_alive(s, false)) {
          ++s.rejected_unavailable;
          return to_error(Status(Code::unavailable, s.config.disaggregated && any_alive(s, true)
                                                        ? "no live decode actor"
                                                        : "no live stage actor"));
        }
        const bool encode = needs_encoding(*request);
        if (encode && !any_encoder_alive(s)) {
          ++s.rejected_unavailable;
          return to_error(Status(Code::unavailable, "request " + std::to_string(id) +
                                                        " has images to encode and there is no "
                                                        "live vision_encoder actor"));
        }
        RouterState::Pending p;
        p.request = std::move(request.value());
        p.last_progress = Clock::now();
        s.pending.emplace(id, std::move(p));
        ++s.admitted;
        if (encode) place_encode(self, id);
        else place_entry(self, id);
        return true;
      },
      [=](event_atom, const Bytes& bytes) {
        auto& s = self->state;
        auto e = codec::decode_as<msg::StreamEvent>(bytes);
        if (!e.ok()) {
          ++s.bad_messages;
          return;
        }
        RouterState::Pending* p = from_current_stage(self, e->request_id);
        if (!p) {
          ++s.stray_events;
          return;
        }
        p->last_progress = Clock::now();
        if (e->kind == msg::StreamEvent::Kind::token) {
          if (e->index != int32_t(p->generated.size())) {  // a replayed token
            ++s.stray_events;
            return;
          }
          p->generated.push_back(e->token);
          ++s.tokens;
          if (e->index == 0 && !p->encode_origin.empty()) {
            e->encode_origin = p->encode_origin;
            e->encode_seconds = p->encode_seconds;
          }
          s.sinks->emit(*e);
          return;
        }
        finish(self, e->request_id, *e);
      },
      [=](handoff_atom, const Bytes& bytes) { on_handoff(self, bytes, nullptr); },
      [=](handoff_atom, const Bytes& bytes, kv_sender_actor source) {
        on_handoff(self, bytes, &source);
      },
      [=](attach_atom, const std::string& kind, stage_actor stage) -> bool {
        auto& s = self->state;
        RouterState::Stage st;
        st.addr = stage.address();
        st.handle = stage;
        st.kind = kind;
        st.entry = kind != "decode";
        st.cont = kind != "prefill";
        self->monitor(stage);
        s.stages.push_back(std::move(st));
        return true;
      },
      [=](attach_atom, const std::string&, vision_encoder_actor encoder) -> bool {
        RouterState::Encoder e;
        e.addr = encoder.address();
        e.handle = encoder;
        self->monitor(encoder);
        self->state.encoders.push_back(std::move(e));
        return true;
      },
      [=](tick_atom) {
        auto& s = self->state;
        const auto now = Clock::now();
        const auto limit = std::chrono::duration<double>(s.config.request_timeout_s);
        std::vector<uint64_t> stuck;
        for (auto& [id, p] : s.pending)
          if (now - p.last_progress > limit) stuck.push_back(id);
        for (uint64_t id : stuck) {
          ++s.timeouts;
          fail(self, id, Status(Code::timed_out, "request " + std::to_string(id) +
                                                     " made no progress for " +
                                                     std::to_string(s.config.request_timeout_s) + " s"));
        }
        self->delayed_send(caf::actor_cast<router_actor>(self), kTickInterval, tick_atom::value);
      },
      [=](shutdown_atom) -> bool {
        auto& s = self->state;
        s.closed = true;
        std::vector<uint64_t> all;
        for (auto& [id, p] : s.pending) all.push_back(id);
        for (uint64_t id : all) fail(self, id, Status(Code::aborted, "pipeline shut down"));
        return true;
      },
      [=](stats_atom) -> Bytes {
        auto& s = self->state;
        uint64_t alive_prefill = 0, alive_decode = 0, alive_colocated = 0, alive_encoders = 0;
        for (const auto& e : s.encoders) alive_encoders += e.alive;
        for (const auto& st : s.stages) {
          if (!st.alive) continue;
          if (st.kind == "prefill") ++alive_prefill;
          if (st.kind == "decode") ++alive_decode;
          if (st.kind == "colocated") ++alive_colocated;
        }
        return encode_stats("router", {{"requests", s.requests},
                                       {"admitted", s.admitted},
                                       {"rejected_busy", s.rejected_busy},
                                       {"rejected_unavailable", s.rejected_unavailable},
                                       {"queue_depth", s.pending.size()},
                                       {"finished", s.finished},
                                       {"failures", s.failed},
                                       {"tokens", s.tokens},
                                       {"handoffs", s.handoffs},
                                       {"direct_handoffs", s.direct_handoffs},
                                       {"replacements", s.replacements},
                                       {"stage_downs", s.stage_downs},
                                       {"timeouts", s.timeouts},
                                       {"stray_events", s.stray_events},
                                       {"bad_messages", s.bad_messages},
                                       {"alive_prefill", alive_prefill},
                                       {"alive_decode", alive_decode},
                                       {"alive_colocated", alive_colocated},
                                       {"alive_vision_encoder", alive_encoders},
                                       {"encodes", s.encodes},
                                       {"encoder_downs", s.encoder_downs},
                                       {"encode_replacements", s.encode_replacements},
                                       {"alive_kv_store", s.kv_alive ? 1u : 0u}});
      },
  };
}

// ---- the pipeline ----

// Registers the callback, then hands the request to the router (admission:
// busy, unavailable or a typed error comes back, and the callback goes).
Status submit_to_router(caf::actor_system& system, const router_actor& router, EventSinks& sinks,
                        GenerateRequest request, EventCallback on_event) {
  const uint64_t id = request.request_id;
  if (!sinks.add(id, std::move(on_event)))
    return Status(Code::invalid_argument, "request id " + std::to_string(id) + " is already in flight");
  Status st;
  caf::scoped_actor self{system};
  self->request(router, kClientTimeout, submit_atom::value, codec::encode(request))
      .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
  if (!st.ok()) sinks.remove(id);
  return st;
}

// Appends an actor's counters; a dead actor has none.
template <class Handle>
void collect_stats(caf::scoped_actor& self, const Handle& handle, std::vector<msg::Stats>& out) {
  self->request(handle, kClientTimeout, stats_atom::value)
      .receive(
          [&](const Bytes& b) {
            auto s = codec::decode_as<msg::Stats>(b);
            if (s.ok()) out.push_back(std::move(s.value()));
          },
          [](caf::error&) {});
}

Result<std::shared_ptr<TieredStore>> make_store(const PipelineOptions& o, uint64_t fp,
                                                const KvLayout& layout) {
  constexpr size_t kDefaultTierBytes = size_t(64) << 20;
  std::vector<std::unique_ptr<Tier>> tiers;
  auto t0 = MemoryTier::create(MemoryKind::host_arena, o.kv_tier0_bytes ? o.kv_tier0_bytes
                                                                        : kDefaultTierBytes,
                               fp, layout);
  if (!t0.ok()) return t0.status();
  tiers.push_back(std::move(t0.value()));
  auto t1 = MemoryTier::create(MemoryKind::pinned_host, o.kv_tier1_bytes ? o.kv_tier1_bytes
                                                                         : kDefaultTierBytes,
                               fp, layout);
  if (!t1.ok()) return t1.status();
  tiers.push_back(std::move(t1.value()));
  if (!o.kv_dir.empty()) {
#ifdef CLEAVE_HAVE_ROCKSDB
    RocksDbTierOptions ro;
    ro.capacity_bytes = size_t(16) << 30;
    ro.model_fingerprint = fp;
    ro.layout = layout;
    auto t2 = RocksDbTier::open(o.kv_dir, ro);
    if (!t2.ok()) return t2.status();
    tiers.push_back(std::move(t2.value()));
#else
    return Status(Code::unsupported, "kv_dir '" + o.kv_dir +
                                         "': this build has no RocksDB tier (CLEAVE_STORAGE=OFF)");
#endif
  }
  auto store = TieredStore::create(std::move(tiers), fp, layout);
  if (!store.ok()) return store.status();
  return std::shared_ptr<TieredStore>(std::move(store.value()));
}

class ActorPipeline final : public Pipeline {
 public:
  ActorPipeline(const PipelineOptions& options, int32_t context, int32_t n_vocab, int32_t n_embd)
      : options_(options), context_(context), n_vocab_(n_vocab), n_embd_(n_embd) {
    if (options.actor_threads > 0)
      config_.set("scheduler.max-threads", size_t(options.actor_threads));
    // Idle CAF workers poll (by default 100 busy polls, then 500 polls 50 us
    // apart) before they sleep on a condition variable that a new job wakes
    // at once. On a machine whose cores run the engines' threads, that
    // polling steals the cores every parallel step waits on; poll briefly
    // and sleep instead (no added latency: enqueue wakes the sleeper).
    config_.set("work-stealing.aggressive-poll-attempts", size_t(10));
    config_.set("work-stealing.moderate-poll-attempts", size_t(0));
    system_ = std::make_unique<caf::actor_system>(config_);
    sinks_ = std::make_shared<EventSinks>();
  }

  ~ActorPipeline() override {
    {
      caf::scoped_actor self{*system_};
      // Every admitted request gets its one final event (aborted) before the
      // actors go.
      self->request(router_, kClientTimeout, shutdown_atom::value)
          .receive([](bool) {}, [](caf::error&) {});
      for (auto& st : stages_) self->send_exit(st.handle, caf::exit_reason::user_shutdown);
      for (auto& e : encoders_) self->send_exit(e.handle, caf::exit_reason::user_shutdown);
      self->send_exit(router_, caf::exit_reason::user_shutdown);
      self->send_exit(kv_, caf::exit_reason::user_shutdown);
    }
    // A detached actor's thread ends only when its last handle is gone.
    stages_.clear();
    encoders_.clear();
    router_ = router_actor{};
    kv_ = kv_store_actor{};
    system_.reset();  // waits for every actor (a stage ends its current step first)
  }

  Status start(std::vector<std::pair<std::string, std::shared_ptr<StageCore>>> cores,
               std::vector<std::shared_ptr<VisionEncoder>> encoders,
               std::shared_ptr<TieredStore> store) {
    kv_ = system_->spawn<caf::detached>(kv_store_fn, std::move(store));
    RouterConfig rc;
    rc.disaggregated = options_.topology == Topology::pd;
    rc.max_pending = options_.max_pending;
    rc.block_size = options_.engine.block_size;
    rc.request_timeout_s = options_.request_timeout_s;
    router_ = system_->spawn(router_fn, rc, sinks_, kv_);
    caf::scoped_actor self{*system_};
    Status result;
    for (auto& [kind, core] : cores) {
      const bool persist = kind != "prefill";
      auto handle =
          system_->spawn<caf::detached>(stage_fn, core, kind, router_, kv_, persist,
                                        options_.kv_stream);
      stages_.push_back(StageHandle{kind, handle});
      self->request(router_, kClientTimeout, attach_atom::value, kind, handle)
          .receive([](bool) {}, [&](caf::error& e) { result = from_error(e); });
      if (!result.ok()) return result;
    }
    for (size_t i = 0; i < encoders.size(); ++i) {
      auto handle = system_->spawn<caf::detached>(vision_encoder_fn, std::move(encoders[i]),
                                                  "vision_encoder/" + std::to_string(i));
      encoders_.push_back(EncoderHandle{handle});
      self->request(router_, kClientTimeout, attach_atom::value, std::string("vision_encoder"), handle)
          .receive([](bool) {}, [&](caf::error& e) { result = from_error(e); });
      if (!result.ok()) return result;
    }
    return Status::Ok();
  }

  Status submit(GenerateRequest request, EventCallback on_event) override {
    Status st = validate_request(request, context_, n_vocab_, n_embd_);
    if (!st.ok()) return st;
    if (encoders_.empty() && !check_images_encoded(request).ok())
      return Status(Code::invalid_argument,
                    "request " + std::to_string(request.request_id) +
                        " has images without embeddings and this pipeline has no vision encoder "
                        "(no mmproj)");
    return submit_to_router(*system_, router_, *sinks_, std::move(request), std::move(on_event));
  }

  std::vector<msg::Stats> stats() override {
    std::vector<msg::Stats> out;
    caf::scoped_actor self{*system_};
    auto collect = [&](auto handle) { collect_stats(self, handle, out); };
    collect(router_);
    collect(kv_);
    for (auto& st : stages_) collect(st.handle);
    for (auto& e : encoders_) collect(e.handle);
    return out;
  }

  int32_t alive(const std::string& kind) override {
    for (const msg::Stats& s : stats())
      if (s.actor == "router") return int32_t(s.get("alive_" + kind));
    return 0;
  }

  Status kill_decode_actor(int32_t index) override {
    const std::string kind = options_.topology == Topology::pd ? "decode" : "colocated";
    int32_t n = 0;
    for (auto& st : stages_) {
      if (st.kind != kind) continue;
      if (n++ != index) continue;
      if (st.killed) break;
      st.killed = true;
      caf::anon_send_exit(st.handle, caf::exit_reason::kill);
      return Status::Ok();
    }
    return Status(Code::not_found, "no live " + kind + " actor " + std::to_string(index));
  }

  Status kill_vision_actor(int32_t index) override {
    if (index < 0 || index >= int32_t(encoders_.size()) || encoders_[size_t(index)].killed)
      return Status(Code::not_found, "no live vision_encoder actor " + std::to_string(index));
    encoders_[size_t(index)].killed = true;
    caf::anon_send_exit(encoders_[size_t(index)].handle, caf::exit_reason::kill);
    return Status::Ok();
  }

  Status send_raw_for_test(const std::string& kind, int32_t index,
                           const std::vector<char>& bytes) override {
    caf::scoped_actor self{*system_};
    Status st;
    auto on_error = [&](caf::error& e) { st = from_error(e); };
    if (kind == "router") {
      self->request(router_, kClientTimeout, submit_atom::value, bytes)
          .receive([](bool) {}, on_error);
      return st;
    }
    if (kind == "kv_store") {
      self->request(kv_, kClientTimeout, kv_put_atom::value, bytes)
          .receive([](const Bytes&) {}, on_error);
      return st;
    }
    if (kind == "vision_encoder") {
      if (index < 0 || index >= int32_t(encoders_.size()))
        return Status(Code::not_found, "no vision_encoder actor " + std::to_string(index));
      self->request(encoders_[size_t(index)].handle, kClientTimeout, encode_atom::value, bytes)
          .receive([](const Bytes&) {}, on_error);
      return st;
    }
    int32_t n = 0;
    for (auto& s : stages_) {
      if (s.kind != kind || n++ != index) continue;
      self->request(s.handle, kClientTimeout, submit_atom::value, bytes)
          .receive([](bool) {}, on_error);
      return st;
    }
    return Status(Code::not_found, "no " + kind + " actor " + std::to_string(index));
  }

  const PipelineOptions& options() const override { return options_; }

 private:
  struct StageHandle {
    std::string kind;
    stage_actor handle;
    bool killed = false;
  };
  struct EncoderHandle {
    vision_encoder_actor handle;
    bool killed = false;
  };
  PipelineOptions options_;
  int32_t context_, n_vocab_, n_embd_;
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
  std::shared_ptr<EventSinks> sinks_;
  kv_store_actor kv_;
  router_actor router_;
  std::vector<StageHandle> stages_;
  std::vector<EncoderHandle> encoders_;
};

}  // namespace

Result<std::unique_ptr<Pipeline>> make_actor_pipeline(std::shared_ptr<const GgufFile> file,
                                                       std::shared_ptr<const Tokenizer> tokenizer,
                                                       const PipelineOptions& options) {
  // Engines and the store first, so their errors come back before any actor.
  std::vector<std::pair<std::string, std::shared_ptr<StageCore>>> cores;
  auto add = [&](const std::string& kind, int32_t n, bool prefill_only) -> Status {
    SchedulerOptions so = options.scheduler;
    so.prefill_only = prefill_only;
    for (int32_t i = 0; i < n; ++i) {
      auto core = StageCore::create(file, tokenizer, options.engine, so,
                                    kind + "/" + std::to_string(i));
      if (!core.ok()) return core.status();
      cores.emplace_back(kind, std::shared_ptr<StageCore>(std::move(core.value())));
    }
    return Status::Ok();
  };
  Status st = options.topology == Topology::pd
                  ? add("prefill", options.prefill_actors, true)
                  : add("colocated", options.colocated_actors, false);
  if (st.ok() && options.topology == Topology::pd) st = add("decode", options.decode_actors, false);
  if (!st.ok()) return st;
  Engine& engine = cores.front().second->engine();
  auto encoders = make_vision_encoders(options, engine.config().dim);
  if (!encoders.ok()) return encoders.status();
  auto store = make_store(options, engine.model_fingerprint(), engine.kv_layout());
  if (!store.ok()) return store.status();
  auto pipeline = std::make_unique<ActorPipeline>(options, engine.context(), engine.config().n_vocab,
                                                  engine.config().dim);
  st = pipeline->start(std::move(cores), std::move(encoders.value()), std::move(store.value()));
  if (!st.ok()) return st;
  return std::unique_ptr<Pipeline>(std::move(pipeline));
}

}  // namespace cleave

// ---- nodes: the same actors spread over processes (actors/node.h) ----

namespace cleave {

bool secrets_equal(std::string_view a, std::string_view b) {
  // Every byte of the longer string is looked at, whatever differs first.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

Result<std::optional<std::string>> read_cluster_secret(const ClusterSpec& spec) {
  if (!spec.secret_file.empty()) {
    std::ifstream f(spec.secret_file, std::ios::binary);
    if (!f) return Status(Code::io_error, "cannot read the cluster secret file '" + spec.secret_file + "'");
    std::string secret((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
    if (secret.empty())
      return Status(Code::invalid_argument, "the cluster secret file '" + spec.secret_file + "' is empty");
    return std::optional<std::string>(std::move(secret));
  }
  const char* env = spec.secret_env.empty() ? nullptr : std::getenv(spec.secret_env.c_str());
  if (!env || !*env) return std::optional<std::string>();
  return std::optional<std::string>(std::string(env));
}

namespace {

using join_atom = caf::atom_constant<caf::atom("join")>;

// What the head publishes. join: (secret, node name) -> the router and
// kv_store handles, or an error naming why the node is refused. attach:
// (secret, node name, kind, stage) -> the router's answer; the join actor
// watches the stage so the head can say which node lost it.
using join_actor = caf::typed_actor<
    caf::replies_to<join_atom, std::string, std::string>::with<router_actor, kv_store_actor>,
    caf::replies_to<attach_atom, std::string, std::string, std::string, stage_actor>::with<bool>,
    caf::replies_to<attach_atom, std::string, std::string, std::string,
                    vision_encoder_actor>::with<bool>>;

constexpr auto kJoinTimeout = std::chrono::seconds(10);

void log_line(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A name from the wire, safe to print.
std::string printable(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 64)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return out;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

bool is_stage_kind(const std::string& kind) {
  return kind == "prefill" || kind == "decode" || kind == "colocated";
}

struct JoinState {
  std::optional<std::string> secret;
  router_actor router;
  kv_store_actor kv;
  struct Watched {
    caf::actor_addr addr;
    std::string node, kind;
  };
  std::vector<Watched> watched;
  static inline const char* name = "cleave.join";
};
using join_pointer = join_actor::stateful_pointer<JoinState>;

join_actor::behavior_type join_fn(join_pointer self, std::optional<std::string> secret,
                                  router_actor router, kv_store_actor kv) {
  self->state.secret = std::move(secret);
  self->state.router = router;
  self->state.kv = kv;
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& w = self->state.watched;
    for (auto it = w.begin(); it != w.end(); ++it) {
      if (it->addr != dm.source) continue;
      char when[32];
      std::snprintf(when, sizeof when, "%.3f", epoch_seconds());
      log_line("cleave node head: node " + it->node + " lost its " + it->kind + " stage (" +
               caf::to_string(dm.reason) + ") at " + when);
      w.erase(it);
      return;
    }
  });
  auto admitted = [=](const std::string& secret) {
    return !self->state.secret || secrets_equal(*self->state.secret, secret);
  };
  // A stage or a vision encoder of a node: watched here (to log which node
  // lost it) and handed to the router, which monitors it.
  auto attach = [=](const std::string& secret, const std::string& node, const std::string& kind,
                    const auto& actor, bool kind_ok) -> caf::result<bool> {
    if (!admitted(secret)) {
      log_line("refused node " + printable(node) + ": wrong cluster secret");
      return to_error(Status(Code::unavailable, "wrong cluster secret"));
    }
    if (!kind_ok)
      return to_error(Status(Code::invalid_argument, "cannot attach a '" + printable(kind) +
                                                         "' actor as this kind of actor"));
    self->monitor(actor);
    self->state.watched.push_back({actor.address(), printable(node), kind});
    auto rp = self->make_response_promise<bool>();
    self->request(self->state.router, kClientTimeout, attach_atom::value, kind, actor)
        .then([=](bool ok) mutable { rp.deliver(ok); },
              [=](caf::error& e) mutable { rp.deliver(std::move(e)); });
    return rp;
  };
  return {
      [=](join_atom, const std::string& secret,
          const std::string& node) -> caf::result<router_actor, kv_store_actor> {
        if (!admitted(secret)) {
          log_line("refused node " + printable(node) + ": wrong cluster secret");
          return to_error(Status(Code::unavailable, "wrong cluster secret"));
        }
        log_line("cleave node head: node " + printable(node) + " joined");
        return {self->state.router, self->state.kv};
      },
      [=](attach_atom, const std::string& secret, const std::string& node, const std::string& kind,
          stage_actor stage) -> caf::result<bool> {
        return attach(secret, node, kind, stage, is_stage_kind(kind));
      },
      [=](attach_atom, const std::string& secret, const std::string& node, const std::string& kind,
          vision_encoder_actor encoder) -> caf::result<bool> {
        return attach(secret, node, kind, encoder, kind == "vision_encoder");
      },
  };
}

// Middleman, heartbeats and the handle types that cross the wire: the same
// on every node.
void configure_node(caf::actor_system_config& config, const ClusterSpec& spec, int32_t threads) {
  config.load<caf::io::middleman>();
  config.add_message_type<router_actor>("cleave.router_actor");
  config.add_message_type<kv_store_actor>("cleave.kv_store_actor");
  config.add_message_type<stage_actor>("cleave.stage_actor");
  config.add_message_type<kv_sender_actor>("cleave.kv_sender_actor");
  config.add_message_type<kv_receiver_actor>("cleave.kv_receiver_actor");
  config.add_message_type<vision_encoder_actor>("cleave.vision_encoder_actor");
  auto span = [](double s) {
    return caf::timespan(std::chrono::nanoseconds(int64_t(s * 1e9)));
  };
  config.set("middleman.heartbeat-interval", span(spec.heartbeat_interval_s));
  config.set("middleman.connection-timeout", span(spec.connection_timeout_s));
  if (threads > 0) config.set("scheduler.max-threads", size_t(threads));
  // As ActorPipeline: idle workers sleep instead of polling the engines' cores.
  config.set("work-stealing.aggressive-poll-attempts", size_t(10));
  config.set("work-stealing.moderate-poll-attempts", size_t(0));
}

// What a node hosts besides the head's router and store.
struct NodeActors {
  std::vector<std::pair<std::string, std::shared_ptr<StageCore>>> cores;  // kind, core
  std::vector<std::shared_ptr<VisionEncoder>> encoders;
};

// The stage cores and vision encoders a node hosts, in kActorKinds order;
// engines and encoders are built before any actor so their errors come
// back first.
Result<NodeActors> make_node_cores(const NodeOptions& o, const NodeSpec& node) {
  NodeActors out;
  auto& cores = out.cores;
  EngineOptions eo = o.engine;
  if (node.threads > 0) eo.threads = node.threads;
  for (const ActorGroupSpec& g : node.actors) {
    if (g.kind == "kv_store") {
      if (!node.head)
        log_line("cleave node " + node.name +
                 ": kv_store on a worker is not implemented yet; the head's store serves the cluster");
      continue;
    }
    if (g.kind == "vision_encoder") {
      if (!o.mmproj)
        return Status(Code::invalid_argument, "node '" + node.name +
                                                  "' hosts vision_encoder actors (line " +
                                                  std::to_string(g.line) + "): give it --mmproj");
      auto lm = LlamaModel::load(o.file);
      if (!lm.ok()) return lm.status();
      VisionEncoderOptions vo = o.vision;
      vo.n_embd = (*lm)->config().dim;
      if (node.threads > 0) vo.threads = node.threads;
      for (int32_t i = 0; i < g.count; ++i) {
        auto e = VisionEncoder::create(o.mmproj, vo);
        if (!e.ok()) return e.status();
        out.encoders.push_back(std::move(e.value()));
      }
      continue;
    }
    if (!is_stage_kind(g.kind))
      return Status(Code::unsupported, "node '" + node.name + "': actor kind '" + g.kind +
                                           "' is not implemented yet (line " + std::to_string(g.line) + ")");
    SchedulerOptions so = o.scheduler;
    so.prefill_only = g.kind == "prefill";
    for (int32_t i = 0; i < g.count; ++i) {
      auto core = StageCore::create(o.file, o.tokenizer, eo, so,
                                    node.name + "/" + g.kind + "/" + std::to_string(i));
      if (!core.ok()) return core.status();
      cores.emplace_back(g.kind, std::shared_ptr<StageCore>(std::move(core.value())));
    }
  }
  return out;
}

// Spawns a node's vision encoders and attaches each through the join actor.
Status spawn_node_encoders(caf::actor_system& system, const join_actor& join, const std::string& secret,
                           const std::string& node, std::vector<std::shared_ptr<VisionEncoder>> encoders,
                           std::vector<vision_encoder_actor>& out) {
  caf::scoped_actor self{system};
  Status st;
  for (size_t i = 0; i < encoders.size(); ++i) {
    auto handle = system.spawn<caf::detached>(vision_encoder_fn, std::move(encoders[i]),
                                              node + "/vision_encoder/" + std::to_string(i));
    out.push_back(handle);
    self->request(join, kJoinTimeout, attach_atom::value, secret, node, std::string("vision_encoder"),
                  handle)
        .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
    if (!st.ok()) return Status(st.code(), "attaching vision_encoder to the head: " + st.message());
  }
  return Status::Ok();
}

class HeadNode final : public Node {
 public:
  explicit HeadNode(const NodeOptions& o, const NodeSpec& me) : options_(o), me_(me) {
    configure_node(config_, o.spec, 0);
    system_ = std::make_unique<caf::actor_system>(config_);
    sinks_ = std::make_shared<EventSinks>();
  }

  ~HeadNode() override {
    {
      caf::scoped_actor self{*system_};
      self->request(router_, kClientTimeout, shutdown_atom::value)
          .receive([](bool) {}, [](caf::error&) {});
      if (port_ > 0) system_->middleman().unpublish(join_, port_);
      self->send_exit(join_, caf::exit_reason::user_shutdown);
      for (auto& st : stages_) self->send_exit(st, caf::exit_reason::user_shutdown);
      for (auto& e : encoders_) self->send_exit(e, caf::exit_reason::user_shutdown);
      self->send_exit(router_, caf::exit_reason::user_shutdown);
      self->send_exit(kv_, caf::exit_reason::user_shutdown);
    }
    stages_.clear();
    encoders_.clear();
    join_ = join_actor{};
    router_ = router_actor{};
    kv_ = kv_store_actor{};
    system_.reset();
  }

  Status start() {
    auto cores = make_node_cores(options_, me_);
    if (!cores.ok()) return cores.status();
    // The store's fingerprint and layout, and request validation, come from
    // an engine: a local stage's, or one made for that when there is none.
    std::unique_ptr<Engine> probe;
    Engine* engine = nullptr;
    if (!cores->cores.empty()) {
      engine = &cores->cores.front().second->engine();
    } else {
      EngineOptions eo = options_.engine;
      eo.max_seqs = 1;
      auto e = Engine::create(options_.file, eo);
      if (!e.ok()) return e.status();
      probe = std::move(e.value());
      engine = probe.get();
    }
    context_ = engine->context();
    n_vocab_ = engine->config().n_vocab;
    n_embd_ = engine->config().dim;
    PipelineOptions po;
    po.kv_tier0_bytes = size_t(me_.kv_tier0_bytes);
    po.kv_tier1_bytes = size_t(me_.kv_tier1_bytes);
    po.kv_dir = me_.kv_dir;
    auto store = make_store(po, engine->model_fingerprint(), engine->kv_layout());
    if (!store.ok()) return store.status();
    probe.reset();

    kv_ = system_->spawn<caf::detached>(kv_store_fn, std::move(store.value()));
    RouterConfig rc;
    rc.disaggregated = options_.spec.count("prefill") > 0;
    rc.max_pending = options_.spec.max_pending;
    rc.block_size = options_.engine.block_size;
    rc.request_timeout_s = options_.spec.request_timeout_s;
    router_ = system_->spawn(router_fn, rc, sinks_, kv_);
    join_ = system_->spawn(join_fn, options_.secret, router_, kv_);
    auto port = system_->middleman().publish(join_, uint16_t(me_.port), me_.host.c_str());
    if (!port)
      return Status(Code::unavailable, "cannot listen on " + me_.host + ":" +
                                           std::to_string(me_.port) + ": " +
                                           system_->render(port.error()));
    port_ = *port;
    KvStreamOptions stream = options_.kv_stream;
    stream.node_address = address();
    caf::scoped_actor self{*system_};
    Status result;
    for (auto& [kind, core] : cores->cores) {
      auto handle = system_->spawn<caf::detached>(stage_fn, core, kind, router_, kv_,
                                                  kind != "prefill", stream);
      stages_.push_back(handle);
      self->request(join_, kClientTimeout, attach_atom::value, options_.secret.value_or(""), me_.name,
                    kind, handle)
          .receive([](bool) {}, [&](caf::error& e) { result = from_error(e); });
      if (!result.ok()) return result;
    }
    return spawn_node_encoders(*system_, join_, options_.secret.value_or(""), me_.name,
                               std::move(cores->encoders), encoders_);
  }

  bool is_head() const override { return true; }
  std::string address() const override { return me_.host + ":" + std::to_string(port_); }
  bool lost_head() const override { return false; }

  int32_t stages() override {
    for (const msg::Stats& s : stats())
      if (s.actor == "router")
        return int32_t(s.get("alive_prefill") + s.get("alive_decode") + s.get("alive_colocated") +
                       s.get("alive_vision_encoder"));
    return 0;
  }

  Status submit(GenerateRequest request, EventCallback on_event) override {
    Status st = validate_request(request, context_, n_vocab_, n_embd_);
    if (!st.ok()) return st;
    return submit_to_router(*system_, router_, *sinks_, std::move(request), std::move(on_event));
  }

  std::vector<msg::Stats> stats() override {
    std::vector<msg::Stats> out;
    caf::scoped_actor self{*system_};
    auto collect = [&](auto handle) { collect_stats(self, handle, out); };
    collect(router_);
    collect(kv_);
    for (auto& e : encoders_) collect(e);
    return out;
  }

 private:
  NodeOptions options_;
  NodeSpec me_;
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
  std::shared_ptr<EventSinks> sinks_;
  kv_store_actor kv_;
  router_actor router_;
  join_actor join_;
  std::vector<stage_actor> stages_;
  std::vector<vision_encoder_actor> encoders_;
  uint16_t port_ = 0;
  int32_t context_ = 0, n_vocab_ = 0, n_embd_ = 0;
};

class WorkerNode final : public Node {
 public:
  WorkerNode(const NodeOptions& o, const NodeSpec& me, const NodeSpec& head)
      : options_(o), me_(me), head_(head) {
    configure_node(config_, o.spec, 0);
    system_ = std::make_unique<caf::actor_system>(config_);
    head_lost_ = std::make_shared<std::atomic<bool>>(false);
  }

  ~WorkerNode() override {
    {
      caf::scoped_actor self{*system_};
      for (auto& st : stages_) self->send_exit(st, caf::exit_reason::user_shutdown);
      for (auto& e : encoders_) self->send_exit(e, caf::exit_reason::user_shutdown);
      if (watcher_) self->send_exit(watcher_, caf::exit_reason::user_shutdown);
    }
    stages_.clear();
    encoders_.clear();
    watcher_ = caf::actor{};
    join_ = join_actor{};
    router_ = router_actor{};
    kv_ = kv_store_actor{};
    system_.reset();
  }

  Status start() {
    auto cores = make_node_cores(options_, me_);
    if (!cores.ok()) return cores.status();
    // Where decoders on other nodes connect for worker-to-worker KV streams
    // (named in this node's hand-offs; the topology's host, 127.0.0.1 by
    // default, port 0: any free one).
    auto listening = system_->middleman().open(uint16_t(me_.port), me_.host.c_str());
    if (!listening)
      return Status(Code::unavailable, "worker " + me_.name + " cannot listen on " + me_.host + ":" +
                                           std::to_string(me_.port) + ": " +
                                           system_->render(listening.error()));
    KvStreamOptions stream = options_.kv_stream;
    stream.node_address = me_.host + ":" + std::to_string(*listening);
    // Nodes start in any order: keep trying until the deadline.
    const auto deadline =
        Clock::now() + std::chrono::milliseconds(int64_t(options_.join_timeout_s * 1e3));
    caf::error last;
    for (;;) {
      auto j = system_->middleman().remote_actor<join_actor>(head_.host, uint16_t(head_.port));
      if (j) {
        join_ = *j;
        break;
      }
      last = j.error();
      if (Clock::now() >= deadline)
        return Status(Code::unavailable, "cannot reach the head '" + head_.name + "' at " + address() +
                                             " within " + seconds_text(options_.join_timeout_s) +
                                             ": " + system_->render(last));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const std::string secret = options_.secret.value_or("");
    caf::scoped_actor self{*system_};
    Status st;
    self->request(join_, kJoinTimeout, join_atom::value, secret, me_.name)
        .receive(
            [&](router_actor& r, kv_store_actor& k) {
              router_ = std::move(r);
              kv_ = std::move(k);
            },
            [&](caf::error& e) { st = from_error(e); });
    if (!st.ok())
      return Status(st.code(), "the head at " + address() + " refused node " + me_.name + ": " + st.message());
    // Arguments go through spawn, not captures: CAF 0.17 dereferences a null
    // shared_ptr<tuple<>> for a function actor spawned without any (UBSan).
    watcher_ = system_->spawn([](caf::event_based_actor* w, router_actor router,
                                 std::shared_ptr<std::atomic<bool>> lost) {
      w->monitor(router);
      w->set_down_handler([=](caf::down_msg&) {
        lost->store(true);
        w->quit();
      });
      return caf::behavior{[](int32_t) {}};
    }, router_, head_lost_);
    for (auto& [kind, core] : cores->cores) {
      auto handle = system_->spawn<caf::detached>(stage_fn, core, kind, router_, kv_,
                                                  kind != "prefill", stream);
      stages_.push_back(handle);
      self->request(join_, kJoinTimeout, attach_atom::value, secret, me_.name, kind, handle)
          .receive([](bool) {}, [&](caf::error& e) { st = from_error(e); });
      if (!st.ok()) return Status(st.code(), "attaching " + kind + " to the head: " + st.message());
    }
    return spawn_node_encoders(*system_, join_, secret, me_.name, std::move(cores->encoders), encoders_);
  }

  bool is_head() const override { return false; }
  std::string address() const override { return head_.host + ":" + std::to_string(head_.port); }
  bool lost_head() const override { return head_lost_->load(); }
  int32_t stages() override { return int32_t(stages_.size() + encoders_.size()); }

  Status submit(GenerateRequest, EventCallback) override {
    return Status(Code::unsupported, "requests go to the head, not to worker node " + me_.name);
  }

  std::vector<msg::Stats> stats() override {
    std::vector<msg::Stats> out;
    caf::scoped_actor self{*system_};
    for (auto& st : stages_) collect_stats(self, st, out);
    for (auto& e : encoders_) collect_stats(self, e, out);
    return out;
  }

 private:
  NodeOptions options_;
  NodeSpec me_, head_;
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
  std::shared_ptr<std::atomic<bool>> head_lost_;
  join_actor join_;
  router_actor router_;
  kv_store_actor kv_;
  caf::actor watcher_;
  std::vector<stage_actor> stages_;
  std::vector<vision_encoder_actor> encoders_;
};

}  // namespace

Result<std::unique_ptr<Node>> Node::start(const NodeOptions& options) {
  if (!options.file) return Status(Code::invalid_argument, "node: no model file");
  CLEAVE_RETURN_IF_ERROR(
      validate_kv_stream_options(options.kv_stream.chunk_bytes, options.kv_stream.window));
  const NodeSpec* me = options.spec.find(options.name);
  if (!me) {
    std::string names;
    for (const NodeSpec& n : options.spec.nodes) names += (names.empty() ? "" : ", ") + n.name;
    return Status(Code::invalid_argument,
                  "no node '" + options.name + "' in the topology (nodes: " + names + ")");
  }
  if (me->head) {
    auto node = std::make_unique<HeadNode>(options, *me);
    Status st = node->start();
    if (!st.ok()) return st;
    return std::unique_ptr<Node>(std::move(node));
  }
  const NodeSpec& head = options.spec.head();
  if (head.port <= 0 || head.port > 65535)
    return Status(Code::invalid_argument,
                  "the head '" + head.name + "' has port " + std::to_string(head.port) +
                      " in the topology: a worker needs its real port (e.g. --set " + head.name +
                      "_port=N)");
  auto node = std::make_unique<WorkerNode>(options, *me, head);
  Status st = node->start();
  if (!st.ok()) return st;
  return std::unique_ptr<Node>(std::move(node));
}

}  // namespace cleave

// ---- the KV transfer benchmark's two ends (actors/kv_stream.h) ----

namespace cleave {

Status serve_kv_sender(std::shared_ptr<const std::vector<BlockRecord>> records, int32_t n_streams,
                       const std::string& host, const std::function<void(uint16_t)>& on_port,
                       double timeout_s) {
  caf::actor_system_config config;
  configure_node(config, ClusterSpec{}, 0);  // as a node's, with default heartbeats
  caf::actor_system system{config};
  auto outbox = std::make_shared<KvOutbox>();
  for (int32_t i = 1; i <= n_streams; ++i) outbox->put(uint64_t(i), records);
  auto counters = std::make_shared<KvStreamCounters>();
  auto sender = system.spawn(kv_sender_fn, outbox, counters, int32_t(-1), host);
  auto port = system.middleman().publish(sender, 0, host.c_str());
  Status st;
  if (!port) {
    st = Status(Code::unavailable, "cannot listen on " + host + ": " + system.render(port.error()));
  } else {
    on_port(*port);
    // Streams erase their outbox entry when their last chunk is acknowledged.
    const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1e3));
    while (outbox->size() > 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (outbox->size() > 0)
      st = Status(Code::timed_out, std::to_string(outbox->size()) + " streams not pulled within " +
                                       std::to_string(timeout_s) + " s");
    system.middleman().unpublish(sender, *port);
  }
  caf::anon_send_exit(sender, caf::exit_reason::user_shutdown);
  return st;
}

Result<std::vector<KvPullTiming>> pull_kv_streams(
    const std::string& host, uint16_t port, int32_t n_streams, uint32_t chunk_bytes, int32_t window,
    const std::function<void(const std::vector<BlockRecord>&)>& sink) {
  CLEAVE_RETURN_IF_ERROR(validate_kv_stream_options(chunk_bytes, window));
  caf::actor_system_config config;
  configure_node(config, ClusterSpec{}, 0);  // as a node's, with default heartbeats
  caf::actor_system system{config};
  auto sender = system.middleman().remote_actor<kv_sender_actor>(host, port);
  if (!sender)
    return Status(Code::unavailable, "cannot reach the kv_sender at " + host + ":" +
                                         std::to_string(port) + ": " + system.render(sender.error()));
  auto inbox = std::make_shared<KvInbox>();
  auto counters = std::make_shared<KvStreamCounters>();
  auto receiver = system.spawn(kv_receiver_fn, inbox, counters);
  std::vector<KvPullTiming> out;
  Status st;
  caf::scoped_actor self{system};
  for (int32_t i = 1; i <= n_streams && st.ok(); ++i) {
    msg::KvPull pull;
    pull.request_id = uint64_t(i);
    pull.chunk_bytes = chunk_bytes;
    pull.window = window;
    const uint64_t bytes_before = counters->bytes_received;
    const auto t0 = Clock::now();
    bool complete = false;
    self->request(receiver, kKvFetchTimeout, kv_fetch_atom::value, codec::encode(pull),
                  caf::actor_cast<caf::actor>(*sender), std::string())
        .receive([&](bool ok) { complete = ok; }, [&](caf::error& e) { st = from_error(e); });
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    auto records = inbox->take(uint64_t(i));
    if (st.ok() && !complete) st = records.ok() ? Status(Code::aborted, "stream failed") : records.status();
    if (!st.ok()) break;
    out.push_back(KvPullTiming{seconds, counters->bytes_received - bytes_before});
    sink(records.value());
    block_buffer_pool().release(records.value());  // as a decoder's scheduler does
  }
  caf::anon_send_exit(receiver, caf::exit_reason::user_shutdown);
  if (!st.ok()) return st;
  return out;
}

}  // namespace cleave
