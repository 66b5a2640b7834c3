// Private to actors/*.cpp (it includes CAF): the typed-actor interfaces,
// atoms, timeouts and Status <-> caf::error conversion every actor file
// shares, and the spawn functions of each actor kind (one file each).
// Public headers never include this one.
//
// Messages are (atom, Cap'n Proto bytes) (schema/codec.h). Behaviours
// unpack the bytes, call the plain class their state owns (StageCore,
// TieredStore, VisionEncoder, PlacementPolicy), and turn Status into
// caf::error (category "cleave", the Code as error code, the message as
// context) or into stream events.
//
//   client --submit--> router --submit/handoff--> stage (prefill | decode | colocated)
//   a request whose images lack embeddings goes first: router --encode-->
//   vision_encoder, whose reply (the embeddings) the router puts into the
//   request before it goes on to a stage
//   stage --event--> router (token / finished / failed) --> client callback
//   prefill --handoff (+ its kv_sender)--> router --handoff--> decode, and
//   prefill --kv_put--> kv_store at the same time (the copy for re-placement)
//   decode --kv_fetch--> its kv_receiver --kv_pull--> the prefill's kv_sender
//   kv_sender --kv_chunk (acked, a bounded window in flight)--> kv_receiver
//   decode resumes from the streamed blocks (or, when the stream fails, from
//   --kv_get--> kv_store); --kv_put--> newly filled blocks
#pragma once

#include <caf/all.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "actors/actor_kind.h"
#include "actors/kv_stream.h"
#include "actors/pd_controller.h"
#include "actors/scale_controller.h"
#include "actors/placement.h"
#include "model/scheduling_policy.h"
#include "common/status.h"
#include "frontend/frontend.h"
#include "storage/kv_pool_index.h"

namespace cleave {

class StageCore;
class TieredStore;
class VisionEncoder;
class ExpertHost;
class LayerStage;
class EventSinks;
struct ClusterSpec;

namespace actors {

using Bytes = std::vector<char>;
using Clock = std::chrono::steady_clock;

using submit_atom = caf::atom_constant<caf::atom("submit")>;
using handoff_atom = caf::atom_constant<caf::atom("handoff")>;
using cancel_atom = caf::atom_constant<caf::atom("cancel")>;
using resume_atom = caf::atom_constant<caf::atom("resume")>;
using step_atom = caf::atom_constant<caf::atom("step")>;
using stats_atom = caf::atom_constant<caf::atom("stats")>;
using event_atom = caf::atom_constant<caf::atom("event")>;
using kv_put_atom = caf::atom_constant<caf::atom("kv_put")>;
using kv_get_atom = caf::atom_constant<caf::atom("kv_get")>;
using tick_atom = caf::atom_constant<caf::atom("tick")>;
using attach_atom = caf::atom_constant<caf::atom("attach")>;
using shutdown_atom = caf::atom_constant<caf::atom("shutdown")>;
using stage_list_atom = caf::atom_constant<caf::atom("stagelist")>;
using kv_pull_atom = caf::atom_constant<caf::atom("kv_pull")>;
using kv_chunk_atom = caf::atom_constant<caf::atom("kv_chunk")>;
using kv_fetch_atom = caf::atom_constant<caf::atom("kv_fetch")>;
using encode_atom = caf::atom_constant<caf::atom("encode")>;
using kv_socket_atom = caf::atom_constant<caf::atom("kv_socket")>;
using kv_done_atom = caf::atom_constant<caf::atom("kv_done")>;
using kv_shared_atom = caf::atom_constant<caf::atom("kv_shared")>;
using kv_shared_done_atom = caf::atom_constant<caf::atom("kv_shdone")>;
using kv_link_atom = caf::atom_constant<caf::atom("kv_link")>;
using kv_link_done_atom = caf::atom_constant<caf::atom("kv_lkdone")>;
using kv_sender_down_atom = caf::atom_constant<caf::atom("kv_sdown")>;
using join_atom = caf::atom_constant<caf::atom("join")>;
using expert_atom = caf::atom_constant<caf::atom("expert")>;
using expert_host_atom = caf::atom_constant<caf::atom("exhost")>;
using expert_watch_atom = caf::atom_constant<caf::atom("exwatch")>;
using expert_add_atom = caf::atom_constant<caf::atom("exadd")>;
using layers_atom = caf::atom_constant<caf::atom("layers")>;
using layers_out_atom = caf::atom_constant<caf::atom("layersout")>;
using layers_err_atom = caf::atom_constant<caf::atom("layerserr")>;
using stage_kv_atom = caf::atom_constant<caf::atom("stagekv")>;
using next_atom = caf::atom_constant<caf::atom("next")>;
using stage_find_atom = caf::atom_constant<caf::atom("stagefind")>;
using stage_watch_atom = caf::atom_constant<caf::atom("stagewatch")>;
using stage_down_atom = caf::atom_constant<caf::atom("stagedown")>;
using pool_join_atom = caf::atom_constant<caf::atom("pooljoin")>;
using pool_add_atom = caf::atom_constant<caf::atom("pooladd")>;
using pool_gone_atom = caf::atom_constant<caf::atom("poolgone")>;
using pool_find_atom = caf::atom_constant<caf::atom("poolfind")>;
using peer_get_atom = caf::atom_constant<caf::atom("peerget")>;
using peer_offer_atom = caf::atom_constant<caf::atom("peeroffer")>;
using peer_done_atom = caf::atom_constant<caf::atom("peerdone")>;
using kv_preload_atom = caf::atom_constant<caf::atom("kvpreload")>;
using stage_store_atom = caf::atom_constant<caf::atom("stagestore")>;
using drain_atom = caf::atom_constant<caf::atom("drain")>;
using role_atom = caf::atom_constant<caf::atom("role")>;
using drain_watch_atom = caf::atom_constant<caf::atom("drainwatch")>;
using topology_atom = caf::atom_constant<caf::atom("topology")>;

// Timeouts of every request between actors: nothing waits forever.
constexpr auto kKvTimeout = std::chrono::seconds(10);
constexpr auto kStageTimeout = std::chrono::seconds(30);
constexpr auto kClientTimeout = std::chrono::seconds(10);
// An expert actor's answer to one layer's batch: past this the actor is
// dropped and its pieces computed elsewhere.
constexpr auto kExpertTimeout = std::chrono::seconds(5);
constexpr auto kJoinTimeout = std::chrono::seconds(10);
// A pipeline micro-batch's answer from the last stage, and a stage's KV
// call: the last guard (a stage that goes down is noticed at once).
constexpr auto kPipelineTimeout = std::chrono::seconds(60);
constexpr auto kTickInterval = std::chrono::milliseconds(200);
// KV streams: a stream that makes no progress this long fails (the decoder
// then reads the store); a whole fetch is bounded too; a prefill keeps a
// finished request's KV for its decoder's pull this long.
constexpr auto kKvStallTimeout = std::chrono::seconds(5);
constexpr auto kKvFetchTimeout = std::chrono::seconds(30);
constexpr auto kKvOutboxTtl = std::chrono::seconds(30);
constexpr auto kKvOutboxSweep = std::chrono::seconds(1);
constexpr uint64_t kKvMaxStreamBytes = uint64_t(1) << 30;

// A node's KV store (kv_store_actor.cpp). kv_put: KvPut -> KvAck. kv_get:
// KvGet -> KvBlocks, the longest leading run of the keys from its own tiers
// and then, in a pool, from the other stores that hold them (the pool
// index's holders, the longest run and the nearest first; each record
// verified where it lands). kv_preload (KvGet): the same, kept in its own
// tiers, no answer (the router's head start for the stage it placed a
// request on). peer_get (KvGet -> KvBlocks): its own tiers only, for
// another store. peer_offer (KvGet -> data socket address, token, stream
// id; "" when it holds none of them): the same blocks offered on the
// store's KV data socket, for a store in another process (unsupported
// without a socket: then peer_get); peer_done (stream id): internal, a
// socket read finished. The head's store is also the pool's directory: pool_join
// (a store and the KvGet of every key it holds), pool_add / pool_gone (a
// store's new and dropped keys) keep the index; pool_find (KvGet) answers
// the stores other than the asker that hold a leading run of the keys,
// the longest first, then those on the asker's node.
using kv_store_actor = caf::typed_actor<caf::replies_to<kv_put_atom, Bytes>::with<Bytes>,
                                        caf::replies_to<kv_get_atom, Bytes>::with<Bytes>,
                                        caf::reacts_to<kv_preload_atom, Bytes>,
                                        caf::replies_to<peer_get_atom, Bytes>::with<Bytes>,
                                        caf::replies_to<peer_offer_atom, Bytes>::with<std::string, std::string, uint64_t>,
                                        caf::reacts_to<peer_done_atom, uint64_t>,
                                        caf::replies_to<pool_join_atom, caf::actor, Bytes>::with<bool>,
                                        caf::reacts_to<pool_add_atom, caf::actor, Bytes>,
                                        caf::reacts_to<pool_gone_atom, caf::actor, Bytes>,
                                        caf::replies_to<pool_find_atom, Bytes>::with<std::vector<caf::actor>>,
                                        caf::replies_to<stats_atom>::with<Bytes>>;

// A store's name in the pool index (unique in the cluster).
inline std::string pool_holder_name(const caf::actor_addr& store) { return caf::to_string(store); }

// A decode stage's end of KV streams. fetch (from its stage: a KvPull, the
// prefill's kv_sender and the "host:port" its node listens on) answers once
// the stream is complete and in the stage's KvInbox (true) or has failed
// (false, or an error: the stage reads the store instead); chunk (from the
// sender) answers the chunk's seq: the ack that lets the sender send
// another. kv_done (from its own socket thread): the stream of that request
// on the data socket ended (the outcome waits in the socket results);
// kv_shared_done (id, ok): its copy out of shared memory ended (ok: the
// records wait there too; not ok: the data socket next); kv_link_done
// (id, ok) likewise for a receive over a device link. kv_sender_down (the
// sender's node and actor id, from its stage as the router tells it): that
// sender is gone, so its streams end now (a sender reached only through the
// head, or one that died mid-handshake, never sends this receiver a down
// message). Plain ids, not an address: deserialising the address of a dead
// node's actor makes CAF reach for that node.
using kv_receiver_actor =
    caf::typed_actor<caf::replies_to<kv_fetch_atom, Bytes, caf::actor, std::string>::with<bool>,
                     caf::replies_to<kv_chunk_atom, Bytes>::with<uint32_t>,
                     caf::reacts_to<kv_done_atom, uint64_t>, caf::reacts_to<kv_shared_done_atom, uint64_t, bool>,
                     caf::reacts_to<kv_link_done_atom, uint64_t, bool>, caf::reacts_to<tick_atom>,
                     caf::reacts_to<kv_sender_down_atom, caf::node_id, uint64_t>>;

// A prefill stage's end: pull (KvPull, where to send) answers the number of
// chunks and streams them to the receiver over CAF; socket (KvPull) offers
// the stream on the sender's data socket (actors/kv_socket.h) and answers
// its "host:port" and the stream's token ("" when there is nothing to send);
// shared (KvPull, the receiver's kv_host_identity()) copies the blocks into
// shared memory (actors/kv_shared.h) and answers the region's handle and
// the offer (a KvChunk with the headers, no data; "" and empty when there is
// nothing to send), unsupported for a receiver on another host or a sender
// that does not share; kv_shared_done (id, ok) from the receiver frees the
// region (ok: the stream is done). link (KvPull, the receiver's name) sends
// the blocks over the device link of that receiver (actors/kv_link.h; made
// at its first stream) and answers the link's id and the offer ("" and
// empty when there is nothing to send), unsupported unless the blocks are
// in this sender's device memory and the device links; kv_link_done (id,
// ok) from the receiver (or from the link's own thread, not ok) ends it
// (not ok: the link is closed, the data socket follows).
using kv_sender_actor =
    caf::typed_actor<caf::replies_to<kv_pull_atom, Bytes, kv_receiver_actor>::with<uint32_t>,
                     caf::replies_to<kv_socket_atom, Bytes>::with<std::string, std::string>,
                     caf::replies_to<kv_shared_atom, Bytes, std::string>::with<std::string, Bytes>,
                     caf::reacts_to<kv_shared_done_atom, uint64_t, bool>,
                     caf::replies_to<kv_link_atom, Bytes, std::string>::with<std::string, Bytes>,
                     caf::reacts_to<kv_link_done_atom, uint64_t, bool>, caf::reacts_to<tick_atom>>;

// submit: GenerateRequest; handoff: Handoff, with the kv_sender to pull the
// KV from or without (then from the store) (the answer is admission only;
// the outcome arrives as events). role: "prefill" or "decode", a prefill or
// decode stage switching roles once the router drained it (invalid_argument
// while work remains, or for another kind). kv_sender_down: the router lost
// the stage of that kv_sender; the stage tells its kv_receiver.
using stage_actor = caf::typed_actor<caf::replies_to<submit_atom, Bytes>::with<bool>,
                                     caf::replies_to<handoff_atom, Bytes>::with<bool>,
                                     caf::replies_to<handoff_atom, Bytes, kv_sender_actor>::with<bool>,
                                     caf::reacts_to<cancel_atom, uint64_t>,
                                     caf::reacts_to<kv_sender_down_atom, caf::node_id, uint64_t>,
                                     caf::replies_to<role_atom, std::string>::with<bool>,
                                     caf::reacts_to<step_atom>,
                                     caf::replies_to<stats_atom>::with<Bytes>>;

// encode: EncodeRequest -> ImageEmbeddings (or a typed error for that
// request alone); requests that arrive between two steps are batched.
using vision_encoder_actor = caf::typed_actor<caf::replies_to<encode_atom, Bytes>::with<Bytes>,
                                              caf::reacts_to<step_atom>,
                                              caf::replies_to<stats_atom>::with<Bytes>>;

// expert: ExpertBatch (one layer's rows for experts this actor hosts) ->
// ExpertBatch (the same pieces, the outputs), or a typed error (an expert
// not hosted here, bad bytes). expert_add: (layer, expert) is hosted here
// from now on too (a replica added at run time), or a typed error for one
// the model lacks.
using expert_actor = caf::typed_actor<caf::replies_to<expert_atom, Bytes>::with<Bytes>,
                                      caf::replies_to<expert_add_atom, int32_t, int32_t>::with<bool>,
                                      caf::replies_to<stats_atom>::with<Bytes>>;

// A pipeline stage after the first (model/layer_stage.h). layers (ticket,
// StageBatch, reply_to): runs the micro-batch through its layers and sends
// it on to its next stage, or, the last, answers reply_to with
// (layers_out, ticket, StageBatch of the logits); any failure answers
// (layers_err, ticket, error) from the stage that failed. stage_kv (ticket,
// StageBatch kv_read / kv_write / kv_copy, reply_to): answers reply_to with
// (layers_out, ticket, StageBatch output) or (layers_err, ticket, error),
// so that the caller waits in one loop that also hears of a stage going
// down. next: the stage after it.
using pipeline_stage_actor =
    caf::typed_actor<caf::reacts_to<layers_atom, uint64_t, Bytes, caf::actor>,
                     caf::reacts_to<stage_kv_atom, uint64_t, Bytes, caf::actor>,
                     caf::replies_to<next_atom, caf::actor>::with<bool>,
                     caf::replies_to<stats_atom>::with<Bytes>>;

// submit: GenerateRequest from the client (admission); resume: a Handoff
// from the client (Frontend::resume: the request and the tokens an earlier
// run generated); event: StreamEvent and handoff: Handoff from stages;
// attach: a stage, its kind and its node's cost (cost_aware placement), or
// a vision encoder. drain: those stages take nothing new and their
// requests move to others (re-placed with their tokens, KV from the store),
// -> how many moved; unavailable when no stage of a role would be
// left. stage_store: the
// stage's node's kv_store (KV pool: placement and preloads). stage_list:
// the live stages and vision encoders attached to it, on any node (a
// cluster head's /metrics asks each for its counters).
using router_actor =
    caf::typed_actor<caf::replies_to<submit_atom, Bytes>::with<bool>,
                     caf::replies_to<resume_atom, Bytes>::with<bool>,
                     caf::reacts_to<event_atom, Bytes>, caf::reacts_to<handoff_atom, Bytes>,
                     caf::reacts_to<cancel_atom, uint64_t>,
                     caf::reacts_to<handoff_atom, Bytes, kv_sender_actor>,
                     caf::replies_to<attach_atom, std::string, stage_actor, double>::with<bool>,
                     caf::replies_to<attach_atom, std::string, vision_encoder_actor>::with<bool>,
                     caf::reacts_to<stage_store_atom, stage_actor, kv_store_actor>,
                     caf::replies_to<drain_atom, std::vector<stage_actor>>::with<uint64_t>,
                     caf::reacts_to<tick_atom>, caf::replies_to<shutdown_atom>::with<bool>,
                     caf::replies_to<stats_atom>::with<Bytes>,
                     caf::replies_to<stage_list_atom>::with<std::vector<stage_actor>,
                                                          std::vector<vision_encoder_actor>>>;

// What a head publishes (node.cpp). join: (secret, node name) -> the router
// and kv_store handles, or an error naming why the node is refused. attach:
// (secret, node name, kind, actor) -> the router's answer.
// A node's list of the cluster's expert actors (actors/expert_dispatch.h):
// host (an expert actor, its ExpertSet::spec) adds one.
using expert_directory_actor =
    caf::typed_actor<caf::reacts_to<expert_host_atom, expert_actor, std::string, std::string>>;

// The head's door. join (secret, node) -> the router and the store; attach
// (secret, node, pipeline, first, last, stage) a later pipeline stage;
// stage_find (secret, pipeline, first layer) -> that pipeline's stage from
// that layer and its last layer (not_found until it has attached);
// stage_watch (secret, pipeline, watcher): the watcher gets (stage_down,
// first layer) when a stage of that pipeline goes down (a worker's first
// stage hears of a dead stage on another worker only through the head);
// attach
// (secret, node, kind, handle) a stage, encoder or expert actor (an expert
// with its ExpertSet::spec); watch (secret, directory): the head sends the
// directory every expert actor attached so far and each one that attaches
// later; drain (secret, node): the router drains the node's stages (their
// requests move to other stages), then the node's watcher hears drain_atom
// and the node exits -> the requests moved; drain_watch (secret, node,
// watcher) names that watcher; topology (secret) -> [script name, script,
// key, value, ...]: what the head loaded, for a node that joins with --join
// HOST:PORT.
using join_actor = caf::typed_actor<
    caf::replies_to<join_atom, std::string, std::string>::with<router_actor, kv_store_actor>,
    caf::replies_to<attach_atom, std::string, std::string, std::string, stage_actor>::with<bool>,
    caf::replies_to<attach_atom, std::string, std::string, std::string,
                    vision_encoder_actor>::with<bool>,
    caf::replies_to<attach_atom, std::string, std::string, expert_actor, std::string, std::string>::with<bool>,
    caf::replies_to<expert_watch_atom, std::string, expert_directory_actor>::with<bool>,
    caf::replies_to<attach_atom, std::string, std::string, std::string, int32_t, int32_t,
                    pipeline_stage_actor>::with<bool>,
    caf::replies_to<stage_find_atom, std::string, std::string, int32_t>::with<pipeline_stage_actor, int32_t>,
    caf::replies_to<stage_watch_atom, std::string, std::string, caf::actor>::with<bool>,
    caf::replies_to<drain_atom, std::string, std::string>::with<uint64_t>,
    caf::replies_to<drain_watch_atom, std::string, std::string, caf::actor>::with<bool>,
    caf::replies_to<topology_atom, std::string>::with<std::vector<std::string>>>;

// ---- Status <-> caf::error (actor_set.cpp) ----
caf::error to_error(const Status& st);
Status from_error(const caf::error& e);
// A request that went to an actor that is gone: its down message re-places it.
bool is_receiver_down(const caf::error& e);
Bytes encode_stats(std::string actor, std::vector<std::pair<std::string, uint64_t>> counters);

// ---- actor systems (actor_set.cpp) ----
// Scheduler workers (0: CAF's default) that poll briefly, then sleep: the
// default polling steals the cores the engines' parallel steps wait on.
void configure_workers(caf::actor_system_config& config, int32_t threads);
// A node's: configure_workers, the middleman, heartbeats from the spec and
// the handle types that cross the wire, the same on every node.
void configure_node(caf::actor_system_config& config, const ClusterSpec& spec, int32_t threads);

// ---- one spawn function per kind, each in its own file ----

// kv_store_actor.cpp: a TieredStore behind KvPut -> KvAck, KvGet -> KvBlocks.
// With an index it is the pool's directory (the head's); with a directory
// it joins that one's pool (a worker's); with neither it stands alone.
struct KvStoreRole {
  std::shared_ptr<KvPoolIndex> index;
  kv_store_actor directory;
  // A block fetched from another store this many times for this node's
  // stages is kept here too (a replica of a hot prefix; the LRU drops it
  // like any block). Preloaded blocks are always kept.
  int32_t replicate_reads = 2;
  bool fault_corrupt_served = false;  // tests: flip a byte of every block served to another store
  bool fault_stale_index = false;     // tests: never tell the index what left this store
  // Where this store's KV data socket listens for stores in other
  // processes (the node's host; "": its blocks go to them as CAF messages).
  std::string data_host;
};
kv_store_actor spawn_kv_store(caf::actor_system& system, std::shared_ptr<TieredStore> store,
                              KvStoreRole role = {});

// kv_stream_actors.cpp: the two ends of KV streams, linked to their stage.
// host: where the sender's data socket listens ("": CAF chunks only).
// shared_memory: offer (sender) and take (receiver) streams between
// processes on one host through shared memory (KvStreamOptions). device:
// the stage engine's backend when its memory is not the host's (null
// otherwise): blocks kept in it are offered from there and streams through
// shared memory land there, device to device (KvReceived::blocks).
kv_sender_actor spawn_kv_sender_linked(caf::local_actor* stage, std::shared_ptr<KvOutbox> outbox,
                                       std::shared_ptr<KvStreamCounters> counters,
                                       int32_t corrupt_chunk, std::string host, bool shared_memory,
                                       std::shared_ptr<Backend> device);
kv_receiver_actor spawn_kv_receiver_linked(caf::local_actor* stage, std::shared_ptr<KvInbox> inbox,
                                           std::shared_ptr<KvStreamCounters> counters, bool shared_memory,
                                           std::shared_ptr<Backend> device);

// vision_encoder_actor.cpp; origin names it in events ("NODE/vision_encoder/0").
vision_encoder_actor spawn_vision_encoder(caf::actor_system& system,
                                          std::shared_ptr<VisionEncoder> encoder, std::string origin);

// expert_actor.cpp: an ExpertHost (detached: a stage blocks on its answers
// inside Engine::forward, so experts must not wait for a scheduler worker).
expert_actor spawn_expert(caf::actor_system& system, std::shared_ptr<ExpertHost> host,
                          std::string name);

// A pipeline stage actor's own counters, shared with whoever spawned it: its
// node still reports them once the actor is gone (a pipeline's first stage
// takes its later stages down when it exits, which on a node that lost its
// head can come before that node prints its counters).
struct PipelineStageCounters {
  std::atomic<uint64_t> bad_messages{0}, failures{0}, forwarded{0}, kv_calls{0};
};

// pipeline_stage_actor.cpp: a LayerStage (detached: it computes in its
// behaviour). name: "NODE/stage/0" in its stats.
pipeline_stage_actor spawn_pipeline_stage(caf::actor_system& system, std::shared_ptr<LayerStage> stage,
                                          std::string name, std::shared_ptr<PipelineStageCounters> counters);
// Its stats message: the stage's counters (LayerStage::stats is thread-safe)
// and the actor's, readable from any thread, the actor alive or not.
Bytes pipeline_stage_stats(const std::string& label, const LayerStage& stage, const PipelineStageCounters& c);

// stage_actor.cpp: prefill, decode or colocated over a StageCore (detached:
// Engine::forward blocks). Prefill stages stream KV through a kv_sender,
// the others receive through a kv_receiver; persist: send newly filled full
// blocks to the store.
// pipeline: the stages after this one's layers (its engine's link): it
// monitors them, and when one goes down, or a forward pass finds the
// pipeline broken, it exits, so the router re-places its requests.
stage_actor spawn_stage(caf::actor_system& system, std::shared_ptr<StageCore> core, ActorKind kind,
                        router_actor router, kv_store_actor kv, KvStreamOptions stream,
                        std::vector<caf::actor> pipeline = {});

// router_actor.cpp.
struct RouterConfig {
  bool disaggregated = false;  // pd: entry = prefill, continue = decode
  // A KV pool (the head store's index): kv_aware placement counts the
  // prompt blocks each stage's store holds and those the pool holds
  // elsewhere, and the chosen stage's store preloads the ones it lacks.
  // The keys need the model's fingerprint and KV layout.
  std::shared_ptr<const KvPoolIndex> kv_index;
  bool kv_preload = true;
  uint64_t model_fingerprint = 0;
  KvLayout kv_layout;
  int32_t max_pending = 1024;
  int32_t block_size = 16;
  double request_timeout_s = 300;
  PlacementConfig placement;   // checked by make_placement_policy before spawning
  // The stages' policy: under fcfs a request with a nonzero priority is
  // refused at admission (invalid_argument), before it reaches a stage.
  SchedulingPolicy scheduling_policy = SchedulingPolicy::fcfs;
  // pd: move stages between prefill and decode against TTFT / TPOT goals
  // (actors/pd_controller.h); off unless a goal is set.
  PdControllerConfig pd_controller;
  // Park and unpark entry stages against a TTFT goal
  // (actors/scale_controller.h); off unless the goal is set.
  AutoscaleConfig autoscale;
};
router_actor spawn_router(caf::actor_system& system, RouterConfig config,
                          std::shared_ptr<EventSinks> sinks, kv_store_actor kv);

}  // namespace actors
}  // namespace cleave
