// Prompt assembly for image prompts (text with <image> markers plus decoded
// images -> prompt ids and PromptImages) and encode_images (the CLIP
// encoder filling the embeddings), then a whole image request through the
// engine.
#include <doctest/doctest.h>

#include "model/clip.h"
#include "model/generate.h"
#include "model/make_model.h"
#include "model/multimodal.h"
#include "model_fixtures.h"

using namespace cleave;
using namespace cleave::fixtures;

namespace {

RgbImage test_image(int32_t w, int32_t h, int salt) {
  RgbImage im;
  im.width = w;
  im.height = h;
  im.rgb.resize(size_t(w) * h * 3);
  for (size_t i = 0; i < im.rgb.size(); ++i) im.rgb[i] = uint8_t((i * 37 + size_t(salt) * 101) % 251);
  return im;
}

std::unique_ptr<ClipModel> clip_model(int32_t projection_dim) {
  ClipSpec s;  // 32x32 images, patch 8: 16 patches
  s.projection_dim = projection_dim;
  s.name = "mm-test-clip-" + std::to_string(projection_dim);
  const std::string path = model_path(small_dense(), "dense") + "." + s.name + ".gguf";
  Status st = write_test_clip_model(s, path);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  auto m = ClipModel::load(open_model(path));
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  return std::move(*m);
}

std::vector<int32_t> concat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

}  // namespace

TEST_CASE("multimodal: each image marker becomes a run of placeholder ids at its position") {
  auto tok = make_tokenizer();
  const RgbImage a = test_image(20, 24, 1), b = test_image(8, 8, 2);
  auto r = build_image_prompt(*tok, "USER: <image>\nwhat is<image> here", {a, b}, 4);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  const std::vector<int32_t> run(4, kImagePlaceholderId);
  const auto want = concat({{tok->bos()}, tok->encode("USER: ", false), run,
                            tok->encode("\nwhat is", false), run, tok->encode(" here", false)});
  CHECK(r->prompt == want);
  REQUIRE(r->images.size() == 2);
  const int32_t first = 1 + int32_t(tok->encode("USER: ", false).size());
  CHECK(r->images[0].position == first);
  CHECK(r->images[1].position == first + 4 + int32_t(tok->encode("\nwhat is", false).size()));
  CHECK(r->images[0].n_tokens == 4);
  CHECK(r->images[0].hash == image_hash(a));
  CHECK(r->images[1].hash == image_hash(b));
  CHECK(r->images[0].image.rgb == a.rgb);
  CHECK(r->images[0].embeddings.empty());
  CHECK(validate_request(*r, 256, tok->n_vocab(), 64).ok());
  // Markers at both ends: no empty text pieces are tokenised.
  r = build_image_prompt(*tok, "<image><image>", {a, b}, 3, /*add_bos=*/false);
  REQUIRE(r.ok());
  CHECK(r->prompt == std::vector<int32_t>(6, kImagePlaceholderId));
  CHECK(r->images[1].position == 3);
}

TEST_CASE("multimodal: without a marker the images go first after BOS") {
  auto tok = make_tokenizer();
  const RgbImage a = test_image(16, 16, 3), b = test_image(16, 16, 4);
  auto r = build_image_prompt(*tok, "describe", {a, b}, 16);
  REQUIRE(r.ok());
  const std::vector<int32_t> run(16, kImagePlaceholderId);
  CHECK(r->prompt == concat({{tok->bos()}, run, run, tok->encode("describe", false)}));
  CHECK(r->images[0].position == 1);
  CHECK(r->images[1].position == 17);
  r = build_image_prompt(*tok, "describe", {a}, 16, /*add_bos=*/false);
  REQUIRE(r.ok());
  CHECK(r->images[0].position == 0);
  CHECK(r->prompt == concat({run, tok->encode("describe", false)}));
  // No images, no markers: plain text.
  r = build_image_prompt(*tok, "describe", {}, 16);
  REQUIRE(r.ok());
  CHECK(r->prompt == tok->encode("describe", true));
  CHECK(r->images.empty());
}

TEST_CASE("multimodal: marker and image counts must agree") {
  auto tok = make_tokenizer();
  const RgbImage a = test_image(16, 16, 5);
  auto r = build_image_prompt(*tok, "<image> and <image>", {a}, 4);
  CHECK(r.status().code() == Code::invalid_argument);
  CHECK(r.status().message().find("2 <image> markers but 1 images") != std::string::npos);
  r = build_image_prompt(*tok, "<image> only", {a, a}, 4);
  CHECK(r.status().code() == Code::invalid_argument);
  CHECK(r.status().message().find("1 <image> markers but 2 images") != std::string::npos);
  r = build_image_prompt(*tok, "<image>", {}, 4);
  CHECK(r.status().code() == Code::invalid_argument);
  r = build_image_prompt(*tok, "<image>", {a}, 0);
  CHECK(r.status().code() == Code::invalid_argument);
}

TEST_CASE("multimodal: encode_images fills the encoder's rows batch-independently") {
  auto tok = make_tokenizer();
  auto clip = clip_model(64);
  auto backend = make_cpu_backend(2);
  const int32_t P = clip->config().n_patches;
  std::vector<RgbImage> images;
  for (int i = 0; i < 5; ++i) images.push_back(test_image(24 + i, 30, 10 + i));
  auto built = build_image_prompt(*tok, "describe", images, P);
  REQUIRE(built.ok());
  GenerateRequest one_by_one = *built, batched = *built;
  REQUIRE(encode_images(*clip, *backend, 64, one_by_one, 1).ok());
  REQUIRE(encode_images(*clip, *backend, 64, batched, 16).ok());
  for (size_t i = 0; i < images.size(); ++i) {
    CAPTURE(i);
    // The encoder's own output for this image alone.
    auto px = clip->preprocess(images[i]);
    REQUIRE(px.ok());
    std::vector<float> want(clip->output_floats());
    REQUIRE(clip->encode(*backend, px->data(), 1, want.data()).ok());
    CHECK(same_bits(one_by_one.images[i].embeddings, want));
    CHECK(same_bits(batched.images[i].embeddings, want));
  }
  // Across requests (batches of 3 that straddle them): the same rows.
  std::vector<GenerateRequest> two = {*build_image_prompt(*tok, "describe", {images[0], images[1]}, P),
                                      *build_image_prompt(*tok, "<image> x <image>", {images[2], images[3]}, P)};
  two[1].request_id = 1;
  REQUIRE(encode_images(*clip, *backend, 64, two, 3).ok());
  for (size_t i = 0; i < 4; ++i)
    CHECK(same_bits(two[i / 2].images[i % 2].embeddings, batched.images[i].embeddings));
  CHECK(validate_request(batched, 256, tok->n_vocab(), 64).ok());
  CHECK(check_images_encoded(batched).ok());
  // Encoded images are left alone.
  GenerateRequest again = batched;
  again.images[0].embeddings.assign(again.images[0].embeddings.size(), 7.f);
  REQUIRE(encode_images(*clip, *backend, 64, again).ok());
  CHECK(again.images[0].embeddings[0] == 7.f);
}

TEST_CASE("multimodal: projection_dim mismatch and bad images are typed errors") {
  auto tok = make_tokenizer();
  auto clip = clip_model(32);
  auto backend = make_cpu_backend(1);
  auto built = build_image_prompt(*tok, "describe", {test_image(16, 16, 1)}, 16);
  REQUIRE(built.ok());
  GenerateRequest r = *built;
  Status st = encode_images(*clip, *backend, 64, r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("projection_dim 32") != std::string::npos);
  CHECK(st.message().find("n_embd 64") != std::string::npos);
  CHECK(check_projector_fits(*clip, 32).ok());
  CHECK(r.images[0].embeddings.empty());

  r = *build_image_prompt(*tok, "describe", {test_image(16, 16, 1)}, 9);  // not n_patches
  st = encode_images(*clip, *backend, 32, r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("9 tokens") != std::string::npos);
  r = *build_image_prompt(*tok, "describe", {RgbImage{}}, 16);
  st = encode_images(*clip, *backend, 32, r);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("no pixels") != std::string::npos);
}

TEST_CASE("multimodal: an assembled and encoded image prompt runs and the image decides the answer") {
  auto tok = make_tokenizer();
  auto clip = clip_model(64);
  auto engine = make_engine(model_path(small_dense(), "dense"), 2, 1);
  const int32_t P = clip->config().n_patches;
  auto run = [&](const RgbImage& image) {
    GenerateRequest r = *build_image_prompt(*tok, "describe <image> please", {image}, P);
    REQUIRE(encode_images(*clip, engine->backend(), engine->config().dim, r).ok());
    r.sampling.temperature = 0;
    r.sampling.max_tokens = 4;
    r.ignore_eos = true;
    r.keep_logits = true;
    auto g = generate(*engine, tok.get(), r);
    REQUIRE_MESSAGE(g.ok(), g.status().to_string());
    return g->logits;
  };
  const auto a1 = run(test_image(32, 32, 1));
  CHECK(same_bits(run(test_image(32, 32, 1)), a1));
  CHECK_FALSE(same_bits(run(test_image(32, 32, 2)), a1));
}
