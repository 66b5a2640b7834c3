// cluster{}'s controllers (pd_controller, autoscale with its encoder fields)
// and a node that joins with --join: fields parsed, the report line, and
// every refusal naming its field.
#include <doctest/doctest.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "actors/topology.h"
#include "tests/actors/topology_util.h"

using namespace cleave;
using namespace cleave::testing;

TEST_CASE("cluster pd_controller: goals for the P:D controller, checked, and only with prefill and decode") {
  const std::string pd = "node { name = 'head', head = true, actors = { prefill = 1, decode = 2 } }\n";
  auto c = load_ok("cluster { pd_controller = { ttft_ms = 500, tpot_ms = 50, interval_s = 0.5, confirm = 2, "
                   "cooldown_s = 10, margin = 0.5, switch_grace_s = 0.5 } }\n" + pd);
  CHECK(c.pd_controller.enabled());
  CHECK(c.pd_controller.ttft_ms == 500);
  CHECK(c.pd_controller.tpot_ms == 50);
  CHECK(c.pd_controller.interval_s == 0.5);
  CHECK(c.pd_controller.confirm == 2);
  CHECK(c.pd_controller.cooldown_s == 10);
  CHECK(c.pd_controller.margin == 0.5);
  CHECK(c.pd_controller.switch_grace_s == 0.5);
  CHECK(placement_table(c).find("pd controller (ttft 500 ms, tpot 50 ms, every 0.5 s, confirm 2, cooldown 10 s, "
                                "switch grace 0.5 s)") != std::string::npos);
  CHECK(load_ok("cluster { pd_controller = { tpot_ms = 9 } }\n" + pd).pd_controller.switch_grace_s == 2);
  CHECK_FALSE(load_ok(pd).pd_controller.enabled());
  struct Bad {
    std::string script;
    const char* message;
  };
  for (const Bad& b : {Bad{"cluster { pd_controller = { ttft_ms = 500 } }\n" + kHead, "needs prefill and decode actors"},
                       Bad{"cluster { pd_controller = { interval_s = 2 } }\n" + pd, "needs a goal"},
                       Bad{"cluster { pd_controller = { ttft_ms = -1 } }\n" + pd, "ttft_ms must be from 0 to 1e9"},
                       Bad{"cluster { pd_controller = { ttft_ms = 5, confirm = 0 } }\n" + pd, "confirm must be 1 to 1000"},
                       Bad{"cluster { pd_controller = { ttft_ms = 5, confirm = 1.5 } }\n" + pd, "whole number"},
                       Bad{"cluster { pd_controller = { ttft_ms = 'fast' } }\n" + pd, "ttft_ms must be a number"},
                       Bad{"cluster { pd_controller = { ttft = 5 } }\n" + pd, "ttft"},
                       Bad{"cluster { pd_controller = { ttft_ms = 5, switch_grace_s = -1 } }\n" + pd,
                           "switch_grace_s must be 0 to 3600"},
                       Bad{"cluster { pd_controller = { switch_grace_s = 1 } }\n" + kHead, "needs a goal"},
                       Bad{"cluster { pd_controller = 5 }\n" + pd, "field 'pd_controller' must be a table"}}) {
    CAPTURE(b.script);
    auto r = load_topology_string(b.script, "topo.lua");
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == Code::invalid_argument);
    CHECK_MESSAGE(r.status().message().find(b.message) != std::string::npos, r.status().message());
  }
}

TEST_CASE("cluster autoscale: a TTFT goal for the entry stages, reactive or with Holt's forecast, checked") {
  const std::string three = "node { name = 'head', head = true, actors = { colocated = 3 } }\n";
  auto c = load_ok("cluster { autoscale = { ttft_ms = 400, min_stages = 2, interval_s = 0.5, cooldown_s = 4, "
                   "forecast = 'holt', stage_rps = 3.5, horizon_s = 6, alpha = 0.4, beta = 0.2, confirm = 3, "
                   "low = 0.3 } }\n" + three);
  CHECK(c.autoscale.enabled());
  CHECK(c.autoscale.ttft_ms == 400);
  CHECK(c.autoscale.min_stages == 2);
  CHECK(c.autoscale.interval_s == 0.5);
  CHECK(c.autoscale.cooldown_s == 4);
  CHECK(c.autoscale.holt());
  CHECK(c.autoscale.stage_rps == 3.5);
  CHECK(c.autoscale.horizon_s == 6);
  CHECK(c.autoscale.alpha == 0.4);
  CHECK(c.autoscale.beta == 0.2);
  CHECK(c.autoscale.confirm == 3);
  CHECK(c.autoscale.low == 0.3);
  CHECK(placement_table(c).find("autoscale (ttft 400 ms, min 2, every 0.5 s, holt forecast 6 s ahead at 3.5 req/s "
                                "per stage)") != std::string::npos);
  auto r = load_ok("cluster { autoscale = { ttft_ms = 300 } }\n" + three);
  CHECK(r.autoscale.forecast == "none");
  CHECK(placement_table(r).find("autoscale (ttft 300 ms, min 1, every 1 s, reactive, confirm 2, cooldown 5 s)") !=
        std::string::npos);
  CHECK_FALSE(load_ok(three).autoscale.enabled());
  const std::string pd = "node { name = 'head', head = true, actors = { prefill = 2, decode = 1 } }\n";
  CHECK(load_ok("cluster { autoscale = { ttft_ms = 300, min_stages = 2 } }\n" + pd).autoscale.min_stages == 2);
  struct Bad {
    std::string script;
    const char* message;
  };
  for (const Bad& b :
       {Bad{"cluster { autoscale = { forecast = 'holt', stage_rps = 2 } }\n" + three, "ttft_ms must be above 0"},
        Bad{"cluster { autoscale = { ttft_ms = 300, forecast = 'holt' } }\n" + three, "needs stage_rps"},
        Bad{"cluster { autoscale = { ttft_ms = 300, stage_rps = 2 } }\n" + three, "stage_rps needs forecast"},
        Bad{"cluster { autoscale = { ttft_ms = 300, forecast = 'arima' } }\n" + three, "forecast must be"},
        Bad{"cluster { autoscale = { ttft_ms = 300, forecast = 7 } }\n" + three, "forecast must be a string"},
        Bad{"cluster { autoscale = { ttft_ms = 300, min_stages = 4 } }\n" + three, "min_stages 4 is more than the 3"},
        Bad{"cluster { autoscale = { ttft_ms = 300, min_stages = 3 } }\n" + pd, "min_stages 3 is more than the 2"},
        Bad{"cluster { autoscale = { ttft_ms = 300, min_stages = 1.5 } }\n" + three, "whole number"},
        Bad{"cluster { autoscale = { ttft_ms = 300, low = 1 } }\n" + three, "low must be"},
        Bad{"cluster { autoscale = { ttft_ms = 300, speed = 1 } }\n" + three, "speed"},
        Bad{"cluster { autoscale = true }\n" + three, "field 'autoscale' must be a table"},
        Bad{"cluster { autoscale = { ttft_ms = 300 }, pd_controller = { ttft_ms = 300 } }\n" + pd,
            "autoscale and cluster{}.pd_controller together"}}) {
    CAPTURE(b.script);
    auto res = load_topology_string(b.script, "topo.lua");
    REQUIRE_FALSE(res.ok());
    CHECK(res.status().code() == Code::invalid_argument);
    CHECK_MESSAGE(res.status().message().find(b.message) != std::string::npos, res.status().message());
  }
}

TEST_CASE("cluster autoscale of the vision encoders: encode_ms, min_encoders, max_active, checked") {
  const std::string epd =
      "node { name = 'head', head = true, actors = { prefill = 2, decode = 1, vision_encoder = 3 } }\n";
  auto c = load_ok("cluster { autoscale = { ttft_ms = 400, encode_ms = 150, min_encoders = 2, max_active = 4 } }\n" +
                   epd);
  CHECK(c.autoscale.encoders());
  CHECK(c.autoscale.encode_ms == 150);
  CHECK(c.autoscale.min_encoders == 2);
  CHECK(c.autoscale.max_active == 4);
  CHECK_MESSAGE(placement_table(c).find("autoscale (ttft 400 ms, min 1, every 1 s, reactive, confirm 2, cooldown 5 s; "
                                        "encoders: encode 150 ms, min 2, at most 4 stages and encoders at once)") !=
                    std::string::npos,
                placement_table(c));
  auto d = load_ok("cluster { autoscale = { ttft_ms = 400, encode_ms = 150 } }\n" + epd);
  CHECK(d.autoscale.min_encoders == 1);
  CHECK(d.autoscale.max_active == 0);
  CHECK(placement_table(d).find("; encoders: encode 150 ms, min 1)") != std::string::npos);
  auto f = load_ok("cluster { autoscale = { ttft_ms = 400, forecast = 'holt', stage_rps = 4, encode_ms = 150, "
                   "encoder_rps = 20 } }\n" + epd);
  CHECK(f.autoscale.encoder_rps == 20);
  CHECK(f.autoscale.encoder_config().holt());
  CHECK_MESSAGE(placement_table(f).find("; encoders: encode 150 ms, min 1, holt forecast at 20 req/s per encoder)") !=
                    std::string::npos,
                placement_table(f));
  const std::string text_only = "node { name = 'head', head = true, actors = { colocated = 2 } }\n";
  for (auto [script, message] : std::vector<std::pair<std::string, const char*>>{
           {"cluster { autoscale = { ttft_ms = 400, encode_ms = 150, min_encoders = 4 } }\n" + epd,
            "min_encoders 4 is more than the 3 vision_encoder actors"},
           {"cluster { autoscale = { ttft_ms = 400, encode_ms = 150 } }\n" + text_only,
            "min_encoders 1 is more than the 0 vision_encoder actors"},
           {"cluster { autoscale = { ttft_ms = 400, min_encoders = 2 } }\n" + epd, "min_encoders needs encode_ms"},
           {"cluster { autoscale = { ttft_ms = 400, max_active = 3 } }\n" + epd, "max_active needs encode_ms"},
           {"cluster { autoscale = { ttft_ms = 400, encode_ms = 150, max_active = 1 } }\n" + epd,
            "max_active must be 0 (no budget) or from min_stages + min_encoders (2)"},
           {"cluster { autoscale = { ttft_ms = 400, encode_ms = '150' } }\n" + epd, "encode_ms must be a number"},
           {"cluster { autoscale = { ttft_ms = 400, encode_ms = 150, max_active = 2.5 } }\n" + epd, "whole number"},
           {"cluster { autoscale = { encode_ms = 150 } }\n" + epd, "ttft_ms must be above 0"},
           {"cluster { autoscale = { ttft_ms = 400, encode_ms = 150, encoder_rps = 20 } }\n" + epd,
            "encoder_rps needs encode_ms and forecast = \"holt\""},
           {"cluster { autoscale = { ttft_ms = 400, forecast = 'holt', stage_rps = 4, encode_ms = 150, "
            "encoder_rps = 'fast' } }\n" + epd, "encoder_rps must be a number"}}) {
    CAPTURE(script);
    auto res = load_topology_string(script, "topo.lua");
    REQUIRE_FALSE(res.ok());
    CHECK(res.status().code() == Code::invalid_argument);
    CHECK_MESSAGE(res.status().message().find(message) != std::string::npos, res.status().message());
  }
}

TEST_CASE("a joining node: --actors parsed into a worker of the head's model, refusals named") {
  const std::string pd = "node { name = 'head', head = true, port = param('head_port', 0), actors = { prefill = 1 } }\n"
                         "node { name = 'd0', actors = { decode = 1 } }\n";
  auto c = load_topology_string(pd, "pd.lua", {{"head_port", "7000"}});
  REQUIRE(c.ok());
  CHECK(c->source == pd);  // what a head hands a joining node
  CHECK(c->source_name == "pd.lua");
  CHECK(c->source_args.at("head_port") == "7000");
  ClusterSpec spec = *c;
  REQUIRE(add_joining_node(spec, "e1", "vision_encoder=2,decode=3").ok());
  const NodeSpec* e1 = spec.find("e1");
  REQUIRE(e1);
  CHECK_FALSE(e1->head);
  CHECK(e1->host == "127.0.0.1");
  CHECK(e1->port == 0);
  CHECK(e1->model == spec.head().model);
  CHECK(e1->count("decode") == 3);
  CHECK(e1->count("vision_encoder") == 2);
  REQUIRE(e1->actors.size() == 2);
  CHECK(e1->actors[0].kind == "decode");  // in kActorKindTable order, as the loader makes them
  CHECK(spec.count("decode") == 4);
  for (auto [name, actors, message] : std::vector<std::tuple<std::string, std::string, const char*>>{
           {"d0", "decode=1", "the script declares 'd0'"},
           {"e1", "decode=1", "the script declares 'e1'"},
           {"bad name", "decode=1", "must be 1 to 64 of"},
           {"e2", "", "names no actor"},
           {"e2", "decoder=1", "unknown actor kind 'decoder'"},
           {"e2", "kv_store=1", "cannot host 'kv_store'"},
           {"e2", "expert=1", "cannot host 'expert'"},
           {"e2", "decode=0", "must be 1 to 4096, got '0'"},
           {"e2", "decode=5000", "must be 1 to 4096"},
           {"e2", "decode=2x", "got '2x'"},
           {"e2", "decode", "got ''"},
           {"e2", "decode=1,decode=2", "'decode' given twice"}}) {
    CAPTURE(name);
    CAPTURE(actors);
    ClusterSpec s = spec;
    Status st = add_joining_node(s, name, actors);
    CHECK(st.code() == Code::invalid_argument);
    CHECK_MESSAGE(st.message().find(message) != std::string::npos, st.message());
    CHECK(s.nodes.size() == spec.nodes.size());  // nothing added
  }
  // A prefill joining a colocated cluster hands off to the colocated stages.
  auto only = load_topology_string("node { name = 'head', head = true, actors = { colocated = 1 } }\n", "c.lua");
  REQUIRE(only.ok());
  ClusterSpec s = *only;
  CHECK(add_joining_node(s, "p9", "prefill=1").ok());
  // The head's script as a joining node loads it: the head's address is
  // where it was reached, whatever the script says.
  auto joined = load_joined_topology(pd, "pd.lua", {}, "10.1.2.3", 7123);
  REQUIRE(joined.ok());
  CHECK(joined->head().host == "10.1.2.3");
  CHECK(joined->head().port == 7123);
  auto broken = load_joined_topology("node { name = 'x' ", "head.lua", {}, "h", 1);
  CHECK(broken.status().code() == Code::invalid_argument);
  CHECK(load_joined_topology(std::string((1 << 20) + 1, ' '), "big.lua", {}, "h", 1).status().message().find(
            "over the limit") != std::string::npos);
}

TEST_CASE("cluster cache types: -ctk / -ctv for every node, named in the summary, refused when unknown") {
  const ClusterSpec plain = load_ok(kHead);
  CHECK(plain.cache_type_k == DType::F32);
  CHECK(plain.cache_type_v == DType::F32);
  CHECK(topology_summary(plain).find("KV cache") == std::string::npos);
  const ClusterSpec q = load_ok("cluster { cache_type_k = 'q8_0', cache_type_v = 'f16' }\n" + kHead);
  CHECK(q.cache_type_k == DType::Q8_0);
  CHECK(q.cache_type_v == DType::F16);
  CHECK(topology_summary(q).find("KV cache Q8_0 K / F16 V") != std::string::npos);
  CHECK(load_ok("cluster { cache_type_v = 'f16' }\n" + kHead).cache_type_k == DType::F32);
  const ClusterSpec q4 = load_ok("cluster { cache_type_k = 'q8_0', cache_type_v = 'q4_0' }\n" + kHead);
  CHECK(q4.cache_type_v == DType::Q4_0);
  CHECK(topology_summary(q4).find("KV cache Q8_0 K / Q4_0 V") != std::string::npos);
  expect_error("cluster { cache_type_k = 'bf16' }\n" + kHead, 1,
               "unknown cache_type_k 'bf16' (expected f32, f16, q8_0 or q4_0)");
  expect_error("cluster { cache_type_v = 8 }\n" + kHead, 1, "cache_type_v");
}

TEST_CASE("cluster block_size: --block-size for every node, named in the summary, refused outside vLLM's choices") {
  const ClusterSpec plain = load_ok(kHead);
  CHECK(plain.block_size == 16);
  CHECK(topology_summary(plain).find("KV blocks") == std::string::npos);
  const ClusterSpec b64 = load_ok("cluster { block_size = 64 }\n" + kHead);
  CHECK(b64.block_size == 64);
  CHECK(topology_summary(b64).find(", KV blocks of 64 positions") != std::string::npos);
  for (int n : {8, 16, 32, 128})
    CHECK(load_ok("cluster { block_size = " + std::to_string(n) + " }\n" + kHead).block_size == n);
  expect_error("cluster { block_size = 12 }\n" + kHead, 1, "block_size 12 is not one of 8, 16, 32, 64 or 128");
  expect_error("cluster { block_size = 0 }\n" + kHead, 1, "block_size 0 is not one of");
  expect_error("cluster { block_size = '64' }\n" + kHead, 1, "block_size");
  expect_error("cluster { block_size = 16.5 }\n" + kHead, 1, "block_size");
}

TEST_CASE("cluster compute: --compute for every node, named in the summary, refused when unknown") {
  const ClusterSpec plain = load_ok(kHead);
  CHECK(plain.compute == Compute::exact);
  CHECK(topology_summary(plain).find("compute") == std::string::npos);
  const ClusterSpec i8 = load_ok("cluster { compute = 'int8' }\n" + kHead);
  CHECK(i8.compute == Compute::int8);
  CHECK(topology_summary(i8).find(", compute int8") != std::string::npos);
  CHECK(load_ok("cluster { compute = 'exact' }\n" + kHead).compute == Compute::exact);
  expect_error("cluster { compute = 'int4' }\n" + kHead, 1, "unknown compute 'int4' (expected exact or int8)");
  expect_error("cluster { compute = true }\n" + kHead, 1, "compute");
}
