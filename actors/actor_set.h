// Private to actors/*.cpp (CAF): the one wiring path. An ActorSet spawns a
// process's stage and vision_encoder actors, attaches each to the router
// (directly in one process, through the head's join actor on a node),
// collects their counters, kills them for tests, and tears everything
// down in one order: stages and encoders, then the services (router,
// store, join, watchers). The in-process Pipeline, the head and every
// worker use it.
//
// Adding an actor kind (docs/ARCHITECTURE.md): its own file with its
// spawn function (actor_types.h), a row in actor_kind.h, and its
// registration in ActorSet::spawn_group.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "actors/actor_types.h"
#include "actors/event_sinks.h"
#include "actors/expert_dispatch.h"
#include "actors/expert_socket.h"
#include "actors/hosted.h"
#include "actors/stage_link.h"

namespace cleave::actors {

// How a spawned actor joins the router: (kind name, handle) -> the answer.
// expert: null in one process (the stages find their experts in the
// set's directory).
struct Attach {
  std::function<Status(const std::string&, const stage_actor&)> stage;
  std::function<Status(const vision_encoder_actor&)> encoder;
  // endpoint: where other processes send its batches (actors/expert_socket.h),
  // "" in process.
  std::function<Status(const expert_actor&, const ExpertSet&, const std::string& endpoint)> expert;
  // A pipeline stage of another process's pipeline (HostedActors::
  // remote_stages): null in one process.
  std::function<Status(const pipeline_stage_actor&, LayerRange)> pipeline_stage;
  // The later stages of a first stage's pipeline held by other processes,
  // from layer `from` to the model's last layer n_layers - 1, in order:
  // null in one process (the stages are spawned here).
  std::function<Result<std::vector<std::pair<pipeline_stage_actor, LayerRange>>>(int32_t from,
                                                                                 int32_t n_layers)>
      pipeline_chain;
  // Tells `watcher` (a link's mailbox) of a stage of this node's pipeline
  // that goes down anywhere: null in one process (monitors see it).
  std::function<Status(const caf::actor& watcher)> pipeline_watch;
};
Attach attach_to_router(caf::actor_system& system, const router_actor& router);

class ActorSet {
 public:
  explicit ActorSet(caf::actor_system& system)
      : system_(system), directory_(std::make_shared<ExpertDirectory>()) {}
  ActorSet(const ActorSet&) = delete;
  ActorSet& operator=(const ActorSet&) = delete;
  ~ActorSet() { stop(); }

  // Spawns what `hosted` holds (stages talk to router and kv) and attaches
  // each; the first failed attach is returned.
  Status spawn(HostedActors hosted, const std::string& name_prefix, const router_actor& router,
               const kv_store_actor& kv, const KvStreamOptions& stream, const Attach& attach);
  // The expert actors this process's attention stages dispatch to: the
  // set's own, and on a node those the head reports (spawn_expert_directory).
  const std::shared_ptr<ExpertDirectory>& expert_directory() const { return directory_; }
  // Actors that go after the stages (router, store, join, watcher).
  void add_service(caf::actor service) { services_.push_back(std::move(service)); }

  // Every live actor's counters (stages, then encoders, then experts).
  void collect_stats(std::vector<msg::Stats>& out);
  int32_t size() const {
    return int32_t(stages_.size() + encoders_.size() + experts_.size() + pipeline_stages_.size());
  }

  // Tests: exit_reason::kill for actor `index` of `kind` (a stage kind,
  // "vision_encoder", "expert" or "stage").
  Status kill(const std::string& kind, int32_t index);
  // Tests: bytes as the main message of actor `index` of `kind`.
  Status send_raw(const std::string& kind, int32_t index, const Bytes& bytes);

  // user_shutdown to every actor, stages and encoders first, then the
  // services; drops every handle (a detached actor's thread ends only when
  // its last handle is gone). Idempotent.
  void stop();

 private:
  struct Stage {
    ActorKind kind;
    stage_actor handle;
    bool killed = false;
  };
  struct Encoder {
    vision_encoder_actor handle;
    bool killed = false;
  };
  struct Expert {
    expert_actor handle;
    ExpertSet set;
    bool killed = false;
  };
  struct PipelineStage {
    pipeline_stage_actor handle;
    bool killed = false;
    // What its stats are made of, kept here so they outlive the actor.
    std::shared_ptr<LayerStage> stage;
    std::shared_ptr<PipelineStageCounters> counters;
    std::string label;
  };
  // Spawns the later stages of one stage's pipeline, last first, each told
  // its next; their refs in layer order.
  Result<std::vector<PipelineStageRef>> spawn_pipeline(
      std::vector<std::shared_ptr<LayerStage>> later, const std::string& name_prefix);
  // The later stages of engine's pipeline that other processes hold, each
  // told its next.
  Result<std::vector<PipelineStageRef>> find_pipeline(const Attach& attach, const Engine& engine);
  caf::actor_system& system_;
  std::vector<Stage> stages_;
  std::vector<Encoder> encoders_;
  std::vector<Expert> experts_;
  std::vector<PipelineStage> pipeline_stages_;
  std::vector<caf::actor> services_;
  std::shared_ptr<ExpertDirectory> directory_;
  std::unique_ptr<ExpertSocketServer> expert_socket_;  // HostedActors::expert_socket_host
};

// Registers the callback, then hands the request to the router (admission:
// busy, unavailable or a typed error comes back, and the callback goes).
// With `generated` tokens (Frontend::resume), the router continues it as a
// hand-off whose KV the stage reads from the store.
Status submit_to_router(caf::actor_system& system, const router_actor& router, EventSinks& sinks,
                        GenerateRequest request, EventCallback on_event,
                        std::vector<int32_t> generated = {});

// Asks the router to end a request early (Frontend::cancel): not_found when
// its callback is gone already.
Status cancel_at_router(const router_actor& router, EventSinks& sinks, uint64_t request_id);

// Appends an actor's counters; a dead actor, or one that does not answer
// within `timeout`, has none.
void collect_stats(caf::scoped_actor& self, const caf::actor& handle, std::vector<msg::Stats>& out,
                   caf::duration timeout = caf::duration(kClientTimeout));
template <class Handle>
void collect_stats(caf::scoped_actor& self, const Handle& handle, std::vector<msg::Stats>& out,
                   caf::duration timeout = caf::duration(kClientTimeout)) {
  collect_stats(self, caf::actor_cast<caf::actor>(handle), out, timeout);
}
// The same for many actors at once: every request goes out before the
// first answer is awaited, so the whole takes at most one `timeout`.
void collect_stats(caf::scoped_actor& self, const std::vector<caf::actor>& handles, std::vector<msg::Stats>& out,
                   caf::duration timeout);

// The router's, the store's, then every actor of the set.
std::vector<msg::Stats> collect_all_stats(caf::actor_system& system, const router_actor& router,
                                          const kv_store_actor& kv, ActorSet& actors);

// Asks the router to end every admitted request (aborted) before the
// actors go.
void shutdown_router(caf::actor_system& system, const router_actor& router);

}  // namespace cleave::actors
