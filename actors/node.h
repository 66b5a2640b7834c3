// One process of a multi-node cluster (`cleave node`), behind a CAF-free
// interface; the implementation lives in actors/node.cpp.
//
//   head    spawns a router and a kv_store for every model the script
//           names (node{}.model, one by default), hosts its own stage actors,
//           and publishes a join actor on its host:port (CAF middleman).
//   worker  connects to the head (retrying until a deadline: nodes start in
//           any order), joins with the cluster secret, gets the router and
//           kv_store handles back, spawns its stage actors with them and
//           attaches each one through the join actor.
//
// The head monitors every attached stage (the router re-places the requests
// of a stage that goes down); a worker watches the router and reports when
// the head is gone. Every node sends middleman heartbeats, so a frozen peer
// is dropped after the spec's connection timeout.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "actors/pipeline.h"
#include "actors/topology.h"

namespace cleave {

struct NodeOptions {
  ClusterSpec spec;
  std::string name;  // this node's name in spec
  std::shared_ptr<const GgufFile> file;  // this node's model (its NodeSpec::model, else -m)
  std::shared_ptr<const Tokenizer> tokenizer;  // may be null
  // Head: the file of every other model the cluster serves, by its
  // NodeSpec::model value (cluster_models); each gets a router and a store.
  std::map<std::string, std::shared_ptr<const GgufFile>> model_files;
  EngineOptions engine;        // per stage engine; threads from the NodeSpec when it sets them
  SchedulerOptions scheduler;  // prefill_only is set for prefill stages
  // vision_encoder actors: the mmproj they run (required when the node
  // hosts any) and their options (threads from the NodeSpec when it sets
  // them; n_embd from the model).
  std::shared_ptr<const GgufFile> mmproj;
  VisionEncoderOptions vision;
  // The cluster secret: nullopt on the head = open cluster; a worker sends
  // "" then.
  std::optional<std::string> secret;
  double join_timeout_s = 30;  // worker: keep trying to reach the head this long
  KvStreamOptions kv_stream;   // how prefill stages move KV to decoders
  // Attention stages replicate hot experts across the cluster's expert
  // actors (PipelineOptions::expert_replication).
  bool expert_replication = false;
  bool kv_fault_corrupt_served = false;  // tests: KvStoreRole::fault_corrupt_served
  bool kv_fault_stale_index = false;     // tests: KvStoreRole::fault_stale_index
  bool fault_stall_attach = false;       // tests, head: JoinConfig::fault_stall_attach
};

// A worker that had joined lost its head while it attached its actors (its
// requests to the head then time out): Node::start's aborted error, which
// `cleave node` treats as a lost head (a supervised run starts again to
// rejoin). The message names the head and what failed.
inline constexpr const char* kLostHeadWhileStarting = "lost the head while starting";
Status lost_head_while_starting_status(const std::string& head, const Status& cause);
bool lost_head_while_starting(const Status& st);

class Node : public Frontend {
 public:
  // Head: publishes and returns once listening. Worker: returns once joined
  // and every stage is attached. Errors: invalid_argument (unknown node, a
  // worker without the head's real port), unsupported (an actor kind not
  // implemented yet), unavailable (the head unreachable before the
  // deadline, or the head refused the node: the message names its reason,
  // "wrong cluster secret"), aborted (a worker that joined lost the head
  // before it was done starting: lost_head_while_starting() below), the
  // engines' and the store's errors.
  static Result<std::unique_ptr<Node>> start(const NodeOptions& options);
  // Stops the node's actors and its actor system. Delete a node on the
  // thread that created it: CAF 0.17's actor_system destructor never returns
  // on another thread. Known problem: after a peer's connection broke, it
  // now and then waits forever for a detached actor (about 1 exit in 15
  // here); `cleave node` bounds that with an exit deadline.
  ~Node() override = default;

  virtual bool is_head() const = 0;
  // Head: the bound "HOST:PORT"; worker: the head's "HOST:PORT".
  virtual std::string address() const = 0;
  // Head: live stages and vision encoders attached to the router (local and
  // remote; in a KV pool, a stage once the router also has its store, which
  // kv_aware placement and preloads need). Worker: the stages and encoders
  // it spawned.
  virtual int32_t stages() = 0;
  // Worker: the head went away (its router is down). Head: always false.
  virtual bool lost_head() const = 0;
  // Worker: asks the head to drain this node: its stages take nothing new
  // and their requests move to other stages (same tokens), -> how many
  // moved. unavailable when no stage of a role would be left;
  // unsupported on the head.
  virtual Result<uint64_t> drain() = 0;
  // Worker: the head drained this node (drain(), or `cleave node drain`
  // from anywhere): it may exit without failing a request. Head: false.
  virtual bool drained() const = 0;
  // Head: one front end per model the cluster serves, in cluster_models()
  // order, each with its NodeSpec::model value; the first is the head's own
  // (what submit() serves). Worker: none.
  virtual std::vector<std::pair<std::string, Frontend*>> model_frontends() = 0;
  // Head only (unsupported on a worker): as Pipeline::submit.
  Status submit(GenerateRequest request, EventCallback on_event) override = 0;
  // Head: the router's and kv_store's counters; worker: its stages'.
  std::vector<msg::Stats> stats() override = 0;
};

// The secret the spec names: secret_file's contents (trailing newlines
// dropped) when set, else the environment variable secret_env; nullopt when
// neither gives one. io_error for an unreadable file, invalid_argument for an
// empty one.
Result<std::optional<std::string>> read_cluster_secret(const ClusterSpec& spec);

// `cleave node drain NAME`: asks the spec's head to drain worker `name`
// (Node::drain), within timeout_s; the node exits once drained. The
// secret as read_cluster_secret gives it. Errors: unavailable (the head
// unreachable, a wrong secret), not_found (no such node with stages),
// unsupported (the head), unavailable (the last stage of a role).
Result<uint64_t> drain_node(const ClusterSpec& spec, const std::string& name, double timeout_s);

// `cleave node --join HOST:PORT`: the cluster's spec from the head there
// (its script and --set pairs, load_joined_topology), dialling until
// timeout_s, asking with `secret` (the caller reads it from its own
// configuration: the head's script must not choose which file a joining
// node sends it). Errors: unavailable (unreachable, a wrong secret),
// corruption (a malformed answer), the script's own errors.
Result<ClusterSpec> fetch_topology(const std::string& host, int32_t port, const std::optional<std::string>& secret,
                                   double timeout_s);

// Compares in time that depends only on the lengths, not on where the
// strings differ.
bool secrets_equal(std::string_view a, std::string_view b);

}  // namespace cleave
