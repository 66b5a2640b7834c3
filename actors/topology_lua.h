// Private to the topology loader (actors/topology*.cpp): the sandbox the
// script runs in, the limits, and the helpers node{} and cluster{} read
// their tables with. Every helper that takes a lua_State may raise (a Lua
// error, a longjmp): callers keep only trivially destructible locals while
// they can (actors/topology.cpp says why).
#pragma once

#include <lua.hpp>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "actors/actor_kind.h"
#include "actors/topology.h"

namespace cleave::topology_detail {

using Clock = std::chrono::steady_clock;

constexpr int kNumKinds = int(kActorKindTable.size());
constexpr int kKvStore = int(ActorKind::kv_store);

constexpr const char* kNodeFields[] = {"name",   "host", "port",   "threads", "device", "head",  "actors",
                                       "kv",     "expert", "stage", "cost",   "model",  "mmproj"};
constexpr const char* kNodeFieldList =
    "name, host, port, threads, device, head, actors, kv, expert, stage, cost, model, mmproj";
constexpr double kMaxNodeCost = 1e6;
constexpr size_t kMaxModelPath = 4096;
constexpr const char* kStageFields[] = {"layers", "pipeline"};
constexpr int kStage = int(ActorKind::stage);
constexpr const char* kExpertFields[] = {"experts", "layers"};
constexpr int kExpert = int(ActorKind::expert);
constexpr lua_Integer kMaxExpertIds = 4096;  // ids in one expert{} list
constexpr lua_Integer kMaxLayer = 1 << 20;
constexpr const char* kKvFields[] = {"tier0", "tier1", "dir", "durable"};
constexpr const char* kKvFieldList = "tier0, tier1, dir, durable";
constexpr const char* kClusterFields[] = {"router",          "max_pending",
                                          "request_timeout_s", "heartbeat_interval_s",
                                          "connection_timeout_s", "secret_env",
                                          "secret_file",    "kv_pool",
                                          "kv_replicate_reads", "kv_preload",
                                          "scheduling_policy", "pd_controller",
                                          "autoscale",      "cache_type_k",
                                          "cache_type_v",   "block_size",
                                          "compute"};
constexpr const char* kClusterFieldList =
    "router, max_pending, request_timeout_s, heartbeat_interval_s, connection_timeout_s, "
    "secret_env, secret_file, kv_pool, kv_replicate_reads, kv_preload, scheduling_policy, "
    "pd_controller, autoscale, cache_type_k, cache_type_v, block_size, compute";

constexpr size_t kMaxNodes = 4096;
constexpr lua_Integer kMaxCount = 4096;       // actors of one kind on one node
constexpr lua_Integer kMaxThreads = 4096;
constexpr lua_Integer kMaxTierBytes = lua_Integer(1) << 50;
constexpr size_t kMaxPathBytes = 4096;
constexpr size_t kMaxScriptBytes = 1 << 20;
constexpr size_t kMaxMessageBytes = 400;
constexpr int kHookEvery = 1000;  // instructions between count-hook calls

// Shared by the allocator, the hook and the API functions. It lives in the
// C++ caller's frame, outside every Lua error, and is reached through the
// allocator's user data.
struct Sandbox {
  ClusterSpec* spec = nullptr;
  const std::map<std::string, std::string>* args = nullptr;
  TopologyLimits limits;
  Clock::time_point deadline;
  size_t used = 0;
  uint64_t instructions = 0;
  int last_line = 0;     // the line the script was last seen running
  int cluster_line = 0;  // where cluster{} was called (0: not yet)
  bool memory_hit = false, instructions_hit = false, time_hit = false;
  bool finished = false;  // node{} / cluster{} refuse calls once the script is over
  char src[LUA_IDSIZE] = "?";  // the chunk's short_src, as Lua's messages name it
};

Sandbox* sandbox(lua_State* L);

// luaL_error that the compiler knows does not return.
[[noreturn]] void raise(lua_State* L, const char* fmt, ...);
int caller_line(lua_State* L);

// Levenshtein distance for "did you mean"; long words are never close.
int edit_distance(const char* a, const char* b);

template <size_t N>
int index_of(const char* word, const char* const (&names)[N]) {
  for (size_t i = 0; i < N; ++i)
    if (std::strcmp(word, names[i]) == 0) return int(i);
  return -1;
}

int kind_index(const char* kind);
std::vector<const char*> kind_names();

template <class Names>
const char* nearest(const char* word, const Names& names) {
  const char* best = nullptr;
  int best_d = 3;  // at most two edits away
  for (const char* n : names) {
    int d = edit_distance(word, n);
    if (d < best_d) best_d = d, best = n;
  }
  return best;
}

// Pushes t[key] without metamethods and returns its type.
int raw_field(lua_State* L, int t, const char* key);
void check_plain_table(lua_State* L, int t, const char* what);

// Every key of the table at t must name a field: a typo is an error, not a
// silently ignored setting.
template <size_t N>
void check_fields(lua_State* L, int t, const char* what, const char* const (&names)[N],
                  const char* list) {
  lua_pushnil(L);
  while (lua_next(L, t)) {
    lua_pop(L, 1);
    if (lua_type(L, -1) != LUA_TSTRING)
      raise(L, "%s: keys must be field names, got a %s key (fields: %s)", what,
            luaL_typename(L, -1), list);
    const char* key = lua_tostring(L, -1);
    if (index_of(key, names) >= 0) continue;
    if (const char* near = nearest(key, names))
      raise(L, "%s: unknown field '%s' (did you mean '%s'? fields: %s)", what, key, near, list);
    raise(L, "%s: unknown field '%s' (fields: %s)", what, key, list);
  }
}

// An optional string field; the value stays pushed (it anchors the returned
// pointer) and nullptr means absent.
const char* opt_string(lua_State* L, int t, const char* key, const char* what, size_t* len);
// An optional integer field (floats with an integral value count); nothing
// stays pushed.
bool opt_integer(lua_State* L, int t, const char* key, const char* what, lua_Integer* out);
// An optional number of seconds (> 0, finite, at most a year); nothing stays pushed.
bool opt_seconds(lua_State* L, int t, const char* key, const char* what, double* out);

bool valid_name(const char* s, size_t len);
// A host name or an IPv4/IPv6 address; resolving it is the node's business.
bool valid_host(const char* s, size_t len);
bool valid_env_name(const char* s, size_t len);

// The script's node{} (actors/topology_node.cpp) and cluster{}
// (actors/topology_cluster.cpp).
int lua_node(lua_State* L);
int lua_cluster(lua_State* L);

}  // namespace cleave::topology_detail
