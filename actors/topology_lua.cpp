// The helpers node{} and cluster{} read the script's tables with
// (actors/topology_lua.h).
#include "actors/topology_lua.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdarg>
#include <cstdlib>

namespace cleave::topology_detail {

Sandbox* sandbox(lua_State* L) {
  void* ud = nullptr;
  lua_getallocf(L, &ud);
  return static_cast<Sandbox*>(ud);
}

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


int kind_index(const char* kind) {
  const auto k = parse_actor_kind(kind);
  return k ? int(*k) : -1;
}

std::vector<const char*> kind_names() {
  std::vector<const char*> out;
  for (const ActorKindInfo& k : kActorKindTable) out.push_back(k.name);
  return out;
}


int raw_field(lua_State* L, int t, const char* key) {
  lua_pushstring(L, key);
  return lua_rawget(L, t);
}

void check_plain_table(lua_State* L, int t, const char* what) {
  if (lua_getmetatable(L, t)) raise(L, "%s: the table must not have a metatable", what);
}


const char* opt_string(lua_State* L, int t, const char* key, const char* what, size_t* len) {
  int type = raw_field(L, t, key);
  if (type == LUA_TNIL) return nullptr;
  if (type != LUA_TSTRING)
    raise(L, "%s: field '%s' must be a string, got %s", what, key, lua_typename(L, type));
  const char* s = lua_tolstring(L, -1, len);
  if (std::memchr(s, 0, *len) != nullptr) raise(L, "%s: field '%s' contains a NUL byte", what, key);
  return s;
}

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

bool valid_env_name(const char* s, size_t len) {
  if (len < 1 || len > 128 || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (size_t i = 0; i < len; ++i)
    if (!std::isalnum(static_cast<unsigned char>(s[i])) && s[i] != '_') return false;
  return true;
}

}  // namespace cleave::topology_detail
