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
#include "actors/topology_lua.h"

#include <lua.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdlib>
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

std::string model_mmproj(const ClusterSpec& spec, const std::string& model) {
  for (const NodeSpec& n : spec.nodes)
    if (n.model == model && !n.mmproj.empty()) return n.mmproj;
  return "";
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

using namespace topology_detail;
namespace fs = std::filesystem;

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
  spec.source = script;
  spec.source_name = chunkname;
  spec.source_args = args;
  return spec;
}

Status add_joining_node(ClusterSpec& spec, const std::string& name, const std::string& actors) {
  using namespace topology_detail;
  auto bad = [&](const std::string& what) { return Status(Code::invalid_argument, "--join: " + what); };
  if (!valid_name(name.data(), name.size()))
    return bad("node name '" + name.substr(0, 64) + "' must be 1 to 64 of [A-Za-z0-9_-]");
  if (spec.find(name))
    return bad("the script declares '" + name + "': drop --actors (its actors come from the script)");
  if (spec.nodes.size() >= kMaxNodes) return bad("the cluster has " + std::to_string(kMaxNodes) + " nodes already");
  NodeSpec node;
  node.name = name;
  node.model = spec.head().model;
  std::vector<int32_t> counts(kActorKindTable.size(), 0);
  std::stringstream in(actors);
  std::string item;
  while (std::getline(in, item, ',')) {
    const size_t eq = item.find('=');
    const std::string kind = item.substr(0, eq), count = eq == std::string::npos ? "" : item.substr(eq + 1);
    const int k = kind_index(kind.c_str());
    if (k < 0 || is_planned_actor_kind(kind))
      return bad("unknown actor kind '" + kind.substr(0, 64) + "' in --actors (a joining node takes prefill, "
                 "decode, colocated, vision_encoder)");
    if (kind != "prefill" && kind != "decode" && kind != "colocated" && kind != "vision_encoder")
      return bad("a joining node cannot host '" + kind + "' (it needs fields of the script: declare the node there)");
    char* end = nullptr;
    errno = 0;
    const long n = count.empty() ? 0 : std::strtol(count.c_str(), &end, 10);
    if (count.empty() || errno != 0 || *end != '\0' || n < 1 || n > kMaxCount)
      return bad("actor count for '" + kind + "' must be 1 to " + std::to_string(kMaxCount) + ", got '" +
                 count.substr(0, 32) + "' (--actors KIND=N,...)");
    if (counts[size_t(k)] != 0) return bad("'" + kind + "' given twice in --actors");
    counts[size_t(k)] = int32_t(n);
  }
  for (size_t k = 0; k < counts.size(); ++k)
    if (counts[k] > 0) node.actors.push_back({kActorKindTable[k].name, counts[k], 0});
  if (node.actors.empty()) return bad("--actors names no actor (e.g. --actors decode=1)");
  spec.nodes.push_back(std::move(node));
  return Status::Ok();
}

Result<ClusterSpec> load_joined_topology(const std::string& source, const std::string& source_name,
                                         const std::map<std::string, std::string>& args,
                                         const std::string& head_host, int32_t head_port) {
  using topology_detail::kMaxScriptBytes;
  if (source.size() > kMaxScriptBytes)
    return Status(Code::invalid_argument, "the head's topology script is " + std::to_string(source.size()) +
                                              " bytes, over the limit of " + std::to_string(kMaxScriptBytes));
  auto spec = load_topology_string(source, source_name.empty() ? "head-topology" : source_name.substr(0, 256), args);
  if (!spec.ok()) return spec.status();
  for (NodeSpec& n : spec->nodes)
    if (n.head) {
      n.host = head_host;
      n.port = head_port;
    }
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
