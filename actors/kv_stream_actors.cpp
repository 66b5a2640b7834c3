// The two ends of KV streams (the protocol is actors/kv_stream.h): a
// kv_sender linked to each prefill stage and a kv_receiver linked to each
// decode (and colocated) stage, so a stream flows while the stage's engine
// computes; and the transfer benchmark's two ends (serve_kv_sender,
// pull_kv_streams), each with an actor system of its own.
#include "actors/actor_types.h"

#include <caf/io/all.hpp>

#include <cstdio>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "actors/kv_link.h"
#include "actors/kv_shared.h"
#include "actors/kv_socket.h"
#include "actors/topology.h"
#include "schema/codec.h"

namespace cleave::actors {
namespace {

struct KvSenderState {
  std::shared_ptr<KvOutbox> outbox;
  std::shared_ptr<KvStreamCounters> counters;
  int32_t corrupt_chunk = -1;
  std::string host;  // where the data socket listens ("": no data socket)
  std::unique_ptr<KvSocketServer> socket;  // opened at the first offer
  bool shared_memory = false;              // offers shared memory to receivers on this host
  // The stage engine's backend when its memory is not the host's (a GPU):
  // its blocks are offered from there, device to device.
  std::shared_ptr<Backend> device;
  std::unique_ptr<KvSharedOffers> shared;  // made at the first shared offer
  // Device links, one per receiver (by its name), and the streams sent on
  // them until the receiver acknowledges.
  struct LinkStream {
    std::string receiver, link;
    int32_t blocks = 0;
    uint64_t bytes = 0;
  };
  std::unordered_map<std::string, std::shared_ptr<KvLinkEnd>> links;
  std::unordered_map<uint64_t, LinkStream> link_streams;
  // Last member: destroyed first. Closes dropped links off the actor's
  // thread (closing joins the link's thread, which may wait on its peer).
  std::unique_ptr<KvSocketJobs> jobs = std::make_unique<KvSocketJobs>();
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

// The KV kept for a pull (not_found, or invalid_argument for a first
// block past it).
Result<KvOutbox::Kept> kept_for(const KvSenderState& s, const msg::KvPull& pull) {
  auto kept = s.outbox->get(pull.request_id);
  if (!kept) return Status(Code::not_found, "no KV kept for request " + std::to_string(pull.request_id));
  if (size_t(pull.first_block) > kept.size())
    return Status(Code::invalid_argument, "pull from block " + std::to_string(pull.first_block) + " of " +
                                              std::to_string(kept.size()));
  return kept;
}

// Closes a device link on a job thread (it may wait for a call on its peer).
void retire(KvSocketJobs& jobs, std::shared_ptr<KvLinkEnd> end) {
  if (end) jobs.run([end]() mutable { end.reset(); });
}

// A pull over the receiver's device link: one send of the kept blocks on
// the link's thread, the offer answered at once.
Result<std::pair<std::string, msg::KvChunk>> offer_link(kv_sender_pointer self, const msg::KvPull& pull,
                                                        const std::string& receiver) {
  auto& s = self->state;
  auto unsupported = [](const std::string& why) { return Status(Code::unsupported, "KV over a device link: " + why); };
  if (!s.shared_memory) return unsupported("this KV sender uses the socket only (--kv-transport socket)");
  if (!s.device) return unsupported("the sender's engine is not on a device");
  auto kept = kept_for(s, pull);
  if (!kept.ok()) return kept.status();
  if (!kept->blocks || &kept->blocks->backend() != s.device.get())
    return unsupported("the KV is not in the sender's device memory");
  const size_t first = size_t(pull.first_block);
  if (first == kept->size()) return std::pair<std::string, msg::KvChunk>();
  std::shared_ptr<KvLinkEnd>& end = s.links[receiver];
  if (!end) {
    auto id = s.device->new_link_id();
    if (!id.ok()) {
      s.links.erase(receiver);
      return id.status();
    }
    end = std::make_shared<KvLinkEnd>(s.device, id.value(), 0);
  }
  auto blocks = kept->blocks;
  msg::KvChunk offer;
  offer.request_id = pull.request_id;
  offer.first_block = pull.first_block;
  offer.headers.assign(blocks->headers().begin() + long(first), blocks->headers().end());
  offer.total_bytes = uint64_t(offer.headers.size()) * blocks->block_bytes();
  s.link_streams[pull.request_id] =
      KvSenderState::LinkStream{receiver, end->id(), int32_t(offer.headers.size()), offer.total_bytes};
  auto me = caf::actor_cast<kv_sender_actor>(self);
  const uint64_t id = pull.request_id;
  end->run([me, id, blocks, first](DeviceLink* link, const Status& opened) {
    Status st = link ? send_kv_link(*link, *blocks, first) : opened;
    if (st.ok()) return;  // the receiver's ack ends the stream
    std::fprintf(stderr, "cleave: KV of request %llu over a device link failed (%s)\n",
                 static_cast<unsigned long long>(id), st.to_string().c_str());
    caf::anon_send(me, kv_link_done_atom::value, id, false);
  });
  return std::pair<std::string, msg::KvChunk>(end->id(), std::move(offer));
}

// Offers the kept KV in shared memory: blocks in the device's memory copied
// into a region of it by the device, host records uploaded.
Result<std::string> offer_shared(KvSenderState& s, const msg::KvPull& pull, const KvOutbox::Kept& kept,
                                 msg::KvChunk& offer) {
  if (!s.shared)
    s.shared = std::make_unique<KvSharedOffers>(s.device ? s.device
                                                         : std::shared_ptr<Backend>(make_cpu_backend(1)));
  const size_t first = size_t(pull.first_block);
  if (kept.blocks && s.device && &kept.blocks->backend() == s.device.get()) {
    const auto& hs = kept.blocks->headers();
    return s.shared->offer_from(pull.request_id, kept.blocks->block(first),
                                std::vector<BlockHeader>(hs.begin() + long(first), hs.end()), pull.first_block,
                                offer, s.corrupt_chunk);
  }
  auto records = s.outbox->host_records(pull.request_id);
  if (!records.ok()) return records.status();
  return s.shared->offer(pull.request_id, *records.value(), pull.first_block, offer, s.corrupt_chunk);
}

kv_sender_actor::behavior_type kv_sender_fn(kv_sender_pointer self, std::shared_ptr<KvOutbox> outbox,
                                            std::shared_ptr<KvStreamCounters> counters,
                                            int32_t corrupt_chunk, std::string host, bool shared_memory,
                                            std::shared_ptr<Backend> device) {
  self->state.device = std::move(device);
  self->state.outbox = std::move(outbox);
  self->state.counters = std::move(counters);
  self->state.corrupt_chunk = corrupt_chunk;
  self->state.host = std::move(host);
  self->state.shared_memory = shared_memory;
  self->delayed_send(caf::actor_cast<kv_sender_actor>(self), kKvOutboxSweep, tick_atom::value);
  return {
      [=](kv_pull_atom, const Bytes& bytes, kv_receiver_actor to) -> caf::result<uint32_t> {
        auto& s = self->state;
        auto pull = codec::decode_as<msg::KvPull>(bytes);
        if (!pull.ok()) return to_error(pull.status());
        auto kept = kept_for(s, pull.value());
        if (!kept.ok()) return to_error(kept.status());
        auto records = s.outbox->host_records(pull->request_id);
        if (!records.ok()) return to_error(records.status());
        auto t = std::make_shared<SendTransfer>(
            KvStreamWriter(pull->request_id, records.value(), pull->first_block, pull->chunk_bytes),
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
        auto kept = kept_for(s, pull.value());
        if (!kept.ok()) return to_error(kept.status());
        if (size_t(pull->first_block) == kept->size()) {
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
        auto records = s.outbox->host_records(id);
        if (!records.ok()) return to_error(records.status());
        std::weak_ptr<KvOutbox> outbox = s.outbox;
        const std::string token = s.socket->offer(
            id, records.value(), pull->first_block, pull->chunk_bytes, [outbox, id](bool complete) {
              if (auto o = outbox.lock(); o && complete) o->erase(id);
            });
        return caf::result<std::string, std::string>(s.socket->address(), token);
      },
      [=](kv_shared_atom, const Bytes& bytes, const std::string& host_id) -> caf::result<std::string, Bytes> {
        auto& s = self->state;
        auto pull = codec::decode_as<msg::KvPull>(bytes);
        if (!pull.ok()) return to_error(pull.status());
        if (!s.shared_memory)
          return to_error(Status(Code::unsupported, "this KV sender does not share memory (--kv-transport socket)"));
        if (host_id.empty() || host_id != kv_host_identity())
          return to_error(Status(Code::unsupported, "the KV receiver is on another host"));
        auto kept = kept_for(s, pull.value());
        if (!kept.ok()) return to_error(kept.status());
        if (size_t(pull->first_block) == kept->size()) {
          s.outbox->erase(pull->request_id);
          return caf::result<std::string, Bytes>(std::string(), Bytes());
        }
        msg::KvChunk offer;
        auto handle = offer_shared(s, pull.value(), kept.value(), offer);
        if (!handle.ok()) return to_error(handle.status());
        return caf::result<std::string, Bytes>(handle.value(), codec::encode(offer));
      },
      [=](kv_shared_done_atom, uint64_t id, bool ok) {
        auto& s = self->state;
        int32_t blocks = 0;
        uint64_t bytes = 0;
        if (!s.shared || !s.shared->release(id, &blocks, &bytes) || !ok) return;  // not ok: a socket pull follows
        ++s.counters->transfers_sent;
        ++s.counters->shared_sent;
        s.counters->blocks_sent += uint64_t(blocks);
        s.counters->chunks_sent += uint64_t(blocks);
        s.counters->bytes_sent += bytes;
        s.outbox->erase(id);
      },
      [=](kv_link_atom, const Bytes& bytes,
          const std::string& receiver) -> caf::result<std::string, Bytes> {
        auto pull = codec::decode_as<msg::KvPull>(bytes);
        if (!pull.ok()) return to_error(pull.status());
        auto offered = offer_link(self, pull.value(), receiver);
        if (!offered.ok()) return to_error(offered.status());
        if (offered->first.empty()) {
          self->state.outbox->erase(pull->request_id);
          return caf::result<std::string, Bytes>(std::string(), Bytes());
        }
        return caf::result<std::string, Bytes>(offered->first, codec::encode(offered->second));
      },
      [=](kv_link_done_atom, uint64_t id, bool ok) {
        auto& s = self->state;
        auto it = s.link_streams.find(id);
        if (it == s.link_streams.end()) return;  // ended already (the link's thread and the receiver both say so)
        const KvSenderState::LinkStream ls = std::move(it->second);
        s.link_streams.erase(it);
        if (ok) {
          ++s.counters->transfers_sent;
          ++s.counters->link_sent;
          s.counters->blocks_sent += uint64_t(ls.blocks);
          s.counters->chunks_sent += uint64_t(ls.blocks);
          s.counters->bytes_sent += ls.bytes;
          s.outbox->erase(id);
          return;
        }
        // The link is out of step or gone: closed here and at the
        // receiver; its next stream makes a new one. The socket follows.
        auto l = s.links.find(ls.receiver);
        if (l != s.links.end() && l->second->id() == ls.link) {
          retire(*s.jobs, std::move(l->second));
          s.links.erase(l);
        }
      },
      [=](tick_atom) {
        self->state.outbox->expire(kKvOutboxTtl);
        if (self->state.shared) self->state.shared->expire(kKvOutboxTtl);
        self->delayed_send(caf::actor_cast<kv_sender_actor>(self), kKvOutboxSweep, tick_atom::value);
      },
  };
}

struct KvReceiverState {
  struct Transfer {
    std::unique_ptr<KvStreamAssembler> assembler;
    caf::actor from;  // the sender
    Bytes pull_bytes;
    msg::KvPull pull;
    caf::typed_response_promise<bool> done;
    Clock::time_point last_progress;
    // While the set-up requests (connect, kv_socket, kv_shared) run, their
    // own timeouts bound the transfer, and on the data socket and in shared
    // memory the job's do; the stall tick watches chunks over CAF only.
    bool watched = false;
  };
  std::shared_ptr<KvInbox> inbox;
  std::shared_ptr<KvStreamCounters> counters;
  std::unordered_map<uint64_t, Transfer> transfers;
  std::unordered_set<std::string> connected;  // nodes this one reaches directly
  std::shared_ptr<KvInbox> socket_results;  // outcomes of socket and shared-memory streams, until taken
  bool shared_memory = false;              // takes streams from senders on this host through shared memory
  std::shared_ptr<KvSharedMappings> shared_maps;  // senders' regions, mapped (made at the first)
  // The stage engine's backend when its memory is not the host's (a GPU):
  // streams through shared memory land there, device to device.
  std::shared_ptr<Backend> device;
  // Device links from senders (by their names), made at their first stream.
  std::unordered_map<std::string, std::shared_ptr<KvLinkEnd>> links;
  // Last member: destroyed first, joining the socket threads before the rest goes.
  std::unique_ptr<KvSocketJobs> socket_jobs = std::make_unique<KvSocketJobs>();
  static inline const char* name = "cleave.kv_receiver";
};
using kv_receiver_pointer = kv_receiver_actor::stateful_pointer<KvReceiverState>;

// Hands the outcome to the stage (inbox + the fetch's answer).
void end_transfer(kv_receiver_pointer self, uint64_t id, Result<KvReceived> result) {
  auto& s = self->state;
  auto it = s.transfers.find(id);
  if (it == s.transfers.end()) return;
  const bool ok = result.ok();
  if (ok) {
    ++s.counters->transfers_received;
    s.counters->blocks_received += result->size();
  } else {
    ++s.counters->transfers_failed;
    // The stage reads the store instead; the line says why the stream failed.
    std::fprintf(stderr, "cleave: the KV stream of request %llu failed (%s); reading the store\n",
                 static_cast<unsigned long long>(id), result.status().to_string().c_str());
  }
  auto done = it->second.done;
  s.transfers.erase(it);
  s.inbox->put(id, std::move(result));
  done.deliver(ok);
}

void end_transfer_records(kv_receiver_pointer self, uint64_t id, Result<std::vector<BlockRecord>> result) {
  if (!result.ok()) return end_transfer(self, id, Result<KvReceived>(result.status()));
  end_transfer(self, id, Result<KvReceived>(KvReceived{std::move(result.value()), nullptr}));
}

// A shared-memory offer fetched into the device's memory (device to device,
// checked there), else into host records.
Result<KvReceived> fetch_shared(KvSharedMappings& maps, const std::shared_ptr<Backend>& device,
                                const std::string& handle, const msg::KvChunk& offer, const msg::KvPull& pull,
                                KvStreamCounters& counters) {
  if (!device) {
    auto got = fetch_kv_shared(maps, handle, offer, pull, kKvMaxStreamBytes, counters);
    if (!got.ok()) return got.status();
    return KvReceived{std::move(got.value()), nullptr};
  }
  // Sizes checked before the device memory is taken (fetch_kv_shared_to checks the rest).
  CLEAVE_RETURN_IF_ERROR(check_kv_offer(offer, pull, kKvMaxStreamBytes, "KV over shared memory"));
  auto blocks = BackendBlocks::allocate(device, offer.headers.size(), offer.headers.front().layout.block_bytes());
  if (!blocks.ok()) return blocks.status();
  auto got = fetch_kv_shared_to(maps, handle, offer, pull, kKvMaxStreamBytes, counters, (*blocks)->data());
  if (!got.ok()) return got.status();
  (*blocks)->headers() = std::move(got.value());
  return KvReceived{{}, std::move(blocks.value())};
}

// Ends every stream from one sender (it went down, or sent garbage).
void end_transfers_from(kv_receiver_pointer self, const caf::node_id& node, uint64_t actor, const Status& why) {
  std::vector<uint64_t> cut;
  for (auto& [id, t] : self->state.transfers)
    if (t.from.id() == actor && t.from.node() == node) cut.push_back(id);
  for (uint64_t id : cut) end_transfer(self, id, why);
}

KvReceiverState::Transfer* transfer_of(kv_receiver_pointer self, uint64_t id) {
  auto it = self->state.transfers.find(id);
  return it == self->state.transfers.end() ? nullptr : &it->second;
}

// The chunks over CAF (a sender in this process, or one without a data socket).
void pull_chunks(kv_receiver_pointer self, uint64_t id) {
  auto* t = transfer_of(self, id);
  if (!t) return;
  t->watched = true;
  t->last_progress = Clock::now();
  self->request(caf::actor_cast<kv_sender_actor>(t->from), kKvTimeout, kv_pull_atom::value, t->pull_bytes,
                caf::actor_cast<kv_receiver_actor>(self))
      .then(
          [=](uint32_t n_chunks) {
            if (n_chunks == 0) end_transfer_records(self, id, std::vector<BlockRecord>{});
          },
          [=](caf::error& e) { end_transfer(self, id, from_error(e)); });
}

// The bytes on the sender's data socket, read on a thread of ours; a sender
// without one streams over CAF.
void pull_via_socket(kv_receiver_pointer self, uint64_t id) {
  auto* t = transfer_of(self, id);
  if (!t) return;
  self->request(caf::actor_cast<kv_sender_actor>(t->from), kKvTimeout, kv_socket_atom::value, t->pull_bytes)
      .then(
          [=](const std::string& where, const std::string& token) {
            auto& s = self->state;
            auto* t = transfer_of(self, id);
            if (!t) return;
            if (where.empty()) return end_transfer_records(self, id, std::vector<BlockRecord>{});
            auto results = s.socket_results;
            auto counters = s.counters;
            auto me = caf::actor_cast<kv_receiver_actor>(self);
            const msg::KvPull p = t->pull;
            s.socket_jobs->run([=] {
              results->put(id, fetch_kv_socket(where, token, p, kKvMaxStreamBytes, *counters));
              caf::anon_send(me, kv_done_atom::value, id);
            });
          },
          [=](caf::error& e) {
            if (from_error(e).code() == Code::unsupported) return pull_chunks(self, id);
            end_transfer(self, id, from_error(e));
          });
}

// A stream over the pair's device link failed, or its offer was unreadable:
// the sender hears of it, the link is closed here as it is there (the
// sender's next stream makes a new one), and the data socket serves the pull.
void link_failed(kv_receiver_pointer self, uint64_t id) {
  auto& s = self->state;
  auto* t = transfer_of(self, id);
  if (!t) return;
  self->send(caf::actor_cast<kv_sender_actor>(t->from), kv_link_done_atom::value, id, false);
  auto l = s.links.find(caf::to_string(t->from.address()));
  if (l != s.links.end()) {
    retire(*s.socket_jobs, std::move(l->second));
    s.links.erase(l);
  }
  ++s.counters->link_fallbacks;
  pull_via_socket(self, id);
}

// A job's outcome (shared memory, a device link) to the receiver: into the
// results, then Done (id, ok) to the actor; a failure says so on stderr.
template <class Done>
void report_job(KvInbox& results, const kv_receiver_actor& me, uint64_t id, Result<KvReceived> got,
                const char* path) {
  const bool ok = got.ok();
  if (!ok)
    std::fprintf(stderr, "cleave: KV of request %llu %s failed (%s); using the socket\n",
                 static_cast<unsigned long long>(id), path, got.status().to_string().c_str());
  results.put(id, std::move(got));
  caf::anon_send(me, Done::value, id, ok);
}

// Both engines on devices that link (NCCL), shared memory out of reach: the
// blocks over the pair's device link into this engine's device memory,
// received and checked on the link's thread. A sender that cannot (not on
// a device, no links) answers unsupported and the data socket follows, as
// it does on any failure (the link is then closed on both ends).
void pull_via_link(kv_receiver_pointer self, uint64_t id) {
  auto& s = self->state;
  auto* t = transfer_of(self, id);
  if (!t) return;
  if (!s.shared_memory || !s.device) return pull_via_socket(self, id);
  const std::string sender = caf::to_string(t->from.address());
  self->request(caf::actor_cast<kv_sender_actor>(t->from), kKvTimeout, kv_link_atom::value, t->pull_bytes,
                caf::to_string(self->address()))
      .then(
          [=](const std::string& link_id, const Bytes& offer_bytes) {
            auto& s = self->state;
            auto* t = transfer_of(self, id);
            if (!t) return;
            if (link_id.empty()) return end_transfer_records(self, id, std::vector<BlockRecord>{});
            auto offer = codec::decode_as<msg::KvChunk>(offer_bytes);
            std::shared_ptr<KvLinkEnd>& end = s.links[sender];
            if (end && end->id() != link_id) retire(*s.socket_jobs, std::move(end));  // the sender made a new one
            if (!offer.ok()) return link_failed(self, id);  // the sender's send meets no recv
            if (!end) end = std::make_shared<KvLinkEnd>(s.device, link_id, 1);
            auto results = s.socket_results;
            auto counters = s.counters;
            auto device = s.device;
            auto me = caf::actor_cast<kv_receiver_actor>(self);
            const msg::KvPull p = t->pull;
            end->run([=, o = std::move(offer.value())](DeviceLink* link, const Status& opened) {
              Result<KvReceived> got = opened;
              if (link) {
                auto blocks = recv_kv_link(*link, device, o, p, kKvMaxStreamBytes, *counters);
                got = blocks.ok() ? Result<KvReceived>(KvReceived{{}, std::move(blocks.value())})
                                  : Result<KvReceived>(blocks.status());
              }
              report_job<kv_link_done_atom>(*results, me, id, std::move(got), "over a device link");
            });
          },
          [=](caf::error& e) {
            // unsupported: a sender not on a device, or without links.
            if (from_error(e).code() == Code::unsupported) return pull_via_socket(self, id);
            end_transfer(self, id, from_error(e));
          });
}

// A sender on this host: the blocks through shared memory, copied out on a
// thread of ours; whatever fails there goes to the data socket. Another
// host, or a sender that does not share: a device link, else the socket.
void pull_via_shared(kv_receiver_pointer self, uint64_t id) {
  auto& s = self->state;
  auto* t = transfer_of(self, id);
  if (!t) return;
  if (!s.shared_memory || kv_host_identity().empty()) return pull_via_link(self, id);
  self->request(caf::actor_cast<kv_sender_actor>(t->from), kKvTimeout, kv_shared_atom::value, t->pull_bytes,
                kv_host_identity())
      .then(
          [=](const std::string& handle, const Bytes& offer_bytes) {
            auto& s = self->state;
            auto* t = transfer_of(self, id);
            if (!t) return;
            if (handle.empty()) return end_transfer_records(self, id, std::vector<BlockRecord>{});
            auto offer = codec::decode_as<msg::KvChunk>(offer_bytes);
            if (!offer.ok()) {
              self->send(caf::actor_cast<kv_sender_actor>(t->from), kv_shared_done_atom::value, id, false);
              ++s.counters->shared_fallbacks;
              return pull_via_socket(self, id);
            }
            if (!s.shared_maps)
              s.shared_maps = std::make_shared<KvSharedMappings>(
                  s.device ? s.device : std::shared_ptr<Backend>(make_cpu_backend(1)));
            auto results = s.socket_results;
            auto counters = s.counters;
            auto maps = s.shared_maps;
            auto device = s.device;
            auto me = caf::actor_cast<kv_receiver_actor>(self);
            const msg::KvPull p = t->pull;
            s.socket_jobs->run([=, o = std::move(offer.value())] {
              report_job<kv_shared_done_atom>(*results, me, id, fetch_shared(*maps, device, handle, o, p, *counters),
                                              "through shared memory");
            });
          },
          [=](caf::error& e) {
            // unsupported: another host, or a sender that does not share.
            if (from_error(e).code() == Code::unsupported) return pull_via_link(self, id);
            end_transfer(self, id, from_error(e));
          });
}

kv_receiver_actor::behavior_type kv_receiver_fn(kv_receiver_pointer self,
                                                std::shared_ptr<KvInbox> inbox,
                                                std::shared_ptr<KvStreamCounters> counters,
                                                bool shared_memory, std::shared_ptr<Backend> device) {
  self->state.device = std::move(device);
  self->state.inbox = std::move(inbox);
  self->state.counters = std::move(counters);
  self->state.socket_results = std::make_shared<KvInbox>();
  self->state.shared_memory = shared_memory;
  self->set_down_handler([=](caf::down_msg& dm) {
    end_transfers_from(self, dm.source.node(), dm.source.id(), Status(Code::unavailable, "the KV sender went down"));
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
        t.from = from;
        t.pull_bytes = bytes;
        t.pull = pull.value();
        t.done = self->make_response_promise<bool>();
        t.last_progress = Clock::now();
        auto done = t.done;
        s.transfers.emplace(id, std::move(t));
        self->monitor(from);
        if (from.node() == self->node()) {  // in process: chunks over CAF
          pull_chunks(self, id);
          return done;
        }
        // First a middleman connection of our own to the sender's node
        // (once per node): without it CAF routes through the head, and a
        // dead prefill node would show up only at the stall timeout, since
        // CAF 0.17 does not pass on that a node reached through another is
        // gone. Failing the connect, through the head all the same.
        const size_t colon = address.rfind(':');
        if (s.connected.count(address) || colon == std::string::npos) {
          pull_via_shared(self, id);
        } else {
          const int port = std::atoi(address.c_str() + colon + 1);
          self->request(self->system().middleman().actor_handle(), kKvTimeout, caf::connect_atom::value,
                        address.substr(0, colon), uint16_t(port))
              .then(
                  [=](const caf::node_id&, const caf::strong_actor_ptr&, const std::set<std::string>&) {
                    self->state.connected.insert(address);
                    pull_via_shared(self, id);
                  },
                  [=](caf::error&) { pull_via_shared(self, id); });
        }
        return done;
      },
      [=](kv_chunk_atom, const Bytes& bytes) -> caf::result<uint32_t> {
        auto& s = self->state;
        auto chunk = codec::decode_as<msg::KvChunk>(bytes);
        if (!chunk.ok()) {
          // Unreadable: end whatever this sender streams to us.
          ++s.counters->chunks_rejected;
          const auto from = caf::actor_cast<caf::actor_addr>(self->current_sender());
          end_transfers_from(self, from.node(), from.id(),
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
        if (a.complete()) end_transfer_records(self, id, a.take());
        return chunk->seq;
      },
      [=](kv_done_atom, uint64_t id) {
        // A transfer ended meanwhile (its sender went down) is gone: end_transfer ignores it.
        end_transfer(self, id, self->state.socket_results->take_received(id));
      },
      [=](kv_shared_done_atom, uint64_t id, bool ok) {
        auto& s = self->state;
        auto result = s.socket_results->take_received(id);
        auto* t = transfer_of(self, id);
        if (!t) {
          if (result.ok()) block_buffer_pool().release(result->records);
          return;
        }
        // The sender frees the region either way; not ok, it keeps the KV for the socket.
        self->send(caf::actor_cast<kv_sender_actor>(t->from), kv_shared_done_atom::value, id, ok);
        if (!ok) {
          ++s.counters->shared_fallbacks;
          return pull_via_socket(self, id);
        }
        ++s.counters->shared_received;
        end_transfer(self, id, std::move(result));
      },
      [=](kv_link_done_atom, uint64_t id, bool ok) {
        auto& s = self->state;
        auto result = s.socket_results->take_received(id);
        auto* t = transfer_of(self, id);
        if (!t) return;  // ended meanwhile (its sender went down)
        if (!ok) return link_failed(self, id);
        self->send(caf::actor_cast<kv_sender_actor>(t->from), kv_link_done_atom::value, id, true);
        ++s.counters->link_received;
        end_transfer(self, id, std::move(result));
      },
      [=](tick_atom) {
        const auto now = Clock::now();
        std::vector<uint64_t> stalled;
        for (auto& [id, t] : self->state.transfers)
          if (t.watched && now - t.last_progress > kKvStallTimeout) stalled.push_back(id);
        for (uint64_t id : stalled)
          end_transfer(self, id, Status(Code::timed_out, "the KV stream of request " +
                                                             std::to_string(id) + " stalled"));
        self->delayed_send(caf::actor_cast<kv_receiver_actor>(self), kTickInterval,
                           tick_atom::value);
      },
      [=](kv_sender_down_atom, const caf::node_id& node, uint64_t actor) {
        end_transfers_from(self, node, actor,
                           Status(Code::unavailable, "the KV sender's stage is gone (the router lost it)"));
      },
  };
}

}  // namespace

kv_sender_actor spawn_kv_sender_linked(caf::local_actor* stage, std::shared_ptr<KvOutbox> outbox,
                                       std::shared_ptr<KvStreamCounters> counters,
                                       int32_t corrupt_chunk, std::string host, bool shared_memory,
                                       std::shared_ptr<Backend> device) {
  return stage->spawn<caf::linked>(kv_sender_fn, std::move(outbox), std::move(counters), corrupt_chunk,
                                   std::move(host), shared_memory, std::move(device));
}

kv_receiver_actor spawn_kv_receiver_linked(caf::local_actor* stage, std::shared_ptr<KvInbox> inbox,
                                           std::shared_ptr<KvStreamCounters> counters, bool shared_memory,
                                           std::shared_ptr<Backend> device) {
  return stage->spawn<caf::linked>(kv_receiver_fn, std::move(inbox), std::move(counters), shared_memory,
                                   std::move(device));
}

}  // namespace cleave::actors

namespace cleave {

using namespace actors;

Status serve_kv_sender(KvOutbox::Kept kv, int32_t n_streams, const std::string& host,
                       const std::function<void(uint16_t)>& on_port, double timeout_s, bool shared_memory,
                       std::shared_ptr<Backend> device) {
  caf::actor_system_config config;
  configure_node(config, ClusterSpec{}, 0);  // as a node's, with default heartbeats
  caf::actor_system system{config};
  auto outbox = std::make_shared<KvOutbox>();
  for (int32_t i = 1; i <= n_streams; ++i) {
    if (kv.blocks) outbox->put(uint64_t(i), kv.blocks);
    else outbox->put(uint64_t(i), kv.records);
  }
  auto counters = std::make_shared<KvStreamCounters>();
  auto sender = system.spawn(kv_sender_fn, outbox, counters, int32_t(-1), host, shared_memory, std::move(device));
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

Result<std::vector<KvPullTiming>> pull_kv_streams(const std::string& host, uint16_t port, int32_t n_streams,
                                                  uint32_t chunk_bytes, int32_t window,
                                                  const std::function<void(const KvReceived&)>& sink,
                                                  bool shared_memory, std::shared_ptr<Backend> device) {
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
  auto receiver = system.spawn(kv_receiver_fn, inbox, counters, shared_memory, std::move(device));
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
    auto got = inbox->take_received(uint64_t(i));
    if (st.ok() && !complete) st = got.ok() ? Status(Code::aborted, "stream failed") : got.status();
    if (!st.ok()) break;
    out.push_back(KvPullTiming{seconds, counters->bytes_received - bytes_before});
    sink(got.value());
    block_buffer_pool().release(got->records);  // as a decoder's scheduler does
  }
  caf::anon_send_exit(receiver, caf::exit_reason::user_shutdown);
  if (!st.ok()) return st;
  return out;
}

}  // namespace cleave
