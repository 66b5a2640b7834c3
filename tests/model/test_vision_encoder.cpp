// VisionEncoder (model/vision_encoder.h): batching, the embedding cache and
// per-request errors, against ClipModel::encode run on each image alone.
#include <doctest/doctest.h>
#include <unistd.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/clip.h"
#include "model/gguf.h"
#include "model/make_model.h"
#include "model/vision_encoder.h"
#include "tests/same_bits.h"

using namespace cleave;
using cleave::testing::same_bits;

namespace {

std::shared_ptr<const GgufFile> test_mmproj() {
  static std::shared_ptr<const GgufFile> file = [] {
    ClipSpec spec;  // 32x32, patch 8: 16 tokens of 64 floats
    const std::string path = "/tmp/cleave_test_vision_encoder_" + std::to_string(::getpid()) + ".gguf";
    Status st = write_test_clip_model(spec, path);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    auto f = GgufFile::open(path);
    REQUIRE_MESSAGE(f.ok(), f.status().to_string());
    ::unlink(path.c_str());  // the mapping stays valid
    return std::shared_ptr<const GgufFile>(*f);
  }();
  return file;
}

std::unique_ptr<VisionEncoder> make_encoder(VisionEncoderOptions o = {}) {
  auto e = VisionEncoder::create(test_mmproj(), o);
  REQUIRE_MESSAGE(e.ok(), e.status().to_string());
  return std::move(*e);
}

// An image of random pixels (sizes vary, so resizing runs too).
PromptImage random_image(uint32_t seed, int32_t n_tokens = 16) {
  std::mt19937 rng(seed);
  PromptImage im;
  im.n_tokens = n_tokens;
  im.image.width = 20 + int32_t(rng() % 30);
  im.image.height = 20 + int32_t(rng() % 30);
  im.image.rgb.resize(size_t(im.image.width) * size_t(im.image.height) * 3);
  for (auto& b : im.image.rgb) b = uint8_t(rng());
  im.hash = image_hash(im.image);
  return im;
}

// ClipModel::encode of one image alone: the reference rows.
std::vector<float> encode_alone(const ClipModel& clip, const RgbImage& image) {
  auto px = clip.preprocess(image);
  REQUIRE(px.ok());
  std::vector<float> out(clip.output_floats());
  auto backend = make_cpu_backend(1);
  REQUIRE(clip.encode(*backend, px->data(), 1, out.data()).ok());
  return out;
}

std::vector<std::vector<PromptImage>*> pointers(std::vector<std::vector<PromptImage>>& groups) {
  std::vector<std::vector<PromptImage>*> out;
  for (auto& g : groups) out.push_back(&g);
  return out;
}

}  // namespace

TEST_CASE("vision encoder batches give each image the bits it gets alone") {
  VisionEncoderOptions o;
  o.max_batch = 5;
  o.threads = 2;
  auto enc = make_encoder(o);
  std::vector<std::vector<PromptImage>> groups(7);
  uint32_t seed = 1;
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i = 0; i < 1 + g % 3; ++i) groups[g].push_back(random_image(seed++));
  auto ptrs = pointers(groups);
  const std::vector<Status> st = enc->encode(ptrs);
  REQUIRE(st.size() == groups.size());
  for (const Status& s : st) CHECK_MESSAGE(s.ok(), s.to_string());
  for (auto& g : groups)
    for (auto& im : g) {
      REQUIRE(im.embeddings.size() == enc->clip().output_floats());
      CHECK(same_bits(im.embeddings, encode_alone(enc->clip(), im.image)));
    }
  const VisionEncoderCounters c = enc->counters();
  CHECK(c.images == uint64_t(seed - 1));
  CHECK(c.cache_misses == uint64_t(seed - 1));
  CHECK(c.batches == (uint64_t(seed - 1) + 4) / 5);  // full batches of max_batch
}

TEST_CASE("vision encoder cache serves a repeated image without encoding it again") {
  auto enc = make_encoder();
  const PromptImage a = random_image(11), b = random_image(12);
  std::vector<std::vector<PromptImage>> first = {{a, b, a}};
  auto p1 = pointers(first);
  REQUIRE(enc->encode(p1)[0].ok());
  CHECK(enc->counters().cache_misses == 2);  // a's twin in the same call is a hit
  CHECK(enc->counters().cache_hits == 1);
  CHECK(same_bits(first[0][0].embeddings, first[0][2].embeddings));

  std::vector<PromptImage> second = {b, a};
  REQUIRE(enc->encode(second, 7).ok());
  const VisionEncoderCounters c = enc->counters();
  CHECK(c.cache_misses == 2);
  CHECK(c.cache_hits == 3);
  CHECK(c.batches == 1);
  CHECK(c.cache_entries == 2);
  CHECK(c.cache_bytes == 2 * enc->clip().output_floats() * sizeof(float));
  CHECK(same_bits(second[0].embeddings, first[0][1].embeddings));
  CHECK(same_bits(second[1].embeddings, first[0][0].embeddings));
}

TEST_CASE("vision encoder cache evicts the least recently used image within its bytes") {
  VisionEncoderOptions o;
  o.cache_bytes = 2 * 16 * 64 * sizeof(float);  // two images
  auto enc = make_encoder(o);
  const PromptImage a = random_image(21), b = random_image(22), c = random_image(23);
  for (const PromptImage& im : {a, b, a, c}) {  // a is used after b: b goes when c comes
    std::vector<PromptImage> g = {im};
    REQUIRE(enc->encode(g).ok());
  }
  CHECK(enc->counters().cache_evictions == 1);
  CHECK(enc->counters().cache_bytes <= o.cache_bytes);
  const uint64_t misses = enc->counters().cache_misses;
  std::vector<PromptImage> again_a = {a};
  REQUIRE(enc->encode(again_a).ok());
  CHECK(enc->counters().cache_misses == misses);  // a stayed
  std::vector<PromptImage> again_b = {b};
  REQUIRE(enc->encode(again_b).ok());
  CHECK(enc->counters().cache_misses == misses + 1);  // b was evicted
}

TEST_CASE("vision encoder without a cache still encodes repeated images identically") {
  VisionEncoderOptions o;
  o.cache_bytes = 0;
  auto enc = make_encoder(o);
  const PromptImage a = random_image(31);
  std::vector<PromptImage> g1 = {a}, g2 = {a};
  REQUIRE(enc->encode(g1).ok());
  REQUIRE(enc->encode(g2).ok());
  CHECK(enc->counters().cache_misses == 2);
  CHECK(enc->counters().cache_entries == 0);
  CHECK(same_bits(g1[0].embeddings, g2[0].embeddings));
}

TEST_CASE("vision encoder fails a bad request alone and leaves it unchanged") {
  auto enc = make_encoder();
  std::vector<std::vector<PromptImage>> groups(5);
  groups[0] = {random_image(41)};
  groups[1] = {random_image(42), random_image(43, 9)};  // second spans 9 tokens, not 16
  groups[2] = {random_image(44)};
  groups[2][0].image.rgb.clear();  // no pixels
  groups[3] = {random_image(45)};
  groups[3][0].image.rgb[0] ^= 1;  // pixels that do not match the hash
  groups[4] = {random_image(46)};
  groups[4][0].image.width = 3;  // width x height disagree with the bytes
  const std::vector<uint64_t> ids = {100, 101, 102, 103, 104};
  auto ptrs = pointers(groups);
  const std::vector<Status> st = enc->encode(ptrs, ids);
  CHECK(st[0].ok());
  CHECK(groups[0][0].embeddings.size() == enc->clip().output_floats());
  CHECK(st[1].code() == Code::invalid_argument);
  CHECK(st[1].message().find("request 101 image 1 spans 9 tokens") != std::string::npos);
  CHECK(groups[1][0].embeddings.empty());
  CHECK(st[2].code() == Code::invalid_argument);
  CHECK(st[2].message().find("no pixels") != std::string::npos);
  CHECK(st[3].code() == Code::invalid_argument);
  CHECK(st[3].message().find("hash does not match") != std::string::npos);
  CHECK(st[4].code() == Code::invalid_argument);
  CHECK(st[4].message().find("3x") != std::string::npos);
  CHECK(enc->counters().failed_groups == 4);
  CHECK(enc->counters().cache_entries == 1);
}

TEST_CASE("vision encoder keeps embeddings an image already has") {
  auto enc = make_encoder();
  PromptImage done = random_image(51);
  done.embeddings.assign(enc->clip().output_floats(), 0.25f);
  done.image = {};  // encoded already: needs no pixels
  std::vector<PromptImage> g = {done, random_image(52)};
  REQUIRE(enc->encode(g).ok());
  CHECK(g[0].embeddings == std::vector<float>(enc->clip().output_floats(), 0.25f));
  CHECK(g[1].embeddings.size() == enc->clip().output_floats());
  CHECK(enc->counters().images == 1);
}

TEST_CASE("vision encoder create refuses a projector of another width and bad options") {
  VisionEncoderOptions o;
  o.n_embd = 96;
  auto wrong = VisionEncoder::create(test_mmproj(), o);
  REQUIRE_FALSE(wrong.ok());
  CHECK(wrong.status().code() == Code::invalid_argument);
  CHECK(wrong.status().message().find("64") != std::string::npos);
  CHECK(wrong.status().message().find("96") != std::string::npos);
  o.n_embd = 64;
  CHECK(VisionEncoder::create(test_mmproj(), o).ok());
  o.max_batch = 0;
  CHECK(VisionEncoder::create(test_mmproj(), o).status().code() == Code::invalid_argument);
  o.max_batch = 4;
  o.threads = 0;
  CHECK(VisionEncoder::create(test_mmproj(), o).status().code() == Code::invalid_argument);
  CHECK(VisionEncoder::create(nullptr, {}).status().code() == Code::invalid_argument);
}
