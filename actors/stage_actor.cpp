// Stage actors: prefill, decode or colocated over a StageCore. They run
// detached (Engine::forward blocks) and drive their scheduler with step
// messages to themselves, so every other message is handled between two
// forward passes.
#include "actors/actor_types.h"

#include <unordered_set>

#include "actors/stage_core.h"
#include "schema/codec.h"

namespace cleave::actors {
namespace {

struct StageState {
  std::shared_ptr<StageCore> core;
  ActorKind kind = ActorKind::colocated;
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
  uint64_t pool_lookups = 0, pool_blocks_got = 0;
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
//
// A device engine's KV stays in its memory for the decoder's pull (device
// to device on one host); the store's copy is downloaded after the handoff
// went out.
void publish_handoff(stage_pointer self, SchedulerEvent&& e) {
  auto& s = self->state;
  msg::Handoff h;
  h.request = std::move(e.request);
  h.generated = std::move(e.generated);
  h.n_kv_tokens = e.n_kv_tokens;
  if (e.backend_blocks)
    for (const BlockHeader& b : e.backend_blocks->headers()) h.kv_keys.push_back(b.key);
  for (const BlockRecord& r : e.blocks) h.kv_keys.push_back(r.header.key);
  if (s.sender) h.kv_source = s.stream.node_address;
  Bytes handoff = codec::encode(h);
  ++s.handoffs;
  if (h.kv_keys.empty()) {
    self->send(s.router, handoff_atom::value, std::move(handoff));
    return;
  }
  msg::KvPut put;
  const bool direct = bool(s.sender);
  if (direct) {
    // The decoder pulls from the outbox; the store's copy (for a
    // re-placement) goes at the same time and delays nothing.
    if (e.backend_blocks) {
      s.outbox->put(h.request.request_id, e.backend_blocks);
      self->send(s.router, handoff_atom::value, handoff, s.sender);
    } else {
      auto records = std::make_shared<const std::vector<BlockRecord>>(std::move(e.blocks));
      s.outbox->put(h.request.request_id, records);
      self->send(s.router, handoff_atom::value, handoff, s.sender);
      put.blocks = *records;
    }
  } else {
    put.blocks = std::move(e.blocks);
  }
  if (e.backend_blocks) {
    auto records = e.backend_blocks->to_records();
    if (records.ok()) put.blocks = std::move(records.value());
    else ++s.kv_errors;  // the store lacks them: a re-placement recomputes
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
  if (!st.ok() && s.core->engine().pipeline_broken()) {
    // A stage of its pipeline failed: the requests are not failed here but
    // re-placed by the router, which sees this actor go down.
    self->quit(to_error(st));
    return;
  }
  const double step_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The store hears of the new blocks before anyone hears of the finish, so
  // in a KV pool a request that follows a finished one can find its prefix.
  if (s.persist) persist_new_blocks(self);
  for (SchedulerEvent& e : events) {
    if (e.kind == SchedulerEvent::Kind::handoff) {
      publish_handoff(self, std::move(e));
      continue;
    }
    msg::StreamEvent m = to_stream_event(e, s.core->name());
    m.stage_seconds = step_seconds;
    send_event(self, m);
  }
  kick(self);
}

// blocks hold KV from block first_block on; this engine caches the ones
// before. They are host records, or in the engine's backend memory.
void finish_resume(stage_pointer self, std::shared_ptr<msg::Handoff> h, KvReceived blocks,
                   int32_t first_block) {
  auto& s = self->state;
  const uint64_t id = h->request.request_id;
  if (s.awaiting_kv.erase(id) == 0) return;  // cancelled meanwhile
  Status st = blocks.blocks ? s.core->resume_from_backend(std::move(h->request), std::move(h->generated),
                                             std::shared_ptr<const BackendBlocks>(std::move(blocks.blocks)),
                                             first_block)
                            : s.core->resume(std::move(h->request), std::move(h->generated),
                                             std::move(blocks.records), first_block);
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
                          KvReceived{blocks.ok() ? std::move(blocks->blocks) : std::vector<BlockRecord>{}, nullptr},
                          first_block);
          },
          [=](caf::error&) {
            ++self->state.kv_errors;
            finish_resume(self, h, {}, first_block);  // recompute what is not cached
          });
}

// A new request in a KV pool: the prompt's leading blocks after the ones
// this engine caches come from the store (its own tiers, then the pool's
// other stores) and are imported like a hand-off's; the rest is computed.
// What the store lacks or fails to verify costs a recompute, never tokens.
caf::result<bool> submit_with_pool(stage_pointer self, GenerateRequest request) {
  auto& s = self->state;
  Status valid = s.core->check_request(request);
  if (!valid.ok()) return to_error(valid);
  std::vector<BlockKey> keys = s.core->resume_keys(request, {});
  const int32_t first = s.core->engine().cached_leading_blocks(keys);
  ++s.requests;
  if (size_t(first) >= keys.size()) {
    Status st = s.core->submit(std::move(request));
    if (!st.ok()) return to_error(st);
    kick(self);
    return true;
  }
  ++s.pool_lookups;
  const uint64_t id = request.request_id;
  s.awaiting_kv.insert(id);
  msg::KvGet get;
  get.keys.assign(keys.begin() + first, keys.end());
  auto r = std::make_shared<GenerateRequest>(std::move(request));
  auto run = [=](std::vector<BlockRecord> blocks) {
    auto& s = self->state;
    if (s.awaiting_kv.erase(id) == 0) return;  // cancelled meanwhile
    s.pool_blocks_got += blocks.size();
    Status st = blocks.empty() ? s.core->submit(std::move(*r))
                               : s.core->resume(std::move(*r), {}, std::move(blocks), first);
    if (!st.ok()) fail_request(self, id, st);
    kick(self);
  };
  self->request(s.kv, kKvTimeout, kv_get_atom::value, codec::encode(get))
      .then(
          [=](const Bytes& reply) {
            auto blocks = codec::decode_as<msg::KvBlocks>(reply);
            if (!blocks.ok()) ++self->state.kv_errors;
            run(blocks.ok() ? std::move(blocks->blocks) : std::vector<BlockRecord>{});
          },
          [=](caf::error&) {
            ++self->state.kv_errors;
            run({});
          });
  return true;
}

// The engine's backend when its KV moves in device memory (a GPU engine
// holding every layer), else null.
std::shared_ptr<Backend> device_of(StageCore& core) {
  return core.engine().kv_in_backend() ? core.engine().shared_backend() : nullptr;
}

// A handed-off request: the decoder skips the leading blocks its prefix
// cache holds (incremental), streams the rest from the prefill's kv_sender
// when there is one, else (or when the stream fails) reads the store.
// The stream ends its kind needs (kept when it switches roles: pulls of KV
// it handed off before still find its sender).
void spawn_kv_ends(stage_pointer self) {
  auto& s = self->state;
  if (s.stream.direct && s.kind == ActorKind::prefill && !s.sender) {
    s.outbox = std::make_shared<KvOutbox>();
    // The data socket listens on the node's host (in-process pipelines have none: CAF only).
    const size_t colon = s.stream.node_address.rfind(':');
    s.sender = spawn_kv_sender_linked(
        self, s.outbox, s.stream_counters, s.stream.fault_corrupt_chunk,
        colon == std::string::npos ? std::string() : s.stream.node_address.substr(0, colon),
        s.stream.shared_memory, device_of(*s.core));
  } else if (s.kind != ActorKind::prefill && !s.receiver) {
    s.inbox = std::make_shared<KvInbox>();
    s.receiver = spawn_kv_receiver_linked(self, s.inbox, s.stream_counters, s.stream.shared_memory,
                                          device_of(*s.core));
  }
}

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
    finish_resume(self, h, KvReceived{std::move(blocks), nullptr}, 0);
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
            auto blocks = self->state.inbox->take_received(id);
            if (!complete || !blocks.ok()) return on_failure(keys);
            finish_resume(self, h, std::move(blocks.value()), first);
          },
          [=](caf::error&) { on_failure(keys); });
  return true;
}

stage_actor::behavior_type stage_fn(stage_pointer self, std::shared_ptr<StageCore> core,
                                    ActorKind kind, router_actor router, kv_store_actor kv,
                                    KvStreamOptions stream, std::vector<caf::actor> pipeline) {
  auto& s = self->state;
  // Its pipeline's stages live and die with it: one that goes down takes
  // this actor down (its requests are re-placed), and its exit ends them.
  for (const caf::actor& p : pipeline) self->link_to(p);
  s.core = std::move(core);
  s.kind = kind;
  s.router = std::move(router);
  s.kv = std::move(kv);
  // Decoders keep the store current for re-placement; a prefill hands its KV off.
  s.persist = kind != ActorKind::prefill;
  if (s.persist) s.core->keep_finished_blocks();
  s.stream = stream;
  spawn_kv_ends(self);
  // The router places by what this stage's store holds and preloads there.
  if (stream.pool) self->send(s.router, stage_store_atom::value, caf::actor_cast<stage_actor>(self), s.kv);
  return {
      [=](submit_atom, const Bytes& bytes) -> caf::result<bool> {
        auto& s = self->state;
        auto request = codec::decode_as<GenerateRequest>(bytes);
        if (!request.ok()) {
          ++s.bad_messages;
          return to_error(request.status());
        }
        if (s.stream.pool) return submit_with_pool(self, std::move(request.value()));
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
      [=](kv_sender_down_atom, const caf::node_id& node, uint64_t actor) {
        if (self->state.receiver) self->send(self->state.receiver, kv_sender_down_atom::value, node, actor);
      },
      [=](role_atom, const std::string& role) -> caf::result<bool> {
        auto& s = self->state;
        const bool to_prefill = role == "prefill";
        if ((!to_prefill && role != "decode") || (s.kind != ActorKind::prefill && s.kind != ActorKind::decode))
          return to_error(Status(Code::invalid_argument, s.core->name() + ": cannot switch a " +
                                                             actor_kind_info(s.kind).name + " stage to '" +
                                                             role.substr(0, 32) + "'"));
        if (!s.awaiting_kv.empty())
          return to_error(Status(Code::invalid_argument, s.core->name() + ": cannot switch roles with " +
                                                             std::to_string(s.awaiting_kv.size()) +
                                                             " hand-offs waiting for their KV"));
        if (Status st = s.core->set_prefill_only(to_prefill); !st.ok()) return to_error(st);
        s.kind = to_prefill ? ActorKind::prefill : ActorKind::decode;
        s.persist = !to_prefill;
        spawn_kv_ends(self);  // a sender for a new prefill, a receiver for a new decoder
        return true;
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
                            {"pool_lookups", s.pool_lookups},
                            {"pool_blocks_got", s.pool_blocks_got},
                            {"kv_blocks_moved", s.kv_blocks_put + s.kv_blocks_got}});
        for (auto& c : s.stream_counters->snapshot()) st.counters.push_back(std::move(c));
        return codec::encode(st);
      },
  };
}

}  // namespace

stage_actor spawn_stage(caf::actor_system& system, std::shared_ptr<StageCore> core, ActorKind kind,
                        router_actor router, kv_store_actor kv, KvStreamOptions stream,
                        std::vector<caf::actor> pipeline) {
  return system.spawn<caf::detached>(stage_fn, std::move(core), kind, std::move(router), std::move(kv),
                                     std::move(stream), std::move(pipeline));
}

}  // namespace cleave::actors
