// What `cleave topology check` and `show` print.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <vector>

#include "actors/actor_kind.h"
#include "actors/topology_internal.h"

namespace cleave {

namespace {

using topology_detail::format_bytes;
using topology_detail::format_seconds;

std::string router_text(const PlacementConfig& p) {
  if (p.policy != "kv_aware") return p.policy;
  char buf[96];
  std::snprintf(buf, sizeof buf, "kv_aware (prefill_weight %g, decode_weight %g)", p.prefill_weight,
                p.decode_weight);
  return buf;
}

std::string address_of(const NodeSpec& n) {
  bool v6 = n.host.find(':') != std::string::npos;
  return (v6 ? "[" + n.host + "]" : n.host) + ":" + std::to_string(n.port);
}

std::string actors_of(const NodeSpec& n) {
  std::string s;
  for (const ActorGroupSpec& a : n.actors) {
    s += (s.empty() ? "" : ", ") + a.kind + " " + std::to_string(a.count);
    if (a.kind == "expert") s += " (" + n.experts.describe() + ")";
    // A pipeline's stage: the later one (stage) or the first (its one
    // prefill, decode or colocated actor).
    const auto k = parse_actor_kind(a.kind);
    if (n.stage.set && (a.kind == "stage" || (k && actor_kind_info(*k).stage)))
      s += " (pipeline " + n.stage.pipeline + ", layers " + n.stage.layers.to_string() + ")";
  }
  return s.empty() ? "-" : s;
}

std::string totals_of(const ClusterSpec& c, int32_t* total) {
  std::string s;
  *total = 0;
  for (const ActorKindInfo& k : kActorKindTable) {
    const char* kind = k.name;
    int32_t n = c.count(kind);
    *total += n;
    if (n > 0) s += (s.empty() ? "" : ", ") + std::string(kind) + " " + std::to_string(n);
  }
  return s;
}

}  // namespace

std::string topology_summary(const ClusterSpec& c) {
  int32_t total = 0;
  std::string kinds = totals_of(c, &total);
  std::string s = std::to_string(c.nodes.size()) + (c.nodes.size() == 1 ? " node, " : " nodes, ") +
                  std::to_string(total) + (total == 1 ? " actor" : " actors");
  if (!kinds.empty()) s += " (" + kinds + ")";
  for (const NodeSpec& n : c.nodes)
    if (n.head) s += ", head '" + n.name + "' at " + address_of(n);
  s += ", router " + router_text(c.placement);
  if (const size_t models = cluster_models(c).size(); models > 1) s += ", " + std::to_string(models) + " models";
  if (c.cache_type_k != DType::F32 || c.cache_type_v != DType::F32)
    s += std::string(", KV cache ") + dtype_name(c.cache_type_k) + " K / " + dtype_name(c.cache_type_v) + " V";
  if (c.block_size != 16) s += ", KV blocks of " + std::to_string(c.block_size) + " positions";
  if (c.compute != Compute::exact) s += std::string(", compute ") + compute_name(c.compute);
  return s;
}

static std::string pd_text(const PdControllerConfig& p) {
  if (!p.enabled()) return "";
  char buf[192];
  std::snprintf(buf, sizeof buf,
                ", pd controller (ttft %g ms, tpot %g ms, every %g s, confirm %d, cooldown %g s, switch grace %g s)",
                p.ttft_ms, p.tpot_ms, p.interval_s, int(p.confirm), p.cooldown_s, p.switch_grace_s);
  return buf;
}

static std::string autoscale_text(const AutoscaleConfig& a) {
  if (!a.enabled()) return "";
  char buf[224];
  if (a.holt())
    std::snprintf(buf, sizeof buf,
                  ", autoscale (ttft %g ms, min %d, every %g s, holt forecast %g s ahead at %g req/s per stage)",
                  a.ttft_ms, int(a.min_stages), a.interval_s, a.horizon_s, a.stage_rps);
  else
    std::snprintf(buf, sizeof buf, ", autoscale (ttft %g ms, min %d, every %g s, reactive, confirm %d, cooldown %g s)",
                  a.ttft_ms, int(a.min_stages), a.interval_s, int(a.confirm), a.cooldown_s);
  std::string out = buf;
  if (a.encoders()) {
    out.pop_back();  // the closing parenthesis
    std::snprintf(buf, sizeof buf, "; encoders: encode %g ms, min %d", a.encode_ms, int(a.min_encoders));
    out += buf;
    if (a.encoder_rps > 0) {
      std::snprintf(buf, sizeof buf, ", holt forecast at %g req/s per encoder", a.encoder_rps);
      out += buf;
    }
    if (a.max_active > 0) out += ", at most " + std::to_string(a.max_active) + " stages and encoders at once";
    out += ")";
  }
  return out;
}

static std::string cost_text(double cost) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", cost);
  return buf;
}

std::string placement_table(const ClusterSpec& c) {
  std::vector<std::vector<std::string>> rows = {
      {"node", "address", "role", "threads", "device", "cost", "actors", "kv tier0", "kv tier1", "kv dir"}};
  for (const NodeSpec& n : c.nodes) {
    const bool kv = n.count("kv_store") > 0;
    auto tier = [&](uint64_t bytes) {
      return !kv ? std::string("-") : bytes == 0 ? std::string("default") : format_bytes(bytes);
    };
    rows.push_back({n.name, address_of(n), n.head ? "head" : "worker",
                    n.threads == 0 ? "default" : std::to_string(n.threads), n.device, cost_text(n.cost),
                    actors_of(n),
                    tier(n.kv_tier0_bytes), tier(n.kv_tier1_bytes),
                    !kv ? "-" : n.kv_dir.empty() ? "none" : n.kv_dir});
  }
  // A model column when the script names models (node{}.model).
  if (cluster_models(c).size() > 1 || !c.nodes.front().model.empty()) {
    rows[0].push_back("model");
    for (size_t i = 0; i < c.nodes.size(); ++i)
      rows[i + 1].push_back(c.nodes[i].model.empty() ? "(-m)" : c.nodes[i].model);
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows)
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());

  std::string out = "cluster: router " + router_text(c.placement) + ", max_pending " +
                    std::to_string(c.max_pending) + ", scheduling " +
                    scheduling_policy_name(c.scheduling_policy) + pd_text(c.pd_controller) +
                    autoscale_text(c.autoscale) + ", request timeout " +
                    format_seconds(c.request_timeout_s) + ", heartbeat " +
                    format_seconds(c.heartbeat_interval_s) + ", connection timeout " +
                    format_seconds(c.connection_timeout_s) + ", secret from " +
                    (c.secret_file.empty() ? "$" + c.secret_env : "file " + c.secret_file) +
                    "\n\n";
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i)
      line += row[i] + (i + 1 < row.size() ? std::string(width[i] - row[i].size() + 2, ' ') : "");
    out += line + "\n";
  }
  int32_t total = 0;
  std::string kinds = totals_of(c, &total);
  out += "\ntotal: " + std::to_string(c.nodes.size()) + " nodes, " + std::to_string(total) +
         " actors" + (kinds.empty() ? "" : " (" + kinds + ")") + "\n";
  return out;
}

}  // namespace cleave
