// Private to actors/*.cpp (CAF): an attention stage's ExpertExecutor over
// expert actors. Each piece of a layer's work goes to the least loaded live
// actor hosting its expert; all actors' batches are sent before any answer
// is awaited, so they compute at the same time. An actor that fails (gone,
// timed out, a bad answer) is dropped and its pieces go to a replica, or,
// when no live actor hosts an expert, to the stage's own fallback host (the
// whole model's experts from the model file): a layer always completes, with
// the same bits.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "actors/actor_types.h"
#include "model/experts.h"

namespace cleave::actors {

struct ExpertRef {
  expert_actor handle;
  ExpertSet set;
  // Another process's actor: its batches go on this data socket
  // (actors/expert_socket.h); "" in process: as messages.
  std::string endpoint;
};

// The expert actors a process's stages may dispatch to: its own and, on a
// cluster node, those the head reports as they attach (a node that joins
// late, or again after a restart). Only grows: each executor finds out for
// itself which hosts failed. Thread-safe: the directory actor adds while
// stages read.
class ExpertDirectory {
 public:
  // Ignored when that actor is listed already.
  void add(ExpertRef ref);
  size_t size() const { return size_.load(std::memory_order_acquire); }
  // Entries [from, size()).
  std::vector<ExpertRef> since(size_t from) const;

 private:
  mutable std::mutex mu_;
  std::vector<ExpertRef> refs_;
  std::atomic<size_t> size_{0};
};

// With `replication`, once per model step the policy may ask one actor to
// host a hot expert too (expert_add); the executor then shares that
// expert's rows with it.
std::shared_ptr<ExpertExecutor> make_actor_expert_executor(caf::actor_system& system,
                                                           std::shared_ptr<const ExpertDirectory> experts,
                                                           std::shared_ptr<ExpertHost> fallback,
                                                           std::optional<ReplicationPolicy> replication = std::nullopt);

// The actor through which the head fills a node's directory (parses each
// set's spec; a spec it cannot read is logged and skipped).
expert_directory_actor spawn_expert_directory(caf::actor_system& system,
                                              std::shared_ptr<ExpertDirectory> directory);

}  // namespace cleave::actors
