// The Prometheus registry and the server's metric set: promtool accepts the
// exposition (no lint findings), histogram buckets are cumulative with an
// inclusive le, label values are escaped, counters hold exact values after a
// known sequence and under concurrent increments, and the runtime's actor
// counters map to their metrics (monotonic across dead and restarted actors).
#include <doctest/doctest.h>
#include <unistd.h>

#include <sys/wait.h>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "server/metrics.h"

using namespace cleave;
using namespace cleave::server;
namespace fs = std::filesystem;

namespace {

// CLEAVE_PROMTOOL overrides the path (to try the missing-promtool paths).
std::string promtool_path() {
  const char* p = std::getenv("CLEAVE_PROMTOOL");
  return p != nullptr ? p : "/usr/bin/promtool";
}

struct Promtool {
  bool ran = false;
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// Pipes `text` into `promtool check metrics`. ran = false when promtool is
// missing and CLEAVE_REQUIRE_PROMTOOL is not set (the caller skips); with it
// set, a missing promtool fails the test.
Promtool promtool_check(const std::string& text) {
  Promtool r;
  const std::string promtool = promtool_path();
  if (access(promtool.c_str(), X_OK) != 0) {
    if (std::getenv("CLEAVE_REQUIRE_PROMTOOL") != nullptr)
      FAIL("CLEAVE_REQUIRE_PROMTOOL is set and " << promtool << " is missing");
    MESSAGE("promtool check skipped: " << promtool << " is missing (apt-get install prometheus)");
    return r;
  }
  const fs::path out =
      fs::temp_directory_path() / ("cleave_promtool_" + std::to_string(getpid()) + "_" +
                                   std::to_string(reinterpret_cast<uintptr_t>(&r)) + ".txt");
  const std::string cmd = "'" + promtool + "' check metrics > '" + out.string() + "' 2>&1";
  FILE* p = popen(cmd.c_str(), "w");
  REQUIRE(p != nullptr);
  REQUIRE(std::fwrite(text.data(), 1, text.size(), p) == text.size());
  const int status = pclose(p);
  REQUIRE(WIFEXITED(status));
  r.ran = true;
  r.exit_code = WEXITSTATUS(status);
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  fs::remove(out);
  return r;
}

void check_promtool_clean(const std::string& text) {
  Promtool r = promtool_check(text);
  if (!r.ran) return;
  INFO("exposition:\n" << text);
  CHECK_MESSAGE(r.exit_code == 0, "promtool: " << r.output);
  CHECK_MESSAGE(r.output.empty(), "promtool: " << r.output);
}

bool has_line(const std::string& text, const std::string& line) {
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);)
    if (l == line) return true;
  return false;
}

msg::Stats stats(std::string actor, std::vector<std::pair<std::string, uint64_t>> counters) {
  msg::Stats s;
  s.actor = std::move(actor);
  s.counters = std::move(counters);
  return s;
}

// A pd topology's stats as Frontend::stats() gives them: router, KV store,
// a prefill and a decode stage, a vision encoder.
std::vector<msg::Stats> pd_stats(uint64_t scale) {
  return {
      stats("router", {{"requests", 10 * scale},
                       {"queue_depth", 3},
                       {"stage_downs", 1 * scale},
                       {"replacements", 2 * scale},
                       {"rejected_slo", 3 * scale},
                       {"encodes", 4 * scale}}),
      stats("kv_store", {{"kv_puts", 5 * scale},
                         {"store_corrupt_detected", 1 * scale},
                         {"tier_hops_0_1", 11 * scale},
                         {"tier_hops_1_0", 4 * scale}}),
      stats("prefill/0", {{"requests", 10 * scale},
                          {"kv_blocks_put", 20 * scale},
                          {"kv_blocks_got", 0},
                          {"kv_errors", 1 * scale},
                          {"queue_depth", 2},
                          {"running", 1},
                          {"steps", 30 * scale},
                          {"step_us", 250000 * scale},
                          {"kv_transfers_aborted", 1 * scale},
                          {"kv_bytes_sent", 4096 * scale},
                          {"kv_blocks_sent", 8 * scale}}),
      stats("decode/0", {{"requests", 9 * scale},
                         {"kv_blocks_put", 0},
                         {"kv_blocks_got", 3 * scale},
                         {"kv_errors", 0},
                         {"queue_depth", 1},
                         {"running", 4},
                         {"steps", 50 * scale},
                         {"kv_transfers_failed", 2 * scale},
                         {"kv_bytes_received", 4000 * scale},
                         {"kv_blocks_received", 7 * scale},
                         {"expert_fallback_rows", 12 * scale},
                         {"expert_host_failures", 1 * scale},
                         {"expert_replicas_added", 2 * scale},
                         {"expert_routed_rows_0_3", 40 * scale},
                         {"expert_routed_rows_11_0", 7 * scale}}),
      stats("vision_encoder/0",
            {{"steps", 6 * scale}, {"cache_hits", 5 * scale}, {"encode_us", 1500000 * scale}}),
      stats("expert/0", {{"batches", 3 * scale}, {"refused", 0}, {"rows", 90 * scale}, {"busy_us", 500000 * scale},
                         {"busy_us_0_3", 250000 * scale}}),
      stats("expert/1", {{"batches", 1 * scale}, {"refused", 0}, {"rows", 30 * scale}, {"busy_us", 1500000 * scale},
                         {"busy_us_0_3", 500000 * scale}, {"busy_us_2_1", 1000000 * scale}}),
  };
}

}  // namespace

TEST_CASE("metrics: value formatting and escaping") {
  CHECK(prom::format_value(0) == "0");
  CHECK(prom::format_value(3) == "3");
  CHECK(prom::format_value(0.001) == "0.001");
  CHECK(prom::format_value(2.5) == "2.5");
  CHECK(prom::format_value(1.0 / 0.0) == "+Inf");
  CHECK(prom::format_value(-1.0 / 0.0) == "-Inf");
  CHECK(prom::format_value(0.0 / 0.0) == "NaN");
  CHECK(prom::escape_label_value("plain") == "plain");
  CHECK(prom::escape_label_value("a\"b\\c\nd") == "a\\\"b\\\\c\\nd");
  CHECK(prom::escape_help("x\\y\nz \"q\"") == "x\\\\y\\nz \"q\"");
  CHECK(std::string(ServerMetrics::content_type()) == "text/plain; version=0.0.4; charset=utf-8");
}

TEST_CASE("metrics: label values are escaped in the exposition, which promtool accepts") {
  prom::Registry reg;
  prom::Counter& c = reg.counter("test_things_total", "Things.\nSecond \\ line.", {"kind"});
  c.labels({"quote\"back\\slash\nnewline"}).inc(2);
  c.labels({"plain"}).inc();
  const std::string text = reg.render();
  CHECK(has_line(text, "# HELP test_things_total Things.\\nSecond \\\\ line."));
  CHECK(has_line(text, "# TYPE test_things_total counter"));
  CHECK(has_line(text, "test_things_total{kind=\"quote\\\"back\\\\slash\\nnewline\"} 2"));
  CHECK(has_line(text, "test_things_total{kind=\"plain\"} 1"));
  CHECK(c.value({"quote\"back\\slash\nnewline"}) == 2);
  CHECK(c.value({"absent"}) == 0);
  check_promtool_clean(text);
}

TEST_CASE("metrics: histogram buckets are cumulative, le inclusive, with +Inf, _sum and _count") {
  prom::Registry reg;
  prom::Histogram& h = reg.histogram("test_latency_seconds", "Latency.", {0.1, 0.5, 1.0});
  // Before any observation: every bucket at 0.
  std::string text = reg.render();
  CHECK(has_line(text, "test_latency_seconds_bucket{le=\"0.1\"} 0"));
  CHECK(has_line(text, "test_latency_seconds_bucket{le=\"+Inf\"} 0"));
  CHECK(has_line(text, "test_latency_seconds_count 0"));
  for (double v : {0.05, 0.1, 0.2, 0.5, 0.7, 1.0, 3.0, 3.0}) h.observe(v);
  h.observe(0.0 / 0.0);  // dropped
  const auto s = h.snapshot();
  REQUIRE(s.cumulative.size() == 4);
  CHECK(s.cumulative[0] == 2);  // 0.05, 0.1 (le is inclusive)
  CHECK(s.cumulative[1] == 4);  // + 0.2, 0.5
  CHECK(s.cumulative[2] == 6);  // + 0.7, 1.0
  CHECK(s.cumulative[3] == 8);  // + 3.0 twice
  CHECK(s.count == 8);
  CHECK(s.sum == doctest::Approx(8.55));
  text = reg.render();
  CHECK(has_line(text, "# TYPE test_latency_seconds histogram"));
  CHECK(has_line(text, "test_latency_seconds_bucket{le=\"0.1\"} 2"));
  CHECK(has_line(text, "test_latency_seconds_bucket{le=\"0.5\"} 4"));
  CHECK(has_line(text, "test_latency_seconds_bucket{le=\"1\"} 6"));
  CHECK(has_line(text, "test_latency_seconds_bucket{le=\"+Inf\"} 8"));
  CHECK(has_line(text, "test_latency_seconds_sum 8.55"));
  CHECK(has_line(text, "test_latency_seconds_count 8"));

  // With labels: le comes last, each child has its own buckets.
  prom::Histogram& hl = reg.histogram("test_size_bytes", "Sizes.", {10, 100}, {"route"});
  hl.labels({"/a"}).observe(5);
  hl.labels({"/b"}).observe(50);
  hl.labels({"/b"}).observe(500);
  text = reg.render();
  CHECK(has_line(text, "test_size_bytes_bucket{route=\"/a\",le=\"10\"} 1"));
  CHECK(has_line(text, "test_size_bytes_bucket{route=\"/b\",le=\"10\"} 0"));
  CHECK(has_line(text, "test_size_bytes_bucket{route=\"/b\",le=\"100\"} 1"));
  CHECK(has_line(text, "test_size_bytes_bucket{route=\"/b\",le=\"+Inf\"} 2"));
  CHECK(has_line(text, "test_size_bytes_count{route=\"/b\"} 2"));
  CHECK(has_line(text, "test_size_bytes_sum{route=\"/b\"} 550"));
  CHECK(hl.snapshot({"/absent"}).count == 0);
  check_promtool_clean(text);
}

TEST_CASE("metrics: gauges set, move and replace their children") {
  prom::Registry reg;
  prom::Gauge& g = reg.gauge("test_depth", "Depth.");
  g.set(5);
  g.labels({}).inc(2);
  g.labels({}).dec(4);
  CHECK(g.value() == 3);
  prom::Gauge& gl = reg.gauge("test_stat", "Stats.", {"actor", "name"});
  gl.labels({"a", "x"}).set(1);
  gl.replace_all({{{"b", "y"}, 2}, {{"b", "z"}, 3}});
  const std::string text = reg.render();
  CHECK(has_line(text, "test_depth 3"));
  CHECK_FALSE(has_line(text, "test_stat{actor=\"a\",name=\"x\"} 1"));
  CHECK(has_line(text, "test_stat{actor=\"b\",name=\"y\"} 2"));
  CHECK(has_line(text, "test_stat{actor=\"b\",name=\"z\"} 3"));
  check_promtool_clean(text);
}

TEST_CASE("metrics: concurrent increments and observations are exact") {
  prom::Registry reg;
  prom::Counter& plain = reg.counter("test_hits_total", "Hits.");
  prom::Counter& labelled = reg.counter("test_labelled_total", "Labelled.", {"worker"});
  prom::Histogram& h = reg.histogram("test_obs_seconds", "Observations.", {0.5});
  prom::Gauge& g = reg.gauge("test_level", "Level.");
  constexpr int kThreads = 8, kEach = 20000;
  std::atomic<bool> stop{false};
  std::thread renderer([&] {  // renders race the updates
    while (!stop.load()) (void)reg.render();
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        plain.inc();
        labelled.labels({std::to_string(t % 2)}).inc(0.5);  // children created concurrently
        h.observe(i % 2 == 0 ? 0.25 : 1.0);
        g.labels({}).inc();
        g.labels({}).dec(2);
      }
    });
  }
  for (auto& th : threads) th.join();
  stop = true;
  renderer.join();
  CHECK(plain.value() == double(kThreads) * kEach);
  CHECK(labelled.value({"0"}) == 0.5 * (kThreads / 2) * kEach);
  CHECK(labelled.value({"1"}) == 0.5 * (kThreads / 2) * kEach);
  const auto s = h.snapshot();
  CHECK(s.count == uint64_t(kThreads) * kEach);
  CHECK(s.cumulative[0] == uint64_t(kThreads) * kEach / 2);
  CHECK(s.sum == doctest::Approx(kThreads * (kEach / 2) * 1.25));
  CHECK(g.value() == -double(kThreads) * kEach);

  // ServerMetrics' record API from many threads.
  ServerMetrics m;
  threads.clear();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) {
        m.on_request_start();
        m.on_first_token(0.05, 0.01);
        m.on_token(0.01);
        m.on_finish("stop", 0.5, 10, 2, 4);
        m.on_http("/v1/completions", 200);
      }
    });
  }
  for (auto& th : threads) th.join();
  const std::string text = m.render();
  CHECK(has_line(text, "cleave_request_success_total{finished_reason=\"stop\"} 8000"));
  CHECK(has_line(text, "cleave_generation_tokens_total 16000"));
  CHECK(
      has_line(text, "cleave_http_requests_total{route=\"/v1/completions\",status=\"200\"} 8000"));
  CHECK(has_line(text, "cleave_num_requests_running 0"));
  CHECK(has_line(text, "cleave_num_requests_waiting 0"));
}

TEST_CASE("server metrics: a known sequence of requests") {
  ServerMetrics m;
  // Before anything: every unlabelled family at 0, the finish reasons at 0.
  std::string text = m.render();
  CHECK(has_line(text, "cleave_prompt_tokens_total 0"));
  CHECK(text.find("cleave_kv_cache_usage_perc 0") == std::string::npos);  // not set: no sample
  CHECK(has_line(text, "cleave_request_success_total{finished_reason=\"error\"} 0"));
  CHECK(has_line(text, "cleave_time_to_first_token_seconds_count 0"));

  // A: 3 tokens, stop. B: 2 tokens then the client goes away. C: fails
  // before its first token. D: arrives, still waiting.
  m.on_request_start();  // A
  m.on_request_start();  // B
  m.on_request_start();  // C
  m.on_request_start();  // D
  text = m.render();
  CHECK(has_line(text, "cleave_num_requests_waiting 4"));
  CHECK(has_line(text, "cleave_num_requests_running 0"));
  m.on_first_token(0.03, 0.002);  // A
  m.on_first_token(0.2, 0.15);    // B
  text = m.render();
  CHECK(has_line(text, "cleave_num_requests_waiting 2"));
  CHECK(has_line(text, "cleave_num_requests_running 2"));
  m.on_token(0.012);                     // A
  m.on_token(0.03);                      // A
  m.on_token(0.2);                       // B
  m.on_finish("stop", 0.9, 100, 3, 64);  // A
  m.on_cancel();                         // B
  m.on_finish("abort", 0.45, 50, 2, 0);  // B
  m.on_finish("error", 0.01, 20, 0, 0);  // C
  m.on_http("/v1/completions", 200);
  m.on_http("/v1/completions", 200);
  m.on_http("/v1/completions", 500);
  m.on_http("/health", 200);
  m.set_kv_cache_usage(0.25);
  text = m.render();
  CHECK(has_line(text, "cleave_num_requests_waiting 1"));
  CHECK(has_line(text, "cleave_num_requests_running 0"));
  CHECK(has_line(text, "cleave_kv_cache_usage_perc 0.25"));
  CHECK(has_line(text, "cleave_prompt_tokens_total 170"));
  CHECK(has_line(text, "cleave_generation_tokens_total 5"));
  CHECK(has_line(text, "cleave_prefix_cache_queries_total 150"));  // A and B reached a cache
  CHECK(has_line(text, "cleave_prefix_cache_hits_total 64"));
  CHECK(has_line(text, "cleave_request_success_total{finished_reason=\"stop\"} 1"));
  CHECK(has_line(text, "cleave_request_success_total{finished_reason=\"abort\"} 1"));
  CHECK(has_line(text, "cleave_request_success_total{finished_reason=\"error\"} 1"));
  CHECK(has_line(text, "cleave_request_success_total{finished_reason=\"length\"} 0"));
  CHECK(has_line(text, "cleave_requests_cancelled_total 1"));
  CHECK(has_line(text, "cleave_http_requests_total{route=\"/v1/completions\",status=\"200\"} 2"));
  CHECK(has_line(text, "cleave_http_requests_total{route=\"/v1/completions\",status=\"500\"} 1"));
  CHECK(has_line(text, "cleave_http_requests_total{route=\"/health\",status=\"200\"} 1"));
  // TTFT 0.03 (le 0.04) and 0.2 (le 0.25).
  CHECK(has_line(text, "cleave_time_to_first_token_seconds_bucket{le=\"0.02\"} 0"));
  CHECK(has_line(text, "cleave_time_to_first_token_seconds_bucket{le=\"0.04\"} 1"));
  CHECK(has_line(text, "cleave_time_to_first_token_seconds_bucket{le=\"0.1\"} 1"));
  CHECK(has_line(text, "cleave_time_to_first_token_seconds_bucket{le=\"0.25\"} 2"));
  CHECK(has_line(text, "cleave_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2"));
  CHECK(has_line(text, "cleave_time_to_first_token_seconds_sum 0.23"));
  // Inter-token gaps 0.012 (le 0.025), 0.03 (le 0.05), 0.2 (le 0.2).
  CHECK(has_line(text, "cleave_time_per_output_token_seconds_bucket{le=\"0.01\"} 0"));
  CHECK(has_line(text, "cleave_time_per_output_token_seconds_bucket{le=\"0.025\"} 1"));
  CHECK(has_line(text, "cleave_time_per_output_token_seconds_bucket{le=\"0.05\"} 2"));
  CHECK(has_line(text, "cleave_time_per_output_token_seconds_bucket{le=\"0.2\"} 3"));
  CHECK(has_line(text, "cleave_time_per_output_token_seconds_count 3"));
  // e2e: A and B (errors are not observed), queue time: A and B.
  CHECK(has_line(text, "cleave_e2e_request_latency_seconds_bucket{le=\"0.3\"} 0"));
  CHECK(has_line(text, "cleave_e2e_request_latency_seconds_bucket{le=\"0.5\"} 1"));
  CHECK(has_line(text, "cleave_e2e_request_latency_seconds_bucket{le=\"1\"} 2"));
  CHECK(has_line(text, "cleave_e2e_request_latency_seconds_count 2"));
  CHECK(has_line(text, "cleave_request_queue_time_seconds_bucket{le=\"0.3\"} 2"));
  CHECK(has_line(text, "cleave_request_queue_time_seconds_count 2"));
  // "context" is "length"; an unknown reason is an error.
  m.on_request_start();
  m.on_first_token(0.01, 0);
  m.on_finish("context", 0.1, 1, 1, 0);
  m.on_request_start();
  m.on_finish("bogus", 0.1, 1, 0, 0);
  text = m.render();
  CHECK(has_line(text, "cleave_request_success_total{finished_reason=\"length\"} 1"));
  CHECK(has_line(text, "cleave_request_success_total{finished_reason=\"error\"} 2"));
  // Absolute values take over from the server's own count.
  m.set_running(7);
  m.set_waiting(9);
  m.on_request_start();
  text = m.render();
  CHECK(has_line(text, "cleave_num_requests_running 7"));
  CHECK(has_line(text, "cleave_num_requests_waiting 9"));
  check_promtool_clean(text);
}

TEST_CASE("server metrics: the runtime's actor counters map to their metrics") {
  ServerMetrics m;
  m.update_from_stats(pd_stats(1));
  std::string text = m.render();
  CHECK(has_line(text, "cleave_kv_blocks_moved_total{from=\"stage\",to=\"kv_store\"} 20"));
  CHECK(has_line(text, "cleave_kv_blocks_moved_total{from=\"kv_store\",to=\"stage\"} 3"));
  CHECK(has_line(text, "cleave_kv_blocks_moved_total{from=\"stage\",to=\"stage\"} 7"));
  CHECK(has_line(text, "cleave_kv_transfer_bytes_total{direction=\"sent\"} 4096"));
  CHECK(has_line(text, "cleave_kv_transfer_bytes_total{direction=\"received\"} 4000"));
  CHECK(has_line(text, "cleave_kv_transfer_failures_total{reason=\"receive_failed\"} 2"));
  CHECK(has_line(text, "cleave_kv_transfer_failures_total{reason=\"send_aborted\"} 1"));
  CHECK(has_line(text, "cleave_kv_transfer_failures_total{reason=\"store_error\"} 1"));
  CHECK(has_line(text, "cleave_kv_transfer_failures_total{reason=\"store_corrupt\"} 1"));
  CHECK(has_line(text, "cleave_stage_deaths_total 1"));
  CHECK(has_line(text, "cleave_replacements_total 2"));
  CHECK(has_line(text, "cleave_requests_rejected_slo_total 3"));
  CHECK(has_line(text, "cleave_encoder_cache_hits_total 5"));
  CHECK(has_line(text, "cleave_expert_fallback_rows_total 12"));
  CHECK(has_line(text, "cleave_expert_host_failures_total 1"));
  CHECK(has_line(text, "cleave_expert_rows_total{host=\"expert/0\"} 90"));
  CHECK(has_line(text, "cleave_expert_busy_seconds_total{host=\"expert/0\"} 0.5"));
  CHECK(has_line(text, "cleave_expert_routed_rows_total{layer=\"0\",expert=\"3\"} 40"));
  CHECK(has_line(text, "cleave_expert_routed_rows_total{layer=\"11\",expert=\"0\"} 7"));
  CHECK(has_line(text, "cleave_expert_replicas_added_total 2"));
  // Expert 3 of layer 0 on both hosts: their times add up.
  CHECK(has_line(text, "cleave_expert_compute_seconds_total{layer=\"0\",expert=\"3\"} 0.75"));
  CHECK(has_line(text, "cleave_expert_compute_seconds_total{layer=\"2\",expert=\"1\"} 1"));
  // rows 90 and 30, busy 0.5 s and 1.5 s: each spreads 50 % around its mean.
  CHECK(has_line(text, "cleave_expert_host_rows_spread 0.5"));
  CHECK(has_line(text, "cleave_expert_host_busy_spread 0.5"));
  CHECK(has_line(text, "cleave_stage_steps_total{stage=\"prefill/0\"} 30"));
  CHECK(has_line(text, "cleave_stage_steps_total{stage=\"decode/0\"} 50"));
  CHECK(has_line(text, "cleave_stage_steps_total{stage=\"vision_encoder/0\"} 6"));
  CHECK(has_line(text, "cleave_stage_step_seconds_total{stage=\"vision_encoder/0\"} 1.5"));
  CHECK(has_line(text, "cleave_stage_step_seconds_total{stage=\"prefill/0\"} 0.25"));
  CHECK(has_line(text, "cleave_kv_blocks_moved_total{from=\"tier0\",to=\"tier1\"} 11"));
  CHECK(has_line(text, "cleave_kv_blocks_moved_total{from=\"tier1\",to=\"tier0\"} 4"));
  CHECK(has_line(text, "cleave_num_requests_running 5"));  // 1 + 4
  CHECK(
      has_line(text, "cleave_num_requests_waiting 3"));  // 2 + 1 (the router's queue_depth is not)
  CHECK(has_line(text, "cleave_actor_stat{actor=\"router\",name=\"queue_depth\"} 3"));
  CHECK(has_line(text, "cleave_actor_stat{actor=\"decode/0\",name=\"kv_bytes_received\"} 4000"));
  // The server's own count no longer moves the gauges the runtime reports.
  m.on_request_start();
  CHECK(has_line(m.render(), "cleave_num_requests_waiting 3"));

  // Later: values grow; then decode/0 dies (gone from the stats) and
  // prefill/0 restarts from zero. Counters never go down.
  m.update_from_stats(pd_stats(2));
  text = m.render();
  CHECK(has_line(text, "cleave_kv_blocks_moved_total{from=\"stage\",to=\"kv_store\"} 40"));
  CHECK(has_line(text, "cleave_stage_deaths_total 2"));
  auto later = pd_stats(2);
  later.erase(later.begin() + 3);  // decode/0
  later[2] =
      stats("prefill/0", {{"kv_blocks_put", 5}, {"running", 0}, {"queue_depth", 0}, {"steps", 1}});
  m.update_from_stats(later);
  text = m.render();
  CHECK(
      has_line(text, "cleave_kv_blocks_moved_total{from=\"stage\",to=\"kv_store\"} 45"));  // 40 + 5
  CHECK(has_line(
      text, "cleave_kv_blocks_moved_total{from=\"kv_store\",to=\"stage\"} 6"));  // decode/0's last
  CHECK(has_line(text, "cleave_stage_steps_total{stage=\"prefill/0\"} 61"));     // 60 + 1
  CHECK(has_line(text, "cleave_stage_steps_total{stage=\"decode/0\"} 100"));
  CHECK(has_line(text, "cleave_num_requests_running 0"));
  CHECK_FALSE(
      has_line(text, "cleave_actor_stat{actor=\"decode/0\",name=\"kv_bytes_received\"} 8000"));
  check_promtool_clean(text);
}

TEST_CASE("server metrics: two models' routers and stores add up, scrape after scrape") {
  // A cluster head of two models: the second model's actors are named
  // "model:PATH/..." (actors/node.cpp). Each counts toward the totals once
  // per scrape; neither is read as the other restarting.
  auto two = [](uint64_t downs_a, uint64_t downs_b) {
    return std::vector<msg::Stats>{stats("router", {{"stage_downs", downs_a}, {"rejected_slo", 1}}),
                                   stats("kv_store", {{"tier_hops_0_1", 3}}),
                                   stats("model:/m/b.gguf/router", {{"stage_downs", downs_b}, {"rejected_slo", 2}}),
                                   stats("model:/m/b.gguf/kv_store", {{"tier_hops_0_1", 4}})};
  };
  ServerMetrics m;
  for (int scrape = 0; scrape < 3; ++scrape) {
    m.update_from_stats(two(0, 1));
    const std::string text = m.render();
    CAPTURE(scrape);
    CHECK(has_line(text, "cleave_stage_deaths_total 1"));
    CHECK(has_line(text, "cleave_requests_rejected_slo_total 3"));
    CHECK(has_line(text, "cleave_kv_blocks_moved_total{from=\"tier0\",to=\"tier1\"} 7"));
    CHECK(has_line(text, "cleave_actor_stat{actor=\"model:/m/b.gguf/router\",name=\"stage_downs\"} 1"));
    check_promtool_clean(text);
  }
  m.update_from_stats(two(2, 1));
  CHECK(has_line(m.render(), "cleave_stage_deaths_total 3"));
  // Only a model's own router or store: a stage that happens to end in
  // "router" or a bare "model:router" is neither.
  ServerMetrics other;
  other.update_from_stats({stats("w1/router", {{"stage_downs", 5}}), stats("model:router", {{"stage_downs", 6}})});
  CHECK(has_line(other.render(), "cleave_stage_deaths_total 0"));
}

TEST_CASE("server metrics: the exposition passes promtool check metrics with no lint findings") {
  ServerMetrics m;
  check_promtool_clean(m.render());  // empty: families without samples yet
  m.on_request_start();
  m.on_first_token(0.1, 0.01);
  m.on_token(0.02);
  m.on_finish("length", 1.2, 30, 2, 16);
  m.on_http("/v1/chat/completions", 200);
  m.on_http("other", 404);
  m.set_kv_cache_usage(0.5);
  auto st = pd_stats(3);
  st.push_back(stats("node-\"a\"\\b/decode/0", {{"running", 1}, {"steps", 2}}));  // escaped labels
  m.update_from_stats(st);
  check_promtool_clean(m.render());
}

TEST_CASE("metrics: the promtool harness sees lint findings (a counter without _total)") {
  prom::Registry reg;
  reg.counter("test_bad", "A counter named against the rules.").inc();
  Promtool r = promtool_check(reg.render());
  if (!r.ran) return;
  CHECK(r.exit_code != 0);
  CHECK(r.output.find("_total") != std::string::npos);
}
