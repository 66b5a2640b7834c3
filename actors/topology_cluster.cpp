// cluster{}: the router, admission, timeouts, the secret, the KV pool and the
// controllers, validated into plain data before the spec is touched
// (actors/topology.cpp says why); ranges needing the whole cluster are
// checked in check_cluster.
#include "actors/topology_lua.h"

#include <algorithm>
#include <cmath>

#include "model/scheduling_policy.h"
#include "storage/block.h"  // kKvBlockSizes

namespace cleave::topology_detail {
namespace {

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
// cooldown_s = 5, margin = 0.25, switch_grace_s = 2 }: types here; ranges and the roles it needs
// in check_cluster (validate_pd_controller).
void read_pd_controller(lua_State* L, int t, const char* what, PdControllerConfig* out) {
  static constexpr const char* kFields[] = {"ttft_ms",    "tpot_ms", "interval_s",
                                            "confirm",    "cooldown_s", "margin",
                                            "switch_grace_s"};
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
  check_fields(L, ct, cwhat, kFields, "ttft_ms, tpot_ms, interval_s, confirm, cooldown_s, margin, switch_grace_s");
  for (auto [key, v] : {std::pair<const char*, double*>{"ttft_ms", &out->ttft_ms}, {"tpot_ms", &out->tpot_ms},
                        {"interval_s", &out->interval_s}, {"cooldown_s", &out->cooldown_s},
                        {"margin", &out->margin}, {"switch_grace_s", &out->switch_grace_s}}) {
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
// alpha = 0.5, beta = 0.3, encode_ms = 800, min_encoders = 1, max_active = 4,
// encoder_rps = 20 }: types here (the forecast's name as a pointer
// into the script's table: nothing here may own memory across raise());
// ranges in check_cluster (validate_autoscale).
struct RawAutoscale {
  AutoscaleConfig* out;
  const char* forecast = nullptr;
  size_t forecast_len = 0;
};
void read_autoscale(lua_State* L, int t, const char* what, RawAutoscale* raw) {
  static constexpr const char* kFields[] = {"ttft_ms",   "min_stages", "interval_s",   "confirm",
                                            "cooldown_s", "low",        "forecast",     "stage_rps",
                                            "horizon_s",  "alpha",      "beta",         "encode_ms",
                                            "min_encoders", "max_active", "encoder_rps"};
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
               "ttft_ms, min_stages, interval_s, confirm, cooldown_s, low, forecast, stage_rps, horizon_s, alpha, beta, "
               "encode_ms, min_encoders, max_active, encoder_rps");
  AutoscaleConfig* out = raw->out;
  for (auto [key, v] : {std::pair<const char*, double*>{"ttft_ms", &out->ttft_ms}, {"interval_s", &out->interval_s},
                        {"cooldown_s", &out->cooldown_s}, {"low", &out->low}, {"stage_rps", &out->stage_rps},
                        {"horizon_s", &out->horizon_s}, {"alpha", &out->alpha}, {"beta", &out->beta},
                        {"encode_ms", &out->encode_ms}, {"encoder_rps", &out->encoder_rps}}) {
    const int ft = raw_field(L, ct, key);
    if (ft == LUA_TNUMBER) *v = double(lua_tonumber(L, -1));
    else if (ft != LUA_TNIL) raise(L, "%s: %s must be a number, got %s", cwhat, key, lua_typename(L, ft));
    lua_pop(L, 1);
  }
  for (auto [key, v] : {std::pair<const char*, int32_t*>{"min_stages", &out->min_stages}, {"confirm", &out->confirm},
                        {"min_encoders", &out->min_encoders}, {"max_active", &out->max_active}}) {
    lua_Integer n = *v;
    if (opt_integer(L, ct, key, cwhat, &n)) *v = int32_t(std::clamp<lua_Integer>(n, -1, 1 << 20));
  }
  const int ft = raw_field(L, ct, "forecast");
  if (ft == LUA_TSTRING) raw->forecast = lua_tolstring(L, -1, &raw->forecast_len);
  else if (ft != LUA_TNIL) raise(L, "%s: forecast must be a string (\"none\" or \"holt\"), got %s", cwhat, lua_typename(L, ft));
  lua_pop(L, 1);  // the string stays alive in the script's table
  lua_pop(L, 1);
}

}  // namespace

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

  DType cache_types[2] = {sb->spec->cache_type_k, sb->spec->cache_type_v};
  for (int i = 0; i < 2; ++i) {
    const char* field = i == 0 ? "cache_type_k" : "cache_type_v";
    size_t len = 0;
    if (const char* name = opt_string(L, 1, field, what, &len)) {
      if (std::strcmp(name, "f32") == 0) cache_types[i] = DType::F32;
      else if (std::strcmp(name, "f16") == 0) cache_types[i] = DType::F16;
      else if (std::strcmp(name, "q8_0") == 0) cache_types[i] = DType::Q8_0;
      else if (std::strcmp(name, "q4_0") == 0) cache_types[i] = DType::Q4_0;
      else raise(L, "%s: unknown %s '%s' (expected f32, f16, q8_0 or q4_0)", what, field, name);
    }
  }

  lua_Integer block_size = sb->spec->block_size;
  if (opt_integer(L, 1, "block_size", what, &block_size) && !is_kv_block_size(block_size))
    raise(L, "%s: block_size %I is not one of %s", what, block_size, kKvBlockSizeList);

  Compute compute = sb->spec->compute;
  size_t compute_len = 0;
  if (const char* name = opt_string(L, 1, "compute", what, &compute_len)) {
    if (std::strcmp(name, "exact") == 0) compute = Compute::exact;
    else if (std::strcmp(name, "int8") == 0) compute = Compute::int8;
    else raise(L, "%s: unknown compute '%s' (expected exact or int8)", what, name);
  }

  // No Lua call below.
  ClusterSpec& c = *sb->spec;
  c.cache_type_k = cache_types[0];
  c.cache_type_v = cache_types[1];
  c.block_size = int32_t(block_size);
  c.compute = compute;
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

}  // namespace cleave::topology_detail
