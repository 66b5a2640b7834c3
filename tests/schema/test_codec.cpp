// schema/codec: round trips of every message, kind mismatches, truncation,
// random corruption, reader limits and value validation.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <tuple>

#include "examples.h"
#include "schema/codec.h"
#include "tests/same_bits.h"

using namespace cleave;
using codec::Bytes;

namespace {

template <class F>
bool same_bits(F a, F b) {
  return std::memcmp(&a, &b, sizeof(F)) == 0;
}

// Field-by-field equality, floats bit for bit; CHECKs name the field.
void check_same(const Status& a, const Status& b) {
  CHECK(a.code() == b.code());
  CHECK(a.message() == b.message());
}
void check_same(const PromptImage& a, const PromptImage& b) {
  CHECK(a.position == b.position);
  CHECK(a.n_tokens == b.n_tokens);
  CHECK(a.hash == b.hash);
  CHECK(a.image.width == b.image.width);
  CHECK(a.image.height == b.image.height);
  CHECK(a.image.rgb == b.image.rgb);
  CHECK(cleave::testing::same_bits(a.embeddings, b.embeddings));
}
void check_same(const std::vector<PromptImage>& a, const std::vector<PromptImage>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) check_same(a[i], b[i]);
}
void check_same(const msg::EncodeRequest& a, const msg::EncodeRequest& b) {
  CHECK(a.request_id == b.request_id);
  check_same(a.images, b.images);
}
void check_same(const msg::ImageEmbeddings& a, const msg::ImageEmbeddings& b) {
  CHECK(a.request_id == b.request_id);
  check_same(a.images, b.images);
  CHECK(a.origin == b.origin);
  CHECK(same_bits(a.seconds, b.seconds));
}
void check_same(const GenerateRequest& a, const GenerateRequest& b) {
  check_same(a.images, b.images);
  CHECK(a.prompt == b.prompt);
  CHECK(same_bits(a.sampling.temperature, b.sampling.temperature));
  CHECK(a.sampling.top_k == b.sampling.top_k);
  CHECK(same_bits(a.sampling.top_p, b.sampling.top_p));
  CHECK(same_bits(a.sampling.min_p, b.sampling.min_p));
  CHECK(same_bits(a.sampling.repeat_penalty, b.sampling.repeat_penalty));
  CHECK(a.sampling.repeat_last_n == b.sampling.repeat_last_n);
  CHECK(a.sampling.seed == b.sampling.seed);
  CHECK(a.sampling.max_tokens == b.sampling.max_tokens);
  CHECK(a.sampling.stop == b.sampling.stop);
  CHECK(a.request_id == b.request_id);
  CHECK(a.prefill_chunk == b.prefill_chunk);
  CHECK(a.ignore_eos == b.ignore_eos);
  CHECK(a.keep_logits == b.keep_logits);
  CHECK(same_bits(a.sampling.presence_penalty, b.sampling.presence_penalty));
  CHECK(same_bits(a.sampling.frequency_penalty, b.sampling.frequency_penalty));
  CHECK(a.rng_stream == b.rng_stream);
  CHECK(a.logprobs == b.logprobs);
  CHECK(a.priority == b.priority);
  CHECK(same_bits(a.ttft_target_ms, b.ttft_target_ms));
  CHECK(same_bits(a.tpot_target_ms, b.tpot_target_ms));
  CHECK(same_bits(a.deadline_ms, b.deadline_ms));
  CHECK(same_bits(a.max_cost, b.max_cost));
}
void check_same(const msg::StreamEvent& a, const msg::StreamEvent& b) {
  CHECK(a.kind == b.kind);
  CHECK(a.request_id == b.request_id);
  CHECK(a.index == b.index);
  CHECK(a.token == b.token);
  CHECK(a.text == b.text);
  CHECK(a.finish_reason == b.finish_reason);
  CHECK(cleave::testing::same_bits(a.logits, b.logits));
  CHECK(a.cached_tokens == b.cached_tokens);
  CHECK(a.has_logprobs == b.has_logprobs);
  CHECK(a.logprobs.chosen.token == b.logprobs.chosen.token);
  CHECK(same_bits(a.logprobs.chosen.logprob, b.logprobs.chosen.logprob));
  REQUIRE(a.logprobs.top.size() == b.logprobs.top.size());
  for (size_t i = 0; i < a.logprobs.top.size(); ++i) {
    CHECK(a.logprobs.top[i].token == b.logprobs.top[i].token);
    CHECK(same_bits(a.logprobs.top[i].logprob, b.logprobs.top[i].logprob));
  }
  check_same(a.error, b.error);
  CHECK(a.origin == b.origin);
  CHECK(same_bits(a.stage_seconds, b.stage_seconds));
  CHECK(a.encode_origin == b.encode_origin);
  CHECK(same_bits(a.encode_seconds, b.encode_seconds));
}
void check_same(const BlockRecord& a, const BlockRecord& b) {
  CHECK(a.header.key == b.header.key);
  CHECK(a.header.model_fingerprint == b.header.model_fingerprint);
  CHECK(a.header.layout == b.header.layout);
  CHECK(a.header.checksum == b.header.checksum);
  CHECK(a.header.n_tokens == b.header.n_tokens);
  CHECK(a.bytes == b.bytes);
}
void check_same(const std::vector<BlockRecord>& a, const std::vector<BlockRecord>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) check_same(a[i], b[i]);
}
void check_same(const msg::Handoff& a, const msg::Handoff& b) {
  check_same(a.request, b.request);
  CHECK(a.generated == b.generated);
  CHECK(a.n_kv_tokens == b.n_kv_tokens);
  CHECK(a.kv_keys == b.kv_keys);
  check_same(a.blocks, b.blocks);
}
void check_same(const msg::KvPut& a, const msg::KvPut& b) { check_same(a.blocks, b.blocks); }
void check_same(const msg::KvBlocks& a, const msg::KvBlocks& b) { check_same(a.blocks, b.blocks); }
void check_same(const msg::KvGet& a, const msg::KvGet& b) { CHECK(a.keys == b.keys); }
void check_same(const msg::KvAck& a, const msg::KvAck& b) {
  CHECK(a.stored == b.stored);
  CHECK(a.rejected == b.rejected);
  check_same(a.first_error, b.first_error);
}
void check_same(const msg::Health& a, const msg::Health& b) {
  CHECK(a.actor == b.actor);
  CHECK(a.ok == b.ok);
  CHECK(a.uptime_ms == b.uptime_ms);
  CHECK(a.queue_depth == b.queue_depth);
  CHECK(a.running == b.running);
}
void check_same(const msg::Stats& a, const msg::Stats& b) {
  CHECK(a.actor == b.actor);
  CHECK(a.counters == b.counters);
}

template <class T>
T round_trip(const T& in) {
  Bytes bytes = codec::encode(in);
  T out;
  Status st = codec::decode(bytes, out);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  return out;
}

// Every kind, with the name the codec gives it.
auto all_examples() {
  return std::make_tuple(examples::request(), examples::finished_event(), examples::handoff(),
                         examples::kv_put(), examples::kv_ack(), examples::kv_get(),
                         examples::kv_blocks(), examples::health(), examples::stats(),
                         examples::kv_pull(), examples::kv_chunk(), examples::encode_request(),
                         examples::image_embeddings(), examples::expert_batch(),
                         examples::stage_batch());
}
const char* const kNames[] = {"GenerateRequest", "StreamEvent",   "Handoff",  "KvPut",
                              "KvAck",           "KvGet",         "KvBlocks", "Health",
                              "Stats",           "KvPull",        "KvChunk",  "EncodeRequest",
                              "ImageEmbeddings", "ExpertBatch",   "StageBatch"};

template <class F>
void for_each_example(F&& f) {
  size_t i = 0;
  std::apply([&](const auto&... m) { (f(m, kNames[i++]), ...); }, all_examples());
}

template <class T>
Status decode_as(const char* data, size_t size) {
  T out;
  return codec::decode(data, size, out);
}

// Decodes `bytes` as every kind; returns how many kinds accepted them.
int decode_as_every_kind(const Bytes& bytes) {
  int accepted = 0;
  for_each_example([&](const auto& example, const char*) {
    using T = std::decay_t<decltype(example)>;
    T out;
    if (codec::decode(bytes, out).ok()) {
      ++accepted;
      // Whatever decodes is a value the codec writes and reads back the same.
      Bytes again = codec::encode(out);
      T out2;
      REQUIRE(codec::decode(again, out2).ok());
      CHECK(codec::encode(out2) == again);
    }
  });
  return accepted;
}

}  // namespace

TEST_CASE("codec: every message round-trips field by field, floats bit for bit") {
  for (const auto& e : {examples::token_event(), examples::finished_event(), examples::failed_event()})
    check_same(round_trip(e), e);
  for (float f : examples::finished_event().logits) CHECK(!std::isnan(f));
  check_same(round_trip(examples::request()), examples::request());
  check_same(round_trip(examples::handoff()), examples::handoff());
  check_same(round_trip(examples::kv_put()), examples::kv_put());
  check_same(round_trip(examples::kv_ack()), examples::kv_ack());
  check_same(round_trip(examples::kv_get()), examples::kv_get());
  check_same(round_trip(examples::kv_blocks()), examples::kv_blocks());
  check_same(round_trip(examples::health()), examples::health());
  check_same(round_trip(examples::stats()), examples::stats());
  check_same(round_trip(examples::encode_request()), examples::encode_request());
  check_same(round_trip(examples::image_embeddings()), examples::image_embeddings());
  // Default values too (empty lists, empty strings, default Status).
  check_same(round_trip(GenerateRequest{}), GenerateRequest{});
  msg::StreamEvent finished;  // (the default kind, token, needs a token id)
  finished.kind = msg::StreamEvent::Kind::finished;
  check_same(round_trip(finished), finished);
  check_same(round_trip(msg::Handoff{}), msg::Handoff{});
  check_same(round_trip(msg::KvAck{}), msg::KvAck{});
  check_same(round_trip(msg::Stats{}), msg::Stats{});
  check_same(round_trip(msg::EncodeRequest{}), msg::EncodeRequest{});
}

TEST_CASE("codec: encoding is deterministic and decoding does not need aligned input") {
  for_each_example([](const auto& m, const char* name) {
    using T = std::decay_t<decltype(m)>;
    INFO(name);
    Bytes bytes = codec::encode(m);
    CHECK(bytes.size() % 8 == 0);
    CHECK(codec::encode(m) == bytes);
    std::vector<char> shifted(bytes.size() + 1);
    std::memcpy(shifted.data() + 1, bytes.data(), bytes.size());
    T out;
    Status st = codec::decode(shifted.data() + 1, bytes.size(), out);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    CHECK(codec::encode(out) == bytes);
  });
}

TEST_CASE("codec: a KvPut of 1000 blocks and blocks of 4 MiB round-trip") {
  msg::KvPut many;
  for (uint32_t i = 0; i < 1000; ++i) many.blocks.push_back(examples::block(i));
  check_same(round_trip(many), many);

  KvLayout big;
  big.tokens_per_block = 16;
  big.n_layers = 32;
  big.n_kv_heads = 8;
  big.head_dim = 128;
  msg::KvBlocks large{{examples::block(1, big), examples::block(2, big)}};
  REQUIRE(large.blocks[0].bytes.size() == 4u << 20);
  check_same(round_trip(large), large);
}

TEST_CASE("codec: decoding one kind as another is invalid_argument naming both") {
  size_t i = 0;
  for_each_example([&](const auto& m, const char* name) {
    Bytes bytes = codec::encode(m);
    const std::string wanted = std::string("got ") + name;
    size_t j = 0;
    for_each_example([&](const auto& other, const char* other_name) {
      using U = std::decay_t<decltype(other)>;
      INFO(name << " decoded as " << other_name);
      Status st = decode_as<U>(bytes.data(), bytes.size());
      if (i == j) {
        CHECK(st.ok());
      } else {
        CHECK(st.code() == Code::invalid_argument);
        CHECK(st.message() == std::string("expected ") + other_name + ", " + wanted);
      }
      ++j;
    });
    ++i;
  });
}

TEST_CASE("codec: every truncation of every message is an error") {
  for_each_example([](const auto& m, const char* name) {
    using T = std::decay_t<decltype(m)>;
    Bytes bytes = codec::encode(m);
    for (size_t n = 0; n < bytes.size(); ++n) {
      Bytes prefix(bytes.begin(), bytes.begin() + ptrdiff_t(n));
      T out;
      Status st = codec::decode(prefix.data(), prefix.size(), out);
      INFO(name << " cut to " << n << " of " << bytes.size() << " bytes: " << st.to_string());
      REQUIRE(!st.ok());
      CHECK(st.code() == Code::corruption);
      CHECK(st.message().find(name) != std::string::npos);
    }
  });
}

TEST_CASE("codec: 2000 random byte flips give an error or a consistent value, never a crash") {
  std::mt19937_64 rng(20240604);
  std::vector<Bytes> encoded;
  for_each_example([&](const auto& m, const char*) { encoded.push_back(codec::encode(m)); });
  int errors = 0, accepted = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    Bytes bytes = encoded[size_t(trial) % encoded.size()];
    const int flips = 1 + int(rng() % 4);
    for (int f = 0; f < flips; ++f) bytes[rng() % bytes.size()] ^= char(1 + rng() % 255);
    const int kinds = decode_as_every_kind(bytes);
    CHECK(kinds <= 1);  // the envelope names one kind
    (kinds ? accepted : errors)++;
  }
  MESSAGE("flipped messages: " << accepted << " decoded, " << errors << " rejected");
  CHECK(errors > 0);
  CHECK(accepted > 0);  // flips in payload bytes leave valid values
}

TEST_CASE("codec: empty input and a partial word are corruption for every kind") {
  for_each_example([](const auto& m, const char* name) {
    using T = std::decay_t<decltype(m)>;
    Status st = decode_as<T>(nullptr, 0);
    CHECK(st.code() == Code::corruption);
    CHECK(st.message() == std::string("decoding ") + name + ": empty input");
    Bytes bytes = codec::encode(m);
    bytes.push_back(0);
    CHECK(decode_as<T>(bytes.data(), bytes.size()).code() == Code::corruption);
  });
}

TEST_CASE("codec: reader limits turn oversized or deep messages into corruption") {
  // 5 blocks of 4 MiB: over control_limits' 16 MiB, within kv_limits' 1 GiB.
  KvLayout big;
  big.tokens_per_block = 16;
  big.n_layers = 32;
  big.n_kv_heads = 8;
  big.head_dim = 128;
  msg::KvPut put;
  for (uint32_t i = 0; i < 5; ++i) put.blocks.push_back(examples::block(i, big));
  Bytes bytes = codec::encode(put);
  msg::KvPut out;
  Status st = codec::decode(bytes.data(), bytes.size(), out, codec::control_limits());
  CHECK(st.code() == Code::corruption);
  CHECK(st.message().find("KvPut") != std::string::npos);
  CHECK(st.message().find("traversal limit") != std::string::npos);
  CHECK(out.blocks.empty());  // untouched on failure
  REQUIRE(codec::decode(bytes, out).ok());  // KvPut's default is kv_limits
  CHECK(out.blocks.size() == 5);

  Bytes small = codec::encode(examples::handoff());
  msg::Handoff h;
  CHECK(codec::decode(small.data(), small.size(), h, codec::Limits{16, 16}).code() ==
        Code::corruption);
  // Envelope -> Handoff -> GenerateRequest -> SamplingParams -> stop: 4 levels.
  st = codec::decode(small.data(), small.size(), h, codec::Limits{1 << 20, 2});
  CHECK(st.code() == Code::corruption);
  CHECK(st.message().find("nesting") != std::string::npos);
  CHECK(codec::decode(small.data(), small.size(), h, codec::Limits{1 << 20, 6}).ok());
}

TEST_CASE("codec: traversal_words is what a reader is charged for the encoding") {
  auto check = [](const auto& m, const char* name) {
    using T = std::decay_t<decltype(m)>;
    INFO(std::string(name));
    const Bytes bytes = codec::encode(m);
    const uint64_t words = codec::traversal_words(m);
    T out;
    Status st = codec::decode(bytes.data(), bytes.size(), out, codec::Limits{words, 16});
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    // One word less and Cap'n Proto itself stops reading: the count is exact.
    st = codec::decode(bytes.data(), bytes.size(), out, codec::Limits{words - 1, 16});
    CHECK(st.code() == Code::corruption);
    CHECK_MESSAGE(st.message().find("Exceeded message traversal limit") != std::string::npos,
                  st.to_string());
  };
  for_each_example(check);
  // Empty lists, texts and blobs, and absent values.
  check(GenerateRequest{}, "GenerateRequest");
  check(examples::token_event(), "StreamEvent");
  check(examples::failed_event(), "StreamEvent");
  check(msg::Handoff{}, "Handoff");
  check(msg::KvGet{}, "KvGet");
  check(msg::Stats{}, "Stats");
  check(msg::KvChunk{}, "KvChunk");
  GenerateRequest r = examples::request();
  r.images = {examples::image(1, false), examples::image(2, true)};
  r.sampling.stop = {"", "a", "12345678"};
  check(r, "GenerateRequest");
  // Larger than Cap'n Proto's default first segment (1024 words).
  msg::KvGet keys;
  keys.keys.resize(5000);
  check(keys, "KvGet");
  msg::KvPut put;
  for (uint32_t i = 0; i < 300; ++i) put.blocks.push_back(examples::block(i));
  check(put, "KvPut");
}

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot read " << path);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

const std::string kRegressions = std::string(CLEAVE_SOURCE_DIR) + "/tests/fuzz/regressions/codec";

// Every input that ever crashed fuzz_codec (tests/fuzz/regressions/codec/,
// also replayed by the ctest fuzz_regressions): decoded as every kind,
// whatever decodes re-encodes and decodes again to the same bytes.
TEST_CASE("codec: the fuzz regression inputs keep the round-trip property") {
  size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kRegressions)) {
    INFO(entry.path().string());
    decode_as_every_kind(read_file(entry.path().string()));
    ++n;
  }
  CHECK(n >= 1);
}

// libFuzzer's first find: a KvGet whose keys are 2^20 structs of zero words.
// Cap'n Proto charges such a list one word per element (2^20 of
// control_limits' 2^21), but the encoder writes each BlockKey as two words:
// re-encoded it needed 2^21 + 6 words and no longer decoded under the limits
// it was read with ("KvGet: re-encoded value does not decode").
TEST_CASE("codec: a KvGet of zero-word keys that would not re-encode is refused (fuzz find)") {
  Bytes bytes = read_file(kRegressions + "/kvget-zero-word-keys");
  REQUIRE(bytes.size() == 96);
  msg::KvGet out;
  Status st = codec::decode(bytes, out);
  CHECK(st.code() == Code::corruption);
  CHECK(st.message() ==
        "decoding KvGet: re-encoded it needs 2097158 words, over the reader's traversal limit of "
        "2097152 (lists or structs smaller on the wire than in the schema)");
  CHECK(out.keys.empty());  // untouched
  CHECK(decode_as_every_kind(bytes) == 0);

  // Under a limit that holds the encoding the same bytes decode, and the
  // encoding reads back under it to the same value.
  const codec::Limits roomy{2097158, 16};
  REQUIRE(codec::decode(bytes.data(), bytes.size(), out, roomy).ok());
  CHECK(out.keys.size() == size_t(1) << 20);
  CHECK(codec::traversal_words(out) == roomy.traversal_words);
  const Bytes again = codec::encode(out);
  msg::KvGet out2;
  REQUIRE(codec::decode(again.data(), again.size(), out2, roomy).ok());
  CHECK(out2.keys == out.keys);

  // Half as many zero-word keys (the count in the list pointer's upper half:
  // elements << 3 | element size) fit control_limits re-encoded: accepted.
  REQUIRE(bytes[0x26] == char(0x80));
  bytes[0x26] = char(0x40);
  REQUIRE(codec::decode(bytes, out).ok());
  CHECK(out.keys.size() == size_t(1) << 19);
  CHECK(decode_as_every_kind(bytes) == 1);
}

TEST_CASE("codec: BlockRecords must match their layout: invalid_argument naming the block") {
  auto decode_put = [](const BlockRecord& r) {
    msg::KvPut put{{examples::block(0), r}};
    msg::KvPut out;
    return codec::decode(codec::encode(put), out);
  };
  BlockRecord r = examples::block(9);
  r.bytes.pop_back();
  Status st = decode_put(r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("block 1 (" + r.header.key.hex() + "): 127 bytes, layout needs 128") !=
        std::string::npos);

  r = examples::block(9);
  r.bytes.resize(136);  // whole words: the zero-copy encode path
  CHECK(decode_put(r).code() == Code::invalid_argument);

  r = examples::block(9);
  r.header.n_tokens = 5;  // tokens_per_block is 4
  st = decode_put(r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("n_tokens 5 exceeds tokens_per_block 4") != std::string::npos);

  r = examples::block(9);
  r.header.layout.head_dim = 0;
  CHECK(decode_put(r).code() == Code::invalid_argument);

  r = examples::block(9);
  r.header.layout.k_type = DType::BF16;  // a type id, but not a KV cache type
  st = decode_put(r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("k_type BF16 is not a KV cache type") != std::string::npos);

  r = examples::block(9);
  r.header.layout.v_type = DType(77);  // no type at all
  st = decode_put(r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("v_type 77 is not a type id") != std::string::npos);

  // F16 rows are half the bytes: the F32 record's bytes no longer match.
  r = examples::block(9);
  r.header.layout.k_type = r.header.layout.v_type = DType::F16;
  st = decode_put(r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("layout needs") != std::string::npos);

  // Dimensions whose product wraps size_t must not match any byte count.
  r = examples::block(9);
  r.header.layout.tokens_per_block = 1 << 30;
  r.header.layout.n_layers = 1 << 30;
  r.header.layout.n_kv_heads = 1 << 30;
  r.header.layout.head_dim = 1 << 30;
  r.header.n_tokens = 1;
  st = decode_put(r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("more bytes than fit") != std::string::npos);

  // The codec does not verify checksums (receivers call verify()).
  r = examples::block(9);
  r.header.checksum ^= 1;
  CHECK(decode_put(r).ok());
}

TEST_CASE("codec: decoded values are validated") {
  auto code_of = [](const auto& m) {
    std::decay_t<decltype(m)> out;
    return codec::decode(codec::encode(m), out).code();
  };
  GenerateRequest r = examples::request();
  r.prompt[2] = -1;
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.sampling.temperature = NAN;
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.sampling.top_p = INFINITY;
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.prefill_chunk = 0;
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.sampling.max_tokens = -1;
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.ttft_target_ms = -1;
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.tpot_target_ms = NAN;
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.deadline_ms = INFINITY;
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.max_cost = -0.5;
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.sampling.stop.assign(codec::kMaxListEntries + 1, "x");
  CHECK(code_of(r) == Code::invalid_argument);
  r = examples::request();
  r.sampling.stop = {std::string(codec::kMaxStringBytes + 1, 'a')};
  CHECK(code_of(r) == Code::invalid_argument);

  msg::StreamEvent e = examples::token_event();
  e.token = -1;
  CHECK(code_of(e) == Code::invalid_argument);
  e = examples::token_event();
  e.kind = msg::StreamEvent::Kind(3);
  CHECK(code_of(e) == Code::invalid_argument);
  e = examples::failed_event();
  e.error = Status(Code(int(Code::rejected) + 1), "no such code");
  CHECK(code_of(e) == Code::invalid_argument);
  e = examples::token_event();
  e.stage_seconds = -1;
  CHECK(code_of(e) == Code::invalid_argument);

  msg::Handoff h = examples::handoff();
  h.n_kv_tokens = 11;  // 6 prompt + 4 generated
  CHECK(code_of(h) == Code::invalid_argument);
  h = examples::handoff();
  h.generated.back() = -7;
  CHECK(code_of(h) == Code::invalid_argument);

  msg::KvAck a = examples::kv_ack();
  a.rejected = -1;
  CHECK(code_of(a) == Code::invalid_argument);
  msg::Health hl = examples::health();
  hl.queue_depth = -2;
  CHECK(code_of(hl) == Code::invalid_argument);
  msg::Stats s;
  s.counters.assign(codec::kMaxListEntries + 1, {"c", 1});
  CHECK(code_of(s) == Code::invalid_argument);
}

TEST_CASE("codec: another schema version is unsupported, an unknown kind is named") {
  Bytes bytes = codec::encode(examples::health());
  // One segment: 8 bytes of segment table, the root pointer, then Envelope's
  // data section: version (UInt16) at byte 16, the union tag at byte 18.
  REQUIRE(bytes[16] == char(codec::kSchemaVersion));
  REQUIRE(bytes[18] == 7);  // health
  Bytes other = bytes;
  other[16] = 2;
  msg::Health out;
  Status st = codec::decode(other, out);
  CHECK(st.code() == Code::unsupported);
  CHECK(st.message().find("schema version 2") != std::string::npos);
  other = bytes;
  other[18] = 42;
  st = codec::decode(other, out);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message() == "expected Health, got unknown kind 42");
}

TEST_CASE("codec: images carry pixels and float32 embeddings bit for bit") {
  // A NaN payload and every byte value of the pixels survive.
  GenerateRequest r = examples::request();
  uint32_t payload = 0x7fc01234u;
  std::memcpy(&r.images[1].embeddings[5], &payload, sizeof(payload));
  r.images[0].image.width = 16;
  r.images[0].image.height = 16;
  r.images[0].image.rgb.resize(16 * 16 * 3);
  for (size_t i = 0; i < r.images[0].image.rgb.size(); ++i) r.images[0].image.rgb[i] = uint8_t(i);
  const GenerateRequest back = round_trip(r);
  check_same(back, r);
  uint32_t got = 0;
  std::memcpy(&got, &back.images[1].embeddings[5], sizeof(got));
  CHECK(got == payload);
  // A handoff's request keeps its images (the decoder needs their embeddings).
  msg::Handoff h = examples::handoff();
  h.request = r;
  check_same(round_trip(h).request, r);
  // An image of 64 KiB of embeddings and one of 256x256 pixels.
  msg::ImageEmbeddings big;
  big.images = {examples::image(5, true)};
  big.images[0].n_tokens = 128;
  big.images[0].embeddings.assign(128 * 128, 0.125f);
  check_same(round_trip(big), big);
  msg::EncodeRequest px;
  px.images = {examples::image(6, false)};
  px.images[0].image.width = px.images[0].image.height = 256;
  px.images[0].image.rgb.assign(256 * 256 * 3, 200);
  check_same(round_trip(px), px);
}

TEST_CASE("codec: image fields are validated and named") {
  auto status_of = [](const auto& m) {
    std::decay_t<decltype(m)> out;
    return codec::decode(codec::encode(m), out);
  };
  auto expect = [&](const auto& m, const std::string& what) {
    Status st = status_of(m);
    INFO(st.to_string());
    CHECK(st.code() == Code::invalid_argument);
    CHECK(st.message().find(what) != std::string::npos);
  };
  GenerateRequest r = examples::request();
  r.images[1].position = -2;
  expect(r, "image 1: position -2 is negative");
  r = examples::request();
  r.images[0].n_tokens = 0;
  expect(r, "image 0: n_tokens 0 must be >= 1");
  r = examples::request();
  r.images[0].image.rgb.pop_back();
  expect(r, "image 0: 17 pixel bytes, 3x2 RGB needs 18");
  r = examples::request();
  r.images[0].image.width = codec::kMaxImageSide + 1;
  expect(r, "outside 0..8192");
  r = examples::request();
  r.images[1].embeddings.pop_back();  // 19 floats for 4 tokens
  expect(r, "19 embedding floats are not whole rows of its 4 tokens");
  r = examples::request();
  r.images.assign(codec::kMaxImages + 1, examples::image(1, true));
  expect(r, "images: 257 entries, limit 256");

  msg::EncodeRequest enc = examples::encode_request();
  enc.images[1].image.rgb.clear();
  expect(enc, "image 1 has no pixels to encode");
  msg::ImageEmbeddings emb = examples::image_embeddings();
  emb.images[0].embeddings.clear();
  expect(emb, "image 0 has no embeddings");
  emb = examples::image_embeddings();
  emb.seconds = -1;
  expect(emb, "seconds = -1");
  msg::StreamEvent ev = examples::token_event();
  ev.encode_seconds = NAN;
  expect(ev, "encode_seconds");
  // Pixels may be dropped once a request is encoded (width and height stay).
  r = examples::request();
  r.images[0].image.rgb.clear();
  CHECK(status_of(r).ok());
}

TEST_CASE("codec: requests with images have their own reader limit") {
  // 20 MiB of pixels: over control_limits' 16 MiB, within image_limits.
  msg::EncodeRequest m;
  m.images = {examples::image(1, false)};
  m.images[0].image.width = 2560;
  m.images[0].image.height = 2731;
  m.images[0].image.rgb.assign(size_t(2560) * 2731 * 3, 7);
  const Bytes bytes = codec::encode(m);
  msg::EncodeRequest out;
  CHECK(codec::decode(bytes.data(), bytes.size(), out, codec::control_limits()).code() ==
        Code::corruption);
  REQUIRE(codec::decode(bytes, out).ok());
  CHECK(out.images[0].image.rgb.size() == m.images[0].image.rgb.size());
}

TEST_CASE("codec: an expert batch round-trips bit for bit, bad sizes and checksums are refused") {
  const msg::ExpertBatch m = examples::expert_batch();
  const msg::ExpertBatch back = round_trip(m);
  CHECK(back.layer == m.layer);
  CHECK(back.dim == m.dim);
  REQUIRE(back.pieces.size() == 2);
  CHECK(back.pieces[0].expert == 5);
  CHECK(back.pieces[0].rows == 3);
  CHECK(back.pieces[1].expert == 0);
  CHECK(back.data == m.data);  // -0.0 included
  CHECK(back.checksum == m.checksum);

  auto refused = [](msg::ExpertBatch bad) { return codec::decode_as<msg::ExpertBatch>(codec::encode(bad)).status(); };
  msg::ExpertBatch flipped = m;
  flipped.data[7] ^= 1;
  Status st = refused(flipped);
  CHECK(st.code() == Code::corruption);
  CHECK(st.message().find("checksum") != std::string::npos);
  msg::ExpertBatch short_rows = m;
  short_rows.pieces[0].rows = 2;
  st = refused(short_rows);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("3 rows of 4 floats need 48 bytes, data has 64") != std::string::npos);
  msg::ExpertBatch no_dim = m;
  no_dim.dim = 0;
  CHECK(refused(no_dim).message().find("dim = 0") != std::string::npos);
  msg::ExpertBatch neg = m;
  neg.pieces[1].expert = -1;
  CHECK(refused(neg).message().find("expert") != std::string::npos);
  msg::ExpertBatch neg_layer = m;
  neg_layer.layer = -3;
  CHECK(refused(neg_layer).message().find("layer") != std::string::npos);
}

TEST_CASE("codec: a stage batch round-trips bit for bit, bad tables, sizes and checksums are refused") {
  const msg::StageBatch m = examples::stage_batch();
  const msg::StageBatch back = round_trip(m);
  CHECK(back.op == msg::StageOp::layers);
  CHECK(back.first_layer == 3);
  CHECK(back.model_fingerprint == m.model_fingerprint);
  CHECK(back.positions == m.positions);
  CHECK(back.row_table == m.row_table);
  CHECK(back.table_offsets == m.table_offsets);
  CHECK(back.table_ids == m.table_ids);
  CHECK(back.logit_rows == m.logit_rows);
  CHECK(back.data == m.data);  // -0.0 included
  auto refused = [](msg::StageBatch bad) {
    return codec::decode_as<msg::StageBatch>(codec::encode(bad)).status();
  };
  msg::StageBatch bad = m;
  bad.data[3] ^= 0x40;
  CHECK(refused(bad).code() == Code::corruption);
  bad = m;
  bad.row_table[2] = 2;
  CHECK(refused(bad).message().find("names table 2 of 2") != std::string::npos);
  bad = m;
  bad.table_offsets = {0, 3, 2};
  CHECK(refused(bad).message().find("must not decrease") != std::string::npos);
  bad = m;
  bad.table_offsets = {1, 2, 3};
  CHECK(refused(bad).message().find("start at 0") != std::string::npos);
  bad = m;
  bad.positions.pop_back();
  CHECK(refused(bad).message().find("2 positions and 3 row tables") != std::string::npos);
  bad = m;
  bad.width = 5;
  CHECK(refused(bad).code() == Code::invalid_argument);
  bad = m;
  bad.first_layer = 0;
  CHECK(refused(bad).message().find("firstLayer = 0") != std::string::npos);
  bad = m;
  bad.op = msg::StageOp::kv_copy;
  bad.blocks = {1};
  CHECK(refused(bad).message().find("kvCopy needs 2 blocks") != std::string::npos);
}
