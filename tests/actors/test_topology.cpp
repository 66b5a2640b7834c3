// Topology scripts: valid scripts give the exact ClusterSpec (args, loops,
// functions), bad ones a typed error naming the line and the problem, the
// sandbox keeps io/os/require/bytecode out and stops endless loops and memory
// bombs, and every example in examples/ loads.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <tuple>
#include <vector>
#include <unistd.h>

#include "actors/actor_kind.h"
#include "actors/topology.h"
#include "tests/actors/topology_util.h"
#include "tests/process_scratch.h"

using namespace cleave;
using namespace cleave::testing;
namespace fs = std::filesystem;

namespace {

const std::string kExamples = std::string(CLEAVE_SOURCE_DIR) + "/examples";

}  // namespace

TEST_CASE("a P/D script gives the exact spec with ports from args") {
  const std::string script = R"(cluster { router = "round_robin", max_pending = 512, request_timeout_s = 30,
            heartbeat_interval_s = 0.05, connection_timeout_s = 0.25, secret_file = "/etc/cleave/secret" }
node { name = "head", head = true, port = tonumber(args.head_port or "0"),
       actors = { prefill = 1, kv_store = 1 },
       kv = { tier0 = 64 * MiB, tier1 = 2 * GiB, dir = "/tmp/kv" } }
node { name = "d-1", host = "10.0.0.2", port = param("d_port", 0), threads = 8,
       device = "cuda:1", actors = { decode = 3 } }
)";
  ClusterSpec c = load_ok(script, {{"head_port", "7100"}, {"d_port", "7101"}});
  CHECK(c.placement.policy == "round_robin");
  CHECK(c.max_pending == 512);
  CHECK(c.request_timeout_s == 30);
  CHECK(c.heartbeat_interval_s == 0.05);
  CHECK(c.connection_timeout_s == 0.25);
  CHECK(c.secret_file == "/etc/cleave/secret");
  REQUIRE(c.nodes.size() == 2);

  const NodeSpec& h = c.nodes[0];
  CHECK(h.name == "head");
  CHECK(h.head);
  CHECK(h.host == "127.0.0.1");
  CHECK(h.port == 7100);
  CHECK(h.threads == 0);
  CHECK(h.device == "cpu");
  CHECK(h.line == 3);
  REQUIRE(h.actors.size() == 2);
  CHECK(h.actors[0].kind == "prefill");  // kActorKindTable order, not the script's
  CHECK(h.actors[0].count == 1);
  CHECK(h.actors[1].kind == "kv_store");
  CHECK(h.actors[1].line == 3);
  CHECK(h.kv_tier0_bytes == (uint64_t(64) << 20));
  CHECK(h.kv_tier1_bytes == (uint64_t(2) << 30));
  CHECK(h.kv_dir == "/tmp/kv");

  const NodeSpec& d = c.nodes[1];
  CHECK(d.name == "d-1");
  CHECK_FALSE(d.head);
  CHECK(d.host == "10.0.0.2");
  CHECK(d.port == 7101);
  CHECK(d.threads == 8);
  CHECK(d.device == "cuda:1");
  CHECK(d.line == 6);
  CHECK(d.count("decode") == 3);
  CHECK(d.kv_tier0_bytes == 0);
  CHECK(d.kv_dir.empty());

  CHECK(&c.head() == &c.nodes[0]);
  CHECK(c.find("d-1") == &c.nodes[1]);
  CHECK(c.find("d1") == nullptr);
  CHECK(c.count("decode") == 3);
  CHECK(c.count("prefill") == 1);
  CHECK(c.count("vision_encoder") == 0);
}

TEST_CASE("fields left out take their defaults") {
  ClusterSpec c = load_ok("node { name = 'solo', head = true, actors = { colocated = 1 } }");
  ClusterSpec defaults;
  CHECK(c.placement.policy == defaults.placement.policy);
  CHECK(c.max_pending == defaults.max_pending);
  CHECK(c.request_timeout_s == defaults.request_timeout_s);
  CHECK(c.heartbeat_interval_s == defaults.heartbeat_interval_s);
  CHECK(c.connection_timeout_s == defaults.connection_timeout_s);
  CHECK(c.secret_env == "CLEAVE_CLUSTER_SECRET");
  CHECK(c.secret_file.empty());
  REQUIRE(c.nodes.size() == 1);
  CHECK(c.nodes[0].host == "127.0.0.1");
  CHECK(c.nodes[0].port == 0);
  CHECK(c.nodes[0].device == "cpu");
  CHECK(c.nodes[0].line == 1);
}

TEST_CASE("loops and functions produce nodes") {
  const std::string script = R"(local base = param("base_port", 0)
local function decoder(i, n)
  node { name = "d" .. i, port = base + 1 + i, actors = { decode = n } }
end
node { name = "p", head = true, port = base, actors = { prefill = 2, kv_store = 1 } }
for i = 0, 3 do decoder(i, i % 2 + 1) end
)";
  ClusterSpec c = load_ok(script, {{"base_port", "9000"}});
  REQUIRE(c.nodes.size() == 5);
  for (int i = 0; i < 4; ++i) {
    const NodeSpec& d = c.nodes[size_t(i) + 1];
    CHECK(d.name == "d" + std::to_string(i));
    CHECK(d.port == 9001 + i);
    CHECK(d.count("decode") == i % 2 + 1);
    CHECK(d.line == 3);  // the node{} call inside decoder()
  }
  CHECK(c.nodes[0].port == 9000);
  CHECK(c.count("decode") == 6);
  CHECK(c.count("prefill") == 2);
}

TEST_CASE("decoders placed round-robin over nodes by a loop") {
  const std::string script = R"(local hosts = { "d0", "d1", "d2" }
local decoders = {}
for e = 0, 7 do
  local h = hosts[e % #hosts + 1]
  decoders[h] = (decoders[h] or 0) + 1
end
node { name = "head", head = true, actors = { prefill = 1 } }
for _, h in ipairs(hosts) do node { name = h, actors = { decode = decoders[h] } } end
)";
  ClusterSpec c = load_ok(script);
  REQUIRE(c.nodes.size() == 4);
  CHECK(c.nodes[1].count("decode") == 3);
  CHECK(c.nodes[2].count("decode") == 3);
  CHECK(c.nodes[3].count("decode") == 2);
  CHECK(c.count("decode") == 8);
  CHECK(c.count("prefill") == 1);
}

TEST_CASE("kinds not implemented yet are refused with the implemented ones") {
  for (const char* kind : kPlannedActorKinds) {
    CAPTURE(kind);
    const std::string script = std::string("node { name = \"head\", head = true, actors = { colocated = 1, ") +
                               kind + " = 1 } }\n";
    auto r = load_topology_string(script, "t.lua");
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == Code::invalid_argument);
    const std::string m = r.status().message();
    CHECK_MESSAGE(m.find(std::string("actor kind '") + kind + "' is not implemented yet") != std::string::npos, m);
    CHECK_MESSAGE(m.find(actor_kind_list()) != std::string::npos, m);
    CHECK_MESSAGE(m.find("t.lua:1:") != std::string::npos, m);
  }
}

TEST_CASE("router: a policy name or a table with kv_aware weights") {
  const std::string head = "node { name = \"head\", head = true, actors = { colocated = 2 } }\n";
  for (const char* name : kPlacementPolicies) {
    auto c = load_ok(head + "cluster { router = \"" + name + "\" }\n");
    CHECK(c.placement.policy == name);
  }
  auto kv = load_ok(head + "cluster { router = { policy = \"kv_aware\", prefill_weight = 4, decode_weight = 0.5 } }\n");
  CHECK(kv.placement.policy == "kv_aware");
  CHECK(kv.placement.prefill_weight == 4.0);
  CHECK(kv.placement.decode_weight == 0.5);
  CHECK(topology_summary(kv).find("kv_aware (prefill_weight 4, decode_weight 0.5)") != std::string::npos);
  struct Bad {
    const char* cluster;
    const char* message;
  };
  for (const Bad& b : {Bad{"router = \"fastest\"", "unknown router policy 'fastest'"},
                       Bad{"router = { policy = \"round_robin\", prefill_weight = 2 }",
                           "prefill_weight applies to policy kv_aware only"},
                       Bad{"router = { policy = \"kv_aware\", decode_weight = -1 }", "decode_weight must be"},
                       Bad{"router = { prefill_weight = 1 }", "needs policy"},
                       Bad{"router = { policy = \"kv_aware\", speed = 1 }", "speed"},
                       Bad{"router = 3", "field 'router' must be"}}) {
    CAPTURE(b.cluster);
    auto r = load_topology_string(head + "cluster { " + b.cluster + " }\n", "r.lua");
    REQUIRE_FALSE(r.ok());
    CHECK_MESSAGE(r.status().message().find(b.message) != std::string::npos, r.status().message());
  }
}

TEST_CASE("node cost: a positive number for cost_aware placement, refused with any other router") {
  const std::string nodes = "node { name = 'head', head = true, actors = { colocated = 1 } }\n"
                            "node { name = 'dear', cost = 1.5, actors = { colocated = 1 } }\n";
  auto c = load_ok("cluster { router = 'cost_aware' }\n" + nodes);
  REQUIRE(c.nodes.size() == 2);
  CHECK(c.nodes[0].cost == 1.0);
  CHECK(c.nodes[1].cost == 1.5);
  CHECK(placement_table(c).find("1.5") != std::string::npos);
  // Declaring the router after the nodes is the same script.
  CHECK(load_ok(nodes + "cluster { router = 'cost_aware' }\n").nodes[1].cost == 1.5);
  // A cost no policy reads is refused at the node that sets it.
  expect_error(nodes, 2, "node 'dear' has a cost, which only router policy 'cost_aware' reads");
  expect_error("cluster { router = 'kv_aware' }\n" + nodes, 3, "(the router is 'kv_aware')");
  // cost = 1 is the default: nothing to refuse.
  CHECK(load_ok(kHead + "node { name = 'n', cost = 1, actors = { colocated = 1 } }\n").nodes[1].cost == 1.0);
  for (const char* bad : {"0", "-2", "1e7", "0/0", "1/0"})
    expect_error("cluster { router = 'cost_aware' }\n" + kHead + "node { name = 'n', cost = " + bad +
                     ", actors = { colocated = 1 } }\n",
                 3, "cost must be a number above 0 and at most 1e6");
  expect_error(kHead + "node { name = 'n', cost = 'cheap', actors = { colocated = 1 } }\n", 2,
               "field 'cost' must be a number");
}

TEST_CASE("node model: several models in one cluster, each checked as a cluster of its own") {
  const std::string two = "node { name = 'head', head = true, actors = { colocated = 1 } }\n"
                          "node { name = 'p', model = 'b.gguf', actors = { prefill = 1 } }\n"
                          "node { name = 'd', model = 'b.gguf', actors = { decode = 2 } }\n"
                          "node { name = 'c', model = 'c.gguf', actors = { colocated = 1 } }\n";
  auto c = load_ok(two);
  CHECK(c.nodes[0].model.empty());
  CHECK(c.nodes[1].model == "b.gguf");
  CHECK(cluster_models(c) == std::vector<std::string>{"", "b.gguf", "c.gguf"});
  CHECK(c.count("decode", "b.gguf") == 2);
  CHECK(c.count("decode", "") == 0);
  CHECK(c.count("colocated", "c.gguf") == 1);
  CHECK(topology_summary(c).find(", 3 models") != std::string::npos);
  CHECK(placement_table(c).find("b.gguf") != std::string::npos);
  // The head's model comes first whatever the declaration order.
  auto h = load_ok("node { name = 'w', model = 'x.gguf', actors = { colocated = 1 } }\n"
                   "node { name = 'head', head = true, model = 'y.gguf', actors = { colocated = 1 } }\n");
  CHECK(cluster_models(h) == std::vector<std::string>{"y.gguf", "x.gguf"});
  // One model's P/D needs both sides even when another model has them.
  expect_error(kHead + "node { name = 'p', model = 'b.gguf', actors = { prefill = 1 } }\n"
                       "node { name = 'd', actors = { decode = 1 } }\n",
               2, "prefill actors but no decode or colocated actor in the cluster for model 'b.gguf'");
  expect_error("node { name = 'head', head = true, model = 'a.gguf', actors = { prefill = 1 } }\n"
               "node { name = 'w', model = 'b.gguf', actors = { colocated = 1 } }\n",
               1, "for model 'a.gguf'");
  // A model whose nodes host nothing that serves.
  expect_error(kHead + "node { name = 'k', model = 'b.gguf' }\n", 2,
               "no actor serves requests for model 'b.gguf'");
  // A KV pool per model (nodes_models_pool runs one).
  auto pools = load_ok("cluster { kv_pool = true }\n" + two);
  CHECK(cluster_models(pools).size() == 3);
  // What spans models is refused, naming it.
  // Vision encoders serve their model: each model names its encoder once.
  auto vision = load_ok(two + "node { name = 'e', mmproj = 'va.gguf', actors = { vision_encoder = 1 } }\n"
                              "node { name = 'f', model = 'b.gguf', mmproj = 'vb.gguf', actors = { vision_encoder = 2 } }\n"
                              "node { name = 'g', model = 'b.gguf', actors = { vision_encoder = 1 } }\n");
  CHECK(vision.nodes[4].mmproj == "va.gguf");
  CHECK(model_mmproj(vision, "") == "va.gguf");
  CHECK(model_mmproj(vision, "b.gguf") == "vb.gguf");
  CHECK(model_mmproj(vision, "c.gguf").empty());
  CHECK(vision.count("vision_encoder", "b.gguf") == 3);
  expect_error(two + "node { name = 'e', actors = { vision_encoder = 1 } }\n", 5,
               "node 'e' hosts vision_encoder actors in a cluster of several models: name its model's vision "
               "encoder with node{}.mmproj");
  expect_error(two + "node { name = 'e', mmproj = 'v1.gguf', actors = { vision_encoder = 1 } }\n"
                     "node { name = 'f', mmproj = 'v2.gguf', actors = { vision_encoder = 1 } }\n",
               6, "node 'f': mmproj 'v2.gguf' differs from 'v1.gguf', named by another node of the same model");
  expect_error(kHead + "node { name = 'n', mmproj = '', actors = { colocated = 1 } }\n", 2,
               "mmproj must be a GGUF file's path of 1 to 4096 bytes");
  expect_error(kHead + "node { name = 'n', mmproj = 7, actors = { colocated = 1 } }\n", 2, "mmproj");
  expect_error(two + "node { name = 'x', actors = { expert = 1 } }\n", 5, "node 'x': expert actors with several models");
  expect_error(kHead + "node { name = 'f', model = 'b.gguf', stage = { layers = {0, 1} }, actors = { colocated = 1 } }\n"
                       "node { name = 'g', model = 'b.gguf', stage = { layers = {2, 3} }, actors = { stage = 1 } }\n",
               2, "node 'f': stage{} pipelines with several models");
  // The field itself.
  expect_error(kHead + "node { name = 'n', model = '', actors = { colocated = 1 } }\n", 2,
               "model must be a GGUF file's path of 1 to 4096 bytes");
  expect_error(kHead + "node { name = 'n', model = 7, actors = { colocated = 1 } }\n", 2, "model");
  expect_error(kHead + "node { name = 'n', model = string.rep('a', 4097), actors = { colocated = 1 } }\n", 2,
               "model must be a GGUF file's path");
  // One model named on every node is a one-model cluster: pools and the rest are fine.
  auto one = load_ok("cluster { kv_pool = true }\nnode { name = 'head', head = true, model = 'a.gguf', "
                     "actors = { colocated = 1, kv_store = 1 } }\n");
  CHECK(cluster_models(one).size() == 1);
}

TEST_CASE("param converts --set values to the type of its default") {
  const std::string script = R"(
local n = param("n", 1)
local flag = param("flag", false)
local label = param("label", "x")
assert(math.type(n) == "integer" and n == 3, "n")
assert(flag == true, "flag")
assert(label == "hello", "label")
assert(param("unset", 42) == 42 and param("unset") == nil, "defaults")
assert(args.n == "3", "args holds strings")
node { name = label, head = true, threads = n, actors = { colocated = 1 } }
)";
  ClusterSpec c = load_ok(script, {{"n", "3"}, {"flag", "true"}, {"label", "hello"}});
  CHECK(c.nodes[0].name == "hello");
  CHECK(c.nodes[0].threads == 3);

  Status st = load_bad("local p = param('port', 0)\n" + kHead, {{"port", "http"}});
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().rfind("topo.lua:1: ", 0) == 0);
  CHECK(st.message().find("--set port=http is not a number") != std::string::npos);
  st = load_bad("local p = param('on', true)\n" + kHead, {{"on", "maybe"}});
  CHECK(st.message().find("--set on=maybe is not a boolean") != std::string::npos);
}

TEST_CASE("unknown names give the line and the known ones") {
  expect_error(kHead + "node { name = 'd', actors = { decoder = 1 } }", 2,
               "unknown actor kind 'decoder' (did you mean 'decode'? expected one of prefill, decode");
  expect_error(kHead + "node { name = 'd', actors = { gpu_thing = 1 } }", 2,
               "unknown actor kind 'gpu_thing' (expected one of prefill, decode, colocated");
  expect_error(kHead + "\nnode { name = 'd', prot = 7000, actors = { decode = 1 } }", 3,
               "node{}: unknown field 'prot' (did you mean 'port'?");
  expect_error(kHead + "cluster { routr = 'round_robin' }", 2,
               "cluster{}: unknown field 'routr' (did you mean 'router'?");
  expect_error(kHead + "cluster { router = 'fastest' }", 2, "unknown router policy 'fastest'");
  expect_error("node { name = 'h', head = true, actors = { kv_store = 1, colocated = 1 },\n"
               "       kv = { teir0 = 1 } }",
               1, "kv{}: unknown field 'teir0' (did you mean 'tier0'?");
  expect_error(kHead + "node { name = 'd', actors = { 'decode' } }", 2,
               "actors must map a kind to a count");
}

TEST_CASE("zero or negative counts and capacities are refused") {
  expect_error(kHead + "node { name = 'd', actors = { decode = 0 } }", 2,
               "actor count for 'decode' must be >= 1, got 0");
  expect_error(kHead + "node { name = 'd', actors = { decode = -2 } }", 2,
               "actor count for 'decode' must be >= 1, got -2");
  expect_error(kHead + "node { name = 'd', actors = { decode = 1.5 } }", 2,
               "actor count for 'decode' must be a whole number");
  expect_error(kHead + "node { name = 'kv', actors = { kv_store = 1 }, kv = { tier0 = 0 } }", 2,
               "zero capacity: kv.tier0 must be > 0 bytes, got 0");
  expect_error(kHead + "node { name = 'kv', actors = { kv_store = 1 }, kv = { tier1 = -1 } }", 2,
               "zero capacity: kv.tier1");
  expect_error(kHead + "node { name = 'kv', actors = { kv_store = 2 } }", 2,
               "at most one kv_store per node (got 2)");
  expect_error(kHead + "node { name = 'kv', actors = { decode = 1 }, kv = { tier0 = MiB } }", 2,
               "kv{} is set but the node has no kv_store actor");
  expect_error(kHead + "node { name = 'kv', actors = { kv_store = 1, decode = 1 } }", 2,
               "node 'kv' is not the head: a kv_store on a worker needs cluster { kv_pool = true }");
}

TEST_CASE("KV pool fields: kv_pool, kv_replicate_reads, kv_preload, kv.durable, fetch_weight") {
  ClusterSpec pool = load_ok("cluster { kv_pool = true, kv_replicate_reads = 3 }\n"
                   "node { name = 'h', head = true, actors = { kv_store = 1 } }\n"
                   "node { name = 'w', actors = { colocated = 1, kv_store = 1 }, "
                   "kv = { dir = '/tmp/x', durable = true } }");
  CHECK(pool.kv_pool);
  CHECK(pool.kv_replicate_reads == 3);
  CHECK(pool.find("w")->kv_durable);
  CHECK(pool.find("w")->kv_dir == "/tmp/x");
  CHECK_FALSE(pool.find("h")->kv_durable);
  CHECK(pool.kv_preload);
  CHECK_FALSE(load_ok("cluster { kv_pool = true, kv_preload = false }\n" + kHead).kv_preload);
  expect_error("cluster { kv_preload = false }\n" + kHead, 1, "kv_preload needs kv_pool = true");
  expect_error("cluster { kv_pool = true, kv_preload = 0 }\n" + kHead, 1,
               "field 'kv_preload' must be a boolean, got number");
  expect_error("cluster { kv_pool = 1 }\n" + kHead, 1, "field 'kv_pool' must be a boolean, got number");
  expect_error("cluster { kv_replicate_reads = 2 }\n" + kHead, 1, "kv_replicate_reads needs kv_pool = true");
  expect_error("cluster { kv_pool = true, kv_replicate_reads = 0 }\n" + kHead, 1,
               "kv_replicate_reads 0 is out of range 1..1048576");
  expect_error(kHead + "node { name = 'kv', actors = { kv_store = 1 }, kv = { durable = true } }", 2,
               "kv.durable needs kv.dir");
  expect_error(kHead + "node { name = 'kv', actors = { kv_store = 1 }, kv = { dir = '/x', durable = 'yes' } }", 2,
               "kv.durable must be a boolean, got string");
  expect_error(kHead + "node { name = 'kv', actors = { kv_store = 1 }, kv = { tier0 = MiB, dir = '/x', durable = true } }",
               2, "a durable kv_store is RocksDB alone: kv.tier0 / kv.tier1 do not apply");
  ClusterSpec weighted = load_ok("cluster { router = { policy = 'kv_aware', fetch_weight = 0.5 } }\n" + kHead);
  CHECK(weighted.scheduling_policy == SchedulingPolicy::fcfs);
  CHECK(load_ok("cluster { scheduling_policy = 'priority' }\n" + kHead).scheduling_policy ==
        SchedulingPolicy::priority);
  expect_error("cluster { scheduling_policy = 'lifo' }\n" + kHead, 1,
               "unknown scheduling_policy 'lifo' (expected one of fcfs, priority)");
  CHECK(weighted.placement.fetch_weight == 0.5);
  expect_error("cluster { router = { policy = 'round_robin', fetch_weight = 0.5 } }\n" + kHead, 1,
               "fetch_weight applies to policy kv_aware only");
}

TEST_CASE("bad values and wrong types name the field") {
  expect_error(kHead + "node { name = 'd', device = 'gpu0', actors = { decode = 1 } }", 2,
               "node 'd': bad device 'gpu0' (expected \"cpu\" or \"cuda:N\")");
  expect_error(kHead + "node { name = 'd', device = 'cuda:', actors = { decode = 1 } }", 2,
               "bad device 'cuda:'");
  expect_error(kHead + "node { name = 'd e', actors = { decode = 1 } }", 2, "bad name 'd e'");
  expect_error(kHead + "node { actors = { decode = 1 } }", 2, "node{} needs a name");
  expect_error(kHead + "node { name = 'd', port = '7000', actors = { decode = 1 } }", 2,
               "node 'd': field 'port' must be an integer, got string");
  expect_error(kHead + "node { name = 'd', port = 70000, actors = { decode = 1 } }", 2,
               "port 70000 is out of range 0..65535");
  expect_error(kHead + "node { name = 'd', head = 'yes' }", 2,
               "field 'head' must be a boolean, got string");
  expect_error(kHead + "node { name = 'd', actors = 'decode' }", 2,
               "field 'actors' must be a table");
  expect_error(kHead + "node 'd'", 2, "node{} takes one table");
  expect_error(kHead + "cluster { max_pending = 0 }", 2, "max_pending 0 is out of range");
  expect_error(kHead + "cluster { heartbeat_interval_s = 1, connection_timeout_s = 0.5 }", 2,
               "connection_timeout_s (0.5) must exceed heartbeat_interval_s (1.0)");
  expect_error(kHead + "cluster { secret_env = 'A', secret_file = '/s' }", 2,
               "set secret_env or secret_file, not both");
  expect_error(kHead + "cluster {}\ncluster {}", 3, "cluster{} called twice (first at line 2)");
}

TEST_CASE("cluster-wide mistakes name the line of the node at fault") {
  expect_error(kHead + "node { name = 'd', actors = { decode = 1 } }\n"
                       "node { name = 'd', actors = { decode = 1 } }",
               3, "duplicate node name 'd' (first declared at line 2)");
  expect_error(kHead + "node { name = 'a', port = 7000, actors = { decode = 1 } }\n"
                       "node { name = 'b', port = 7000, actors = { decode = 1 } }",
               3, "duplicate address 127.0.0.1:7000: node 'b' and node 'a' (line 2)");
  // The same port on two hosts, and port 0 twice, are fine.
  load_ok(kHead + "node { name = 'a', port = 7000, actors = { decode = 1 } }\n"
                  "node { name = 'b', host = '10.0.0.3', port = 7000, actors = { decode = 1 } }\n"
                  "node { name = 'c', actors = { decode = 1 } }");
  expect_error("\nnode { name = 'a', actors = { colocated = 1 } }\nnode { name = 'b' }", 2,
               "no head node: mark exactly one node head = true");
  expect_error(kHead + "node { name = 'h2', head = true }", 2,
               "two head nodes: 'h2' and 'head' (line 1)");
  load_ok("node { name = 'h', head = true, actors = { prefill = 1 } }\n"
          "node { name = 'd', actors = { decode = 1 } }");
  expect_error("node { name = 'h', head = true, actors = { kv_store = 1 } }\n"
               "node { name = 'd', actors = { decode = 2 } }",
               2, "decode actors but no prefill or colocated actor in the cluster (P/D needs both)");
  expect_error("node { name = 'h', head = true, actors = { prefill = 1 } }", 1,
               "prefill actors but no decode or colocated actor");
  expect_error("node { name = 'h', head = true, actors = { kv_store = 1 } }", 1,
               "no actor serves requests");
}

TEST_CASE("a script with no node is refused") {
  Status st = load_bad("-- nothing here\nlocal x = 1\n");
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().rfind("topo.lua: no node declared", 0) == 0);
}

TEST_CASE("runtime and syntax errors keep the script line") {
  expect_error(kHead + "local t = nil\nlocal x = t.field", 3, "attempt to index a nil value");
  expect_error(kHead + "node { name = 'd', actors = { decode = 1 }", 2, "expected");
  expect_error(kHead + "error('custom failure')", 2, "custom failure");
  expect_error(kHead + "error('no position', 0)", 2, "no position");
  expect_error(kHead + "\n\nerror({})", 4, "error object of type table");
  // A multi-line message stays on one line.
  expect_error(kHead + "error('a\\nb')", 2, "a b");
}

TEST_CASE("the sandbox has no io os require dofile or bytecode") {
  expect_error(kHead + "local f = io.open('/etc/passwd')", 2, "global 'io'");
  expect_error(kHead + "os.execute('touch /tmp/cleave-pwned')", 2, "global 'os'");
  expect_error(kHead + "local m = require('os')", 2, "global 'require'");
  expect_error(kHead + "dofile('/etc/passwd')", 2, "global 'dofile'");
  expect_error(kHead + "loadfile('/etc/passwd')", 2, "global 'loadfile'");
  expect_error(kHead + "local d = debug.getinfo(1)", 2, "global 'debug'");
  expect_error(kHead + "local s = string.dump(function() end)", 2, "field 'dump'");
  // A bytecode string (what string.dump would give) is refused by load,
  // asked for binary mode outright or not.
  expect_error(kHead + "assert(load('\\27Lua\\84\\0 junk'))", 2, "attempt to load a binary chunk");
  expect_error(kHead + "load('\\27Lua', 'x', 'b')", 2, "only text chunks are allowed");
  expect_error(kHead + "load('\\27Lua', 'x', 'bt')", 2, "only text chunks are allowed");
  // Text chunks still load, with or without an environment.
  load_ok(kHead + "assert(load('return 1 + 1')() == 2)\n"
                  "assert(load('return x', 'c', 't', { x = 5 })() == 5)");
  // Pattern matching can backtrack for hours in one C call: not there.
  expect_error(kHead + "local a = ('x'):rep(30):find('.-.-.-y')", 2, "method 'find'");
  expect_error(kHead + "local s = string.gsub('a', 'a', 'b')", 2, "field 'gsub'");
}

TEST_CASE("an endless loop stops at the instruction limit") {
  const auto t0 = std::chrono::steady_clock::now();
  Status st = load_bad(kHead + "local i = 0\nwhile true do i = i + 1 end");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("instruction limit reached after ", s, " s");
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().rfind("topo.lua:3: instruction limit of 10000000 instructions exceeded", 0) == 0);
}

TEST_CASE("pcall cannot catch the sandbox limits") {
  Status st = load_bad(kHead + "while true do\n  pcall(function() while true do end end)\nend");
  CHECK(st.message().find("instruction limit") != std::string::npos);
  st = load_bad(kHead + "local ok = pcall(function() local s = 'x' while true do s = s .. s end end)"
                        "\nnode { name = 'after' }");
  CHECK(st.message().find("memory limit") != std::string::npos);
  // Ordinary errors are still catchable.
  ClusterSpec c = load_ok(kHead + "local ok, e = pcall(error, 'boom')\nassert(not ok and e == 'boom')");
  CHECK(c.nodes.size() == 1);
}

TEST_CASE("a memory bomb stops at the memory limit") {
  const auto t0 = std::chrono::steady_clock::now();
  Status st = load_bad(kHead + "local s = 'x'\nwhile true do\n  s = s .. s\nend");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("memory limit reached after ", s, " s");
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().rfind("topo.lua:4: memory limit of 16 MiB exceeded", 0) == 0);

  st = load_bad(kHead + "local t = {}\nfor i = 1, 1e9 do t[i] = i end");
  CHECK(st.message().rfind("topo.lua:3: memory limit", 0) == 0);
  st = load_bad(kHead + "local s = string.rep('x', 100 * MiB)");
  CHECK(st.message().rfind("topo.lua:2: memory limit", 0) == 0);
}

TEST_CASE("time spent in library calls stops at the time limit") {
  TopologyLimits limits;
  limits.max_seconds = 0.2;
  limits.max_instructions = uint64_t(1) << 40;
  Status st = load_bad(kHead + "while true do\n  local s = string.rep('x', 4 * MiB)\nend", {}, limits);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("time limit of 0.2 s exceeded") != std::string::npos);
}

TEST_CASE("finalizers are refused") {
  // Lua runs __gc with hooks off, out of the instruction limit's reach.
  expect_error(kHead + "keep = setmetatable({}, { __gc = function() while true do end end })", 2,
               "__gc metamethods are not allowed");
  ClusterSpec c = load_ok(kHead + "local t = setmetatable({}, { __index = { x = 1 } })\nassert(t.x == 1)");
  CHECK(c.nodes.size() == 1);
}

TEST_CASE("topology files: missing file directory and binary chunk") {
  auto r = load_topology_file("/nonexistent/topo.lua");
  CHECK(r.status().code() == Code::not_found);
  CHECK(r.status().message().find("/nonexistent/topo.lua") != std::string::npos);
  r = load_topology_file(kExamples);
  CHECK(r.status().code() == Code::io_error);

  const fs::path dir = test::process_scratch("cleave-topo-test");
  const std::string path = (dir / "binary.lua").string();
  {
    std::ofstream out(path, std::ios::binary);
    out << "\x1bLua\x54" << std::string(32, '\0');
  }
  r = load_topology_file(path);
  CHECK(r.status().code() == Code::invalid_argument);
  CHECK(r.status().message().find("attempt to load a binary chunk") != std::string::npos);
  // A long path is named in full, not cut to Lua's 60 characters.
  const std::string long_path = (dir / (std::string(80, 'a') + ".lua")).string();
  {
    std::ofstream out(long_path);
    out << kHead << "node { name = 'x', actors = { decode = 0 } }\n";
  }
  r = load_topology_file(long_path);
  CHECK(r.status().message().rfind(long_path + ":2: ", 0) == 0);
  fs::remove_all(dir);
}

TEST_CASE("placement_table lists every node and actor count") {
  ClusterSpec c = load_ok(R"(cluster { router = "least_loaded" }
node { name = "head", head = true, port = 7000, actors = { prefill = 1, kv_store = 1 },
       kv = { tier0 = 64 * MiB, dir = "/var/kv" } }
for i = 1, 3 do node { name = "dec" .. i, threads = i, device = "cuda:" .. (i - 1), actors = { decode = i } } end
)");
  const std::string t = placement_table(c);
  MESSAGE(t);
  for (const char* needle :
       {"router least_loaded", "head", "127.0.0.1:7000", "prefill 1, kv_store 1", "64 MiB",
        "default", "/var/kv", "dec1", "dec2", "dec3", "decode 1", "decode 2", "decode 3", "cuda:2",
        "worker", "total: 4 nodes, 8 actors (prefill 1, decode 6, kv_store 1)"})
    CHECK_MESSAGE(t.find(needle) != std::string::npos, needle);
  CHECK(topology_summary(c) ==
        "4 nodes, 8 actors (prefill 1, decode 6, kv_store 1), head 'head' at 127.0.0.1:7000, "
        "router least_loaded");
}

TEST_CASE("the examples load") {
  int seen = 0;
  for (const auto& entry : fs::directory_iterator(kExamples)) {
    if (entry.path().extension() != ".lua") continue;
    ++seen;
    auto r = load_topology_file(entry.path().string());
    CHECK_MESSAGE(r.ok(), r.status().to_string());
  }
  CHECK(seen >= 4);

  auto one = load_topology_file(kExamples + "/one_process.lua", {{"head_port", "7000"}});
  REQUIRE(one.ok());
  CHECK(one->nodes.size() == 1);
  CHECK(one->nodes[0].port == 7000);
  CHECK(one->count("colocated") == 1);
  auto split = load_topology_file(kExamples + "/one_process.lua", {{"split", "true"}});
  REQUIRE(split.ok());
  CHECK(split->count("prefill") == 1);
  CHECK(split->count("decode") == 1);

  auto pd = load_topology_file(kExamples + "/pd_2nodes.lua",
                               {{"prefill_port", "7000"}, {"decode_port", "7001"}});
  REQUIRE(pd.ok());
  REQUIRE(pd->nodes.size() == 2);
  CHECK(pd->head().count("prefill") == 1);
  CHECK(pd->head().count("kv_store") == 1);
  CHECK(pd->head().port == 7000);
  CHECK(pd->find("decode")->count("decode") == 1);
  CHECK(pd->find("decode")->port == 7001);

  auto p1d2 = load_topology_file(kExamples + "/p1_d2.lua");
  REQUIRE(p1d2.ok());
  CHECK(p1d2->nodes.size() == 3);
  CHECK(p1d2->count("prefill") == 1);
  CHECK(p1d2->count("decode") == 2);
  CHECK(p1d2->find("d0")->count("decode") == 1);
  CHECK(p1d2->find("d1")->count("decode") == 1);

  auto epd = load_topology_file(kExamples + "/epd_3nodes.lua");
  REQUIRE(epd.ok());
  CHECK(epd->nodes.size() == 3);
  const NodeSpec* enc = epd->find("encoder");
  REQUIRE(enc != nullptr);
  REQUIRE(enc->actors.size() == 1);
  CHECK(enc->actors[0].kind == "vision_encoder");
}

// Every input that ever made fuzz_topology fail (tests/fuzz/regressions/
// topology/, replayed by the ctest fuzz_topology too) loads or gives a
// one-line invalid_argument naming the script. Under the ASan build
// LeakSanitizer checks what the fuzzer found first: the error paths of
// cluster{ router = ... } and actors = { KIND = n } raised (longjmp) past a
// local std::string, leaking it. Then: the pipelines' cut checks (after the
// script ran) returned errors without the script's name.
TEST_CASE("topology: the fuzz regression inputs load or fail with a one-line error") {
  const fs::path dir = fs::path(CLEAVE_SOURCE_DIR) / "tests/fuzz/regressions/topology";
  TopologyLimits limits;  // fuzz_topology's
  limits.max_instructions = 200'000;
  limits.max_memory_bytes = 4 << 20;
  limits.max_seconds = 1.0;
  size_t n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string script((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    INFO(entry.path().string());
    auto r = load_topology_string(script, "fuzz.lua", {}, limits);
    ++n;
    if (r.ok()) continue;
    CHECK(r.status().code() == Code::invalid_argument);
    CHECK(r.status().message().rfind("fuzz.lua:", 0) == 0);
    CHECK(r.status().message().find('\n') == std::string::npos);
    if (entry.path().filename() == "unknown-router-policy-leak")
      CHECK(r.status().message().find("unknown router policy") != std::string::npos);
    if (entry.path().filename() == "pipeline-overlap-unnamed")  // the pipeline checks name the script too
      CHECK(r.status().message().find("overlaps node 'prefill1_1'") != std::string::npos);
  }
  CHECK(n >= 1);
  // The other path the fix covers: an unknown actor kind.
  expect_error("node { name = 'h', head = true, actors = { fastest = 1 } }\n", 1,
               "unknown actor kind 'fastest'");
}

TEST_CASE("pipelines: stage{} cuts a model over nodes, gaps, overlaps and ranges past the model are refused") {
  const std::string head = "node { name = 'a', head = true, actors = { prefill = 1, kv_store = 1 }, "
                           "stage = { layers = {0, 5} } }\n"
                           "node { name = 'd', actors = { decode = 1 } }\n";
  ClusterSpec c = load_ok(head + "node { name = 'b', actors = { stage = 1 }, stage = { layers = {6, 11} } }\n");
  REQUIRE(c.nodes.size() == 3);
  CHECK(c.nodes[0].stage.set);
  CHECK(c.nodes[0].stage.pipeline == "main");
  CHECK(c.nodes[2].stage.layers == LayerRange{6, 11});
  CHECK(c.nodes[2].count("stage") == 1);
  CHECK_FALSE(c.nodes[1].stage.set);
  const auto nodes = pipeline_nodes(c, "main");
  REQUIRE(nodes.size() == 2);
  CHECK(nodes[0]->name == "a");
  CHECK(nodes[1]->name == "b");
  LlamaConfig twelve;
  twelve.n_layers = 12;
  CHECK(check_topology_pipelines(c, &twelve).ok());
  LlamaConfig ten = twelve, sixteen = twelve;
  ten.n_layers = 10;
  sixteen.n_layers = 16;
  CHECK(check_topology_pipelines(c, &ten).message() ==
        "pipeline 'main': node 'b' (line 3) holds [6, 11], past the model's layers [0, 9]");
  CHECK(check_topology_pipelines(c, &sixteen).message() ==
        "pipeline 'main': layers [12, 15] are held by no stage (a gap after node 'b' (line 3))");
  // A gap and an overlap between the stages, at load.
  Status gap = load_bad(head + "node { name = 'b', actors = { stage = 1 }, stage = { layers = {7, 11} } }\n");
  CHECK(gap.message().find("pipeline 'main': layers [6, 6] are held by no stage (a gap before node 'b' "
                           "(line 3), [7, 11])") != std::string::npos);
  Status overlap = load_bad(head + "node { name = 'b', actors = { stage = 1 }, stage = { layers = {5, 11} } }\n");
  CHECK(overlap.message().find("node 'b' (line 3) holds [5, 11], which overlaps node 'a' (line 1), [0, 5]") !=
        std::string::npos);
  // Two pipelines cut differently (prefill over 2 nodes, decode over 3).
  load_ok("node { name = 'a', head = true, actors = { prefill = 1, kv_store = 1 }, stage = { layers = {0, 5}, pipeline = 'p' } }\n"
          "node { name = 'b', actors = { stage = 1 }, stage = { layers = {6, 11}, pipeline = 'p' } }\n"
          "node { name = 'c', actors = { decode = 1 }, stage = { layers = {0, 3}, pipeline = 'd' } }\n"
          "node { name = 'e', actors = { stage = 1 }, stage = { layers = {4, 7}, pipeline = 'd' } }\n"
          "node { name = 'f', actors = { stage = 1 }, stage = { layers = {8, 11}, pipeline = 'd' } }\n");
  // Node-level refusals, each naming the rule.
  auto refused = [&](const std::string& script, const std::string& part) {
    Status st = load_bad(script);
    CHECK_MESSAGE(st.message().find(part) != std::string::npos, st.message());
  };
  refused("node { name = 'a', head = true, actors = { colocated = 1, stage = 1 } }\n", "a stage actor needs stage =");
  refused("node { name = 'a', head = true, actors = { colocated = 1, stage = 1 }, stage = { layers = {1, 2} } }\n",
          "not both");
  refused("node { name = 'a', head = true, actors = { colocated = 1 } }\n"
          "node { name = 'b', actors = { stage = 1 }, stage = { layers = {0, 2} } }\n",
          "a later stage cannot hold layer 0");
  refused("node { name = 'a', head = true, actors = { colocated = 2 }, stage = { layers = {0, 2} } }\n",
          "it must host exactly one (it hosts 2)");
  refused("node { name = 'a', head = true, actors = { colocated = 1 }, stage = { layers = {1, 2} } }\n",
          "a pipeline's first stage holds layers from 0");
  refused("node { name = 'a', head = true, actors = { colocated = 1 }, stage = { layers = {3, 1} } }\n",
          "is not a range");
  refused("node { name = 'a', head = true, actors = { colocated = 1 }, stage = { layers = {0, 1}, pipe = 'x' } }\n",
          "pipe");
  refused("node { name = 'a', head = true, actors = { colocated = 1 } }\n"
          "node { name = 'b', actors = { stage = 1 }, stage = { layers = {1, 2} } }\n",
          "pipeline 'main' has 0 first stages");
}
