// Image prompts in the engine and the scheduler: rows fed from embeddings
// instead of token ids. Every comparison is bit for bit (memcmp) against
// generate() run alone on an engine of its own: chunking, batching,
// preemption, prefix reuse and KV hand-off must not change a bit, and the
// KV keys must keep one image's KV from ever serving another.
#include <doctest/doctest.h>

#include <algorithm>

#include "model/generate.h"
#include "model/scheduler.h"
#include "model_fixtures.h"

using namespace cleave;
using namespace cleave::fixtures;

namespace {

// A stand-in for an encoded image: deterministic rows in [-0.5, 0.5) and a
// content hash derived from the salt (a real hash comes from image_hash()).
PromptImage fake_image(int32_t position, int32_t n_tokens, int32_t n_embd, uint64_t salt) {
  PromptImage im;
  im.position = position;
  im.n_tokens = n_tokens;
  im.hash = ImageHash{salt * 0x9E3779B97F4A7C15ull + 1, salt ^ 0xC2B2AE3D27D4EB4Full};
  uint64_t x = salt * 6364136223846793005ull + 1442695040888963407ull;
  im.embeddings.resize(size_t(n_tokens) * size_t(n_embd));
  for (float& v : im.embeddings) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = float(x >> 40) / float(1 << 24) - 0.5f;
  }
  return im;
}

// text_before tokens, then the image's placeholder ids (0, as train.py
// feeds), then text_after tokens; greedy, every step's logits kept.
GenerateRequest image_request(int text_before, int32_t image_tokens, int text_after,
                              uint64_t image_salt, int32_t n_embd, int text_salt = 1) {
  GenerateRequest r;
  r.prompt = prompt_of(text_before, text_salt);
  r.images.push_back(fake_image(text_before, image_tokens, n_embd, image_salt));
  r.prompt.insert(r.prompt.end(), size_t(image_tokens), 0);
  const auto tail = prompt_of(text_after, text_salt + 100);
  r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
  r.sampling.temperature = 0;
  r.sampling.max_tokens = 6;
  r.ignore_eos = true;
  r.keep_logits = true;
  return r;
}

GenerateResult alone(Engine& engine, const GenerateRequest& r) {
  auto g = generate(engine, nullptr, r);
  REQUIRE_MESSAGE(g.ok(), g.status().to_string());
  return std::move(*g);
}

// What the scheduler does on admission: attach the longest cached prefix,
// then prefill the rest in one chunk. Returns the logits of the last prompt
// token; the sequence is closed again (its full blocks stay cached).
std::vector<float> prefill_cached(Engine& e, const GenerateRequest& r) {
  auto seq = e.open_sequence(image_key_spans(r));
  REQUIRE_MESSAGE(seq.ok(), seq.status().to_string());
  const int32_t n = int32_t(r.prompt.size());
  auto hit = e.attach_cached_prefix(*seq, r.prompt.data(), n);
  REQUIRE(hit.ok());
  std::vector<float> scratch, logits(static_cast<size_t>(e.config().n_vocab));
  Status st = e.forward({{*seq, r.prompt.data() + *hit, n - *hit,
                          image_rows(r, *hit, n - *hit, e.config().dim, scratch)}},
                        logits.data());
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  e.close_sequence(*seq);
  return logits;
}

std::vector<float> first_row(const GenerateResult& g, int32_t n_vocab) {
  return std::vector<float>(g.logits.begin(), g.logits.begin() + n_vocab);
}

}  // namespace

TEST_CASE("engine images: embedding rows are used and bit-identical in one chunk or split") {
  const std::string path = model_path(small_dense(), "dense");
  auto e = make_engine(path, 1, 1);
  const int32_t D = e->config().dim;
  const GenerateRequest whole = image_request(3, 20, 9, 7, D);
  const GenerateResult want = alone(*e, whole);
  for (int chunk : {1, 5, 7, 16, 21}) {  // 21: the image ends a chunk exactly
    CAPTURE(chunk);
    GenerateRequest r = whole;
    r.prefill_chunk = chunk;
    const GenerateResult got = alone(*e, r);
    CHECK(got.tokens == want.tokens);
    CHECK(same_bits(got.logits, want.logits));
  }
  // The rows matter: the same ids fed as tokens, or other embeddings, give other logits.
  GenerateRequest as_tokens = whole;
  as_tokens.images.clear();
  CHECK_FALSE(same_bits(alone(*e, as_tokens).logits, want.logits));
  GenerateRequest other = image_request(3, 20, 9, 8, D);
  CHECK_FALSE(same_bits(alone(*e, other).logits, want.logits));
}

TEST_CASE("engine images: a row's result does not depend on the batch beside it") {
  const std::string path = model_path(small_dense(), "dense");
  auto single = make_engine(path, 1, 1);
  auto batched = make_engine(path, 3, 4);
  const int32_t D = single->config().dim, V = single->config().n_vocab;
  const GenerateRequest a = image_request(1, 16, 12, 11, D);
  GenerateRequest b = image_request(5, 9, 4, 12, D, 2);
  // b carries two images: the second chunk below holds rows of both.
  b.images.push_back(fake_image(int32_t(b.prompt.size()), 6, D, 13));
  b.prompt.insert(b.prompt.end(), 6, 0);
  const std::vector<int32_t> text = prompt_of(23, 3);

  const std::vector<float> want_a = first_row(alone(*single, a), V);
  const std::vector<float> want_b = first_row(alone(*single, b), V);

  auto sa = batched->open_sequence(image_key_spans(a));
  auto sb = batched->open_sequence(image_key_spans(b));
  auto st = batched->open_sequence();
  REQUIRE(sa.ok());
  REQUIRE(sb.ok());
  REQUIRE(st.ok());
  std::vector<float> scratch_a, scratch_b;
  const int32_t na = int32_t(a.prompt.size()), nb = int32_t(b.prompt.size());
  // First forward: a whole, b's first 8 tokens (3 image rows), text.
  std::vector<float> logits(3 * size_t(V));
  REQUIRE(batched
              ->forward({{*sb, b.prompt.data(), 8, image_rows(b, 0, 8, D, scratch_b)},
                         {*sa, a.prompt.data(), na, image_rows(a, 0, na, D, scratch_a)},
                         {*st, text.data(), 23}},
                        logits.data())
              .ok());
  CHECK(same_bits(std::vector<float>(logits.begin() + V, logits.begin() + 2 * V), want_a));
  // Second: the rest of b (both images' rows, copied through the scratch).
  const auto rows = image_rows(b, 8, nb - 8, D, scratch_b);
  CHECK(rows.size() == size_t(6 + 6) * size_t(D));
  CHECK(rows.data() == scratch_b.data());
  REQUIRE(batched->forward({{*st, text.data(), 1}, {*sb, b.prompt.data() + 8, nb - 8, rows}},
                           logits.data())
              .ok());
  CHECK(same_bits(std::vector<float>(logits.begin() + V, logits.begin() + 2 * V), want_b));
}

TEST_CASE("engine images: KV is reused for the same image and never for another") {
  const std::string path = model_path(small_dense(), "dense");
  EngineOptions o;
  o.threads = 2;
  o.max_seqs = 2;
  auto e = make_engine(path, o);
  auto fresh = make_engine(path, 1, 1);
  const int32_t D = e->config().dim;
  // Blocks of 16: [0,16) text only, [16,32) and [32,48) hold the image, then a partial block.
  const GenerateRequest x = image_request(20, 16, 14, 21, D);
  const GenerateRequest y = image_request(20, 16, 14, 22, D);
  GenerateRequest z = x;  // X's rows under a third hash: the keys follow the hash
  z.images[0].hash = fake_image(20, 16, D, 23).hash;

  const int32_t V = e->config().n_vocab;
  const std::vector<float> want_x = first_row(alone(*fresh, x), V);
  const std::vector<float> want_y = first_row(alone(*fresh, y), V);
  CHECK(same_bits(prefill_cached(*e, x), want_x));
  CHECK(e->cache_stats().hit_tokens == 0);
  CHECK(same_bits(prefill_cached(*e, x), want_x));
  CHECK(e->cache_stats().hit_tokens == 48);

  // Another image, same text: only the text-only first block is shared.
  CHECK(same_bits(prefill_cached(*e, y), want_y));
  CHECK(e->cache_stats().hit_tokens == 48 + 16);
  CHECK_FALSE(same_bits(want_y, want_x));
  CHECK(same_bits(prefill_cached(*e, z), want_x));  // the same rows: the same bits, KV made anew
  CHECK(e->cache_stats().hit_tokens == 48 + 16 + 16);

  // The placeholder ids as plain text never reach the image blocks either.
  GenerateRequest text_only = x;
  text_only.images.clear();
  prefill_cached(*e, text_only);
  CHECK(e->cache_stats().hit_tokens == 48 + 16 + 16 + 16);

  // Keys: the image's blocks differ, the text-only block does not.
  auto sx = e->open_sequence(image_key_spans(x));
  auto sy = e->open_sequence(image_key_spans(y));
  REQUIRE(sx.ok());
  REQUIRE(sy.ok());
  std::vector<float> scratch, logits(size_t(V) * 2);
  const int32_t n = int32_t(x.prompt.size());
  REQUIRE(e->forward({{*sx, x.prompt.data(), n, image_rows(x, 0, n, D, scratch)},
                      {*sy, y.prompt.data(), n, image_rows(y, 0, n, D, scratch)}},
                     logits.data())
              .ok());
  const auto kx = e->block_keys(*sx), ky = e->block_keys(*sy);
  REQUIRE(kx.size() == 4);
  REQUIRE(ky.size() == 4);
  CHECK(kx[0] == ky[0]);
  for (size_t b = 1; b < 4; ++b) CHECK_FALSE(kx[b] == ky[b]);
  CHECK(kx[0] == chain_keys(x.prompt.data(), 16, e->model_fingerprint(), e->kv_layout())[0]);
  CHECK(kx[1] == chain_keys(x.prompt.data(), 32, e->model_fingerprint(), e->kv_layout(),
                            image_key_spans(x))[1]);
}

TEST_CASE("engine images: exported KV imports only for the same image") {
  const std::string path = model_path(small_dense(), "dense");
  auto a = make_engine(path, 1, 1);
  auto b = make_engine(path, 1, 3);
  const int32_t D = a->config().dim, V = a->config().n_vocab;
  const GenerateRequest x = image_request(2, 16, 20, 31, D);
  const GenerateRequest y = image_request(2, 16, 20, 32, D);
  const int32_t n = int32_t(x.prompt.size());

  auto sa = a->open_sequence(image_key_spans(x));
  REQUIRE(sa.ok());
  std::vector<float> scratch, logits(static_cast<size_t>(V));
  REQUIRE(a->forward({{*sa, x.prompt.data(), n - 1, image_rows(x, 0, n - 1, D, scratch)}},
                     logits.data())
              .ok());
  auto records = a->export_blocks(*sa);
  REQUIRE(records.ok());

  for (const GenerateRequest* other : {&y, static_cast<const GenerateRequest*>(nullptr)}) {
    auto s = b->open_sequence(other ? image_key_spans(*other) : std::vector<KeySpan>{});
    REQUIRE(s.ok());
    Status st = b->import_blocks(*s, x.prompt.data(), n - 1, *records);
    CHECK(st.code() == Code::invalid_argument);
    CHECK(st.message().find("key") != std::string::npos);
    CHECK(b->sequence_length(*s) == 0);
    b->close_sequence(*s);
  }
  auto s = b->open_sequence(image_key_spans(x));
  REQUIRE(s.ok());
  REQUIRE(b->import_blocks(*s, x.prompt.data(), n - 1, *records).ok());
  CHECK(b->block_keys(*s) == a->block_keys(*sa));
  // The last prompt token on top of the imported KV: generate()'s first logits.
  REQUIRE(b->forward({{*s, x.prompt.data() + n - 1, 1}}, logits.data()).ok());
  auto solo = make_engine(path, 1, 1);
  CHECK(same_bits(logits, first_row(alone(*solo, x), V)));
}

TEST_CASE("engine images: bad spans and embedding sizes are typed errors") {
  const std::string path = model_path(small_dense(), "dense");
  auto e = make_engine(path, 1, 2);
  const int32_t D = e->config().dim, V = e->config().n_vocab;
  const BlockKey h{1, 2};
  for (const std::vector<KeySpan>& bad :
       {std::vector<KeySpan>{{-1, 4, h}}, std::vector<KeySpan>{{0, 0, h}},
        std::vector<KeySpan>{{250, 7, h}},                 // past the context of 256
        std::vector<KeySpan>{{4, 4, h}, {7, 2, h}},        // overlapping
        std::vector<KeySpan>{{8, 2, h}, {2, 2, h}}}) {     // unsorted
    auto s = e->open_sequence(bad);
    CHECK(s.status().code() == Code::invalid_argument);
    CHECK(s.status().message().find("image span") != std::string::npos);
  }
  auto s = e->open_sequence({{2, 4, h}});
  REQUIRE(s.ok());
  const std::vector<int32_t> ids(10, 5);
  // One float more than four rows: the too-long case stays inside the buffer.
  std::vector<float> rows(size_t(4) * D + 1, 0.25f), logits(2 * static_cast<size_t>(V));
  for (size_t floats : {size_t(0), size_t(3) * D, size_t(4) * D + 1}) {
    Status st = e->forward({{*s, ids.data(), 10, {rows.data(), floats}}}, logits.data());
    CHECK(st.code() == Code::invalid_argument);
    CHECK(st.message().find("embedding floats") != std::string::npos);
    CHECK(e->sequence_length(*s) == 0);
  }
  // Rows for an item with no image position are refused too.
  auto plain = e->open_sequence();
  REQUIRE(plain.ok());
  CHECK(e->forward({{*plain, ids.data(), 1, {rows.data(), size_t(D)}}}, logits.data()).code() ==
        Code::invalid_argument);
  // Two items of one sequence: the second's image rows count from where the first ends.
  CHECK(e->forward({{*s, ids.data(), 3, {rows.data(), size_t(D)}},
                    {*s, ids.data(), 7, {rows.data(), size_t(3) * D}}},
                   logits.data())
            .ok());
  CHECK(e->sequence_length(*s) == 10);
}

TEST_CASE("requests: image validation and encoding checks name the problem") {
  const int32_t V = 32000, D = 8;
  GenerateRequest r;
  r.prompt.assign(20, 5);
  r.images = {fake_image(1, 4, D, 1), fake_image(8, 3, D, 2)};
  CHECK(validate_request(r, 64, V, D).ok());
  CHECK(validate_request(r, 64, V).ok());
  CHECK(check_images_encoded(r).ok());
  auto expect = [&](GenerateRequest bad, Code code, const std::string& words) {
    Status st = validate_request(bad, 64, V, D);
    CHECK(st.code() == code);
    CHECK_MESSAGE(st.message().find(words) != std::string::npos, st.message());
  };
  GenerateRequest bad = r;
  bad.images[1].n_tokens = 0;
  expect(bad, Code::invalid_argument, "empty");
  bad = r;
  bad.images[1].position = 18;  // 18 + 3 > 20
  expect(bad, Code::out_of_range, "outside the prompt");
  bad = r;
  bad.images[0].position = -1;
  expect(bad, Code::out_of_range, "outside the prompt");
  bad = r;
  bad.images[1].position = 3;  // overlaps [1, 5)
  expect(bad, Code::invalid_argument, "prompt order");
  bad = r;
  std::swap(bad.images[0], bad.images[1]);
  expect(bad, Code::invalid_argument, "prompt order");
  bad = r;
  bad.images[0].embeddings.pop_back();
  expect(bad, Code::invalid_argument, "embedding floats");
  CHECK(validate_request(bad, 64, V).code() == Code::invalid_argument);  // not a multiple of 4
  bad = r;
  bad.images[0].embeddings.resize(size_t(4) * (D + 1));  // another width: only n_embd knows
  CHECK(validate_request(bad, 64, V).ok());
  expect(bad, Code::invalid_argument, "n_embd 8");
  bad = r;
  bad.images[1].embeddings.clear();  // not encoded yet: valid, but not runnable
  CHECK(validate_request(bad, 64, V, D).ok());
  Status st = check_images_encoded(bad);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("image 1") != std::string::npos);
  CHECK(st.message().find("not encoded") != std::string::npos);
}

TEST_CASE("scheduler images: unencoded images are refused at submit and by generate") {
  const std::string path = model_path(small_dense(), "dense");
  auto e = make_engine(path, 1, 2);
  GenerateRequest r = image_request(1, 16, 3, 41, e->config().dim);
  r.images[0].embeddings.clear();
  Scheduler scheduler(*e, nullptr);
  Status st = scheduler.submit(r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("not encoded") != std::string::npos);
  CHECK(scheduler.idle());
  CHECK(generate(*e, nullptr, r).status().code() == Code::invalid_argument);
  r = image_request(1, 16, 3, 41, e->config().dim + 1);  // encoded for another width
  CHECK(scheduler.submit(r).code() == Code::invalid_argument);
}

TEST_CASE("scheduler images: batched and preempted requests equal generate() alone") {
  auto tok = make_tokenizer();
  for (auto [spec, name] : {std::pair{small_dense(), "dense"}, std::pair{small_moe(), "moe"}}) {
    const std::string model = name;
    CAPTURE(model);
    const std::string path = model_path(spec, name);
    auto solo = make_engine(path, 1, 1);
    const int32_t D = solo->config().dim, V = solo->config().n_vocab;
    std::vector<GenerateRequest> requests;
    for (int i = 0; i < 8; ++i) {
      GenerateRequest r;
      if (i % 4 == 3) {
        r = image_request(0, 0, 12 + i, 0, D, i);  // text only
        r.images.clear();
      } else {
        // Images 0 and 4 (and 1 and 5) are the same image: prefix reuse across requests.
        r = image_request(1 + i % 2, 16, 6 + i, uint64_t(50 + i % 4), D, i % 4);
      }
      if (i % 4 == 2) {  // a second image right after the text: two images per chunk
        r.images.push_back(fake_image(int32_t(r.prompt.size()), 9, D, uint64_t(60 + i)));
        r.prompt.insert(r.prompt.end(), 9, 0);
        r.prompt.push_back(7);
      }
      r.request_id = uint64_t(100 + i);
      r.prefill_chunk = std::vector<int>{5, 16, 512}[size_t(i % 3)];
      r.sampling.max_tokens = 30 + i;
      if (i % 2) {
        r.sampling.temperature = 0.8f;
        r.sampling.seed = uint64_t(i);
      }
      requests.push_back(r);
    }
    for (int kv_blocks : {0, 8}) {  // 8 blocks of 16: sequences of 3-5 blocks preempt each other
      CAPTURE(kv_blocks);
      EngineOptions o;
      o.threads = 2;
      o.max_seqs = 4;
      o.kv_blocks = kv_blocks;
      auto engine = make_engine(path, o);
      SchedulerOptions so;
      so.max_batch_tokens = 24;
      Scheduler scheduler(*engine, tok.get(), so);
      std::map<uint64_t, std::vector<int32_t>> tokens;
      std::map<uint64_t, std::vector<float>> last;
      for (const GenerateRequest& r : requests) REQUIRE(scheduler.submit(r).ok());
      for (int steps = 0; !scheduler.idle(); ++steps) {
        REQUIRE(steps < 10000);
        std::vector<SchedulerEvent> events;
        REQUIRE(scheduler.step(events).ok());
        for (const SchedulerEvent& ev : events) {
          REQUIRE(ev.kind != SchedulerEvent::Kind::failed);
          if (ev.kind == SchedulerEvent::Kind::token) tokens[ev.request_id].push_back(ev.token);
          if (ev.kind == SchedulerEvent::Kind::finished) last[ev.request_id] = ev.logits;
        }
      }
      for (const GenerateRequest& r : requests) {
        CAPTURE(r.request_id);
        auto want = generate(*solo, tok.get(), r);
        REQUIRE(want.ok());
        CHECK(tokens[r.request_id] == want->tokens);
        CHECK(same_bits(last[r.request_id],
                        std::vector<float>(want->logits.end() - V, want->logits.end())));
      }
      if (kv_blocks) CHECK(scheduler.counters().preempted > 0);
      else CHECK(scheduler.counters().prefix_hit_tokens > 0);
    }
  }
}

TEST_CASE("scheduler images: handed off with KV and resumed on another engine equals generate()") {
  auto tok = make_tokenizer();
  const std::string path = model_path(small_dense(), "dense");
  auto solo = make_engine(path, 1, 1);
  auto prefill = make_engine(path, 1, 2);
  auto decode = make_engine(path, 1, 2);
  const int32_t D = solo->config().dim, V = solo->config().n_vocab;
  GenerateRequest r = image_request(4, 16, 17, 71, D);
  r.request_id = 9;
  r.sampling.max_tokens = 12;
  SchedulerOptions po;
  po.prefill_only = true;
  Scheduler p(*prefill, tok.get(), po);
  REQUIRE(p.submit(r).ok());
  std::vector<SchedulerEvent> events;
  while (!p.idle()) REQUIRE(p.step(events).ok());
  const auto handoff = std::find_if(events.begin(), events.end(), [](const SchedulerEvent& e) {
    return e.kind == SchedulerEvent::Kind::handoff;
  });
  REQUIRE(handoff != events.end());
  REQUIRE(handoff->request.images.size() == 1);

  const auto want = generate(*solo, tok.get(), r);
  REQUIRE(want.ok());
  for (bool other_image : {false, true}) {
    CAPTURE(other_image);
    GenerateRequest resumed = handoff->request;
    if (other_image) resumed.images[0] = fake_image(4, 16, D, 72);  // records must not attach
    Scheduler d(*decode, tok.get());
    REQUIRE(d.resume(resumed, handoff->generated, handoff->blocks).ok());
    std::vector<int32_t> tokens = handoff->generated;
    std::vector<float> final_logits;
    std::vector<SchedulerEvent> ev;
    while (!d.idle()) REQUIRE(d.step(ev).ok());
    for (const SchedulerEvent& e : ev) {
      if (e.kind == SchedulerEvent::Kind::token) tokens.push_back(e.token);
      if (e.kind == SchedulerEvent::Kind::finished) final_logits = e.logits;
    }
    CHECK(d.counters().imported_tokens == (other_image ? 0u : uint64_t(handoff->n_kv_tokens)));
    if (!other_image) {
      CHECK(tokens == want->tokens);
      CHECK(same_bits(final_logits, std::vector<float>(want->logits.end() - V, want->logits.end())));
    } else {
      CHECK(d.counters().recomputed_tokens == uint64_t(handoff->n_kv_tokens));  // all of it
    }
  }
}
