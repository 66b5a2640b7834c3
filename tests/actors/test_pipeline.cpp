// The actor pipeline against the monolithic run: the topology never changes
// a request's tokens, text, finish reason or final logits (bit for bit), a
// dead decoder's sequences complete elsewhere with the same tokens, no
// decoder left means unavailable within 1 s, admission is bounded, counters
// add up, and corrupt Cap'n Proto bytes get a typed error.
#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "actors/pipeline.h"
#include "actors/stage_core.h"
#include "model/generate.h"
#include "model/make_model.h"
#include "schema/codec.h"
#include "tests/actors/pipeline_load.h"
#include "tests/actors/pipeline_util.h"
#include "tests/same_bits.h"

using namespace cleave;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

using cleave::testing::same_bits;
using namespace cleave::testing;

TEST_CASE("pipeline: options and topology names are checked") {
  CHECK(parse_topology("pd").value() == Topology::pd);
  CHECK(parse_topology("mesh").status().code() == Code::invalid_argument);
  const Model& m = model(small_dense());
  PipelineOptions o = base_options(Topology::pd, 0, 1);
  CHECK(Pipeline::create(m.file, m.tokenizer, o).status().code() == Code::invalid_argument);
  o = base_options(Topology::colocated);
  o.max_pending = 0;
  CHECK(Pipeline::create(m.file, m.tokenizer, o).status().code() == Code::invalid_argument);
  o = base_options(Topology::mono);
  o.scheduler.max_batch_tokens = 0;  // the scheduler would abort on it
  CHECK(Pipeline::create(m.file, m.tokenizer, o).status().code() == Code::invalid_argument);
  // A bad request gets validate_request()'s error and no callback.
  auto p = make_pipeline(m, base_options(Topology::colocated));
  GenerateRequest bad;
  bad.request_id = 1;
  bool called = false;
  CHECK(p->submit(bad, [&](const msg::StreamEvent&) { called = true; }).code() ==
        Code::invalid_argument);
  CHECK_FALSE(called);
}

TEST_CASE("pipeline invariant: 200+ mixed requests are bit-identical across mono, colocated and pd") {
  const Model& m = model(small_dense());
  const auto requests = mixed_requests(m, 210, 1000);
  const auto t0 = Clock::now();
  const auto ref = mono_reference(m, requests);
  MESSAGE("mono: " << std::chrono::duration<double>(Clock::now() - t0).count() << " s");
  // The load exercises what it claims to.
  std::map<std::string, int> reasons;
  size_t max_prompt = 0, total_tokens = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    reasons[ref[i].finish_reason]++;
    max_prompt = std::max(max_prompt, requests[i].prompt.size());
    total_tokens += ref[i].tokens.size();
    CHECK(ref[i].logits.size() == size_t(m.tokenizer->n_vocab()));
  }
  CHECK(reasons["stop"] > 0);
  CHECK(reasons["length"] > 0);
  CHECK(max_prompt >= 100);
  MESSAGE("finish reasons: stop " << reasons["stop"] << ", length " << reasons["length"]
                                  << "; tokens " << total_tokens);

  struct Case {
    Topology t;
    int p, d, c;
  };
  for (Case k : {Case{Topology::colocated, 0, 0, 1}, Case{Topology::colocated, 0, 0, 3},
                 Case{Topology::pd, 1, 1, 0}, Case{Topology::pd, 2, 3, 0},
                 Case{Topology::pd, 4, 4, 0}}) {
    const std::string what = std::string(topology_name(k.t)) + " P" + std::to_string(k.p) + " D" +
                             std::to_string(k.d) + " C" + std::to_string(k.c);
    const auto start = Clock::now();
    auto p = make_pipeline(m, base_options(k.t, k.p, k.d, k.c));
    auto got = run_all(*p, requests);
    check_identical(ref, got, what);
    auto stats = p->stats();
    const msg::Stats* router = find_stats(stats, "router");
    REQUIRE(router);
    CHECK(router->get("finished") == requests.size());
    CHECK(router->get("failures") == 0);
    // Batches really changed size: more decode rows than steps.
    CHECK(sum_counter(stats, "", "decode_rows") > sum_counter(stats, k.t == Topology::pd ? "decode" : "colocated", "steps"));
    // Each stage's second moments of its steps (the planner's spread):
    // between sum^2 / steps and sum^2 of the plain sums, so per step.
    for (const msg::Stats& st : stats) {
      const double n = double(st.get("steps"));
      if (n == 0 || st.actor == "router") continue;
      CAPTURE(st.actor);
      const double us = double(st.get("step_us")), tokens = double(st.get("prefill_tokens")),
                   rows = double(st.get("decode_rows"));
      for (auto [sq, sum] : {std::pair<double, double>{double(st.get("step_us_sq")), us},
                             {double(st.get("step_tokens_sq")), tokens},
                             {double(st.get("step_rows_sq")), rows}}) {
        CHECK(sq >= sum * sum / n * (1 - 1e-9));
        CHECK(sq <= sum * sum);
      }
      CHECK(double(st.get("step_us_tokens")) <= us * tokens);
      CHECK(double(st.get("step_us_rows")) <= us * rows);
      if (tokens > 0 && us > 0) CHECK(st.get("step_us_tokens") > 0);
      if (rows > 0 && us > 0) CHECK(st.get("step_us_rows") > 0);
    }
    MESSAGE(what << ": " << std::chrono::duration<double>(Clock::now() - start).count() << " s");
  }
}

TEST_CASE("pipeline invariant: an MoE model is bit-identical across mono, colocated and pd") {
  const Model& m = model(small_moe());
  const auto requests = mixed_requests(m, 60, 5000);
  const auto ref = mono_reference(m, requests);
  for (auto o : {base_options(Topology::colocated, 0, 0, 2), base_options(Topology::pd, 2, 2)}) {
    auto p = make_pipeline(m, o);
    check_identical(ref, run_all(*p, requests), topology_name(o.topology));
  }
}

TEST_CASE("pipeline invariant: every KV cache type is bit-identical across mono, colocated and pd") {
  ModelSpec spec = small_dense();
  spec.n_heads = 2;
  spec.n_kv_heads = 1;  // head_dim 32: Q8_0 rows fit
  spec.name = "actors-dense-hd32";
  const Model& m = model(spec);
  const auto requests = mixed_requests(m, 40, 7000);
  // P/D moves each prompt's KV; the bytes a block takes follow its type.
  std::map<std::string, double> bytes_per_block;
  for (auto [kt, vt] : {std::pair{DType::F32, DType::F32}, std::pair{DType::F16, DType::F16},
                        std::pair{DType::Q8_0, DType::Q8_0}, std::pair{DType::F32, DType::Q8_0},
                        std::pair{DType::Q4_0, DType::Q4_0}, std::pair{DType::Q8_0, DType::Q4_0}}) {
    const std::string what = std::string(dtype_name(kt)) + "/" + dtype_name(vt);
    CAPTURE(what);
    PipelineOptions mono = base_options(Topology::mono);
    mono.engine.cache_type_k = kt;
    mono.engine.cache_type_v = vt;
    auto mp = make_pipeline(m, mono);
    const auto ref = run_all(*mp, requests);
    for (const Completion& c : ref) REQUIRE_MESSAGE(c.error.ok(), c.error.to_string());
    for (PipelineOptions o : {base_options(Topology::colocated, 0, 0, 2), base_options(Topology::pd, 2, 2)}) {
      o.engine.cache_type_k = kt;
      o.engine.cache_type_v = vt;
      auto p = make_pipeline(m, o);
      check_identical(ref, run_all(*p, requests), what + " " + topology_name(o.topology));
      if (o.topology == Topology::pd) {
        const auto stats = p->stats();
        const uint64_t blocks = sum_counter(stats, "prefill", "kv_blocks_sent");
        REQUIRE(blocks > 0);
        bytes_per_block[what] = double(sum_counter(stats, "prefill", "kv_bytes_sent")) / double(blocks);
      }
    }
  }
  // A block: 2 layers x 16 tokens x one kv head x (K row + V row) of 32 elements,
  // plus the record's header and framing (the same for every type).
  const double f32 = bytes_per_block["F32/F32"], f16 = bytes_per_block["F16/F16"],
               q8 = bytes_per_block["Q8_0/Q8_0"], mixed = bytes_per_block["F32/Q8_0"],
               q4 = bytes_per_block["Q4_0/Q4_0"], q8q4 = bytes_per_block["Q8_0/Q4_0"];
  const double row = 2 * 16;  // rows of K (or of V) per block
  CHECK(f32 - f16 == doctest::Approx(row * (128 - 64) * 2));
  CHECK(f32 - q8 == doctest::Approx(row * (128 - 34) * 2));
  CHECK(f32 - mixed == doctest::Approx(row * (128 - 34)));
  CHECK(f32 - q4 == doctest::Approx(row * (128 - 18) * 2));
  CHECK(f32 - q8q4 == doctest::Approx(row * ((128 - 34) + (128 - 18))));
}

TEST_CASE("pipeline failure: a decode actor killed mid-generation, its sequences finish elsewhere identical") {
  const Model& m = model(small_dense());
  const auto requests = long_requests(m, 40, 7000);
  const auto ref = mono_reference(m, requests);
  for (auto o : {base_options(Topology::pd, 2, 3), base_options(Topology::colocated, 0, 0, 3)}) {
    const std::string topology = topology_name(o.topology);
    CAPTURE(topology);
    auto p = make_pipeline(m, o);
    Collector col;
    for (const auto& r : requests) REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
    REQUIRE(col.wait_tokens(requests.size() * 4, std::chrono::seconds(60)));
    // Mid-generation: the victim holds sequences when it dies (on a busy
    // machine the first tokens can all come before it got any).
    const std::string kind = o.topology == Topology::pd ? "decode" : "colocated";
    const auto victim_running = [&] {
      const auto now = p->stats();
      const msg::Stats* v = find_stats(now, kind + "/0");
      return v ? v->get("running") : 0;
    };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (victim_running() == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    REQUIRE(kill_decoder(*p, 0).ok());
    CHECK(kill_decoder(*p, 0).code() == Code::not_found);
    REQUIRE(col.wait_done(requests.size(), std::chrono::seconds(120)));
    check_identical(ref, col.in_order(requests), "after a kill");
    auto stats = p->stats();
    const msg::Stats* router = find_stats(stats, "router");
    REQUIRE(router);
    CHECK(router->get("stage_downs") == 1);
    CHECK(router->get("replacements") > 0);
    CHECK(router->get("failures") == 0);
    CHECK(p->alive(kind) == 2);
    // The survivors restored KV from the store instead of recomputing it all.
    CHECK(sum_counter(stats, kind, "kv_blocks_got") > 0);
    CHECK(sum_counter(stats, kind, "imported_tokens") > 0);
    MESSAGE(topology << ": replacements " << router->get("replacements")
                                      << ", imported " << sum_counter(stats, kind, "imported_tokens")
                                      << ", recomputed " << sum_counter(stats, kind, "recomputed_tokens"));
  }
}

TEST_CASE("pipeline failure: with no decode actor left every request fails unavailable within 1 s") {
  const Model& m = model(small_dense());
  const auto requests = long_requests(m, 30, 9000);
  auto p = make_pipeline(m, base_options(Topology::pd, 2, 2));
  Collector col;
  for (const auto& r : requests) REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
  REQUIRE(col.wait_tokens(requests.size() * 2, std::chrono::seconds(60)));
  REQUIRE(kill_decoder(*p, 0).ok());
  REQUIRE(kill_decoder(*p, 1).ok());
  const auto killed = Clock::now();
  // New requests right after: refused, or admitted and failed, as unavailable.
  auto late = long_requests(m, 5, 9500);
  size_t refused = 0;
  for (const auto& r : late) {
    Status st = p->submit(r, col.callback(r.request_id));
    if (!st.ok()) {
      CHECK(st.code() == Code::unavailable);
      ++refused;
    }
  }
  REQUIRE(col.wait_done(requests.size() + late.size() - refused, std::chrono::seconds(5)));
  const auto [failed, worst] = unavailable_failures(col, killed);
  CHECK(failed > 0);
  CHECK(worst < 1.0);
  MESSAGE("failed " << failed << " requests, the last " << worst * 1000 << " ms after the kill; "
                    << refused << " of " << late.size() << " late ones refused at submit");
  CHECK(p->alive("decode") == 0);
  Status st = p->submit(late[0], [](const msg::StreamEvent&) {});
  CHECK(st.code() == Code::unavailable);
}

TEST_CASE("pipeline backpressure: a full pipeline answers busy and the admitted requests complete") {
  const Model& m = model(small_dense());
  for (Topology t : {Topology::mono, Topology::colocated, Topology::pd}) {
    const std::string topology = topology_name(t);
    CAPTURE(topology);
    PipelineOptions o = base_options(t);
    o.max_pending = 4;
    auto p = make_pipeline(m, o);
    const auto requests = long_requests(m, 50, 11000);
    Collector col;
    size_t busy = 0, admitted = 0;
    for (const auto& r : requests) {
      Status st = p->submit(r, col.callback(r.request_id));
      if (st.code() == Code::busy) {
        ++busy;
        continue;
      }
      REQUIRE_MESSAGE(st.ok(), st.to_string());
      ++admitted;
    }
    CHECK(busy > 0);
    CHECK(admitted >= 4);
    REQUIRE(col.wait_done(admitted, std::chrono::seconds(60)));
    {
      std::lock_guard<std::mutex> lock(col.mu);
      CHECK(col.done.size() == admitted);  // busy ones never got a callback
      for (const auto& [id, c] : col.done) CHECK(c.error.ok());
    }
    auto stats = p->stats();
    CHECK(sum_counter(stats, "", "rejected_busy") == busy);
    // run() waits and retries on busy: everything completes.
    auto some = mixed_requests(m, 12, 12000);
    auto got = run_all(*p, some);
    for (const auto& c : got) CHECK(c.error.ok());
  }
}

TEST_CASE("pipeline cancel: a cancelled request ends aborted within a step and frees its KV") {
  const Model& m = model(small_dense());
  for (Topology t : {Topology::mono, Topology::colocated, Topology::pd}) {
    const std::string topology = topology_name(t);
    CAPTURE(topology);
    auto p = make_pipeline(m, base_options(t));
    GenerateRequest r = long_requests(m, 1, 13000)[0];
    r.sampling.max_tokens = 400;  // would run for seconds
    GenerateRequest other = long_requests(m, 1, 13001)[0];
    Collector col;
    REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
    REQUIRE(p->submit(other, col.callback(other.request_id)).ok());
    REQUIRE(col.wait_tokens(3, std::chrono::seconds(30)));
    const auto t0 = Clock::now();
    REQUIRE(p->cancel(r.request_id).ok());
    REQUIRE(col.wait_done(2, std::chrono::seconds(30)));
    std::lock_guard<std::mutex> lock(col.mu);
    const Completion& c = col.done.at(r.request_id);
    CHECK(c.error.code() == Code::aborted);
    CHECK(c.tokens.size() < 400);
    CHECK(std::chrono::duration<double>(col.done_at.at(r.request_id) - t0).count() < 1.0);
    CHECK(col.done.at(other.request_id).error.ok());  // the other one is untouched
    CHECK(col.done.at(other.request_id).tokens.size() == 32);
    // Gone: a second cancel and one of an unknown id are not_found.
    CHECK(p->cancel(r.request_id).code() == Code::not_found);
    CHECK(p->cancel(999999).code() == Code::not_found);
  }
  // The stage let go of the sequence: no block held once both are done.
  for (Topology t : {Topology::mono, Topology::colocated, Topology::pd}) {
    const std::string topology = topology_name(t);
    CAPTURE(topology);
    auto p = make_pipeline(m, base_options(t));
    GenerateRequest r = long_requests(m, 1, 14000)[0];
    r.sampling.max_tokens = 400;
    Collector col;
    REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
    REQUIRE(col.wait_tokens(2, std::chrono::seconds(30)));
    REQUIRE(p->cancel(r.request_id).ok());
    REQUIRE(col.wait_done(1, std::chrono::seconds(30)));
    uint64_t used = 1, cancelled = 0;
    for (int i = 0; i < 100 && used != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const auto stats = p->stats();
      used = sum_counter(stats, "", "kv_blocks_used");
      cancelled = sum_counter(stats, "", "cancelled");
    }
    CHECK(used == 0);
    CHECK(cancelled == 1);
  }
}

TEST_CASE("pipeline stats: per-actor counters add up") {
  const Model& m = model(small_dense());
  auto requests = long_requests(m, 20, 13000);
  for (size_t i = 0; i < requests.size(); ++i) requests[i].sampling.max_tokens = 2 + int(i % 5);
  auto p = make_pipeline(m, base_options(Topology::pd, 2, 2));
  auto got = run_all(*p, requests);
  uint64_t tokens = 0;
  for (const auto& c : got) {
    REQUIRE(c.error.ok());
    tokens += c.tokens.size();
  }
  auto stats = p->stats();
  const msg::Stats* router = find_stats(stats, "router");
  const msg::Stats* kv = find_stats(stats, "kv_store");
  REQUIRE(router);
  REQUIRE(kv);
  CHECK(stats.size() == 6);  // router, kv_store, 2 prefill, 2 decode
  CHECK(router->get("admitted") == 20);
  CHECK(router->get("finished") == 20);
  CHECK(router->get("handoffs") == 20);
  CHECK(router->get("tokens") == tokens);
  CHECK(router->get("queue_depth") == 0);
  CHECK(sum_counter(stats, "prefill", "requests") == 20);
  CHECK(sum_counter(stats, "prefill", "handoffs") == 20);
  CHECK(sum_counter(stats, "prefill", "tokens") == 20);  // each the first token
  CHECK(sum_counter(stats, "decode", "resumes") == 20);
  CHECK(sum_counter(stats, "decode", "finished") == 20);
  CHECK(sum_counter(stats, "decode", "tokens") == tokens - 20);
  CHECK(sum_counter(stats, "", "queue_depth") == 0);
  CHECK(sum_counter(stats, "", "failures") == 0);
  // KV moved: the prefills' blocks streamed to the decoders, and a copy went
  // into the store (read by nobody here: no decoder failed).
  CHECK(sum_counter(stats, "prefill", "kv_blocks_put") > 0);
  CHECK(sum_counter(stats, "decode", "kv_blocks_received") > 0);
  CHECK(sum_counter(stats, "decode", "kv_blocks_received") ==
        sum_counter(stats, "prefill", "kv_blocks_sent"));
  CHECK(kv->get("kv_blocks_stored") >= sum_counter(stats, "prefill", "kv_blocks_put"));
  CHECK(kv->get("kv_blocks_served") == sum_counter(stats, "decode", "kv_blocks_got"));
  // Both prefill actors and both decoders took work (placement by load).
  for (const char* name : {"prefill/0", "prefill/1", "decode/0", "decode/1"}) {
    const msg::Stats* s = find_stats(stats, name);
    REQUIRE_MESSAGE(s, name);
    CHECK_MESSAGE(s->get("requests") + s->get("resumes") > 0, name);
  }
}

TEST_CASE("pipeline: a corrupt Cap'n Proto message gets a typed error and the actor survives") {
  const Model& m = model(small_dense());
  auto p = make_pipeline(m, base_options(Topology::pd, 1, 1));
  GenerateRequest good;
  good.prompt = {1, 450, 4799};
  good.request_id = 1;
  codec::Bytes valid = codec::encode(good);
  codec::Bytes truncated(valid.begin(), valid.begin() + long(valid.size() / 2));
  codec::Bytes garbage(64, '\x7f');
  msg::StreamEvent other;  // a message of another kind
  codec::Bytes wrong_kind = codec::encode(other);
  for (const char* kind : {"prefill", "decode", "router", "kv_store"}) {
    for (const codec::Bytes* bytes : {&truncated, &garbage, &wrong_kind}) {
      CAPTURE(kind);
      Status st = hooks(*p).send_raw(kind, 0, *bytes);
      CHECK_FALSE(st.ok());
      CHECK_MESSAGE((st.code() == Code::corruption || st.code() == Code::invalid_argument),
                    st.to_string());
    }
  }
  CHECK(p->alive("prefill") == 1);
  CHECK(p->alive("decode") == 1);
  CHECK(p->alive("kv_store") == 1);
  auto stats = p->stats();
  CHECK(sum_counter(stats, "", "bad_messages") == 9);  // prefill, decode, router: 3 each
  CHECK(find_stats(stats, "kv_store")->get("failures") == 3);
  // Still serving, with the answer mono gives.
  auto requests = mixed_requests(m, 10, 15000);
  check_identical(mono_reference(m, requests), run_all(*p, requests), "after corrupt messages");
}

TEST_CASE("pipeline shutdown: destroying a busy pipeline ends every request once and does not hang") {
  const Model& m = model(small_dense());
  for (Topology t : {Topology::mono, Topology::colocated, Topology::pd}) {
    const std::string topology = topology_name(t);
    CAPTURE(topology);
    const auto requests = long_requests(m, 30, 17000);
    Collector col;
    auto p = make_pipeline(m, base_options(t, 2, 2, 2));
    for (const auto& r : requests) REQUIRE(p->submit(r, col.callback(r.request_id)).ok());
    REQUIRE(col.wait_tokens(10, std::chrono::seconds(60)));
    const auto start = Clock::now();
    p.reset();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    CHECK(seconds < 5.0);
    std::lock_guard<std::mutex> lock(col.mu);
    CHECK(col.done.size() == requests.size());  // Collector checks: never a second final event
    size_t aborted = 0;
    for (const auto& [id, c] : col.done)
      if (!c.error.ok()) {
        CHECK(c.error.code() == Code::aborted);
        ++aborted;
      }
    MESSAGE(topology << ": shut down in " << seconds * 1000 << " ms, " << aborted << " aborted");
  }
}

TEST_CASE("pipeline kv stream: KV goes prefill to decode directly and the store gets a copy") {
  const Model& m = model(small_dense());
  const auto requests = mixed_requests(m, 40, 19000);
  auto p = make_pipeline(m, base_options(Topology::pd, 2, 2));
  check_identical(mono_reference(m, requests), run_all(*p, requests), "direct kv");
  auto stats = p->stats();
  const msg::Stats* router = find_stats(stats, "router");
  REQUIRE(router);
  CHECK(router->get("direct_handoffs") == router->get("handoffs"));
  const uint64_t sent = sum_counter(stats, "prefill", "kv_blocks_sent");
  CHECK(sent > 0);
  CHECK(sum_counter(stats, "decode", "kv_blocks_received") == sent);
  CHECK(sum_counter(stats, "decode", "kv_transfers_failed") == 0);
  CHECK(sum_counter(stats, "prefill", "kv_transfers_aborted") == 0);
  CHECK(sum_counter(stats, "decode", "kv_blocks_got") == 0);  // nothing read from the store
  CHECK(sum_counter(stats, "decode", "imported_tokens") > 0);
  CHECK(sum_counter(stats, "prefill", "kv_blocks_put") > 0);  // the copy for re-placements
}

TEST_CASE("pipeline kv stream: a second request sharing a long prefix sends fewer blocks") {
  const Model& m = model(small_dense());
  GenerateRequest first;
  first.request_id = 21000;
  first.prompt = m.tokenizer->encode(sentence(130, 4));
  first.prompt.resize(std::min<size_t>(first.prompt.size(), 120));
  REQUIRE(first.prompt.size() >= 100);
  first.sampling.max_tokens = 6;
  first.ignore_eos = true;
  GenerateRequest second = first;
  second.request_id = 21001;
  second.prompt.resize(100);  // the first 6 blocks are the first request's
  for (int32_t t : m.tokenizer->encode(sentence(5, 9))) second.prompt.push_back(t);
  const auto ref = mono_reference(m, {first, second});
  auto p = make_pipeline(m, base_options(Topology::pd, 1, 1));
  auto got_first = run_all(*p, {first});
  const auto before = p->stats();
  auto got_second = run_all(*p, {second});
  const auto after = p->stats();
  check_identical({ref[0]}, got_first, "first");
  check_identical({ref[1]}, got_second, "second");
  auto delta = [&](const char* prefix, const char* name) {
    return sum_counter(after, prefix, name) - sum_counter(before, prefix, name);
  };
  const uint64_t blocks_first = sum_counter(before, "prefill", "kv_blocks_sent");
  const uint64_t needed = (second.prompt.size() + 15) / 16;  // KV of the prompt
  CHECK(blocks_first == (first.prompt.size() + 15) / 16);
  CHECK(sum_counter(before, "decode", "kv_blocks_skipped") == 0);
  CHECK(delta("decode", "kv_blocks_skipped") == 6);
  CHECK(delta("prefill", "kv_blocks_sent") == needed - 6);
  CHECK(delta("decode", "kv_blocks_received") == needed - 6);
  CHECK(delta("decode", "prefix_hit_tokens") == 96);
  CHECK(delta("decode", "recomputed_tokens") == 0);
}

TEST_CASE("pipeline kv stream: a tiny chunk size gives many chunks and the same tokens") {
  const Model& m = model(small_dense());
  const auto requests = mixed_requests(m, 40, 23000);
  PipelineOptions o = base_options(Topology::pd, 2, 2);
  o.kv_stream.chunk_bytes = 256;  // a block of this model is 8 KiB: 32 chunks each
  o.kv_stream.window = 3;
  auto p = make_pipeline(m, o);
  check_identical(mono_reference(m, requests), run_all(*p, requests), "256-byte chunks");
  auto stats = p->stats();
  const uint64_t transfers = sum_counter(stats, "decode", "kv_transfers_received");
  CHECK(transfers > 0);
  CHECK(sum_counter(stats, "decode", "kv_chunks_received") == 32 * sum_counter(stats, "decode", "kv_blocks_received"));
  CHECK(sum_counter(stats, "decode", "kv_bytes_received") == sum_counter(stats, "prefill", "kv_bytes_sent"));
  CHECK(sum_counter(stats, "decode", "kv_transfers_failed") == 0);
  CHECK(sum_counter(stats, "decode", "kv_blocks_got") == 0);
  CHECK(sum_counter(stats, "", "failures") == 0);
  o.kv_stream.chunk_bytes = 8;
  CHECK(Pipeline::create(m.file, m.tokenizer, o).status().code() == Code::invalid_argument);
}

TEST_CASE("pipeline kv stream: a corrupt chunk is refused and the request still gives the same tokens") {
  const Model& m = model(small_dense());
  const auto requests = long_requests(m, 20, 25000);
  PipelineOptions o = base_options(Topology::pd, 1, 2);
  o.kv_stream.chunk_bytes = 4096;
  o.kv_stream.fault_corrupt_chunk = 1;  // every stream's second chunk arrives with a flipped bit
  auto p = make_pipeline(m, o);
  check_identical(mono_reference(m, requests), run_all(*p, requests), "corrupt chunks");
  auto stats = p->stats();
  const uint64_t failed = sum_counter(stats, "decode", "kv_transfers_failed");
  CHECK(failed > 0);
  CHECK(sum_counter(stats, "decode", "kv_transfers_received") == 0);
  CHECK(sum_counter(stats, "decode", "kv_chunks_rejected") == failed);
  CHECK(sum_counter(stats, "prefill", "kv_transfers_aborted") == failed);
  // The decoders fell back to the store's copy (or recomputed what it lacked yet).
  CHECK(sum_counter(stats, "decode", "kv_blocks_got") + sum_counter(stats, "decode", "recomputed_tokens") > 0);
  const msg::Stats* router = find_stats(stats, "router");
  REQUIRE(router);
  CHECK(router->get("failures") == 0);
}

TEST_CASE("pipeline images: encoded images run as generate() does in mono colocated and pd") {
  const Model& m = model(small_dense());
  const int32_t D = 64;
  GenerateRequest r;
  r.request_id = 5;
  r.prompt = {1};
  r.prompt.insert(r.prompt.end(), 12, 0);
  for (int32_t t : {300, 301, 302}) r.prompt.push_back(t);
  PromptImage im;
  im.position = 1;
  im.n_tokens = 12;
  im.hash = ImageHash{3, 4};
  im.embeddings.resize(size_t(12) * D);
  for (size_t i = 0; i < im.embeddings.size(); ++i) im.embeddings[i] = float(i % 17) / 17.f - 0.5f;
  r.images.push_back(im);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = 5;
  r.ignore_eos = true;
  r.keep_logits = true;

  EngineOptions eo;
  eo.threads = 1;
  auto engine = Engine::create(m.file, eo);
  REQUIRE(engine.ok());
  auto want = generate(**engine, m.tokenizer.get(), r);
  REQUIRE_MESSAGE(want.ok(), want.status().to_string());
  auto mono = make_pipeline(m, base_options(Topology::mono));
  const auto got = run_all(*mono, {r});
  REQUIRE_MESSAGE(got[0].error.ok(), got[0].error.to_string());
  CHECK(got[0].tokens == want->tokens);
  const int32_t V = (*engine)->config().n_vocab;
  CHECK(same_bits(got[0].logits, std::vector<float>(want->logits.end() - V, want->logits.end())));
  GenerateRequest unencoded = r;
  unencoded.images[0].embeddings.clear();
  Status st = mono->submit(unencoded, [](const msg::StreamEvent&) {});
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("not encoded") != std::string::npos);

  // The actor topologies run encoded images the same; without an mmproj
  // they refuse unencoded ones (tests/actors/test_vision_pipeline.cpp
  // covers the vision_encoder actors).
  for (Topology t : {Topology::colocated, Topology::pd}) {
    CAPTURE(topology_name(t));
    auto p = make_pipeline(m, base_options(t));
    const auto actors = run_all(*p, {r});
    REQUIRE_MESSAGE(actors[0].error.ok(), actors[0].error.to_string());
    CHECK(actors[0].tokens == want->tokens);
    CHECK(same_bits(actors[0].logits, got[0].logits));
    bool called = false;
    st = p->submit(unencoded, [&](const msg::StreamEvent&) { called = true; });
    CHECK(st.code() == Code::invalid_argument);
    CHECK(st.message().find("no vision encoder") != std::string::npos);
    CHECK_FALSE(called);
  }
}

TEST_CASE("stage core: resume keys of an image request are the keys its engine gives the blocks") {
  const Model& m = model(small_dense());
  EngineOptions eo;
  eo.threads = 1;
  eo.block_size = 16;
  auto engine = Engine::create(m.file, eo);
  REQUIRE(engine.ok());
  Engine& e = **engine;
  const int32_t D = e.config().dim;
  GenerateRequest r;
  r.prompt.assign(3, 300);
  r.prompt.insert(r.prompt.end(), 20, 0);  // an image over positions [3, 23): blocks 0 and 1
  r.prompt.insert(r.prompt.end(), 9, 301);
  PromptImage im;
  im.position = 3;
  im.n_tokens = 20;
  im.hash = ImageHash{5, 6};
  im.embeddings.assign(size_t(20) * D, 0.125f);
  r.images.push_back(im);
  const std::vector<int32_t> generated = {400, 401, 402, 403, 404};

  auto seq = e.open_sequence(image_key_spans(r));
  REQUIRE(seq.ok());
  std::vector<int32_t> tokens = r.prompt;
  tokens.insert(tokens.end(), generated.begin(), generated.end() - 1);  // the last has no KV yet
  std::vector<float> scratch, logits(static_cast<size_t>(e.config().n_vocab));
  const int32_t n = int32_t(tokens.size());
  REQUIRE(e.forward({{*seq, tokens.data(), n, image_rows(r, 0, n, D, scratch)}}, logits.data()).ok());
  const auto keys = resume_kv_keys(r.prompt, generated, e.model_fingerprint(), e.kv_layout(),
                                   image_key_spans(r));
  CHECK(keys == e.block_keys(*seq));
  const auto text_keys = resume_kv_keys(r.prompt, generated, e.model_fingerprint(), e.kv_layout());
  CHECK_FALSE(text_keys[0] == keys[0]);
  CHECK(text_keys[2] != keys[2]);
}

namespace {

// The stage that produced a request's tokens ("colocated/1").
std::string stage_of(const Completion& c) {
  std::string out;
  for (const auto& [origin, t] : c.stages)
    if (t.tokens > 0) out = origin;
  return out;
}

GenerateRequest greedy(std::vector<int32_t> prompt, uint64_t id, int32_t max_tokens) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.request_id = id;
  r.sampling.temperature = 0;
  r.sampling.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

// R0 (long) runs on one stage while R1 (a 128-token shared prefix) is
// placed; then, with both done and every stage idle, R2 shares R1's prefix.
// Returns the stages of R0, R1 and R2 and the prefix tokens R2's stage
// reused.
struct PrefixRun {
  std::string r0, r1, r2;
  uint64_t prefix_hit_tokens = 0;
};
PrefixRun run_shared_prefix(const Model& m, const PlacementConfig& placement) {
  PipelineOptions o = base_options(Topology::colocated, 0, 0, 2);
  o.placement = placement;
  auto p = make_pipeline(m, o);
  std::vector<int32_t> prefix = {1};
  for (int i = 1; i < 128; ++i) prefix.push_back(100 + (i * 37) % 3000);
  auto with = [&](std::vector<int32_t> tail) {
    std::vector<int32_t> v = prefix;
    v.insert(v.end(), tail.begin(), tail.end());
    return v;
  };
  Collector col;
  REQUIRE(p->submit(greedy({1, 5000, 5001, 5002}, 1, 120), col.callback(1)).ok());
  REQUIRE(col.wait_tokens(1, std::chrono::seconds(60)));  // R0 is on its stage
  auto r1 = run_all(*p, {greedy(with({7, 8, 9}), 2, 2)});
  REQUIRE(col.wait_done(1, std::chrono::seconds(120)));
  const auto before = p->stats();
  auto r2 = run_all(*p, {greedy(with({40, 41, 42, 43}), 3, 2)});
  PrefixRun out;
  {
    std::lock_guard<std::mutex> lock(col.mu);
    out.r0 = stage_of(col.done.at(1));
  }
  out.r1 = stage_of(r1.at(0));
  out.r2 = stage_of(r2.at(0));
  const auto after = p->stats();
  out.prefix_hit_tokens =
      sum_counter(after, out.r2, "prefix_hit_tokens") - sum_counter(before, out.r2, "prefix_hit_tokens");
  return out;
}

}  // namespace

TEST_CASE("router policies with real actors: round robin alternates, least loaded fills the first") {
  const Model& m = model(small_dense());
  for (const char* name : {"round_robin", "least_loaded"}) {
    CAPTURE(name);
    PipelineOptions o = base_options(Topology::pd, 2, 2);
    o.placement.policy = name;
    auto p = make_pipeline(m, o);
    std::vector<std::string> prefill, decode;
    for (uint64_t id = 1; id <= 6; ++id) {  // one at a time: every stage idle at each placement
      auto c = run_all(*p, {greedy({1, int32_t(300 + id), 301, 302}, id, 3)}).at(0);
      REQUIRE(c.error.ok());
      for (const auto& [origin, t] : c.stages) {
        if (origin.rfind("prefill/", 0) == 0) prefill.push_back(origin);
        if (origin.rfind("decode/", 0) == 0) decode.push_back(origin);
      }
    }
    const std::vector<std::string> alternating = {"/0", "/1", "/0", "/1", "/0", "/1"};
    REQUIRE(prefill.size() == 6);
    REQUIRE(decode.size() == 6);
    for (size_t i = 0; i < 6; ++i) {
      const std::string want = std::string(name) == "round_robin" ? alternating[i] : "/0";
      CHECK(prefill[i] == "prefill" + want);
      CHECK(decode[i] == "decode" + want);
    }
  }
}

TEST_CASE("router policies with real actors: kv_aware sends a repeated long prefix to the stage that holds it") {
  const Model& m = model(small_dense());
  PlacementConfig kv;
  kv.policy = "kv_aware";
  const PrefixRun k = run_shared_prefix(m, kv);
  CHECK(k.r0 == "colocated/0");
  CHECK(k.r1 == "colocated/1");  // stage 0 was busy with R0
  CHECK(k.r2 == k.r1);           // both idle now: the stage holding the prefix
  CHECK(k.prefix_hit_tokens >= 112);  // 7 of the 8 prefix blocks at least were reused
  PlacementConfig ll;
  ll.policy = "least_loaded";
  const PrefixRun l = run_shared_prefix(m, ll);
  CHECK(l.r1 == "colocated/1");
  CHECK(l.r2 == "colocated/0");  // blind to the prefix: the idle lowest stage
  CHECK(l.prefix_hit_tokens == 0);
  MESSAGE("kv_aware reused " << k.prefix_hit_tokens << " prefix tokens on " << k.r2
                             << "; least_loaded " << l.prefix_hit_tokens << " on " << l.r2);
}

TEST_CASE("stage step moments add per step and saturate rather than wrap") {
  StepMoments m;
  m.add(3000, 128, 0);
  m.add(1000, 0, 4);
  CHECK(m.us_sq == 3000ull * 3000 + 1000ull * 1000);
  CHECK(m.tokens_sq == 128 * 128);
  CHECK(m.us_tokens == 3000 * 128);
  CHECK(m.rows_sq == 16);
  CHECK(m.us_rows == 4000);
  m.add(uint64_t(1) << 33, 0, 0);  // 2^66 us^2: past uint64
  CHECK(m.us_sq == UINT64_MAX);
  m.add(1, 0, 0);
  CHECK(m.us_sq == UINT64_MAX);
}
