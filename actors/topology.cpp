// The topology script loader: a sandboxed Lua 5.4 state whose node{} and
// cluster{} functions validate their tables and append to a ClusterSpec,
// then the checks that need the whole cluster (heads, duplicates, P/D pairs).
//
// Lua is compiled as C and raises errors with longjmp. A longjmp must not
// skip a C++ destructor, so every Lua call that can raise runs inside
// lua_pcall, and the C functions registered with Lua keep only trivially
// destructible locals while they can still raise: they validate into plain
// data first and touch the C++ spec last, after their final Lua call.
#include "actors/topology.h"

#include "actors/actor_kind.h"
#include "actors/topology_internal.h"

#include <lua.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace cleave {

bool is_actor_kind(std::string_view kind) {
  if (is_planned_actor_kind(kind)) return false;
  for (const ActorKindInfo& k : kActorKindTable)
    if (kind == k.name) return true;
  return false;
}

int32_t NodeSpec::count(const std::string& kind) const {
  int32_t n = 0;
  for (const ActorGroupSpec& a : actors)
    if (a.kind == kind) n += a.count;
  return n;
}

const NodeSpec* ClusterSpec::find(const std::string& name) const {
  for (const NodeSpec& n : nodes)
    if (n.name == name) return &n;
  return nullptr;
}

const NodeSpec& ClusterSpec::head() const {
  for (const NodeSpec& n : nodes)
    if (n.head) return n;
  CLEAVE_CHECK(!"ClusterSpec without a head node (the loader never returns one)");
  std::abort();
}

int32_t ClusterSpec::count(const std::string& kind) const {
  int32_t n = 0;
  for (const NodeSpec& node : nodes) n += node.count(kind);
  return n;
}

int32_t ClusterSpec::count(const std::string& kind, const std::string& model) const {
  int32_t n = 0;
  for (const NodeSpec& node : nodes)
    if (node.model == model) n += node.count(kind);
  return n;
}

std::vector<std::string> cluster_models(const ClusterSpec& spec) {
  std::vector<std::string> out;
  for (const NodeSpec& n : spec.nodes)
    if (n.head) out.push_back(n.model);
  for (const NodeSpec& n : spec.nodes)
    if (std::find(out.begin(), out.end(), n.model) == out.end()) out.push_back(n.model);
  return out;
}

namespace topology_detail {

std::string format_bytes(uint64_t b) {
  const char* units[] = {"TiB", "GiB", "MiB", "KiB"};
  for (int i = 0; i < 4; ++i) {
    uint64_t unit = uint64_t(1) << (40 - 10 * i);
    if (b >= unit && b % unit == 0) return std::to_string(b / unit) + " " + units[i];
  }
  return std::to_string(b) + " B";
}

std::string format_seconds(double s) {
  std::ostringstream o;
  o << s << " s";
  return o.str();
}

}  // namespace topology_detail

namespace {

using topology_detail::check_cluster;
using topology_detail::format_bytes;
using topology_detail::format_seconds;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr int kNumKinds = int(kActorKindTable.size());
constexpr int kKvStore = int(ActorKind::kv_store);

constexpr const char* kNodeFields[] = {"name", "host",   "port",  "threads", "device", "head",
                                       "actors", "kv",   "expert", "stage", "cost",   "model"};
constexpr const char* kNodeFieldList =
    "name, host, port, threads, device, head, actors, kv, expert, stage, cost, model";
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
                                          "autoscale"};
constexpr const char* kClusterFieldList =
    "router, max_pending, request_timeout_s, heartbeat_interval_s, connection_timeout_s, "
    "secret_env, secret_file, kv_pool, kv_replicate_reads, kv_preload, scheduling_policy, "
    "pd_controller, autoscale";

constexpr size_t kMaxNodes = 4096;
constexpr lua_Integer kMaxCount = 4096;       // actors of one kind on one node
constexpr lua_Integer kMaxThreads = 4096;
constexpr lua_Integer kMaxCudaDevice = 1023;
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

Sandbox* sandbox(lua_State* L) {
  void* ud = nullptr;
  lua_getallocf(L, &ud);
  return static_cast<Sandbox*>(ud);
}

// The memory limit, and the time limit for library calls that allocate.
void* sandbox_alloc(void* ud, void* ptr, size_t osize, size_t nsize) {
  auto* sb = static_cast<Sandbox*>(ud);
  if (ptr == nullptr) osize = 0;  // osize then encodes the kind of object
  if (nsize == 0) {
    std::free(ptr);
    sb->used -= osize;
    return nullptr;
  }
  if (nsize > osize) {
    if (sb->used - osize + nsize > sb->limits.max_memory_bytes) {
      sb->memory_hit = true;
      return nullptr;
    }
    if (Clock::now() > sb->deadline) {
      sb->time_hit = true;
      return nullptr;
    }
  }
  void* p = std::realloc(ptr, nsize);
  if (p != nullptr) sb->used = sb->used - osize + nsize;
  return p;
}

// Line events keep last_line exact; count events enforce the instruction and
// time limits. Once over a limit every later event raises again, so a script
// cannot loop on by catching the error (pcall rethrows it too).
void sandbox_hook(lua_State* L, lua_Debug* ar) {
  Sandbox* sb = sandbox(L);
  if (ar->event == LUA_HOOKLINE) {
    sb->last_line = ar->currentline;
    return;
  }
  sb->instructions += kHookEvery;
  if (sb->instructions > sb->limits.max_instructions) sb->instructions_hit = true;
  if (Clock::now() > sb->deadline) sb->time_hit = true;
  if (sb->instructions_hit || sb->time_hit) {
    lua_pushliteral(L, "sandbox limit exceeded");
    lua_error(L);
  }
}

// luaL_error that the compiler knows does not return.
[[noreturn]] void raise(lua_State* L, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  luaL_where(L, 1);
  lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  lua_concat(L, 2);
  lua_error(L);
  std::abort();
}

int caller_line(lua_State* L) {
  lua_Debug ar;
  if (lua_getstack(L, 1, &ar) && lua_getinfo(L, "l", &ar) && ar.currentline > 0)
    return ar.currentline;
  return sandbox(L)->last_line;
}

// Levenshtein distance for "did you mean"; long words are never close.
int edit_distance(const char* a, const char* b) {
  const size_t la = std::strlen(a), lb = std::strlen(b);
  if (la > 31 || lb > 31) return 99;
  int d[32][32];
  for (size_t i = 0; i <= la; ++i) d[i][0] = int(i);
  for (size_t j = 0; j <= lb; ++j) d[0][j] = int(j);
  for (size_t i = 1; i <= la; ++i)
    for (size_t j = 1; j <= lb; ++j)
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + (a[i - 1] != b[j - 1] ? 1 : 0)});
  return d[la][lb];
}

template <size_t N>
int index_of(const char* word, const char* const (&names)[N]) {
  for (size_t i = 0; i < N; ++i)
    if (std::strcmp(word, names[i]) == 0) return int(i);
  return -1;
}

int kind_index(const char* kind) {
  const auto k = parse_actor_kind(kind);
  return k ? int(*k) : -1;
}

std::vector<const char*> kind_names() {
  std::vector<const char*> out;
  for (const ActorKindInfo& k : kActorKindTable) out.push_back(k.name);
  return out;
}

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
int raw_field(lua_State* L, int t, const char* key) {
  lua_pushstring(L, key);
  return lua_rawget(L, t);
}

void check_plain_table(lua_State* L, int t, const char* what) {
  if (lua_getmetatable(L, t)) raise(L, "%s: the table must not have a metatable", what);
}

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
const char* opt_string(lua_State* L, int t, const char* key, const char* what, size_t* len) {
  int type = raw_field(L, t, key);
  if (type == LUA_TNIL) return nullptr;
  if (type != LUA_TSTRING)
    raise(L, "%s: field '%s' must be a string, got %s", what, key, lua_typename(L, type));
  const char* s = lua_tolstring(L, -1, len);
  if (std::memchr(s, 0, *len) != nullptr) raise(L, "%s: field '%s' contains a NUL byte", what, key);
  return s;
}

// An optional integer field (floats with an integral value count); nothing
// stays pushed.
bool opt_integer(lua_State* L, int t, const char* key, const char* what, lua_Integer* out) {
  int type = raw_field(L, t, key);
  if (type == LUA_TNIL) {
    lua_pop(L, 1);
    return false;
  }
  if (type != LUA_TNUMBER)
    raise(L, "%s: field '%s' must be an integer, got %s", what, key, lua_typename(L, type));
  int is_int = 0;
  *out = lua_tointegerx(L, -1, &is_int);
  if (!is_int)
    raise(L, "%s: field '%s' must be a whole number, got %f", what, key, lua_tonumber(L, -1));
  lua_pop(L, 1);
  return true;
}

bool opt_seconds(lua_State* L, int t, const char* key, const char* what, double* out) {
  int type = raw_field(L, t, key);
  if (type == LUA_TNIL) {
    lua_pop(L, 1);
    return false;
  }
  if (type != LUA_TNUMBER)
    raise(L, "%s: field '%s' must be a number of seconds, got %s", what, key,
          lua_typename(L, type));
  double v = double(lua_tonumber(L, -1));
  if (!(v > 0) || !std::isfinite(v) || v > 365.0 * 86400)
    raise(L, "%s: field '%s' must be > 0 seconds (and finite), got %f", what, key, lua_tonumber(L, -1));
  lua_pop(L, 1);
  *out = v;
  return true;
}

bool valid_name(const char* s, size_t len) {
  if (len < 1 || len > 64) return false;
  for (size_t i = 0; i < len; ++i) {
    char c = s[i];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  }
  return true;
}

// A host name or an IPv4/IPv6 address; resolving it is the node's business.
bool valid_host(const char* s, size_t len) {
  if (len < 1 || len > 253) return false;
  for (size_t i = 0; i < len; ++i) {
    char c = s[i];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != ':' &&
        c != '_')
      return false;
  }
  return true;
}

bool valid_device(const char* s, size_t len) {
  if (len == 3 && std::memcmp(s, "cpu", 3) == 0) return true;
  if (len < 6 || len > 9 || std::memcmp(s, "cuda:", 5) != 0) return false;
  lua_Integer v = 0;
  for (size_t i = 5; i < len; ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
    v = v * 10 + (s[i] - '0');
  }
  return v <= kMaxCudaDevice && (len == 6 || s[5] != '0');
}

bool valid_env_name(const char* s, size_t len) {
  if (len < 1 || len > 128 || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (size_t i = 0; i < len; ++i)
    if (!std::isalnum(static_cast<unsigned char>(s[i])) && s[i] != '_') return false;
  return true;
}

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
    if (!valid_device(device, len))
      raise(L, "%s: bad device '%s' (expected \"cpu\" or \"cuda:N\")", what, device);
    r.device = device, r.device_len = len;
  }
  if (const char* model = opt_string(L, 1, "model", what, &len)) {
    if (len == 0 || len > kMaxModelPath || std::strlen(model) != len)
      raise(L, "%s: model must be a GGUF file's path of 1 to %d bytes without NUL", what, int(kMaxModelPath));
    r.model = model, r.model_len = len;
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

// router = "round_robin", or router = { policy = "kv_aware", prefill_weight =
// 2, decode_weight = 1 } (weights: kv_aware only).
struct RawRouter {
  const char* policy = nullptr;
  size_t policy_len = 0;
  double prefill_weight = 1.0, decode_weight = 1.0, fetch_weight = kDefaultFetchWeight;
};

bool known_policy(const char* p) {
  for (const char* name : kPlacementPolicies)
    if (std::strcmp(p, name) == 0) return true;
  return false;
}

void read_router(lua_State* L, int t, const char* what, RawRouter* r) {
  static constexpr const char* kRouterFields[] = {"policy", "prefill_weight", "decode_weight",
                                                  "fetch_weight"};
  // Static: a local std::string would leak when raise() longjmps past it.
  static const std::string policies = placement_policy_list();
  int type = raw_field(L, t, "router");
  if (type == LUA_TNIL) {
    lua_pop(L, 1);
    return;
  }
  if (type == LUA_TSTRING) {
    lua_pop(L, 1);
    r->policy = opt_string(L, t, "router", what, &r->policy_len);
  } else if (type == LUA_TTABLE) {
    const int rt = lua_gettop(L);
    const char* rwhat = "cluster{}.router";
    check_plain_table(L, rt, rwhat);
    check_fields(L, rt, rwhat, kRouterFields, "policy, prefill_weight, decode_weight, fetch_weight");
    r->policy = opt_string(L, rt, "policy", rwhat, &r->policy_len);
    if (r->policy == nullptr)
      raise(L, "%s: needs policy = \"NAME\" (one of %s)", rwhat, policies.c_str());
    for (auto [key, out] : {std::pair<const char*, double*>{"prefill_weight", &r->prefill_weight},
                            std::pair<const char*, double*>{"decode_weight", &r->decode_weight},
                            std::pair<const char*, double*>{"fetch_weight", &r->fetch_weight}}) {
      int ft = raw_field(L, rt, key);
      if (ft != LUA_TNIL) {
        if (ft != LUA_TNUMBER) raise(L, "%s: %s must be a number, got %s", rwhat, key, lua_typename(L, ft));
        const double v = double(lua_tonumber(L, -1));
        if (!std::isfinite(v) || v < 0 || v > 1e6)
          raise(L, "%s: %s must be a number from 0 to 1e6, got %f", rwhat, key, lua_tonumber(L, -1));
        if (std::strcmp(r->policy, "kv_aware") != 0)
          raise(L, "%s: %s applies to policy kv_aware only, not '%s'", rwhat, key, r->policy);
        *out = v;
      }
      lua_pop(L, 1);
    }
  } else {
    raise(L, "%s: field 'router' must be a policy name or a table { policy = ... }, got %s", what,
          lua_typename(L, type));
  }
  if (!known_policy(r->policy))
    raise(L, "%s: unknown router policy '%s' (expected one of %s)", what, r->policy, policies.c_str());
}

// pd_controller = { ttft_ms = 500, tpot_ms = 50, interval_s = 1, confirm = 3,
// cooldown_s = 5, margin = 0.25 }: types here; ranges and the roles it needs
// in check_cluster (validate_pd_controller).
void read_pd_controller(lua_State* L, int t, const char* what, PdControllerConfig* out) {
  static constexpr const char* kFields[] = {"ttft_ms", "tpot_ms", "interval_s", "confirm", "cooldown_s", "margin"};
  int type = raw_field(L, t, "pd_controller");
  if (type == LUA_TNIL) {
    lua_pop(L, 1);
    return;
  }
  if (type != LUA_TTABLE)
    raise(L, "%s: field 'pd_controller' must be a table like { ttft_ms = 500, tpot_ms = 50 }, got %s", what,
          lua_typename(L, type));
  const int ct = lua_gettop(L);
  const char* cwhat = "cluster{}.pd_controller";
  check_plain_table(L, ct, cwhat);
  check_fields(L, ct, cwhat, kFields, "ttft_ms, tpot_ms, interval_s, confirm, cooldown_s, margin");
  for (auto [key, v] : {std::pair<const char*, double*>{"ttft_ms", &out->ttft_ms}, {"tpot_ms", &out->tpot_ms},
                        {"interval_s", &out->interval_s}, {"cooldown_s", &out->cooldown_s},
                        {"margin", &out->margin}}) {
    const int ft = raw_field(L, ct, key);
    if (ft == LUA_TNUMBER) *v = double(lua_tonumber(L, -1));
    else if (ft != LUA_TNIL) raise(L, "%s: %s must be a number, got %s", cwhat, key, lua_typename(L, ft));
    lua_pop(L, 1);
  }
  lua_Integer confirm = out->confirm;
  if (opt_integer(L, ct, "confirm", cwhat, &confirm)) out->confirm = int32_t(std::clamp<lua_Integer>(confirm, -1, 1 << 20));
  lua_pop(L, 1);
}

// autoscale = { ttft_ms = 500, min_stages = 1, interval_s = 1, confirm = 2,
// cooldown_s = 5, low = 0.5, forecast = "holt", stage_rps = 4, horizon_s = 5,
// alpha = 0.5, beta = 0.3 }: types here (the forecast's name as a pointer
// into the script's table: nothing here may own memory across raise());
// ranges in check_cluster (validate_autoscale).
struct RawAutoscale {
  AutoscaleConfig* out;
  const char* forecast = nullptr;
  size_t forecast_len = 0;
};
void read_autoscale(lua_State* L, int t, const char* what, RawAutoscale* raw) {
  static constexpr const char* kFields[] = {"ttft_ms",  "min_stages", "interval_s", "confirm",
                                            "cooldown_s", "low",      "forecast",   "stage_rps",
                                            "horizon_s", "alpha",     "beta"};
  int type = raw_field(L, t, "autoscale");
  if (type == LUA_TNIL) {
    lua_pop(L, 1);
    return;
  }
  if (type != LUA_TTABLE)
    raise(L, "%s: field 'autoscale' must be a table like { ttft_ms = 500, forecast = \"holt\", stage_rps = 4 }, got %s",
          what, lua_typename(L, type));
  const int ct = lua_gettop(L);
  const char* cwhat = "cluster{}.autoscale";
  check_plain_table(L, ct, cwhat);
  check_fields(L, ct, cwhat, kFields,
               "ttft_ms, min_stages, interval_s, confirm, cooldown_s, low, forecast, stage_rps, horizon_s, alpha, beta");
  AutoscaleConfig* out = raw->out;
  for (auto [key, v] : {std::pair<const char*, double*>{"ttft_ms", &out->ttft_ms}, {"interval_s", &out->interval_s},
                        {"cooldown_s", &out->cooldown_s}, {"low", &out->low}, {"stage_rps", &out->stage_rps},
                        {"horizon_s", &out->horizon_s}, {"alpha", &out->alpha}, {"beta", &out->beta}}) {
    const int ft = raw_field(L, ct, key);
    if (ft == LUA_TNUMBER) *v = double(lua_tonumber(L, -1));
    else if (ft != LUA_TNIL) raise(L, "%s: %s must be a number, got %s", cwhat, key, lua_typename(L, ft));
    lua_pop(L, 1);
  }
  for (auto [key, v] : {std::pair<const char*, int32_t*>{"min_stages", &out->min_stages}, {"confirm", &out->confirm}}) {
    lua_Integer n = *v;
    if (opt_integer(L, ct, key, cwhat, &n)) *v = int32_t(std::clamp<lua_Integer>(n, -1, 1 << 20));
  }
  const int ft = raw_field(L, ct, "forecast");
  if (ft == LUA_TSTRING) raw->forecast = lua_tolstring(L, -1, &raw->forecast_len);
  else if (ft != LUA_TNIL) raise(L, "%s: forecast must be a string (\"none\" or \"holt\"), got %s", cwhat, lua_typename(L, ft));
  lua_pop(L, 1);  // the string stays alive in the script's table
  lua_pop(L, 1);
}

// cluster { router = "least_loaded_prefix", max_pending = 1024, ... }
int lua_cluster(lua_State* L) {
  Sandbox* sb = sandbox(L);
  if (sb->finished) raise(L, "cluster{} called after the script finished");
  if (lua_gettop(L) != 1 || !lua_istable(L, 1))
    raise(L, "cluster{} takes one table, e.g. cluster { router = \"round_robin\" }");
  if (sb->cluster_line != 0) raise(L, "cluster{} called twice (first at line %d)", sb->cluster_line);
  luaL_checkstack(L, 16, "cluster{}");
  const char* what = "cluster{}";
  check_plain_table(L, 1, what);
  check_fields(L, 1, what, kClusterFields, kClusterFieldList);

  size_t env_len = 0, file_len = 0;
  RawRouter router;
  read_router(L, 1, what, &router);
  PdControllerConfig pd;  // plain data: safe across raise()
  read_pd_controller(L, 1, what, &pd);
  ClusterSpec& spec = *sb->spec;
  RawAutoscale autoscale{&spec.autoscale};
  read_autoscale(L, 1, what, &autoscale);
  lua_Integer max_pending = sb->spec->max_pending;
  if (opt_integer(L, 1, "max_pending", what, &max_pending) &&
      (max_pending < 1 || max_pending > (1 << 24)))
    raise(L, "%s: max_pending %I is out of range 1..16777216", what, max_pending);
  bool kv_pool = sb->spec->kv_pool;
  int type = raw_field(L, 1, "kv_pool");
  if (type == LUA_TBOOLEAN)
    kv_pool = lua_toboolean(L, -1);
  else if (type != LUA_TNIL)
    raise(L, "%s: field 'kv_pool' must be a boolean, got %s", what, lua_typename(L, type));
  lua_pop(L, 1);
  bool kv_preload = sb->spec->kv_preload;
  type = raw_field(L, 1, "kv_preload");
  if (type == LUA_TBOOLEAN)
    kv_preload = lua_toboolean(L, -1);
  else if (type != LUA_TNIL)
    raise(L, "%s: field 'kv_preload' must be a boolean, got %s", what, lua_typename(L, type));
  lua_pop(L, 1);
  if (type != LUA_TNIL && !kv_pool) raise(L, "%s: kv_preload needs kv_pool = true", what);
  lua_Integer replicate_reads = sb->spec->kv_replicate_reads;
  if (opt_integer(L, 1, "kv_replicate_reads", what, &replicate_reads)) {
    if (replicate_reads < 1 || replicate_reads > (1 << 20))
      raise(L, "%s: kv_replicate_reads %I is out of range 1..1048576", what, replicate_reads);
    if (!kv_pool) raise(L, "%s: kv_replicate_reads needs kv_pool = true", what);
  }
  double request_timeout = sb->spec->request_timeout_s;
  double heartbeat = sb->spec->heartbeat_interval_s;
  double connection_timeout = sb->spec->connection_timeout_s;
  opt_seconds(L, 1, "request_timeout_s", what, &request_timeout);
  opt_seconds(L, 1, "heartbeat_interval_s", what, &heartbeat);
  opt_seconds(L, 1, "connection_timeout_s", what, &connection_timeout);
  if (connection_timeout <= heartbeat)
    raise(L, "%s: connection_timeout_s (%f) must exceed heartbeat_interval_s (%f)", what,
          lua_Number(connection_timeout), lua_Number(heartbeat));
  const char* env = opt_string(L, 1, "secret_env", what, &env_len);
  if (env != nullptr && !valid_env_name(env, env_len))
    raise(L, "%s: bad secret_env '%s': expected an environment variable name", what, env);
  const char* file = opt_string(L, 1, "secret_file", what, &file_len);
  if (file != nullptr && (file_len == 0 || file_len > kMaxPathBytes))
    raise(L, "%s: secret_file must be a path of 1 to %d bytes", what, int(kMaxPathBytes));
  if (env != nullptr && file != nullptr)
    raise(L, "%s: set secret_env or secret_file, not both", what);
  size_t policy_len = 0;
  SchedulingPolicy scheduling = sb->spec->scheduling_policy;
  if (const char* name = opt_string(L, 1, "scheduling_policy", what, &policy_len)) {
    // No std::string here: raise() longjmps past destructors.
    if (std::strcmp(name, "fcfs") == 0) scheduling = SchedulingPolicy::fcfs;
    else if (std::strcmp(name, "priority") == 0) scheduling = SchedulingPolicy::priority;
    else
      raise(L, "%s: unknown scheduling_policy '%s' (expected one of %s)", what, name,
            kSchedulingPolicies);
  }

  // No Lua call below.
  ClusterSpec& c = *sb->spec;
  if (router.policy != nullptr) c.placement.policy.assign(router.policy, router.policy_len);
  c.placement.prefill_weight = router.prefill_weight;
  c.placement.decode_weight = router.decode_weight;
  c.placement.fetch_weight = router.fetch_weight;
  c.kv_pool = kv_pool;
  c.kv_replicate_reads = int32_t(replicate_reads);
  c.kv_preload = kv_preload;
  c.max_pending = int32_t(max_pending);
  c.scheduling_policy = scheduling;
  c.pd_controller = pd;
  if (autoscale.forecast != nullptr) c.autoscale.forecast.assign(autoscale.forecast, autoscale.forecast_len);
  c.request_timeout_s = request_timeout;
  c.heartbeat_interval_s = heartbeat;
  c.connection_timeout_s = connection_timeout;
  if (env != nullptr) c.secret_env.assign(env, env_len);
  if (file != nullptr) c.secret_file.assign(file, file_len);
  sb->cluster_line = caller_line(L);
  return 0;
}

// param(name [, default]): the --set value of name converted to the type of
// default (number, boolean or string), or default when it was not set.
int lua_param(lua_State* L) {
  const char* key = luaL_checkstring(L, 1);
  lua_settop(L, 2);
  lua_pushvalue(L, 1);
  if (lua_rawget(L, lua_upvalueindex(1)) == LUA_TNIL) {
    lua_pushvalue(L, 2);
    return 1;
  }
  const char* value = lua_tostring(L, -1);
  switch (lua_type(L, 2)) {
    case LUA_TNUMBER:
      if (lua_stringtonumber(L, value) == 0)
        raise(L, "param '%s': --set %s=%s is not a number", key, key, value);
      return 1;
    case LUA_TBOOLEAN:
      for (const char* t : {"true", "1", "yes", "on"}) {
        if (std::strcmp(value, t) != 0) continue;
        lua_pushboolean(L, 1);
        return 1;
      }
      for (const char* f : {"false", "0", "no", "off"}) {
        if (std::strcmp(value, f) != 0) continue;
        lua_pushboolean(L, 0);
        return 1;
      }
      raise(L, "param '%s': --set %s=%s is not a boolean (true/false)", key, key, value);
    default:
      return 1;
  }
}

// pcall that cannot catch the sandbox's limits.
int lua_sandbox_pcall(lua_State* L) {
  luaL_checkany(L, 1);
  int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
  Sandbox* sb = sandbox(L);
  if (status != LUA_OK && (status == LUA_ERRMEM || sb->instructions_hit || sb->time_hit))
    return lua_error(L);
  lua_pushboolean(L, status == LUA_OK);
  lua_insert(L, 1);
  return lua_gettop(L);
}

// setmetatable without __gc: Lua runs finalizers with hooks off, where an
// endless one would escape the instruction and time limits.
int lua_safe_setmetatable(lua_State* L) {
  if (lua_type(L, 2) == LUA_TTABLE) {
    if (raw_field(L, 2, "__gc") != LUA_TNIL)
      raise(L, "setmetatable: __gc metamethods are not allowed in topology scripts");
    lua_pop(L, 1);
  }
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
  return lua_gettop(L);
}

// load with text chunks only: bytecode skips the parser's checks.
int lua_text_load(lua_State* L) {
  int n = lua_gettop(L);
  if (n >= 3 && !lua_isnil(L, 3)) {
    const char* mode = luaL_checkstring(L, 3);
    if (std::strcmp(mode, "t") != 0)
      raise(L, "load: only text chunks are allowed (mode \"t\"), got mode \"%s\"", mode);
  }
  if (n < 3) lua_settop(L, 3);  // env, if given, keeps its place
  lua_pushliteral(L, "t");
  lua_replace(L, 3);
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
  return lua_gettop(L);
}

// print goes to stderr: stdout belongs to the command that loads the script.
int lua_stderr_print(lua_State* L) {
  int n = lua_gettop(L);
  std::fputs("topology: ", stderr);
  for (int i = 1; i <= n; ++i) {
    size_t len = 0;
    const char* s = luaL_tolstring(L, i, &len);
    if (i > 1) std::fputc('\t', stderr);
    std::fwrite(s, 1, len, stderr);
    lua_pop(L, 1);
  }
  std::fputc('\n', stderr);
  return 0;
}

void set_nil(lua_State* L, int table, const char* key) {
  lua_pushnil(L);
  lua_setfield(L, table, key);
}

// Opens the allowed libraries and installs the topology API (protected).
int setup_sandbox(lua_State* L) {
  Sandbox* sb = sandbox(L);
  const luaL_Reg libs[] = {{LUA_GNAME, luaopen_base},
                           {LUA_STRLIBNAME, luaopen_string},
                           {LUA_TABLIBNAME, luaopen_table},
                           {LUA_MATHLIBNAME, luaopen_math},
                           {LUA_UTF8LIBNAME, luaopen_utf8}};
  for (const luaL_Reg& lib : libs) {
    luaL_requiref(L, lib.name, lib.func, 1);
    lua_pop(L, 1);
  }
  lua_pushglobaltable(L);
  const int g = lua_gettop(L);
  for (const char* name : {"dofile", "loadfile", "xpcall", "collectgarbage"}) set_nil(L, g, name);
  // Pattern matching can backtrack for hours inside one C call, where
  // neither the instruction count nor the clock can stop it.
  lua_getglobal(L, LUA_STRLIBNAME);
  for (const char* name : {"dump", "find", "match", "gmatch", "gsub"})
    set_nil(L, lua_gettop(L), name);
  lua_pop(L, 1);

  lua_getfield(L, g, "load");
  lua_pushcclosure(L, lua_text_load, 1);
  lua_setfield(L, g, "load");
  lua_getfield(L, g, "setmetatable");
  lua_pushcclosure(L, lua_safe_setmetatable, 1);
  lua_setfield(L, g, "setmetatable");
  lua_pushcfunction(L, lua_sandbox_pcall);
  lua_setfield(L, g, "pcall");
  lua_pushcfunction(L, lua_stderr_print);
  lua_setfield(L, g, "print");
  lua_pushcfunction(L, lua_node);
  lua_setfield(L, g, "node");
  lua_pushcfunction(L, lua_cluster);
  lua_setfield(L, g, "cluster");
  for (auto [name, bytes] : {std::pair{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}}) {
    lua_pushinteger(L, bytes);
    lua_setfield(L, g, name);
  }
  lua_pushinteger(L, lua_Integer(1) << 40);
  lua_setfield(L, g, "TiB");

  // args for the script to read (and change, if it likes); param() reads a
  // private copy.
  for (int copy = 0; copy < 2; ++copy) {
    lua_createtable(L, 0, int(sb->args->size()));
    for (const auto& [key, value] : *sb->args) {
      lua_pushlstring(L, value.data(), value.size());
      lua_setfield(L, -2, key.c_str());
    }
  }
  lua_pushcclosure(L, lua_param, 1);
  lua_setfield(L, g, "param");
  lua_setfield(L, g, "args");
  return 0;
}

std::string one_line(std::string s) {
  std::replace_if(s.begin(), s.end(), [](char c) { return c == '\n' || c == '\r'; }, ' ');
  if (s.size() > kMaxMessageBytes) s = s.substr(0, kMaxMessageBytes) + "...";
  return s;
}

// The Status for a failed setup, load or run; the message names the script
// line where one is known.
Status script_error(lua_State* L, const Sandbox& sb, int status, const std::string& display) {
  std::string msg;
  if (lua_type(L, -1) == LUA_TSTRING) {
    size_t len = 0;
    const char* s = lua_tolstring(L, -1, &len);
    msg.assign(s, len);
  } else {
    msg = std::string("the script raised an error object of type ") + luaL_typename(L, -1);
  }
  lua_pop(L, 1);
  const std::string at =
      display + (sb.last_line > 0 ? ":" + std::to_string(sb.last_line) + ": " : ": ");
  if (sb.time_hit)
    return Status(Code::invalid_argument,
                  at + "time limit of " + format_seconds(sb.limits.max_seconds) + " exceeded");
  if (sb.instructions_hit)
    return Status(Code::invalid_argument, at + "instruction limit of " +
                                              std::to_string(sb.limits.max_instructions) +
                                              " instructions exceeded (an endless loop?)");
  if (sb.memory_hit && (status == LUA_ERRMEM || msg == "not enough memory"))
    return Status(Code::invalid_argument, at + "memory limit of " +
                                              format_bytes(sb.limits.max_memory_bytes) +
                                              " exceeded");
  if (status == LUA_ERRMEM) return Status(Code::out_of_memory, display + ": out of memory");
  // Lua names the chunk by its short_src (long paths cut to "..."): name it
  // as the caller did, and give messages without a position one.
  const std::string src = std::string(sb.src) + ":";
  if (msg.compare(0, src.size(), src) == 0)
    msg = display + ":" + msg.substr(src.size());
  else if (msg.compare(0, display.size() + 1, display + ":") != 0)
    msg = at + msg;
  return Status(Code::invalid_argument, one_line(msg));
}

// Runs the script in L; every Lua call that can raise is protected.
Status run_script(lua_State* L, Sandbox& sb, const std::string& script,
                  const std::string& display) {
  lua_pushcfunction(L, setup_sandbox);
  int status = lua_pcall(L, 0, 0, 0);
  if (status != LUA_OK) return script_error(L, sb, status, display);
  // Lua names the chunk by its short_src in messages; learn it from an empty
  // chunk of the same name so that even syntax errors can be renamed.
  const std::string chunkname = "@" + display;
  lua_Debug ar;
  status = luaL_loadbufferx(L, "", 0, chunkname.c_str(), "t");
  if (status != LUA_OK) return script_error(L, sb, status, display);
  lua_getinfo(L, ">S", &ar);
  std::snprintf(sb.src, sizeof sb.src, "%s", ar.short_src);
  status = luaL_loadbufferx(L, script.data(), script.size(), chunkname.c_str(), "t");
  if (status != LUA_OK) return script_error(L, sb, status, display);
  lua_sethook(L, sandbox_hook, LUA_MASKCOUNT | LUA_MASKLINE, kHookEvery);
  status = lua_pcall(L, 0, 0, 0);
  if (status != LUA_OK) return script_error(L, sb, status, display);
  return Status::Ok();
}

}  // namespace

Result<ClusterSpec> load_topology_string(const std::string& script, const std::string& chunkname,
                                         const std::map<std::string, std::string>& args,
                                         const TopologyLimits& limits) {
  ClusterSpec spec;
  Sandbox sb;
  sb.spec = &spec;
  sb.args = &args;
  sb.limits = limits;
  sb.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(limits.max_seconds));
  lua_State* L = lua_newstate(sandbox_alloc, &sb);
  if (L == nullptr)
    return Status(Code::invalid_argument,
                  chunkname + ": memory limit of " + format_bytes(limits.max_memory_bytes) +
                      " is too small for a Lua state");
  Status st = run_script(L, sb, script, chunkname);
  sb.finished = true;
  sb.limits.max_memory_bytes = SIZE_MAX;  // let finalizers at close finish
  lua_close(L);
  if (!st.ok()) return st;
  CLEAVE_RETURN_IF_ERROR(check_cluster(spec, chunkname));
  if (Status st = check_topology_pipelines(spec, nullptr); !st.ok())
    return Status(st.code(), chunkname + ": " + st.message());
  return spec;
}

Result<ClusterSpec> load_topology_file(const std::string& path,
                                       const std::map<std::string, std::string>& args,
                                       const TopologyLimits& limits) {
  std::error_code ec;
  fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status))
    return Status(Code::not_found, "topology file '" + path + "' not found");
  if (fs::is_directory(status))
    return Status(Code::io_error, "'" + path + "' is a directory, not a topology file");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return Status(Code::io_error,
                  "cannot open topology file '" + path + "': " + std::strerror(errno));
  std::string text(kMaxScriptBytes + 1, '\0');
  in.read(text.data(), std::streamsize(text.size()));
  if (in.bad())
    return Status(Code::io_error, "cannot read topology file '" + path + "'");
  text.resize(size_t(in.gcount()));
  if (text.size() > kMaxScriptBytes)
    return Status(Code::invalid_argument, "topology file '" + path + "' is larger than " +
                                              format_bytes(kMaxScriptBytes));
  return load_topology_string(text, path, args, limits);
}

}  // namespace cleave
