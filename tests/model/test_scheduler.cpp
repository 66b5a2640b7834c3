// The continuous-batching scheduler against generate() run alone: every
// request's tokens, text, finish reason and final logits must be identical
// (memcmp) however requests were batched, chunked, preempted, handed off
// between engines or resumed from partial / corrupted KV records.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "model/generate.h"
#include "model/scheduler.h"
#include "model_fixtures.h"
#include "tests/fenced_backend.h"

using namespace cleave;
using namespace cleave::fixtures;

namespace {

// What the events said about one request.
struct Outcome {
  std::vector<int32_t> tokens;
  std::string text, finish_reason;
  std::vector<float> logits;
  Status error;
  int32_t first_index = -1;  // index of the first token event (resumed: tokens made elsewhere)
  bool finished = false, failed = false;
  std::vector<SchedulerEvent> handoffs;
};

struct Driver {
  explicit Driver(Scheduler& s) : scheduler(s) {}
  Scheduler& scheduler;
  std::map<uint64_t, Outcome> out;
  std::set<uint64_t> batch_sizes;
  int steps = 0;

  void step() {
    std::vector<SchedulerEvent> events;
    const uint64_t before = scheduler.counters().batch_tokens;
    Status st = scheduler.step(events);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    if (scheduler.counters().batch_tokens > before)
      batch_sizes.insert(scheduler.counters().batch_tokens - before);
    ++steps;
    for (SchedulerEvent& ev : events) {
      Outcome& o = out[ev.request_id];
      REQUIRE_FALSE(o.finished);
      REQUIRE_FALSE(o.failed);
      o.text += ev.text;
      switch (ev.kind) {
        case SchedulerEvent::Kind::token:
          if (o.first_index < 0) o.first_index = ev.index;
          CHECK(ev.index == o.first_index + int32_t(o.tokens.size()));
          o.tokens.push_back(ev.token);
          break;
        case SchedulerEvent::Kind::finished:
          o.finished = true;
          o.finish_reason = ev.finish_reason;
          o.logits = ev.logits;
          break;
        case SchedulerEvent::Kind::failed:
          o.failed = true;
          o.error = ev.error;
          break;
        case SchedulerEvent::Kind::handoff:
          o.handoffs.push_back(std::move(ev));
          break;
      }
    }
  }
  void run_until_idle() {
    while (!scheduler.idle()) {
      REQUIRE(steps < 100000);
      step();
    }
  }
};

GenerateResult reference(Engine& engine, const Tokenizer* tok, GenerateRequest r) {
  r.keep_logits = true;
  auto g = generate(engine, tok, r);
  REQUIRE_MESSAGE(g.ok(), g.status().to_string());
  return std::move(*g);
}

// Tokens, text, finish reason, and the last step's logits bit for bit.
void check_matches(const Outcome& got, const GenerateResult& want, int32_t n_vocab) {
  CHECK(got.finished);
  CHECK(got.tokens == want.tokens);
  CHECK(got.text == want.text);
  CHECK(got.finish_reason == want.finish_reason);
  std::vector<float> last;
  if (!want.logits.empty()) last.assign(want.logits.end() - n_vocab, want.logits.end());
  CHECK(same_bits(got.logits, last));
}

// A request handed off: what the prefill side said, then what the decoder
// said (its finish, unless the prefill's first token finished it).
Outcome joined(Outcome whole, const Outcome& rest) {
  whole.tokens.insert(whole.tokens.end(), rest.tokens.begin(), rest.tokens.end());
  whole.text += rest.text;
  if (!whole.finished) {
    whole.finished = rest.finished;
    whole.finish_reason = rest.finish_reason;
    whole.logits = rest.logits;
  }
  return whole;
}

// A varied request: prompt length 1..100 (every fifth shares a 48-token
// prefix, for the prefix cache), six sampler settings, max_tokens 1..40.
GenerateRequest mixed_request(int i) {
  GenerateRequest r;
  r.request_id = uint64_t(1000 + i);
  const int len = 1 + (i * 37) % 100;
  if (i % 5 == 0 && len > 48) {
    r.prompt = prompt_of(48, 999);
    auto tail = prompt_of(len - 48, i);
    r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
  } else {
    r.prompt = prompt_of(len, i);
  }
  r.prefill_chunk = std::vector<int>{7, 16, 512}[size_t(i % 3)];
  r.keep_logits = true;
  SamplingParams& s = r.sampling;
  s.seed = uint64_t(i * 31 + 5);
  s.max_tokens = 1 + (i * 13) % 40;
  switch (i % 6) {
    case 0: s.temperature = 0; break;
    case 1: break;  // defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05
    case 2: s.temperature = 1.2f; s.top_k = 5; s.top_p = 1; s.min_p = 0; break;
    case 3: s.temperature = 1.0f; s.top_k = 0; s.top_p = 0.5f; break;
    case 4: s.temperature = 0.9f; s.top_k = 0; s.top_p = 1; s.min_p = 0.2f; break;
    case 5: s.temperature = 0.7f; s.repeat_penalty = 1.5f; s.repeat_last_n = 16; break;
  }
  return r;
}

EngineOptions engine_options(int threads, int max_seqs, int kv_blocks = 0) {
  EngineOptions o;
  o.threads = threads;
  o.max_seqs = max_seqs;
  o.kv_blocks = kv_blocks;
  return o;
}

}  // namespace

TEST_CASE("scheduler: staggered mixed requests equal generate() run alone") {
  auto tok = make_tokenizer();
  for (auto [spec, name, count] : {std::tuple{small_dense(), "dense", 72},
                                   std::tuple{small_moe(), "moe", 20}}) {
    const std::string model = name;
    CAPTURE(model);
    const std::string path = model_path(spec, name);
    auto alone = make_engine(path, 1, 1);
    auto engine = make_engine(path, engine_options(2, 8));
    const int32_t V = engine->config().n_vocab;

    std::vector<GenerateRequest> requests;
    std::vector<GenerateResult> want;
    int with_stop = 0;
    for (int i = 0; i < count; ++i) {
      GenerateRequest r = mixed_request(i);
      GenerateResult g = reference(*alone, tok.get(), r);
      if (i % 4 == 3 && g.text.size() >= 8) {  // a stop string from the text it would write
        r.sampling.stop = {g.text.substr(g.text.size() / 2, 2)};
        g = reference(*alone, tok.get(), r);
        with_stop += g.finish_reason == "stop";
      }
      requests.push_back(r);
      want.push_back(std::move(g));
    }
    CHECK(with_stop > 0);

    SchedulerOptions so;
    so.max_batch_tokens = 24;
    Scheduler scheduler(*engine, tok.get(), so);
    Driver d{scheduler};
    // Three new requests every other step, while earlier ones run.
    size_t next = 0;
    while (next < requests.size() || !scheduler.idle()) {
      if (d.steps % 2 == 0)
        for (int k = 0; k < 3 && next < requests.size(); ++k, ++next)
          REQUIRE(scheduler.submit(requests[next]).ok());
      d.step();
    }
    for (int i = 0; i < count; ++i) {
      CAPTURE(i);
      check_matches(d.out[requests[size_t(i)].request_id], want[size_t(i)], V);
    }
    const SchedulerCounters& c = scheduler.counters();
    CHECK(c.finished == uint64_t(count));
    CHECK(c.failed == 0);
    CHECK(d.batch_sizes.size() >= 5);  // batches of many different sizes
    CHECK(*d.batch_sizes.rbegin() <= uint64_t(so.max_batch_tokens));
    CHECK(c.decode_rows > 0);
    CHECK(c.prefill_tokens > 0);
    if (count >= 64) CHECK(c.prefix_hit_tokens > 0);
    MESSAGE(model << ": " << c.steps << " steps, " << c.batch_tokens << " batch tokens, "
                 << d.batch_sizes.size() << " batch sizes, " << c.prefix_hit_tokens
                 << " prefix-hit tokens");
  }
}

TEST_CASE("scheduler: prefill_only handoff, resumed on another engine, equals generate()") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto alone = make_engine(path, 1, 1);
  auto prefill_engine = make_engine(path, engine_options(1, 4));
  auto decode_engine = make_engine(path, engine_options(2, 4));
  const int32_t V = alone->config().n_vocab;

  SchedulerOptions po;
  po.prefill_only = true;
  po.max_batch_tokens = 40;
  Scheduler prefill(*prefill_engine, tok.get(), po);
  Scheduler decode(*decode_engine, tok.get());
  Driver p{prefill}, dd{decode};

  std::vector<GenerateRequest> requests;
  for (int i = 0; i < 8; ++i) {
    GenerateRequest r = mixed_request(i * 7 + 1);
    r.prompt = prompt_of(std::vector<int>{1, 15, 16, 17, 32, 50, 99, 33}[size_t(i)], i);
    r.sampling.max_tokens = i == 7 ? 1 : 12;  // the last finishes on its first token
    requests.push_back(r);
    REQUIRE(prefill.submit(r).ok());
  }
  p.run_until_idle();
  int64_t handed_tokens = 0;
  for (const GenerateRequest& r : requests) {
    const Outcome& o = p.out[r.request_id];
    if (r.sampling.max_tokens == 1) {
      CHECK(o.finished);
      CHECK(o.handoffs.empty());
      continue;
    }
    REQUIRE(o.handoffs.size() == 1);
    const SchedulerEvent& h = o.handoffs[0];
    CHECK(h.generated == o.tokens);
    CHECK(h.n_kv_tokens == int32_t(r.prompt.size()));
    CHECK(h.blocks.size() == (r.prompt.size() + 15) / 16);
    handed_tokens += h.n_kv_tokens;
    REQUIRE(decode.resume(h.request, h.generated, h.blocks).ok());
  }
  CHECK(prefill.counters().handed_off == 7);
  dd.run_until_idle();
  for (const GenerateRequest& r : requests) {
    CAPTURE(r.prompt.size());
    check_matches(joined(p.out[r.request_id], dd.out[r.request_id]), reference(*alone, tok.get(), r), V);
  }
  CHECK(decode.counters().imported_tokens == uint64_t(handed_tokens));
  CHECK(decode.counters().recomputed_tokens == 0);
}

TEST_CASE("scheduler: on a device the hand-off's KV stays in device memory and the decoder imports it there") {
  // Both engines on one fenced backend (two processes' GPUs in production:
  // the move between them is kv_shared's, tested in tests/actors). The host
  // never reads or writes a KV block: no move of a block's size, only
  // logits rows down.
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto alone = make_engine(path, 1, 1);
  auto fence = std::make_shared<cleave::testing::FencedBackend>(make_cpu_backend(1));
  auto on_device = [&] {
    auto e = Engine::create(open_model(path), engine_options(1, 4), fence);
    REQUIRE_MESSAGE(e.ok(), e.status().to_string());
    return std::move(e.value());
  };
  auto prefill_engine = on_device(), decode_engine = on_device();
  const int32_t V = alone->config().n_vocab;
  const size_t block_bytes = prefill_engine->kv_layout().block_bytes();
  const auto log = fence->log();
  log->traffic = {};

  SchedulerOptions po;
  po.prefill_only = true;
  po.max_batch_tokens = 40;
  Scheduler prefill(*prefill_engine, tok.get(), po);
  Scheduler decode(*decode_engine, tok.get());
  Driver p{prefill}, dd{decode};
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < 5; ++i) {
    GenerateRequest r = mixed_request(i * 7 + 1);
    r.prompt = prompt_of(std::vector<int>{15, 16, 17, 50, 33}[size_t(i)], i);
    r.sampling.max_tokens = 10;
    requests.push_back(r);
    REQUIRE(prefill.submit(r).ok());
  }
  p.run_until_idle();
  int64_t handed_tokens = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerateRequest& r = requests[i];
    const Outcome& o = p.out[r.request_id];
    REQUIRE(o.handoffs.size() == 1);
    const SchedulerEvent& h = o.handoffs[0];
    CHECK(h.blocks.empty());
    REQUIRE(h.backend_blocks);
    CHECK(h.backend_blocks->size() == (r.prompt.size() + 15) / 16);
    CHECK(&h.backend_blocks->backend() == fence.get());
    handed_tokens += h.n_kv_tokens;
    // Request 3's second block corrupted where it lies: the decoder
    // imports its first block and recomputes the rest.
    if (i == 3) {
      const uint8_t flip = 0x5a;
      fence->upload(const_cast<void*>(h.backend_blocks->block(1)), &flip, 1);
      handed_tokens -= 50 - 16;
    }
    REQUIRE(decode.resume_from_backend(h.request, h.generated, h.backend_blocks).ok());
  }
  dd.run_until_idle();
  for (const GenerateRequest& r : requests) {
    CAPTURE(r.prompt.size());
    check_matches(joined(p.out[r.request_id], dd.out[r.request_id]), reference(*alone, tok.get(), r), V);
  }
  CHECK(decode.counters().imported_tokens == uint64_t(handed_tokens));
  CHECK(decode.counters().recomputed_tokens == uint64_t(50 - 16));
  CHECK(log->violations.empty());
  CHECK(log->traffic.upload_sizes.count(block_bytes) == 0);
  CHECK(log->traffic.download_sizes.count(block_bytes) == 0);
  for (const auto& [bytes, n] : log->traffic.download_sizes) CHECK(bytes % (uint64_t(V) * sizeof(float)) == 0);
  // Blocks in another backend's memory are refused; the memory of imported
  // blocks went back once admitted.
  auto other = std::make_shared<cleave::testing::FencedBackend>(make_cpu_backend(1), size_t(1) << 30);
  auto foreign = BackendBlocks::allocate(other, 1, block_bytes);
  REQUIRE(foreign.ok());
  CHECK(decode.resume_from_backend(requests[0], {}, foreign.value()).code() == Code::invalid_argument);
}

TEST_CASE("scheduler: a device without room for the hand-off's copy hands off records, losing nothing") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto alone = make_engine(path, 1, 1);
  const size_t reserve = size_t(1) << 30;
  auto fence = std::make_shared<cleave::testing::FencedBackend>(make_cpu_backend(1), reserve);
  auto e = Engine::create(open_model(path), engine_options(1, 2), fence);
  REQUIRE(e.ok());
  auto decode_engine = make_engine(path, engine_options(1, 2));
  SchedulerOptions po;
  po.prefill_only = true;
  Scheduler prefill(**e, tok.get(), po);
  Scheduler decode(*decode_engine, tok.get());
  Driver p{prefill}, dd{decode};
  GenerateRequest a = mixed_request(3), b = mixed_request(4);
  a.prompt = prompt_of(50, 1);
  b.prompt = prompt_of(50, 2);
  a.sampling.max_tokens = b.sampling.max_tokens = 6;
  a.prefill_chunk = b.prefill_chunk = 512;  // one forward of 50 rows each: B grows no buffer
  REQUIRE(prefill.submit(a).ok());
  p.run_until_idle();
  REQUIRE(p.out[a.request_id].handoffs.size() == 1);
  CHECK(p.out[a.request_id].handoffs[0].backend_blocks);  // room: left in device memory
  // The device's memory taken but for a sliver: B's forward reuses A's
  // buffers, its hand-off finds no room for the copy and sends records.
  const size_t used = (fence->log()->used_bytes + 63) / 64 * 64;
  REQUIRE(fence->alloc(reserve - used - 1024) != nullptr);
  REQUIRE(prefill.submit(b).ok());
  p.run_until_idle();
  const Outcome& ob = p.out[b.request_id];
  REQUIRE(ob.handoffs.size() == 1);
  const SchedulerEvent& h = ob.handoffs[0];
  CHECK_FALSE(h.backend_blocks);
  CHECK(h.blocks.size() == 4);
  REQUIRE(decode.resume(h.request, h.generated, h.blocks).ok());
  dd.run_until_idle();
  check_matches(joined(ob, dd.out[b.request_id]), reference(*alone, tok.get(), b), alone->config().n_vocab);
  CHECK(decode.counters().recomputed_tokens == 0);
}

TEST_CASE("scheduler: resume from truncated, corrupted or no KV recomputes the same tokens") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto alone = make_engine(path, 1, 1);
  auto prefill_engine = make_engine(path, engine_options(1, 1));
  const int32_t V = alone->config().n_vocab;

  GenerateRequest r = mixed_request(11);
  r.prompt = prompt_of(50, 77);  // 4 blocks: 16, 16, 16, 2 tokens
  r.sampling.max_tokens = 20;
  const GenerateResult want = reference(*alone, tok.get(), r);
  REQUIRE(want.tokens.size() == 20);

  SchedulerOptions po;
  po.prefill_only = true;
  Scheduler prefill(*prefill_engine, tok.get(), po);
  Driver p{prefill};
  REQUIRE(prefill.submit(r).ok());
  p.run_until_idle();
  REQUIRE(p.out[r.request_id].handoffs.size() == 1);
  const SchedulerEvent handoff = p.out[r.request_id].handoffs[0];
  REQUIRE(handoff.blocks.size() == 4);

  struct Case {
    std::string name;
    std::vector<int32_t> generated;
    std::function<void(std::vector<BlockRecord>&)> damage;
    uint64_t imported;
  };
  auto first = std::vector<int32_t>(want.tokens.begin(), want.tokens.begin() + 1);
  auto six = std::vector<int32_t>(want.tokens.begin(), want.tokens.begin() + 6);
  const std::vector<Case> cases = {
      {"intact", first, [](auto&) {}, 50},
      {"truncated to 2 blocks", first, [](auto& b) { b.resize(2); }, 32},
      {"block 1 corrupted", first, [](auto& b) { b[1].bytes[100] ^= 1; }, 16},
      {"block 0 from other tokens", first, [](auto& b) { b[0].header.key.lo ^= 1; seal(b[0]); }, 0},
      {"last block's token count wrong", first, [](auto& b) { b[3].header.n_tokens = 3; }, 48},
      {"no blocks", first, [](auto& b) { b.clear(); }, 0},
      // A decode actor died after 6 tokens; the store had the prompt's KV.
      {"six tokens generated", six, [](auto&) {}, 50},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    auto engine = make_engine(path, engine_options(2, 2));
    Scheduler decode(*engine, tok.get());
    Driver d{decode};
    std::vector<BlockRecord> blocks = handoff.blocks;
    c.damage(blocks);
    REQUIRE(decode.resume(r, c.generated, blocks).ok());
    d.run_until_idle();
    Outcome whole = d.out[r.request_id];
    CHECK(whole.first_index == int32_t(c.generated.size()));
    whole.tokens.insert(whole.tokens.begin(), c.generated.begin(), c.generated.end());
    // Text of the replayed tokens was shown by whoever produced them.
    RequestProgress shown(r, tok.get(), engine->context(), V);
    REQUIRE(shown.replay(c.generated).ok());
    whole.text = shown.take_text() + whole.text;
    check_matches(whole, want, V);
    CHECK(decode.counters().imported_tokens == c.imported);
    CHECK(decode.counters().recomputed_tokens ==
          uint64_t(r.prompt.size() + c.generated.size() - 1) - c.imported);
  }
}

TEST_CASE("scheduler: preemption under a tiny KV pool gives the same tokens") {
  auto tok = make_tokenizer();
  for (auto [spec, name] : {std::pair{small_dense(), "dense"}, std::pair{small_moe(), "moe"}}) {
    const std::string model = name;
    CAPTURE(model);
    const std::string path = model_path(spec, name);
    auto alone = make_engine(path, 1, 1);
    // 8 blocks of 16 tokens; each request grows to 4-5 blocks.
    auto engine = make_engine(path, engine_options(2, 4, 8));
    const int32_t V = engine->config().n_vocab;
    SchedulerOptions so;
    so.max_batch_tokens = 32;
    Scheduler scheduler(*engine, tok.get(), so);
    Driver d{scheduler};
    std::vector<GenerateRequest> requests;
    for (int i = 0; i < 6; ++i) {
      GenerateRequest r = mixed_request(i);
      r.prompt = prompt_of(20 + 5 * i, i + 40);
      r.sampling.max_tokens = 36 + i;
      r.ignore_eos = true;
      requests.push_back(r);
      REQUIRE(scheduler.submit(r).ok());
    }
    d.run_until_idle();
    for (const GenerateRequest& r : requests) {
      CAPTURE(r.request_id);
      check_matches(d.out[r.request_id], reference(*alone, tok.get(), r), V);
    }
    CHECK(scheduler.counters().preempted > 0);
    CHECK(scheduler.counters().failed == 0);
  }
}

TEST_CASE("scheduler: a request that can never fit fails, the others go on") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto alone = make_engine(path, 1, 1);
  auto engine = make_engine(path, engine_options(1, 2, 4));  // 4 blocks: 64 tokens
  Scheduler scheduler(*engine, tok.get());
  Driver d{scheduler};
  GenerateRequest big = mixed_request(1), small = mixed_request(2);
  big.prompt = prompt_of(80, 1);
  small.prompt = prompt_of(10, 2);
  small.sampling.max_tokens = 8;
  REQUIRE(scheduler.submit(small).ok());
  REQUIRE(scheduler.submit(big).ok());
  d.run_until_idle();
  const Outcome& failed = d.out[big.request_id];
  CHECK(failed.failed);
  CHECK(failed.error.code() == Code::out_of_memory);
  CHECK(failed.error.message().find(std::to_string(big.request_id)) != std::string::npos);
  CHECK(failed.tokens.empty());
  check_matches(d.out[small.request_id], reference(*alone, tok.get(), small),
                engine->config().n_vocab);
  CHECK(scheduler.counters().failed == 1);
}

TEST_CASE("scheduler: busy, duplicate ids, bad requests, cancel, max_tokens 0") {
  const std::string path = model_path(small_dense(), "dense");
  auto engine = make_engine(path, engine_options(1, 1));
  SchedulerOptions so;
  so.max_queue = 2;
  Scheduler scheduler(*engine, nullptr, so);
  GenerateRequest a = mixed_request(1), b = mixed_request(2), c = mixed_request(3);
  REQUIRE(scheduler.submit(a).ok());
  REQUIRE(scheduler.submit(b).ok());
  Status st = scheduler.submit(c);
  CHECK(st.code() == Code::busy);
  CHECK(scheduler.counters().rejected_busy == 1);
  CHECK(scheduler.submit(a).code() == Code::invalid_argument);  // same id
  CHECK(scheduler.queued() == 2);

  Driver d{scheduler};
  d.step();  // a runs (one sequence slot), b waits
  CHECK(scheduler.running() == 1);
  CHECK(scheduler.queued() == 1);
  CHECK(scheduler.resume(a, {}, {}).code() == Code::invalid_argument);  // a is running
  REQUIRE(scheduler.submit(c).ok());  // room in the queue again
  CHECK(scheduler.cancel(a.request_id).ok());
  CHECK_FALSE(scheduler.has(a.request_id));
  CHECK(scheduler.cancel(a.request_id).code() == Code::not_found);
  CHECK(scheduler.cancel(c.request_id).ok());

  GenerateRequest bad = mixed_request(4);
  bad.prompt = {5, 40000};
  CHECK(scheduler.submit(bad).message().find("40000") != std::string::npos);
  bad.prompt = prompt_of(300, 4);
  CHECK(scheduler.submit(bad).code() == Code::out_of_range);
  GenerateRequest bad_resume = mixed_request(5);
  CHECK(scheduler.resume(bad_resume, {1, 99999}, {}).code() == Code::invalid_argument);

  GenerateRequest none = mixed_request(6);
  none.sampling.max_tokens = 0;
  REQUIRE(scheduler.submit(none).ok());
  d.run_until_idle();
  CHECK(d.out[none.request_id].finished);
  CHECK(d.out[none.request_id].finish_reason == "length");
  CHECK(d.out[none.request_id].tokens.empty());
  CHECK(d.out[b.request_id].finished);
  CHECK_FALSE(d.out[a.request_id].finished);  // cancelled: no event after

  SchedulerOptions zero;
  zero.max_batch_tokens = 0;
  CHECK(validate_scheduler_options(zero).message().find("max_batch_tokens") != std::string::npos);
}

TEST_CASE("scheduler: token events carry logprobs when asked, cached tokens on the first, rng_stream keys sampling") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto engine = make_engine(path, engine_options(1, 4));
  const int32_t V = engine->config().n_vocab;
  Scheduler scheduler(*engine, tok.get());

  auto run = [&](GenerateRequest r) {
    std::vector<SchedulerEvent> tokens;
    REQUIRE(scheduler.submit(std::move(r)).ok());
    while (!scheduler.idle()) {
      std::vector<SchedulerEvent> events;
      REQUIRE(scheduler.step(events).ok());
      for (auto& e : events)
        if (e.kind == SchedulerEvent::Kind::token) tokens.push_back(std::move(e));
    }
    return tokens;
  };
  GenerateRequest r;
  r.prompt = prompt_of(40, 7);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = 6;
  r.request_id = 1;
  r.logprobs = 3;
  auto first = run(r);
  REQUIRE(first.size() == 6);
  CHECK(first[0].cached_tokens == 0);  // nothing cached yet
  for (const auto& e : first) {
    REQUIRE(e.has_logprobs);
    CHECK(e.logprobs.chosen.token == e.token);
    REQUIRE(e.logprobs.top.size() == 3);
    CHECK(e.logprobs.top[0].token == e.token);  // greedy: the argmax
    CHECK(e.logprobs.top[0].logprob == e.logprobs.chosen.logprob);
    CHECK(e.logprobs.top[0].logprob >= e.logprobs.top[1].logprob);
    CHECK(e.logprobs.chosen.logprob <= 0.0f);
    CHECK(e.cached_tokens == (e.index == 0 ? e.cached_tokens : 0));
  }
  // The same prompt again: its full blocks come from the prefix cache.
  const uint64_t hits_before = scheduler.counters().prefix_hit_tokens;
  r.request_id = 2;
  r.logprobs = -1;
  auto second = run(r);
  REQUIRE(second.size() == 6);
  CHECK(second[0].cached_tokens > 0);
  CHECK(uint64_t(second[0].cached_tokens) == scheduler.counters().prefix_hit_tokens - hits_before);
  CHECK_FALSE(second[0].has_logprobs);
  for (size_t i = 0; i < 6; ++i) CHECK(second[i].token == first[i].token);

  // Sampling at temperature 1: the RNG follows rng_stream, not the id.
  auto sampled = [&](uint64_t id, std::optional<uint64_t> stream) {
    GenerateRequest s = r;
    s.request_id = id;
    s.rng_stream = stream;
    s.sampling.temperature = 1.5f;
    s.sampling.top_k = 0;
    s.sampling.top_p = 1;
    s.sampling.min_p = 0;
    s.sampling.max_tokens = 24;
    s.ignore_eos = true;
    std::vector<int32_t> out;
    for (const auto& e : run(s)) out.push_back(e.token);
    return out;
  };
  const auto a = sampled(10, 0), b = sampled(11, 0), c = sampled(12, 1);
  CHECK(a == b);
  CHECK(a != c);
  CHECK(sampled(10, std::nullopt) != sampled(13, std::nullopt));
  (void)V;
}

TEST_CASE("scheduler: the finish hook sees a finished request's KV before its sequence closes") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto engine = make_engine(path, engine_options(1, 4));
  Scheduler s(*engine, tok.get());
  struct Seen {
    int32_t seq, length;
    size_t blocks;
  };
  std::vector<Seen> seen;
  s.set_finish_hook([&](int32_t seq) {
    auto blocks = engine->export_blocks(seq);
    REQUIRE(blocks.ok());
    seen.push_back({seq, engine->sequence_length(seq), blocks->size()});
  });
  Driver d{s};
  // 33 tokens ending at the first token, 40 tokens with 5: the first's KV
  // is its prompt (3 blocks), the second's prompt and 4 generated tokens.
  for (auto [id, len, max] : {std::tuple{1, 33, 1}, std::tuple{2, 40, 5}}) {
    GenerateRequest r;
    r.request_id = uint64_t(id);
    r.prompt = prompt_of(len, id);
    r.sampling.temperature = 0;
    r.sampling.max_tokens = max;
    REQUIRE(s.submit(r).ok());
  }
  d.run_until_idle();
  REQUIRE(seen.size() == 2);
  std::sort(seen.begin(), seen.end(), [](const Seen& a, const Seen& b) { return a.length < b.length; });
  CHECK(seen[0].length == 33);
  CHECK(seen[0].blocks == 3);
  CHECK(seen[1].length == 44);
  CHECK(seen[1].blocks == 3);
  CHECK(d.out[1].finished);
  CHECK(d.out[2].finished);
  for (int32_t seq = 0; seq < 4; ++seq) CHECK(engine->sequence_length(seq) == 0);  // closed after the hook
}

namespace {

// The step of each request's first token and of its finish, run to idle.
struct Times {
  int first = -1, finish = -1;
};
std::map<uint64_t, Times> run_timed(Driver& d) {
  std::map<uint64_t, Times> t;
  auto note = [&] {
    for (const auto& [id, o] : d.out) {
      if (!o.tokens.empty() && t[id].first < 0) t[id].first = d.steps;
      if (o.finished && t[id].finish < 0) t[id].finish = d.steps;
    }
  };
  note();
  while (!d.scheduler.idle()) {
    REQUIRE(d.steps < 100000);
    d.step();
    note();
  }
  return t;
}

GenerateRequest prioritised(int i, int32_t priority, int32_t max_tokens) {
  GenerateRequest r = mixed_request(i);
  r.prompt = prompt_of(12 + i, 70 + i);
  r.sampling.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.priority = priority;
  return r;
}

}  // namespace

TEST_CASE("scheduler priority: lower values run first and preempt higher ones, tokens equal generate()") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto alone = make_engine(path, 1, 1);
  auto engine = make_engine(path, engine_options(1, 1));  // one sequence slot
  const int32_t V = engine->config().n_vocab;
  SchedulerOptions so;
  so.policy = SchedulingPolicy::priority;
  Scheduler scheduler(*engine, tok.get(), so);
  Driver d{scheduler};
  const GenerateRequest low = prioritised(1, 5, 12);
  REQUIRE(scheduler.submit(low).ok());
  for (int i = 0; i < 4; ++i) d.step();  // low holds the slot, tokens out
  REQUIRE(d.out[low.request_id].tokens.size() >= 2);
  const GenerateRequest later_low = prioritised(2, 5, 6), high = prioritised(3, 0, 6),
                        urgent = prioritised(4, -1, 6);
  REQUIRE(scheduler.submit(later_low).ok());
  REQUIRE(scheduler.submit(high).ok());
  REQUIRE(scheduler.submit(urgent).ok());
  auto t = run_timed(d);
  // urgent preempts low at once; high runs next; then low (it arrived first)
  // finishes before later_low of the same value starts.
  CHECK(t[urgent.request_id].first == 5);
  CHECK(t[urgent.request_id].finish < t[high.request_id].first);
  CHECK(t[high.request_id].finish < t[low.request_id].finish);
  CHECK(t[low.request_id].finish < t[later_low.request_id].first);
  CHECK(scheduler.counters().preempted_for_priority == 1);
  for (const GenerateRequest& r : {low, later_low, high, urgent}) {
    CAPTURE(r.request_id);
    check_matches(d.out[r.request_id], reference(*alone, tok.get(), r), V);
  }
}

TEST_CASE("scheduler priority: equal values never preempt, fcfs refuses a nonzero priority") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto engine = make_engine(path, engine_options(1, 1));
  {
    SchedulerOptions so;
    so.policy = SchedulingPolicy::priority;
    Scheduler scheduler(*engine, tok.get(), so);
    Driver d{scheduler};
    const GenerateRequest a = prioritised(1, 3, 6), b = prioritised(2, 3, 6);
    REQUIRE(scheduler.submit(a).ok());
    d.step();
    REQUIRE(scheduler.submit(b).ok());
    d.run_until_idle();
    CHECK(scheduler.counters().preempted_for_priority == 0);
    CHECK(scheduler.counters().preempted == 0);
    CHECK(d.out[a.request_id].finished);
    CHECK(d.out[b.request_id].finished);
  }
  Scheduler fcfs(*engine, tok.get());
  GenerateRequest r = prioritised(5, 2, 4);
  Status st = fcfs.submit(r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("priority 2") != std::string::npos);
  CHECK(st.message().find("fcfs") != std::string::npos);
  CHECK(fcfs.resume(r, {}, {}).code() == Code::invalid_argument);
  r.priority = 0;
  CHECK(fcfs.submit(r).ok());
  CHECK(parse_scheduling_policy("priority").value() == SchedulingPolicy::priority);
  CHECK(parse_scheduling_policy("lifo").status().message().find("fcfs, priority") != std::string::npos);
}

TEST_CASE("scheduler priority: a request short of KV blocks preempts higher values, tokens equal generate()") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto alone = make_engine(path, 1, 1);
  // 7 blocks of 16 tokens, 4 slots: the two low requests take 4 blocks and
  // each keeps one to grow by; high needs 4 for its prompt.
  auto engine = make_engine(path, engine_options(1, 4, 7));
  const int32_t V = engine->config().n_vocab;
  SchedulerOptions so;
  so.policy = SchedulingPolicy::priority;
  Scheduler scheduler(*engine, tok.get(), so);
  Driver d{scheduler};
  GenerateRequest low1 = prioritised(1, 9, 20), low2 = prioritised(2, 9, 20), high = prioritised(3, 1, 4);
  low1.prompt = prompt_of(24, 81);
  low2.prompt = prompt_of(24, 82);
  high.prompt = prompt_of(60, 83);  // fits only when a low one leaves
  high.prefill_chunk = 512;
  REQUIRE(scheduler.submit(low1).ok());
  REQUIRE(scheduler.submit(low2).ok());
  for (int i = 0; i < 3; ++i) d.step();
  REQUIRE_FALSE(d.out[low2.request_id].tokens.empty());
  REQUIRE(scheduler.submit(high).ok());
  d.step();  // high is admitted at once, low2 (the younger low) requeued
  CHECK(scheduler.counters().preempted_for_priority == 1);
  auto t = run_timed(d);
  CHECK(scheduler.counters().failed == 0);
  for (const GenerateRequest& r : {low1, low2, high}) {
    CAPTURE(r.request_id);
    check_matches(d.out[r.request_id], reference(*alone, tok.get(), r), V);
  }
  CHECK(t[high.request_id].first == 4);  // its prefill ran in the step it was admitted
  CHECK(t[high.request_id].finish < t[low1.request_id].finish);
  CHECK(t[high.request_id].finish < t[low2.request_id].finish);
}
