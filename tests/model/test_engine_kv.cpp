// The engine's KV management: prefix reuse with copy-on-write, LRU eviction
// of cached blocks, KV export / import between engines, and the model
// fingerprint. Every logit comparison is against a fresh engine without a
// cache that runs the whole token stream at once, bit for bit (memcmp).
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>

#include "model/engine.h"
#include "model/make_model.h"
#include "tests/process_scratch.h"
#include "tests/same_bits.h"

using namespace cleave;
namespace fs = std::filesystem;

namespace {

const std::string kVocab = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";

// A small dense model per seed, written once per process.
std::string model_path(uint64_t seed) {
  static std::map<uint64_t, std::string> made;
  auto it = made.find(seed);
  if (it != made.end()) return it->second;
  const fs::path dir = test::process_scratch("cleave-engine-kv-test");
  ModelSpec s;
  s.dim = 64; s.n_layers = 2; s.n_heads = 4; s.n_kv_heads = 2; s.ffn = 128; s.context = 256;
  s.seed = seed;
  std::string path = (dir / ("seed" + std::to_string(seed) + ".gguf")).string();
  Status st = write_test_model(s, kVocab, path);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  made[seed] = path;
  return path;
}

std::unique_ptr<Engine> make_engine(EngineOptions o, uint64_t seed = 1) {
  auto file = GgufFile::open(model_path(seed));
  REQUIRE_MESSAGE(file.ok(), file.status().to_string());
  auto e = Engine::create(*file, o);
  REQUIRE_MESSAGE(e.ok(), e.status().to_string());
  return std::move(*e);
}

EngineOptions opts(int threads = 1, bool cache = true, int kv_blocks = 0, int max_seqs = 4) {
  EngineOptions o;
  o.threads = threads;
  o.max_seqs = max_seqs;
  o.block_size = 16;
  o.kv_blocks = kv_blocks;
  o.prefix_cache = cache;
  return o;
}

std::vector<int32_t> tokens_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + (i * 7919 + salt * 104729) % 31990);
  return p;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<int32_t> head(const std::vector<int32_t>& v, size_t n) {
  return std::vector<int32_t>(v.begin(), v.begin() + n);
}

using Logits = std::vector<float>;

// Appends tokens to seq; returns the logits of the last one.
Logits step(Engine& e, int32_t seq, const std::vector<int32_t>& toks) {
  Logits out(size_t(e.config().n_vocab));
  Status st = e.forward({{seq, toks.data(), int32_t(toks.size())}}, out.data());
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  return out;
}

// The independent reference: a fresh sequence on an engine without a cache.
Logits reference(Engine& fresh, const std::vector<int32_t>& toks) {
  auto seq = fresh.open_sequence();
  REQUIRE(seq.ok());
  Logits out = step(fresh, *seq, toks);
  fresh.close_sequence(*seq);
  return out;
}

bool same(const Logits& a, const Logits& b) { return cleave::testing::same_bits(a, b); }

int32_t argmax(const Logits& l) { return int32_t(std::max_element(l.begin(), l.end()) - l.begin()); }

int32_t open(Engine& e) {
  auto s = e.open_sequence();
  REQUIRE_MESSAGE(s.ok(), s.status().to_string());
  return *s;
}

}  // namespace

TEST_CASE("engine kv: a cached prefix gives the logits of a fresh engine, with copy-on-write") {
  auto e = make_engine(opts());
  auto fresh = make_engine(opts(1, false));
  const auto P = tokens_of(48, 1);
  const auto P40 = head(P, 40);

  // A prefills 40 tokens: blocks 0 and 1 are published, block 2 is partial.
  const int32_t a = open(*e);
  REQUIRE(same(step(*e, a, P40), reference(*fresh, P40)));
  CHECK(e->cache_stats().published_blocks == 2);

  // B with the same prompt reuses the two full blocks.
  const int32_t b = open(*e);
  auto reused = e->attach_cached_prefix(b, P40.data(), 40);
  REQUIRE(reused.ok());
  CHECK(*reused == 32);
  CHECK(e->sequence_tokens(b) == head(P, 32));
  CHECK(e->blocks_needed(b, 8) == 1);
  CHECK(same(step(*e, b, std::vector<int32_t>(P.begin() + 32, P.begin() + 40)), reference(*fresh, P40)));
  // B's continuation diverges from A's.
  auto stream_b = P40;
  for (int i = 0; i < 4; ++i) {
    const int32_t t = 100 + i;
    stream_b.push_back(t);
    CHECK(same(step(*e, b, {t}), reference(*fresh, stream_b)));
  }

  // C's whole prompt is cached (32 tokens): 31 are reused, so its last block
  // is shared and partly filled; the next token must copy it first.
  const auto P32 = head(P, 32);
  const int32_t c = open(*e);
  reused = e->attach_cached_prefix(c, P32.data(), 32);
  REQUIRE(reused.ok());
  CHECK(*reused == 31);
  CHECK(e->blocks_needed(c, 1) == 1);  // the copy
  const int32_t available = e->available_blocks();
  CHECK(same(step(*e, c, {P[31]}), reference(*fresh, P32)));
  CHECK(e->available_blocks() == available - 1);
  auto stream_c = P32;
  for (int i = 0; i < 20; ++i) {  // diverges and fills the copied block's successor
    const int32_t t = 200 + i;
    stream_c.push_back(t);
    CHECK(same(step(*e, c, {t}), reference(*fresh, stream_c)));
  }

  // A's later logits are unaffected by B and C.
  auto stream_a = P40;
  for (int i = 40; i < 48; ++i) {
    stream_a.push_back(P[size_t(i)]);
    CHECK(same(step(*e, a, {P[size_t(i)]}), reference(*fresh, stream_a)));
  }
  // A's blocks 0-2 and C's block 2; C's copy of block 1 duplicates a
  // published key and stays private.
  CHECK(e->cache_stats().published_blocks == 4);

  // D after A filled block 2: 47 of 48 reused, copy-on-write of block 2.
  const int32_t d = open(*e);
  reused = e->attach_cached_prefix(d, P.data(), 48);
  REQUIRE(reused.ok());
  CHECK(*reused == 47);
  CHECK(same(step(*e, d, {P[47]}), reference(*fresh, P)));
  const auto stats = e->cache_stats();
  CHECK(stats.lookups == 3);
  CHECK(stats.hit_tokens == 32 + 31 + 47);
  CHECK(stats.evicted_blocks == 0);

  // Misuse and the cache switched off.
  CHECK(e->attach_cached_prefix(d, P.data(), 48).status().code() == Code::invalid_argument);
  CHECK(e->attach_cached_prefix(99, P.data(), 48).status().code() == Code::invalid_argument);
  const int32_t s_off = open(*fresh);
  reused = fresh->attach_cached_prefix(s_off, P.data(), 48);
  REQUIRE(reused.ok());
  CHECK(*reused == 0);
  CHECK(fresh->cache_stats().lookups == 0);
}

TEST_CASE("engine kv: export after prefill, import into another engine, decoding continues bit-identically") {
  auto a = make_engine(opts(1));
  auto b = make_engine(opts(2, false));
  const auto P = tokens_of(40, 2);
  const int32_t sa = open(*a);
  Logits la = step(*a, sa, P);

  auto records = a->export_blocks(sa);
  REQUIRE(records.ok());
  REQUIRE(records->size() == 3);
  CHECK((*records)[0].header.n_tokens == 16);
  CHECK((*records)[2].header.n_tokens == 8);
  const auto keys = a->block_keys(sa);
  REQUIRE(keys.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK((*records)[i].header.key == keys[i]);
    CHECK(verify((*records)[i], a->model_fingerprint(), a->kv_layout()).ok());
  }
  // Full blocks carry their prefix chain key; the partial block's key hashes its 8 tokens.
  const auto chain = chain_keys(P.data(), 40, a->model_fingerprint(), a->kv_layout());
  CHECK(keys[0] == chain[0]);
  CHECK(keys[1] == chain[1]);
  CHECK(keys[2] == block_key(chain[1], P.data() + 32, 8, a->model_fingerprint(), a->kv_layout()));
  auto tail = a->export_blocks(sa, 2);
  REQUIRE(tail.ok());
  REQUIRE(tail->size() == 1);
  CHECK((*tail)[0].bytes == (*records)[2].bytes);
  CHECK(a->export_blocks(sa, 4).status().code() == Code::invalid_argument);
  CHECK(a->export_blocks(3, 0).status().code() == Code::invalid_argument);

  const int32_t sb = open(*b);
  Status st = b->import_blocks(sb, P.data(), 40, *records);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  CHECK(b->sequence_tokens(sb) == P);
  CHECK(b->block_keys(sb) == keys);
  for (int i = 0; i < 12; ++i) {  // crosses into block 3
    const int32_t t = argmax(la);
    la = step(*a, sa, {t});
    CHECK(same(step(*b, sb, {t}), la));
  }
}

TEST_CASE("engine kv: a record's bytes depend on its tokens only, not on what its pool block held before") {
  // a runs a long sequence first, so the block its second sequence's
  // partial block lands in holds that sequence's KV in the unfilled slots;
  // b is fresh. Their records of the same tokens must be the same bytes
  // (the unfilled slots zeroed), host and backend-memory exports alike.
  auto a = make_engine(opts(1, false));
  auto b = make_engine(opts(1, false));
  const int32_t s0 = open(*a);
  step(*a, s0, tokens_of(64, 9));  // 4 full blocks of other tokens
  a->close_sequence(s0);
  const auto P = tokens_of(21, 4);  // a full block, then 5 of 16 slots
  const int32_t sa = open(*a), sb = open(*b);
  step(*a, sa, P);
  step(*b, sb, P);
  auto ra = a->export_blocks(sa), rb = b->export_blocks(sb);
  REQUIRE((ra.ok() && rb.ok()));
  REQUIRE(ra->size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK((*ra)[i].bytes == (*rb)[i].bytes);
    CHECK((*ra)[i].header.checksum == (*rb)[i].header.checksum);
  }
  const KvLayout& L = a->kv_layout();
  for (const ByteRange& u : unfilled_ranges(L, 5))
    for (size_t j = 0; j < u.bytes; ++j) REQUIRE((*ra)[1].bytes[u.offset + j] == 0);
  const size_t bb = L.block_bytes();
  void* buf = a->backend().alloc(2 * bb);
  std::vector<BlockHeader> h;
  REQUIRE(a->export_blocks_to(sa, 0, buf, h).ok());
  REQUIRE(h.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(h[i].checksum == (*rb)[i].header.checksum);
    CHECK(std::memcmp(static_cast<uint8_t*>(buf) + i * bb, (*rb)[i].bytes.data(), bb) == 0);
  }
  a->backend().free(buf);
  // The ranges cover exactly the slots past `filled` of every head's rows.
  size_t covered = 0;
  for (const ByteRange& u : unfilled_ranges(L, 5)) covered += u.bytes;
  CHECK(covered == bb / size_t(L.tokens_per_block) * size_t(L.tokens_per_block - 5));
  CHECK(unfilled_ranges(L, L.tokens_per_block).empty());
}

TEST_CASE("engine kv: import rejects corrupt, misplaced or foreign records and changes nothing") {
  auto a = make_engine(opts(1));
  auto b = make_engine(opts(1));
  auto other_model = make_engine(opts(1), 2);
  const auto P = tokens_of(40, 3);
  const int32_t sa = open(*a);
  step(*a, sa, P);
  auto good = a->export_blocks(sa);
  REQUIRE(good.ok());
  const int32_t sb = open(*b);
  const int32_t available = b->available_blocks();

  auto expect_rejected = [&](const std::vector<BlockRecord>& records, const std::vector<int32_t>& toks,
                             Code code) {
    Status st = b->import_blocks(sb, toks.data(), int32_t(toks.size()), records);
    CHECK_MESSAGE(st.code() == code, st.to_string());
    CHECK(!st.message().empty());
    CHECK(b->sequence_length(sb) == 0);
    CHECK(b->sequence_tokens(sb).empty());
    CHECK(b->available_blocks() == available);
  };

  auto flipped = *good;
  flipped[1].bytes[1234] ^= 0x10;
  expect_rejected(flipped, P, Code::corruption);

  auto wrong_key = *good;
  wrong_key[0].header.key.lo ^= 1;
  expect_rejected(wrong_key, P, Code::invalid_argument);

  auto other_tokens = P;
  other_tokens[20] += 1;  // block 1's tokens (and so blocks 1 and 2's keys) differ
  expect_rejected(*good, other_tokens, Code::invalid_argument);

  auto wrong_count = *good;
  wrong_count[2].header.n_tokens = 7;
  expect_rejected(wrong_count, P, Code::invalid_argument);
  expect_rejected(*good, head(P, 39), Code::invalid_argument);  // the last block holds 8, not 7
  expect_rejected(std::vector<BlockRecord>(good->begin(), good->begin() + 2), P, Code::invalid_argument);

  auto foreign_layout = *good;
  foreign_layout[0].header.layout.head_dim *= 2;
  seal(foreign_layout[0]);
  expect_rejected(foreign_layout, P, Code::corruption);

  const int32_t so = open(*other_model);
  step(*other_model, so, P);
  auto foreign_model = other_model->export_blocks(so);
  REQUIRE(foreign_model.ok());
  expect_rejected(*foreign_model, P, Code::corruption);

  auto bad_token = P;
  bad_token[0] = -1;
  expect_rejected(*good, bad_token, Code::invalid_argument);

  // The correct records still import, and then the sequence is no longer empty.
  Status st = b->import_blocks(sb, P.data(), 40, *good);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  CHECK(b->sequence_length(sb) == 40);
  CHECK(b->available_blocks() == available - 3);
  CHECK(b->import_blocks(sb, P.data(), 40, *good).code() == Code::invalid_argument);
  const int32_t t = 777;
  CHECK(same(step(*b, sb, {t}), step(*a, sa, {t})));
}

TEST_CASE("engine kv: a full pool evicts unused cached blocks LRU first, never a block in use") {
  auto e = make_engine(opts(1, true, 6));
  auto fresh = make_engine(opts(1, false));
  const auto X1 = tokens_of(32, 11), X2 = tokens_of(32, 12), X3 = tokens_of(48, 13);
  const auto X1t = concat(X1, {5}), X2t = concat(X2, {5});
  CHECK(e->available_blocks() == 6);

  // X1 and X2 are cached and unused: 4 cached blocks, 2 free.
  for (const auto* x : {&X1, &X2}) {
    const int32_t s = open(*e);
    step(*e, s, *x);
    e->close_sequence(s);
  }
  CHECK(e->available_blocks() == 6);
  CHECK(e->cache_stats().published_blocks == 4);

  // s1 holds X1; a later hit on X2 makes X1 the least recently used.
  const int32_t s1 = open(*e);
  REQUIRE(*e->attach_cached_prefix(s1, X1t.data(), 33) == 32);
  {
    const int32_t s = open(*e);
    REQUIRE(*e->attach_cached_prefix(s, X2t.data(), 33) == 32);
    e->close_sequence(s);
  }
  CHECK(e->available_blocks() == 4);  // 2 free + X2's 2 unused

  // X3 needs 3 blocks: 2 free + 1 evicted, X2's last block (never X1: in use).
  const int32_t s2 = open(*e);
  CHECK(e->blocks_needed(s2, 48) == 3);
  CHECK(same(step(*e, s2, X3), reference(*fresh, X3)));
  CHECK(e->cache_stats().evicted_blocks == 1);
  CHECK(e->available_blocks() == 1);
  {
    const int32_t s = open(*e);
    CHECK(*e->attach_cached_prefix(s, X2t.data(), 33) == 16);  // X2's first block survived
    e->close_sequence(s);
  }

  // s1's next token takes the last evictable block; s1's KV is intact.
  CHECK(e->blocks_needed(s1, 1) == 1);
  CHECK(same(step(*e, s1, {5}), reference(*fresh, X1t)));
  CHECK(e->cache_stats().evicted_blocks == 2);
  CHECK(e->available_blocks() == 0);

  // Nothing left to evict: out_of_memory, and no sequence changes, even one
  // in the same batch that needs no block.
  CHECK(e->blocks_needed(s2, 1) == 1);
  CHECK(e->blocks_needed(s1, 1) == 0);
  std::vector<float> logits(size_t(2 * e->config().n_vocab));
  const int32_t t1 = 6, t2 = 7;
  Status st = e->forward({{s1, &t1, 1}, {s2, &t2, 1}}, logits.data());
  CHECK_MESSAGE(st.code() == Code::out_of_memory, st.to_string());
  CHECK(e->sequence_tokens(s1) == X1t);
  CHECK(e->sequence_tokens(s2) == X3);
  CHECK(e->cache_stats().evicted_blocks == 2);

  // Closing s1 frees its private block and leaves X1 cached: s2 goes on
  // without eviction, its KV intact.
  e->close_sequence(s1);
  CHECK(e->available_blocks() == 3);
  CHECK(same(step(*e, s2, {t2}), reference(*fresh, concat(X3, {t2}))));
  CHECK(e->cache_stats().evicted_blocks == 2);
  const int32_t s3 = open(*e);
  CHECK(*e->attach_cached_prefix(s3, X1t.data(), 33) == 32);
}

TEST_CASE("engine kv: a hit refreshes a cached block's place in the LRU order") {
  auto e = make_engine(opts(1, true, 4));
  const auto X1 = tokens_of(32, 21), X2 = tokens_of(32, 22), X3 = tokens_of(32, 23);
  const auto X1t = concat(X1, {5}), X2t = concat(X2, {5});
  for (const auto* x : {&X1, &X2}) {
    const int32_t s = open(*e);
    step(*e, s, *x);
    e->close_sequence(s);
  }
  {
    const int32_t s = open(*e);
    REQUIRE(*e->attach_cached_prefix(s, X1t.data(), 33) == 32);  // X1 is now newer than X2
    e->close_sequence(s);
  }
  const int32_t s = open(*e);
  step(*e, s, X3);
  e->close_sequence(s);
  CHECK(e->cache_stats().evicted_blocks == 2);
  const int32_t probe = open(*e);
  CHECK(*e->attach_cached_prefix(probe, X2t.data(), 33) == 0);  // a miss leaves it empty
  CHECK(*e->attach_cached_prefix(probe, X1t.data(), 33) == 32);
}

TEST_CASE("engine kv: model fingerprint names the file, layout matches the paged KV") {
  auto a1 = make_engine(opts(1));
  auto a2 = make_engine(opts(2));
  auto b = make_engine(opts(1), 2);
  CHECK(a1->model_fingerprint() != 0);
  CHECK(a1->model_fingerprint() == a2->model_fingerprint());
  CHECK(a1->model_fingerprint() != b->model_fingerprint());

  const KvLayout& l = a1->kv_layout();
  CHECK(l.k_type == DType::F32);
  CHECK(l.v_type == DType::F32);
  CHECK(l.tokens_per_block == 16);
  CHECK(l.n_layers == 2);
  CHECK(l.n_kv_heads == 2);
  CHECK(l.head_dim == 16);
  CHECK(l.block_bytes() == size_t(2) * 2 * 2 * 16 * 16 * sizeof(float));

  EngineOptions o = opts();
  o.kv_blocks = -1;
  auto file = GgufFile::open(model_path(1));
  REQUIRE(file.ok());
  CHECK(Engine::create(*file, o).status().code() == Code::invalid_argument);
}

TEST_CASE("engine kv: records import after an attached cached prefix and decoding continues bit-identically") {
  auto a = make_engine(opts(1));
  auto b = make_engine(opts(1));
  const auto shared = tokens_of(32, 5);  // two full blocks both engines will know
  const auto P = concat(shared, tokens_of(20, 6));
  // b caches the shared prefix from an earlier sequence.
  const int32_t old = open(*b);
  step(*b, old, concat(shared, tokens_of(3, 7)));
  b->close_sequence(old);
  const int32_t sa = open(*a);
  Logits la = step(*a, sa, P);
  auto keys = a->block_keys(sa);
  REQUIRE(keys.size() == 4);
  CHECK(b->cached_leading_blocks(keys) == 2);
  CHECK(a->cached_leading_blocks(keys) == 3);  // its own full blocks; never the partial one
  auto tail = a->export_blocks(sa, 2);
  REQUIRE(tail.ok());
  const int32_t sb = open(*b);
  // Records for the wrong place: before anything is attached they do not fit.
  CHECK(b->import_blocks(sb, P.data(), int32_t(P.size()), *tail).code() == Code::invalid_argument);
  auto hit = b->attach_cached_prefix(sb, P.data(), int32_t(P.size()));
  REQUIRE(hit.ok());
  REQUIRE(*hit == 32);
  Status st = b->import_blocks(sb, P.data(), int32_t(P.size()), *tail);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  CHECK(b->sequence_tokens(sb) == P);
  CHECK(b->block_keys(sb) == keys);
  for (int i = 0; i < 14; ++i) {  // crosses into block 4
    const int32_t t = argmax(la);
    la = step(*a, sa, {t});
    CHECK(same(step(*b, sb, {t}), la));
  }
  // A held prefix that is not whole blocks takes no records.
  const int32_t sc = open(*b);
  const auto short_prompt = head(P, 32);
  auto partial = b->attach_cached_prefix(sc, short_prompt.data(), 32);
  REQUIRE(partial.ok());
  CHECK(*partial == 31);  // capped so the last prompt token still runs
  CHECK(b->import_blocks(sc, P.data(), int32_t(P.size()), *tail).code() == Code::invalid_argument);
  CHECK(b->sequence_length(sc) == 31);
}

TEST_CASE("engine kv: compute int8 is part of the fingerprint, its records import only into int8 engines") {
  const fs::path dir = test::process_scratch("cleave-engine-kv-test");
  ModelSpec s;
  s.dim = 64; s.n_layers = 2; s.n_heads = 4; s.n_kv_heads = 2; s.ffn = 128; s.context = 256;
  s.type = DType::Q8_0;
  const std::string path = (dir / "q8.gguf").string();
  REQUIRE(write_test_model(s, kVocab, path).ok());
  auto engine = [&](Compute c, int threads) {
    auto file = GgufFile::open(path);
    REQUIRE(file.ok());
    EngineOptions o = opts(threads);
    o.compute = c;
    auto e = Engine::create(*file, o);
    REQUIRE_MESSAGE(e.ok(), e.status().to_string());
    return std::move(*e);
  };
  auto a = engine(Compute::int8, 1);
  auto b = engine(Compute::int8, 2);
  auto exact = engine(Compute::exact, 1);
  CHECK(a->model_fingerprint() == b->model_fingerprint());
  CHECK(a->model_fingerprint() != exact->model_fingerprint());
  const auto P = tokens_of(40, 5);
  const int32_t sa = open(*a);
  Logits la = step(*a, sa, P);
  auto records = a->export_blocks(sa);
  REQUIRE(records.ok());
  // An exact engine refuses them and its sequence stays empty.
  const int32_t se = open(*exact);
  CHECK(!exact->import_blocks(se, P.data(), 40, *records).ok());
  CHECK(exact->sequence_tokens(se).empty());
  // Another int8 engine (other thread count) takes them and decodes the same bits.
  const int32_t sb = open(*b);
  REQUIRE(b->import_blocks(sb, P.data(), 40, *records).ok());
  for (int i = 0; i < 6; ++i) {
    const int32_t t = argmax(la);
    la = step(*a, sa, {t});
    CHECK(same(step(*b, sb, {t}), la));
  }
}
