// The head's join actor (actors/node_join.h).
#include "actors/node_join.h"

#include <caf/all.hpp>

#include <chrono>
#include <cstdio>
#include <type_traits>

#include "actors/node.h"

namespace cleave::actors {

void log_line(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

// A name from the wire, safe to print.
std::string printable(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 64)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return out;
}

namespace {

double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct JoinState {
  JoinConfig config;
  const ModelRoute& route_of(const std::string& node) const {
    auto it = config.node_model.find(node);
    return config.models[it == config.node_model.end() ? 0 : it->second];
  }
  struct Watched {
    caf::actor_addr addr;
    std::string node, kind;
  };
  std::vector<Watched> watched;
  struct Expert {
    expert_actor handle;
    std::string spec, endpoint, node;
  };
  std::vector<Expert> experts;                       // attached and alive
  std::vector<expert_directory_actor> directories;  // told of every expert
  struct PipelineStage {
    std::string pipeline;
    LayerRange layers;
    pipeline_stage_actor handle;
  };
  std::vector<PipelineStage> pipeline_stages;  // attached and alive
  std::vector<std::pair<std::string, caf::actor>> stage_watchers;  // (pipeline, watcher)
  std::map<std::string, std::vector<stage_actor>> node_stages;  // attached and alive
  std::map<std::string, caf::actor> drain_watchers;            // told when drained
  std::vector<caf::typed_response_promise<bool>> stalled;  // JoinConfig::fault_stall_attach: never delivered
  static inline const char* name = "cleave.join";
};
using join_pointer = join_actor::stateful_pointer<JoinState>;

join_actor::behavior_type join_fn(join_pointer self, JoinConfig config) {
  self->state.config = std::move(config);
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& st = self->state;
    std::erase_if(st.directories, [&](const expert_directory_actor& d) { return d.address() == dm.source; });
    const size_t before = st.experts.size();
    std::erase_if(st.experts, [&](const JoinState::Expert& e) { return e.handle.address() == dm.source; });
    if (st.experts.size() != before) st.config.experts_alive->store(int32_t(st.experts.size()));
    for (const auto& p : st.pipeline_stages) {
      if (p.handle.address() != dm.source) continue;
      for (const auto& [pipeline, w] : st.stage_watchers)
        if (pipeline == p.pipeline) caf::anon_send(w, stage_down_atom::value, p.layers.first);
    }
    std::erase_if(st.pipeline_stages,
                  [&](const JoinState::PipelineStage& p) { return p.handle.address() == dm.source; });
    std::erase_if(st.stage_watchers, [&](const auto& w) { return w.second.address() == dm.source; });
    for (auto& [node, stages] : st.node_stages)
      std::erase_if(stages, [&](const stage_actor& a) { return a.address() == dm.source; });
    std::erase_if(st.drain_watchers, [&](const auto& w) { return w.second.address() == dm.source; });
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
    return !self->state.config.secret || secrets_equal(*self->state.config.secret, secret);
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
    if (self->state.config.fault_stall_attach) {
      auto stalled = self->make_response_promise<bool>();
      self->state.stalled.push_back(stalled);
      return stalled;
    }
    self->monitor(actor);
    self->state.watched.push_back({actor.address(), printable(node), kind});
    auto rp = self->make_response_promise<bool>();
    auto deliver = [=](bool ok) mutable { rp.deliver(ok); };
    auto refused = [=](caf::error& e) mutable { rp.deliver(std::move(e)); };
    if constexpr (std::is_same_v<std::decay_t<decltype(actor)>, stage_actor>) {
      self->state.node_stages[printable(node)].push_back(actor);
      // A stage carries its node's cost (the script's node { cost }).
      auto c = self->state.config.costs.find(node);
      const double cost = c == self->state.config.costs.end() ? 1.0 : c->second;
      self->request(self->state.route_of(node).router, kClientTimeout, attach_atom::value, kind, actor, cost)
          .then(deliver, refused);
    } else {
      self->request(self->state.route_of(node).router, kClientTimeout, attach_atom::value, kind, actor)
          .then(deliver, refused);
    }
    return rp;
  };
  return {
      [=](drain_atom, const std::string& secret, const std::string& node) -> caf::result<uint64_t> {
        if (!admitted(secret)) {
          log_line("refused to drain node " + printable(node) + ": wrong cluster secret");
          return to_error(Status(Code::unavailable, "wrong cluster secret"));
        }
        auto& st = self->state;
        if (node == st.config.head)
          return to_error(Status(Code::unsupported, "node '" + printable(node) +
                                                                "' is the head (it hosts the router): it cannot drain"));
        auto it = st.node_stages.find(node);
        if (it == st.node_stages.end() || it->second.empty())
          return to_error(Status(Code::not_found, "node '" + printable(node) + "' has no stage attached to drain"));
        auto rp = self->make_response_promise<uint64_t>();
        const std::string name = printable(node);
        self->request(st.route_of(node).router, kClientTimeout, drain_atom::value, it->second)
            .then(
                [=](uint64_t moved) mutable {
                  auto& st = self->state;
                  log_line("cleave node head: drained node " + name + " (" + std::to_string(moved) +
                           " requests moved to other stages)");
                  st.node_stages.erase(name);
                  if (auto w = st.drain_watchers.find(name); w != st.drain_watchers.end())
                    caf::anon_send(w->second, drain_atom::value);
                  rp.deliver(moved);
                },
                [=](caf::error& e) mutable { rp.deliver(std::move(e)); });
        return rp;
      },
      [=](drain_watch_atom, const std::string& secret, const std::string& node,
          const caf::actor& watcher) -> caf::result<bool> {
        if (!admitted(secret)) return to_error(Status(Code::unavailable, "wrong cluster secret"));
        self->monitor(watcher);
        self->state.drain_watchers[printable(node)] = watcher;
        return true;
      },
      [=](topology_atom, const std::string& secret) -> caf::result<std::vector<std::string>> {
        if (!admitted(secret)) {
          log_line("refused to send the topology: wrong cluster secret");
          return to_error(Status(Code::unavailable, "wrong cluster secret"));
        }
        return self->state.config.topology;
      },
      [=](join_atom, const std::string& secret,
          const std::string& node) -> caf::result<router_actor, kv_store_actor> {
        if (!admitted(secret)) {
          log_line("refused node " + printable(node) + ": wrong cluster secret");
          return to_error(Status(Code::unavailable, "wrong cluster secret"));
        }
        log_line("cleave node head: node " + printable(node) + " joined");
        const ModelRoute& route = self->state.route_of(node);
        return {route.router, route.kv};
      },
      [=](attach_atom, const std::string& secret, const std::string& node, const std::string& kind,
          stage_actor stage) -> caf::result<bool> {
        const auto k = parse_actor_kind(kind);
        return attach(secret, node, kind, stage, k && actor_kind_info(*k).stage);
      },
      [=](attach_atom, const std::string& secret, const std::string& node, const std::string& kind,
          vision_encoder_actor encoder) -> caf::result<bool> {
        return attach(secret, node, kind, encoder, kind == "vision_encoder");
      },
      // An expert actor: every node's directory hears of it (the stages
      // dispatch to it from their next layer on).
      [=](attach_atom, const std::string& secret, const std::string& node, expert_actor expert,
          const std::string& spec, const std::string& endpoint) -> caf::result<bool> {
        if (!admitted(secret)) {
          log_line("refused node " + printable(node) + ": wrong cluster secret");
          return to_error(Status(Code::unavailable, "wrong cluster secret"));
        }
        auto& st = self->state;
        self->monitor(expert);
        st.watched.push_back({expert.address(), printable(node), "expert"});
        st.experts.push_back({expert, spec, endpoint, printable(node)});
        st.config.experts_alive->store(int32_t(st.experts.size()));
        for (const auto& d : st.directories) self->send(d, expert_host_atom::value, expert, spec, endpoint);
        log_line("cleave node head: node " + printable(node) + " hosts an expert actor (" +
                 printable(spec) + ")");
        return true;
      },
      // A later pipeline stage: found by its pipeline's first stage.
      [=](attach_atom, const std::string& secret, const std::string& node, const std::string& pipeline,
          int32_t first, int32_t last, pipeline_stage_actor stage) -> caf::result<bool> {
        if (!admitted(secret)) {
          log_line("refused node " + printable(node) + ": wrong cluster secret");
          return to_error(Status(Code::unavailable, "wrong cluster secret"));
        }
        auto& st = self->state;
        self->monitor(stage);
        st.watched.push_back({stage.address(), printable(node), "stage"});
        std::erase_if(st.pipeline_stages, [&](const JoinState::PipelineStage& p) {
          return p.pipeline == pipeline && p.layers.first == first;  // a restarted one replaces it
        });
        st.pipeline_stages.push_back({pipeline, LayerRange{first, last}, stage});
        log_line("cleave node head: node " + printable(node) + " hosts pipeline '" +
                 printable(pipeline) + "' layers " + LayerRange{first, last}.to_string());
        return true;
      },
      [=](stage_find_atom, const std::string& secret, const std::string& pipeline,
          int32_t first) -> caf::result<pipeline_stage_actor, int32_t> {
        if (!admitted(secret)) return to_error(Status(Code::unavailable, "wrong cluster secret"));
        for (const auto& p : self->state.pipeline_stages)
          if (p.pipeline == pipeline && p.layers.first == first)
            return caf::result<pipeline_stage_actor, int32_t>(p.handle, p.layers.last);
        return to_error(Status(Code::not_found, "no stage of pipeline '" + printable(pipeline) +
                                                    "' from layer " + std::to_string(first) +
                                                    " has attached"));
      },
      [=](stage_watch_atom, const std::string& secret, const std::string& pipeline,
          const caf::actor& watcher) -> caf::result<bool> {
        if (!admitted(secret)) return to_error(Status(Code::unavailable, "wrong cluster secret"));
        self->monitor(watcher);
        self->state.stage_watchers.emplace_back(pipeline, watcher);
        return true;
      },
      [=](expert_watch_atom, const std::string& secret, expert_directory_actor directory) -> caf::result<bool> {
        if (!admitted(secret)) return to_error(Status(Code::unavailable, "wrong cluster secret"));
        auto& st = self->state;
        self->monitor(directory);
        st.directories.push_back(directory);
        for (const auto& e : st.experts) self->send(directory, expert_host_atom::value, e.handle, e.spec, e.endpoint);
        return true;
      },
  };
}

}  // namespace

join_actor spawn_join(caf::actor_system& system, JoinConfig config) {
  return system.spawn(join_fn, std::move(config));
}

}  // namespace cleave::actors
