// node{}: one node of the cluster, validated into plain data before the
// spec is touched (actors/topology.cpp says why).
#include "actors/topology_lua.h"
#include "kernels/backend.h"  // parse_device

#include <algorithm>
#include <cmath>
#include <filesystem>

namespace cleave::topology_detail {
namespace {

namespace fs = std::filesystem;

// What node{} validated, as plain data: nothing here has a destructor.
struct RawNode {
  const char* name = nullptr;
  size_t name_len = 0;
  const char* host = "127.0.0.1";
  size_t host_len = 9;
  const char* device = "cpu";
  size_t device_len = 3;
  const char* model = "";
  size_t model_len = 0;
  const char* mmproj = "";
  size_t mmproj_len = 0;
  const char* kv_dir = "";
  size_t kv_dir_len = 0;
  lua_Integer port = 0, threads = 0, tier0 = 0, tier1 = 0;
  double cost = 1.0;
  lua_Integer counts[kNumKinds] = {};
  lua_Integer expert_ids[kMaxExpertIds] = {};
  lua_Integer n_expert_ids = 0, first_layer = 0, last_layer = -1;
  bool head = false, has_kv = false, has_expert = false, kv_durable = false;
  // stage = { layers = {first, last}, pipeline = "NAME" }
  bool has_stage = false;
  lua_Integer stage_first = 0, stage_last = -1;
  const char* pipeline = "main";
  size_t pipeline_len = 4;
  int line = 0;
};

// actors = { decode = 2, kv_store = 1 }
void read_actors(lua_State* L, int t, const char* what, RawNode* r) {
  lua_pushnil(L);
  while (lua_next(L, t)) {
    if (lua_type(L, -2) != LUA_TSTRING)
      raise(L, "%s: actors must map a kind to a count, e.g. actors = { decode = 2 } (got a %s key)",
            what, luaL_typename(L, -2));
    const char* kind = lua_tostring(L, -2);
    if (std::strcmp(kind, "attention") == 0)
      raise(L, "%s: actor kind 'attention': prefill, decode and colocated actors are the attention "
               "actors once the cluster hosts expert actors; name one of those", what);
    // Static: a local std::string would leak when raise() longjmps past it.
    static const std::string kinds = actor_kind_list();
    for (const char* planned : kPlannedActorKinds)
      if (std::strcmp(kind, planned) == 0)
        raise(L, "%s: actor kind '%s' is not implemented yet (implemented: %s)", what, kind,
              kinds.c_str());
    int k = kind_index(kind);
    if (k < 0) {
      if (const char* near = nearest(kind, kind_names()))
        raise(L, "%s: unknown actor kind '%s' (did you mean '%s'? expected one of %s)", what, kind,
              near, kinds.c_str());
      raise(L, "%s: unknown actor kind '%s' (expected one of %s)", what, kind, kinds.c_str());
    }
    if (lua_type(L, -1) != LUA_TNUMBER)
      raise(L, "%s: actor count for '%s' must be an integer, got %s", what, kind,
            luaL_typename(L, -1));
    int is_int = 0;
    lua_Integer n = lua_tointegerx(L, -1, &is_int);
    if (!is_int)
      raise(L, "%s: actor count for '%s' must be a whole number, got %f", what, kind,
            lua_tonumber(L, -1));
    if (n < 1)
      raise(L, "%s: actor count for '%s' must be >= 1, got %I (leave the kind out for none)", what,
            kind, n);
    if (n > kMaxCount)
      raise(L, "%s: actor count for '%s' is %I, more than %I per node", what, kind, n, kMaxCount);
    if (k == kKvStore && n > 1)
      raise(L, "%s: at most one kv_store per node (got %I): it owns the node's KV tiers", what, n);
    r->counts[k] = n;
    lua_pop(L, 1);
  }
}

// kv = { tier0 = 64*MiB, tier1 = 1*GiB, dir = "/var/lib/cleave/kv" }
void read_kv(lua_State* L, int t, const char* what, RawNode* r) {
  check_plain_table(L, t, what);
  check_fields(L, t, what, kKvFields, kKvFieldList);
  lua_Integer* tiers[2] = {&r->tier0, &r->tier1};
  for (int i = 0; i < 2; ++i) {
    const char* key = kKvFields[i];
    if (!opt_integer(L, t, key, what, tiers[i])) continue;
    if (*tiers[i] <= 0)
      raise(L, "%s: zero capacity: kv.%s must be > 0 bytes, got %I (leave it out for the default)",
            what, key, *tiers[i]);
    if (*tiers[i] > kMaxTierBytes)
      raise(L, "%s: kv.%s of %I bytes is more than 1 PiB", what, key, *tiers[i]);
  }
  if (const char* dir = opt_string(L, t, "dir", what, &r->kv_dir_len)) {
    if (r->kv_dir_len == 0 || r->kv_dir_len > kMaxPathBytes)
      raise(L, "%s: kv.dir must be a path of 1 to %d bytes (leave it out for no RocksDB tier)", what,
            int(kMaxPathBytes));
    r->kv_dir = dir;  // stays pushed: the stack anchors it
  }
  // durable: RocksDB is the store's only tier (make_kv_store), so every
  // block it acknowledges is on disk and a restarted node finds it.
  const int type = raw_field(L, t, "durable");
  if (type == LUA_TBOOLEAN) r->kv_durable = lua_toboolean(L, -1);
  else if (type != LUA_TNIL) raise(L, "%s: kv.durable must be a boolean, got %s", what, lua_typename(L, type));
  lua_pop(L, 1);
  if (r->kv_durable && r->kv_dir_len == 0) raise(L, "%s: kv.durable needs kv.dir (the RocksDB directory)", what);
  if (r->kv_durable && (r->tier0 != 0 || r->tier1 != 0))
    raise(L, "%s: a durable kv_store is RocksDB alone: kv.tier0 / kv.tier1 do not apply", what);
  r->has_kv = true;
}

// An array of integers at t (a plain sequence 1..n, nothing else).
lua_Integer read_int_array(lua_State* L, int t, const char* what, const char* key, lua_Integer* out,
                           lua_Integer max_n) {
  check_plain_table(L, t, what);
  const lua_Integer n = lua_Integer(lua_rawlen(L, t));
  lua_Integer keys = 0;
  lua_pushnil(L);
  while (lua_next(L, t)) {
    lua_pop(L, 1);
    ++keys;
  }
  if (keys != n) raise(L, "%s: %s must be a list of integers like {0, 1, 2}", what, key);
  if (n > max_n) raise(L, "%s: %s lists %I values, more than %I", what, key, n, max_n);
  for (lua_Integer i = 1; i <= n; ++i) {
    lua_rawgeti(L, t, i);
    int is_int = 0;
    const lua_Integer v = lua_tointegerx(L, -1, &is_int);
    if (lua_type(L, -1) != LUA_TNUMBER || !is_int)
      raise(L, "%s: %s[%I] must be an integer, got %s", what, key, i, luaL_typename(L, -1));
    out[i - 1] = v;
    lua_pop(L, 1);
  }
  return n;
}

// expert = { experts = {0, 1, 2, 3}, layers = {0, 5} }: what each of the
// node's expert actors hosts (experts left out: all; layers left out: all).
void read_expert(lua_State* L, int t, const char* what, RawNode* r) {
  const char* ewhat = "expert{}";
  check_plain_table(L, t, ewhat);
  check_fields(L, t, ewhat, kExpertFields, "experts, layers");
  int type = raw_field(L, t, "experts");
  if (type == LUA_TTABLE) {
    r->n_expert_ids = read_int_array(L, lua_gettop(L), what, "expert.experts", r->expert_ids, kMaxExpertIds);
    if (r->n_expert_ids == 0)
      raise(L, "%s: expert.experts is empty (leave it out to host every expert)", what);
    for (lua_Integer i = 0; i < r->n_expert_ids; ++i) {
      if (r->expert_ids[i] < 0 || r->expert_ids[i] > 65535)
        raise(L, "%s: expert id %I is out of range 0..65535", what, r->expert_ids[i]);
      for (lua_Integer j = 0; j < i; ++j)
        if (r->expert_ids[j] == r->expert_ids[i])
          raise(L, "%s: expert %I is listed twice in expert.experts", what, r->expert_ids[i]);
    }
  } else if (type != LUA_TNIL) {
    raise(L, "%s: expert.experts must be a list like {0, 1}, got %s", what, lua_typename(L, type));
  }
  lua_pop(L, 1);
  type = raw_field(L, t, "layers");
  if (type == LUA_TTABLE) {
    lua_Integer range[2] = {0, 0};
    if (read_int_array(L, lua_gettop(L), what, "expert.layers", range, 2) != 2)
      raise(L, "%s: expert.layers must be {first, last}, e.g. {0, 5}", what);
    if (range[0] < 0 || range[1] < range[0] || range[1] > kMaxLayer)
      raise(L, "%s: expert.layers {%I, %I} is not a range (0 <= first <= last)", what, range[0], range[1]);
    r->first_layer = range[0];
    r->last_layer = range[1];
  } else if (type != LUA_TNIL) {
    raise(L, "%s: expert.layers must be {first, last}, got %s", what, lua_typename(L, type));
  }
  lua_pop(L, 1);
  r->has_expert = true;
}

// stage = { layers = {0, 5}, pipeline = "p0" }: the range of layers this
// node's pipeline stage holds (pipeline left out: "main").
void read_stage(lua_State* L, int t, const char* what, RawNode* r) {
  check_plain_table(L, t, "stage{}");
  check_fields(L, t, "stage{}", kStageFields, "layers, pipeline");
  int type = raw_field(L, t, "layers");
  if (type != LUA_TTABLE)
    raise(L, "%s: stage.layers must be {first, last}, e.g. {0, 5}, got %s", what, lua_typename(L, type));
  lua_Integer range[2] = {0, 0};
  if (read_int_array(L, lua_gettop(L), what, "stage.layers", range, 2) != 2)
    raise(L, "%s: stage.layers must be {first, last}, e.g. {0, 5}", what);
  if (range[0] < 0 || range[1] < range[0] || range[1] > kMaxLayer)
    raise(L, "%s: stage.layers {%I, %I} is not a range (0 <= first <= last)", what, range[0], range[1]);
  lua_pop(L, 1);
  size_t len = 0;
  if (const char* name = opt_string(L, t, "pipeline", what, &len)) {
    if (!valid_name(name, len))
      raise(L, "%s: bad stage.pipeline '%s': use 1 to 64 of A-Z a-z 0-9 _ -", what, name);
    r->pipeline = name, r->pipeline_len = len;
  }
  r->stage_first = range[0], r->stage_last = range[1];
  r->has_stage = true;
}

}  // namespace

// node { name = "d0", host = "10.0.0.2", port = 7001, threads = 8,
//        device = "cuda:0", head = false, actors = { decode = 2 }, kv = { ... } }
int lua_node(lua_State* L) {
  Sandbox* sb = sandbox(L);
  if (sb->finished) raise(L, "node{} called after the script finished");
  if (lua_gettop(L) != 1 || !lua_istable(L, 1))
    raise(L, "node{} takes one table, e.g. node { name = \"d0\", actors = { decode = 1 } }");
  luaL_checkstack(L, 16, "node{}");
  RawNode r;
  r.line = caller_line(L);
  check_plain_table(L, 1, "node{}");
  check_fields(L, 1, "node{}", kNodeFields, kNodeFieldList);

  r.name = opt_string(L, 1, "name", "node{}", &r.name_len);
  if (r.name == nullptr) raise(L, "node{} needs a name, e.g. node { name = \"d0\", ... }");
  if (!valid_name(r.name, r.name_len))
    raise(L, "node{}: bad name '%s': use 1 to 64 of A-Z a-z 0-9 _ -", r.name);
  char what[96];
  std::snprintf(what, sizeof what, "node '%s'", r.name);

  size_t len = 0;
  if (const char* host = opt_string(L, 1, "host", what, &len)) {
    if (!valid_host(host, len))
      raise(L, "%s: bad host '%s': expected a host name or an IP address", what, host);
    r.host = host, r.host_len = len;
  }
  if (opt_integer(L, 1, "port", what, &r.port) && (r.port < 0 || r.port > 65535))
    raise(L, "%s: port %I is out of range 0..65535 (0: any free port)", what, r.port);
  if (opt_integer(L, 1, "threads", what, &r.threads) && (r.threads < 0 || r.threads > kMaxThreads))
    raise(L, "%s: threads %I is out of range 0..%I (0: default)", what, r.threads, kMaxThreads);
  if (const char* device = opt_string(L, 1, "device", what, &len)) {
    if (std::strlen(device) != len || !parse_device(std::string(device, len)).ok())
      raise(L, "%s: bad device '%s' (expected \"cpu\" or \"cuda:N\")", what, device);
    r.device = device, r.device_len = len;
  }
  if (const char* model = opt_string(L, 1, "model", what, &len)) {
    if (len == 0 || len > kMaxModelPath || std::strlen(model) != len)
      raise(L, "%s: model must be a GGUF file's path of 1 to %d bytes without NUL", what, int(kMaxModelPath));
    r.model = model, r.model_len = len;
  }
  if (const char* mmproj = opt_string(L, 1, "mmproj", what, &len)) {
    if (len == 0 || len > kMaxModelPath || std::strlen(mmproj) != len)
      raise(L, "%s: mmproj must be a GGUF file's path of 1 to %d bytes without NUL", what, int(kMaxModelPath));
    r.mmproj = mmproj, r.mmproj_len = len;
  }
  int type = raw_field(L, 1, "cost");
  if (type == LUA_TNUMBER) {
    r.cost = double(lua_tonumber(L, -1));
    if (!(r.cost > 0) || !(r.cost <= kMaxNodeCost))
      raise(L, "%s: cost must be a number above 0 and at most 1e6, got %f", what, lua_tonumber(L, -1));
  } else if (type != LUA_TNIL) {
    raise(L, "%s: field 'cost' must be a number (1 = the reference node), got %s", what,
          lua_typename(L, type));
  }
  lua_pop(L, 1);
  type = raw_field(L, 1, "head");
  if (type == LUA_TBOOLEAN)
    r.head = lua_toboolean(L, -1);
  else if (type != LUA_TNIL)
    raise(L, "%s: field 'head' must be a boolean, got %s", what, lua_typename(L, type));
  lua_pop(L, 1);

  type = raw_field(L, 1, "actors");
  if (type == LUA_TTABLE) {
    check_plain_table(L, lua_gettop(L), what);
    read_actors(L, lua_gettop(L), what, &r);
  } else if (type != LUA_TNIL) {
    raise(L, "%s: field 'actors' must be a table like { decode = 2 }, got %s", what,
          lua_typename(L, type));
  }
  lua_pop(L, 1);
  type = raw_field(L, 1, "kv");
  if (type == LUA_TTABLE)
    read_kv(L, lua_gettop(L), "kv{}", &r);
  else if (type != LUA_TNIL)
    raise(L, "%s: field 'kv' must be a table like { tier0 = 64*MiB }, got %s", what,
          lua_typename(L, type));
  type = raw_field(L, 1, "expert");
  if (type == LUA_TTABLE)
    read_expert(L, lua_gettop(L), what, &r);
  else if (type != LUA_TNIL)
    raise(L, "%s: field 'expert' must be a table like { experts = {0, 1} }, got %s", what,
          lua_typename(L, type));
  if (r.has_expert && r.counts[kExpert] == 0)
    raise(L, "%s: expert{} is set but the node has no expert actor (add expert = 1 to actors)", what);
  if (r.has_kv && r.counts[kKvStore] == 0)
    raise(L, "%s: kv{} is set but the node has no kv_store actor (add kv_store = 1 to actors)",
          what);
  type = raw_field(L, 1, "stage");
  if (type == LUA_TTABLE)
    read_stage(L, lua_gettop(L), what, &r);
  else if (type != LUA_TNIL)
    raise(L, "%s: field 'stage' must be a table like { layers = {0, 5} }, got %s", what,
          lua_typename(L, type));
  lua_pop(L, 1);
  {
    const lua_Integer entry = r.counts[int(ActorKind::prefill)] + r.counts[int(ActorKind::decode)] +
                              r.counts[int(ActorKind::colocated)];
    if (r.counts[kStage] > 1)
      raise(L, "%s: at most one stage actor per node (got %I): a node holds one range of layers",
            what, r.counts[kStage]);
    if (r.counts[kStage] == 1 && !r.has_stage)
      raise(L, "%s: a stage actor needs stage = { layers = {first, last} }", what);
    if (r.has_stage && r.counts[kStage] == 1 && entry > 0)
      raise(L, "%s: a node is a pipeline's first stage (its one prefill, decode or colocated "
               "actor holds the layers) or a later stage (stage = 1), not both", what);
    if (r.has_stage && r.counts[kStage] == 1 && r.stage_first == 0)
      raise(L, "%s: a later stage cannot hold layer 0 (the first stage, a prefill, decode or "
               "colocated actor, holds the embeddings and layer 0)", what);
    if (r.has_stage && r.counts[kStage] == 0 && entry != 1)
      raise(L, "%s: stage{} on a node without a stage actor makes its prefill, decode or "
               "colocated actor a pipeline's first stage: it must host exactly one (it hosts %I)",
            what, entry);
    if (r.has_stage && r.counts[kStage] == 0 && r.stage_first != 0)
      raise(L, "%s: a pipeline's first stage holds layers from 0 (stage.layers starts at %I); "
               "later stages are stage actors (actors = { stage = 1 })", what, r.stage_first);
  }
  if (sb->spec->nodes.size() >= kMaxNodes)
    raise(L, "%s: more than %d nodes", what, int(kMaxNodes));

  // No Lua call below: nothing can longjmp past the C++ objects.
  NodeSpec& n = sb->spec->nodes.emplace_back();
  n.name.assign(r.name, r.name_len);
  n.host.assign(r.host, r.host_len);
  n.port = int32_t(r.port);
  n.threads = int32_t(r.threads);
  n.device.assign(r.device, r.device_len);
  n.model.assign(r.model, r.model_len);
  n.mmproj.assign(r.mmproj, r.mmproj_len);
  n.head = r.head;
  n.cost = r.cost;
  for (int k = 0; k < kNumKinds; ++k)
    if (r.counts[k] > 0) n.actors.push_back({kActorKindTable[size_t(k)].name, int32_t(r.counts[k]), r.line});
  n.kv_tier0_bytes = uint64_t(r.tier0);
  n.kv_tier1_bytes = uint64_t(r.tier1);
  n.kv_dir.assign(r.kv_dir, r.kv_dir_len);
  n.kv_durable = r.kv_durable;
  n.experts.first_layer = int32_t(r.first_layer);
  n.experts.last_layer = int32_t(r.last_layer);
  n.experts.experts.assign(r.expert_ids, r.expert_ids + r.n_expert_ids);
  if (r.has_stage) {
    n.stage.set = true;
    n.stage.pipeline.assign(r.pipeline, r.pipeline_len);
    n.stage.layers = {int32_t(r.stage_first), int32_t(r.stage_last)};
  }
  n.line = r.line;
  return 0;
}

}  // namespace cleave::topology_detail
