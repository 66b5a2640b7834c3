// CLIP vision encoder (model/clip.h), image decoding and preprocessing
// (model/image.h), and the test mmproj generator (make_model.h).
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "model/clip.h"
#include "model/gguf.h"
#include "model/image.h"
#include "model/make_model.h"
#include "tests/png_util.h"
#include "tests/same_bits.h"

// The test side's own encoder for PNG/JPEG bytes.
#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb/stb_image_write.h>

using namespace cleave;
using cleave::testing::same_bits;

namespace {

std::string tmp_path(const std::string& name) {
  return "/tmp/cleave_test_clip_" + std::to_string(::getpid()) + "_" + name;
}

std::string clip_file(const ClipSpec& spec, const std::string& name) {
  const std::string path = tmp_path(name + ".gguf");
  Status st = write_test_clip_model(spec, path);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  return path;
}

Result<std::unique_ptr<ClipModel>> load_clip(const std::string& path) {
  auto f = GgufFile::open(path);
  if (!f.ok()) return f.status();
  return ClipModel::load(*f);
}

std::unique_ptr<ClipModel> must_load(const std::string& path) {
  auto m = load_clip(path);
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  return std::move(*m);
}

// Copies a GGUF, letting `edit` change metadata and tensors on the way.
struct Edit {
  std::function<bool(GgufKv&)> kv = [](GgufKv&) { return true; };  // false: drop
  // false: drop; may rename or reshape (then data must fit).
  std::function<bool(std::string&, std::vector<int64_t>&, std::vector<uint8_t>&)> tensor =
      [](std::string&, std::vector<int64_t>&, std::vector<uint8_t>&) { return true; };
};

std::string rewrite(const std::string& src, const std::string& name, const Edit& e) {
  auto f = GgufFile::open(src);
  REQUIRE(f.ok());
  GgufWriter w;
  for (GgufKv kv : (*f)->metadata())
    if (e.kv(kv)) w.set(kv.key, kv.value);
  for (const GgufTensorInfo& t : (*f)->tensors()) {
    std::string n = t.name;
    std::vector<int64_t> ne(t.ne, t.ne + t.n_dims);
    const uint8_t* d = (*f)->tensor_data(t);
    std::vector<uint8_t> data(d, d + t.bytes);
    if (e.tensor(n, ne, data)) w.add_tensor(n, t.type, ne, data);
  }
  const std::string out = tmp_path(name + ".gguf");
  Status st = w.write(out);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  return out;
}

Edit drop_tensor(const std::string& victim) {
  Edit e;
  e.tensor = [victim](std::string& n, std::vector<int64_t>&, std::vector<uint8_t>&) { return n != victim; };
  return e;
}

Edit set_kv(const std::string& key, GgufValue value) {
  Edit e;
  e.kv = [key, value](GgufKv& kv) {
    if (kv.key == key) kv.value = value;
    return true;
  };
  return e;
}

GgufValue str_value(const std::string& s) {
  GgufValue v;
  v.type = GgufType::STRING;
  v.s = s;
  return v;
}

// Deterministic pseudo-random pixels.
RgbImage random_image(int32_t w, int32_t h, uint32_t seed) {
  RgbImage img;
  img.width = w;
  img.height = h;
  img.rgb.resize(size_t(w) * size_t(h) * 3);
  uint32_t s = seed * 2654435761u + 1;
  for (uint8_t& b : img.rgb) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    b = uint8_t(s >> 24);
  }
  return img;
}

void append(void* ctx, void* data, int size) {
  auto* out = static_cast<std::vector<uint8_t>*>(ctx);
  out->insert(out->end(), static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
}

std::vector<uint8_t> encode_png(const uint8_t* px, int w, int h, int comp) {
  std::vector<uint8_t> out;
  REQUIRE(stbi_write_png_to_func(append, &out, w, h, comp, px, w * comp) != 0);
  return out;
}
std::vector<uint8_t> encode_png(const RgbImage& img) { return encode_png(img.rgb.data(), img.width, img.height, 3); }

std::vector<uint8_t> encode_jpeg(const RgbImage& img, int quality) {
  std::vector<uint8_t> out;
  REQUIRE(stbi_write_jpg_to_func(append, &out, img.width, img.height, 3, img.rgb.data(), quality) != 0);
  return out;
}

using cleave::testing::png_crc32;
using cleave::testing::put_be32;

// Sets the IHDR width and height of a PNG and fixes the chunk's CRC, so only
// the header's values are wrong.
void set_png_dims(std::vector<uint8_t>& png, uint32_t w, uint32_t h) {
  REQUIRE(png.size() > 33);
  REQUIRE(std::memcmp(&png[12], "IHDR", 4) == 0);
  put_be32(&png[16], w);
  put_be32(&png[20], h);
  put_be32(&png[29], png_crc32(&png[12], 17));
}

std::vector<float> preprocess(const ClipModel& m, const RgbImage& img) {
  auto px = m.preprocess(img);
  REQUIRE_MESSAGE(px.ok(), px.status().to_string());
  return std::move(*px);
}

std::vector<float> encode(const ClipModel& m, const std::vector<float>& pixels, int64_t n, int threads = 1) {
  auto backend = make_cpu_backend(threads);
  std::vector<float> out(m.output_floats() * size_t(n));
  Status st = m.encode(*backend, pixels.data(), n, out.data());
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  return out;
}

void require_code(const Status& st, Code code, const std::string& mentions) {
  INFO(st.to_string());
  CHECK(st.code() == code);
  CHECK(st.message().find(mentions) != std::string::npos);
}

ClipSpec small_spec() {
  ClipSpec s;  // image 32, patch 8, dim 64, 2 blocks, 4 heads, ffn 128
  s.projection_dim = 48;
  s.mm_hidden = 80;
  s.seed = 11;
  return s;
}

}  // namespace

TEST_CASE("clip: the test mmproj loads with the spec's configuration") {
  auto m = must_load(clip_file(small_spec(), "cfg"));
  const ClipConfig& c = m->config();
  CHECK(c.image_size == 32);
  CHECK(c.patch_size == 8);
  CHECK(c.n_patches == 16);
  CHECK(c.n_positions == 17);
  CHECK(c.dim == 64);
  CHECK(c.n_heads == 4);
  CHECK(c.head_dim == 16);
  CHECK(c.n_layers == 2);
  CHECK(c.feature_layer == 1);  // no key: n_layers - 1 blocks run
  CHECK(c.mm_hidden == 80);
  CHECK(c.projection_dim == 48);
  CHECK(c.use_gelu);
  CHECK(c.has_class_embd);
  CHECK(c.has_pre_ln);
  CHECK_FALSE(c.use_post_ln);  // not after the penultimate block
  CHECK_FALSE(c.ffn_swapped);
  CHECK(c.image_std[1] == doctest::Approx(0.26130258f));
  CHECK(m->output_floats() == 16u * 48u);
  CHECK(m->input_floats() == 3u * 32u * 32u);
}

TEST_CASE("clip: a missing tensor is not_found naming it") {
  const std::string base = clip_file(small_spec(), "base_missing");
  for (const char* name : {"v.blk.1.attn_k.weight", "v.blk.0.ln2.bias", "mm.2.weight", "mm.0.bias",
                           "v.position_embd.weight", "v.patch_embd.weight"}) {
    auto m = load_clip(rewrite(base, "missing", drop_tensor(name)));
    REQUIRE_FALSE(m.ok());
    require_code(m.status(), Code::not_found, name);
  }
}

TEST_CASE("clip: a tensor with the wrong shape is corruption naming it") {
  const std::string base = clip_file(small_spec(), "base_shape");
  Edit e;
  e.tensor = [](std::string& n, std::vector<int64_t>& ne, std::vector<uint8_t>&) {
    if (n == "v.blk.1.attn_q.weight") ne = {32, 128};  // same bytes, other shape
    return true;
  };
  auto m = load_clip(rewrite(base, "shape", e));
  REQUIRE_FALSE(m.ok());
  require_code(m.status(), Code::corruption, "v.blk.1.attn_q.weight");
  CHECK(m.status().message().find("[32, 128]") != std::string::npos);

  Edit pos;  // position embeddings for a different patch count
  pos.tensor = [](std::string& n, std::vector<int64_t>& ne, std::vector<uint8_t>& d) {
    if (n == "v.position_embd.weight") {
      ne[1] = 16;
      d.resize(size_t(64) * 16 * 4);
    }
    return true;
  };
  auto m2 = load_clip(rewrite(base, "pos", pos));
  REQUIRE_FALSE(m2.ok());
  require_code(m2.status(), Code::corruption, "v.position_embd.weight");
}

TEST_CASE("clip: projector type other than mlp is unsupported") {
  const std::string base = clip_file(small_spec(), "base_proj");
  auto m = load_clip(rewrite(base, "proj", set_kv("clip.projector_type", str_value("ldp"))));
  REQUIRE_FALSE(m.ok());
  require_code(m.status(), Code::unsupported, "ldp");
}

TEST_CASE("clip: bad or missing keys give typed errors naming the key") {
  const std::string base = clip_file(small_spec(), "base_keys");
  {
    Edit e;
    e.kv = [](GgufKv& kv) { return kv.key != "clip.vision.image_size"; };
    auto m = load_clip(rewrite(base, "k1", e));
    REQUIRE_FALSE(m.ok());
    require_code(m.status(), Code::not_found, "clip.vision.image_size");
  }
  {
    GgufValue v;
    v.type = GgufType::ARRAY;
    v.array_type = GgufType::FLOAT32;
    v.arr_f = {0.5, 0.0, 0.5};
    auto m = load_clip(rewrite(base, "k2", set_kv("clip.vision.image_std", v)));
    REQUIRE_FALSE(m.ok());
    require_code(m.status(), Code::corruption, "clip.vision.image_std[1]");
    v.arr_f = {0.5, 0.5};
    auto m2 = load_clip(rewrite(base, "k3", set_kv("clip.vision.image_std", v)));
    REQUIRE_FALSE(m2.ok());
    require_code(m2.status(), Code::corruption, "clip.vision.image_std");
  }
  {
    GgufValue v;
    v.type = GgufType::UINT32;
    v.u = 12;  // not a multiple of patch 8
    auto m = load_clip(rewrite(base, "k4", set_kv("clip.vision.image_size", v)));
    REQUIRE_FALSE(m.ok());
    require_code(m.status(), Code::corruption, "image_size 12");
    v.u = 5;  // 64 not a multiple of 5 heads
    auto m2 = load_clip(rewrite(base, "k5", set_kv("clip.vision.attention.head_count", v)));
    REQUIRE_FALSE(m2.ok());
    require_code(m2.status(), Code::corruption, "head_count 5");
  }
  {
    ClipSpec s = small_spec();
    s.feature_layer = 0;
    const std::string fl_base = clip_file(s, "base_fl");
    GgufValue v;
    v.type = GgufType::INT32;
    v.i = 3;  // hidden states 0..2 only
    auto m = load_clip(rewrite(fl_base, "k6", set_kv("clip.vision.feature_layer", v)));
    REQUIRE_FALSE(m.ok());
    require_code(m.status(), Code::corruption, "clip.vision.feature_layer = 3");
    GgufValue list;
    list.type = GgufType::ARRAY;
    list.array_type = GgufType::INT32;
    list.arr_i = {1, 2};  // granite-style stacking
    auto m2 = load_clip(rewrite(fl_base, "k6b", set_kv("clip.vision.feature_layer", list)));
    REQUIRE_FALSE(m2.ok());
    require_code(m2.status(), Code::unsupported, "lists 2 layers");
  }
  {
    auto m = load_clip(rewrite(base, "k7", set_kv("general.architecture", str_value("llama"))));
    REQUIRE_FALSE(m.ok());
    require_code(m.status(), Code::unsupported, "llama");
  }
  {
    GgufValue v;
    v.type = GgufType::BOOL;
    v.u = 0;
    auto m = load_clip(rewrite(base, "k8", set_kv("clip.has_vision_encoder", v)));
    REQUIRE_FALSE(m.ok());
    require_code(m.status(), Code::unsupported, "has_vision_encoder");
  }
  {
    // clip.vision.projection_dim is CLIP's own projection size (768 in LLaVA's
    // CLIP-L files); the output size comes from mm.2.
    auto m = load_clip(rewrite(base, "k9", set_kv("clip.vision.projection_dim", [] {
      GgufValue v;
      v.type = GgufType::UINT32;
      v.u = 768;
      return v;
    }())));
    REQUIRE_MESSAGE(m.ok(), m.status().to_string());
    CHECK((*m)->config().projection_dim == 48);
    CHECK((*m)->config().clip_projection_dim == 768);
  }
  {
    Edit e;  // mm.2 reading 40 inputs while mm.0 gives 80
    e.tensor = [](std::string& n, std::vector<int64_t>& ne, std::vector<uint8_t>&) {
      if (n == "mm.2.weight") ne = {40, 96};  // same element count as [80, 48]
      return true;
    };
    auto m = load_clip(rewrite(base, "k10", e));
    REQUIRE_FALSE(m.ok());
    require_code(m.status(), Code::corruption, "mm.2.weight");
  }
}

TEST_CASE("clip: encoding is deterministic and depends on the image") {
  auto m = must_load(clip_file(small_spec(), "det"));
  const std::vector<float> a = preprocess(*m, random_image(40, 30, 1));
  const std::vector<float> b = preprocess(*m, random_image(40, 30, 2));
  const std::vector<float> ea = encode(*m, a, 1), ea2 = encode(*m, a, 1), eb = encode(*m, b, 1);
  CHECK(same_bits(ea, ea2));
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ea.size(); ++i) {
    REQUIRE(std::isfinite(ea[i]));
    diff += std::fabs(ea[i] - eb[i]);
    norm += std::fabs(ea[i]);
  }
  CHECK(norm / double(ea.size()) > 0.05);  // not a vanishing output
  CHECK(diff / double(ea.size()) > 1e-3);  // the image matters
  // Each patch gets its own embedding (positions differ).
  CHECK_FALSE(std::equal(ea.begin(), ea.begin() + 48, ea.begin() + 48));
}

TEST_CASE("clip: batched images give the bits each gives alone") {
  auto m = must_load(clip_file(small_spec(), "batch"));
  std::vector<std::vector<float>> px;
  std::vector<float> all;
  for (uint32_t i = 0; i < 3; ++i) {
    px.push_back(preprocess(*m, random_image(20 + 7 * int32_t(i), 33, 10 + i)));
    all.insert(all.end(), px.back().begin(), px.back().end());
  }
  const std::vector<float> batched = encode(*m, all, 3);
  const std::vector<float> two_threads = encode(*m, all, 3, 2);
  CHECK(same_bits(batched, two_threads));
  const size_t per = m->output_floats();
  for (size_t i = 0; i < 3; ++i) {
    const std::vector<float> alone = encode(*m, px[i], 1);
    CHECK(same_bits(alone, std::vector<float>(batched.begin() + i * per, batched.begin() + (i + 1) * per)));
  }
}

TEST_CASE("clip: feature layer follows llama.cpp and post_ln applies only after every block") {
  // No key: n_layers - 1 blocks run (the penultimate block's output).
  auto deflt = must_load(clip_file(small_spec(), "fl_default"));
  CHECK(deflt->config().feature_layer == 1);
  ClipSpec s = small_spec();
  s.feature_layer = 1;  // written as llama.cpp's list [1]
  auto listed = must_load(clip_file(s, "fl1"));
  s.feature_layer = 2;  // every block
  const std::string all_path = clip_file(s, "fl2");
  auto all = must_load(all_path);
  CHECK(all->config().use_post_ln);
  GgufValue scalar;
  scalar.type = GgufType::INT32;
  scalar.i = 1;
  auto scalar1 = must_load(rewrite(all_path, "fl_scalar", set_kv("clip.vision.feature_layer", scalar)));
  CHECK(scalar1->config().feature_layer == 1);
  s.feature_layer = 0;  // the embeddings after pre_ln, no block
  auto none = must_load(clip_file(s, "fl0"));
  // Tensors depend only on (seed, name): a one-block file without post_ln
  // holds exactly the weights the early exit uses.
  ClipSpec one = small_spec();
  one.n_layers = 1;
  one.feature_layer = 1;
  one.post_ln = false;
  auto truncated = must_load(clip_file(one, "one"));
  one.post_ln = true;
  auto with_post = must_load(clip_file(one, "one_post"));
  CHECK(with_post->config().use_post_ln);

  const std::vector<float> px = preprocess(*deflt, random_image(32, 32, 5));
  const std::vector<float> e_default = encode(*deflt, px, 1);
  CHECK(same_bits(e_default, encode(*listed, px, 1)));
  CHECK(same_bits(e_default, encode(*scalar1, px, 1)));
  CHECK(same_bits(e_default, encode(*truncated, px, 1)));
  CHECK_FALSE(same_bits(e_default, encode(*with_post, px, 1)));
  CHECK_FALSE(same_bits(e_default, encode(*all, px, 1)));
  const std::vector<float> e_none = encode(*none, px, 1);
  CHECK_FALSE(same_bits(e_default, e_none));
  for (float e : e_none) REQUIRE(std::isfinite(e));
}

TEST_CASE("clip: quick GELU and GELU differ and optional tensors are optional") {
  ClipSpec s = small_spec();
  s.use_gelu = false;
  s.class_embd = false;
  s.pre_ln = false;
  s.post_ln = false;
  s.patch_bias = true;
  auto m = must_load(clip_file(s, "quick"));
  CHECK_FALSE(m->config().use_gelu);
  CHECK_FALSE(m->config().has_class_embd);
  CHECK(m->config().n_positions == 16);
  const std::vector<float> px = preprocess(*m, random_image(32, 32, 6));
  const std::vector<float> quick = encode(*m, px, 1);
  s.use_gelu = true;
  const std::vector<float> gelu = encode(*must_load(clip_file(s, "gelu")), px, 1);
  REQUIRE(quick.size() == gelu.size());
  CHECK_FALSE(same_bits(quick, gelu));
}

TEST_CASE("clip: legacy swapped ffn_up and ffn_down names give the same encoder") {
  const std::string base = clip_file(small_spec(), "legacy_base");
  Edit e;
  e.tensor = [](std::string& n, std::vector<int64_t>&, std::vector<uint8_t>&) {
    auto swap = [&](const std::string& a, const std::string& b) {
      if (n.size() > a.size() && n.find(a) != std::string::npos) n.replace(n.find(a), a.size(), b);
      else if (n.find(b) != std::string::npos) n.replace(n.find(b), b.size(), a);
    };
    if (n.find(".ffn_") != std::string::npos) swap("ffn_up", "ffn_down");
    return true;
  };
  auto legacy = must_load(rewrite(base, "legacy", e));
  CHECK(legacy->config().ffn_swapped);
  auto normal = must_load(base);
  const std::vector<float> px = preprocess(*normal, random_image(32, 32, 7));
  CHECK(same_bits(encode(*normal, px, 1), encode(*legacy, px, 1)));
}

TEST_CASE("clip: F16 weights load and stay close to F32") {
  ClipSpec s = small_spec();
  auto f32 = must_load(clip_file(s, "w32"));
  s.type = DType::F16;
  auto f16 = must_load(clip_file(s, "w16"));
  CHECK(f16->config().weight_type == DType::F16);
  const std::vector<float> px = preprocess(*f32, random_image(32, 32, 8));
  const std::vector<float> a = encode(*f32, px, 1), b = encode(*f16, px, 1);
  double max_err = 0;
  for (size_t i = 0; i < a.size(); ++i) max_err = std::max(max_err, double(std::fabs(a[i] - b[i])));
  CHECK(max_err > 0);  // really different weights
  CHECK(max_err < 0.05);
}

TEST_CASE("clip: encode rejects bad arguments") {
  auto m = must_load(clip_file(small_spec(), "args"));
  auto backend = make_cpu_backend(1);
  std::vector<float> px(m->input_floats()), out(m->output_floats());
  require_code(m->encode(*backend, px.data(), 0, out.data()), Code::invalid_argument, "images");
  require_code(m->encode(*backend, nullptr, 1, out.data()), Code::invalid_argument, "images");
}

TEST_CASE("clip: the spec is validated") {
  ClipSpec s = small_spec();
  s.image_size = 30;
  require_code(write_test_clip_model(s, tmp_path("bad.gguf")), Code::invalid_argument, "image_size");
  s = small_spec();
  s.type = DType::Q8_0;  // patch rows of 8 cannot be 32-element blocks
  require_code(write_test_clip_model(s, tmp_path("bad.gguf")), Code::invalid_argument, "patch_size");
  s.patch_size = 32;
  s.image_size = 64;
  s.mm_hidden = 40;
  require_code(write_test_clip_model(s, tmp_path("bad.gguf")), Code::invalid_argument, "mm_hidden");
  s.mm_hidden = 64;
  REQUIRE(write_test_clip_model(s, tmp_path("q8.gguf")).ok());
  auto q8 = must_load(tmp_path("q8.gguf"));
  CHECK(q8->config().weight_type == DType::Q8_0);
  CHECK(q8->config().n_patches == 4);
  s = small_spec();
  s.feature_layer = 3;
  require_code(write_test_clip_model(s, tmp_path("bad.gguf")), Code::invalid_argument, "feature_layer");
}

TEST_CASE("image: PNG decodes to the exact pixels from RGB RGBA and grey") {
  const RgbImage img = random_image(13, 7, 3);
  auto rgb = decode_image(encode_png(img).data(), encode_png(img).size());
  REQUIRE_MESSAGE(rgb.ok(), rgb.status().to_string());
  CHECK(rgb->width == 13);
  CHECK(rgb->height == 7);
  CHECK(rgb->rgb == img.rgb);

  std::vector<uint8_t> rgba, grey;
  for (size_t i = 0; i < img.rgb.size(); i += 3) {
    rgba.insert(rgba.end(), {img.rgb[i], img.rgb[i + 1], img.rgb[i + 2], uint8_t(i)});
    grey.push_back(img.rgb[i]);
  }
  const std::vector<uint8_t> rgba_png = encode_png(rgba.data(), 13, 7, 4);
  auto a = decode_image(rgba_png.data(), rgba_png.size());
  REQUIRE(a.ok());
  CHECK(a->rgb == img.rgb);  // alpha dropped
  const std::vector<uint8_t> grey_png = encode_png(grey.data(), 13, 7, 1);
  auto g = decode_image(grey_png.data(), grey_png.size());
  REQUIRE(g.ok());
  REQUIRE(g->rgb.size() == img.rgb.size());
  for (size_t i = 0; i < grey.size(); ++i) {
    CHECK(g->rgb[3 * i] == grey[i]);
    CHECK(g->rgb[3 * i + 1] == grey[i]);
    CHECK(g->rgb[3 * i + 2] == grey[i]);
  }
}

TEST_CASE("image: JPEG decodes to close pixels") {
  RgbImage img;  // smooth gradient: JPEG keeps it well
  img.width = 24;
  img.height = 16;
  for (int y = 0; y < 16; ++y)
    for (int x = 0; x < 24; ++x) img.rgb.insert(img.rgb.end(), {uint8_t(x * 10), uint8_t(y * 15), 128});
  const std::vector<uint8_t> jpg = encode_jpeg(img, 95);
  auto d = decode_image(jpg.data(), jpg.size());
  REQUIRE_MESSAGE(d.ok(), d.status().to_string());
  CHECK(d->width == 24);
  CHECK(d->height == 16);
  double err = 0;
  for (size_t i = 0; i < img.rgb.size(); ++i) err += std::abs(int(d->rgb[i]) - int(img.rgb[i]));
  CHECK(err / double(img.rgb.size()) < 4.0);
}

TEST_CASE("image: corrupt PNG and JPEG bytes are corruption") {
  const RgbImage img = random_image(16, 16, 4);
  std::vector<uint8_t> png = encode_png(img);
  png[png.size() / 2] ^= 0x40;  // inside IDAT: the CRC no longer matches
  auto p = decode_image(png.data(), png.size());
  REQUIRE_FALSE(p.ok());
  require_code(p.status(), Code::corruption, "PNG");

  // A Huffman table declaring more than 256 codes (overflows a table inside
  // Debian's stb_image 2.27 if it ever gets there).
  std::vector<uint8_t> dht = encode_jpeg(img, 90);
  size_t at = 2;
  while (at + 1 < dht.size() && !(dht[at] == 0xFF && dht[at + 1] == 0xC4)) ++at;
  REQUIRE(at + 21 < dht.size());
  for (size_t i = 0; i < 16; ++i) dht[at + 5 + i] = 0xFF;
  auto h = decode_image(dht.data(), dht.size());
  REQUIRE_FALSE(h.ok());
  require_code(h.status(), Code::corruption, "Huffman table with 4080 codes");

  std::vector<uint8_t> jpg = encode_jpeg(img, 90);
  // Garble the quantisation and Huffman tables and the frame header.
  for (size_t i = 4; i < std::min<size_t>(jpg.size() - 4, 400); i += 3) jpg[i] = 0xFF;
  auto j = decode_image(jpg.data(), jpg.size());
  REQUIRE_FALSE(j.ok());
  CHECK(j.status().code() == Code::corruption);
}

// Every input that ever made fuzz_image fail (tests/fuzz/regressions/image/,
// replayed by ctest fuzz_image too): an error or an image of the header's
// size, never a crash. jpeg-scan-short-of-its-blocks: an 8x8 JPEG whose scan
// ends before its six blocks do (stb_image 2.27's bit reader then shifts by
// 32: model/CMakeLists.txt). jpeg-scan-names-an-undefined-huffman-table: its
// DHT defines DC 0, AC 0, DC 1 and DC 0 again, its scan reads AC 1 (stb would
// decode with an uninitialised table: its assert fired in the fuzz build).
TEST_CASE("image: the fuzz regression inputs decode or fail typed") {
  const std::string dir = std::string(CLEAVE_SOURCE_DIR) + "/tests/fuzz/regressions/image";
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::ifstream f(entry.path(), std::ios::binary);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    CAPTURE(entry.path().string());
    auto r = decode_image(bytes.data(), bytes.size());
    if (r.ok()) {
      CHECK(r->width > 0);
      CHECK(r->rgb.size() == size_t(r->width) * size_t(r->height) * 3);
    } else {
      CHECK((r.status().code() == Code::corruption || r.status().code() == Code::out_of_range ||
             r.status().code() == Code::unsupported));
    }
    ++n;
  }
  CHECK(n >= 1);
  // The short scan itself: stb pads it with zeros, an 8x8 image comes back.
  std::ifstream f(dir + "/jpeg-scan-short-of-its-blocks", std::ios::binary);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto r = decode_image(bytes.data(), bytes.size());
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  CHECK(r->width == 8);
  CHECK(r->height == 8);
  std::ifstream g(dir + "/jpeg-scan-names-an-undefined-huffman-table", std::ios::binary);
  const std::vector<uint8_t> undefined((std::istreambuf_iterator<char>(g)), std::istreambuf_iterator<char>());
  REQUIRE(undefined.size() > 600);
  require_code(decode_image(undefined.data(), undefined.size()).status(), Code::corruption,
               "scan uses AC Huffman table 1, which no table before it defines");
}

// A scan may name only tables a DHT before it defined; a progressive scan
// reads DC tables in its first DC pass and AC tables in its AC passes only.
TEST_CASE("image: a JPEG scan naming a Huffman table no DHT defined is corruption") {
  const std::vector<uint8_t> jpg = encode_jpeg(random_image(16, 16, 9), 90);
  REQUIRE(decode_image(jpg.data(), jpg.size()).ok());
  // The encoder's tables, each as (class << 4 | id): relabel one at a time
  // to an id no scan reads, so its scan's table is missing.
  std::vector<size_t> table_at;
  for (size_t pos = 2; pos + 4 <= jpg.size();) {
    if (jpg[pos] != 0xFF || jpg[pos + 1] == 0xDA) break;
    const size_t len = size_t(jpg[pos + 2]) << 8 | jpg[pos + 3];
    if (jpg[pos + 1] == 0xC4)
      for (size_t off = pos + 4; off < pos + 2 + len;) {
        table_at.push_back(off);
        size_t codes = 0;
        for (int i = 1; i <= 16; ++i) codes += jpg[off + size_t(i)];
        off += 17 + codes;
      }
    pos += 2 + len;
  }
  REQUIRE(table_at.size() == 4);  // DC 0, AC 0, DC 1, AC 1 (luma and chroma)
  for (size_t at : table_at) {
    std::vector<uint8_t> bad = jpg;
    const int cls = bad[at] >> 4, id = bad[at] & 15;
    bad[at] = uint8_t(cls << 4 | 3);  // table 3: no component reads it
    CAPTURE(cls);
    CAPTURE(id);
    require_code(decode_image(bad.data(), bad.size()).status(), Code::corruption,
                 std::string("scan uses ") + (cls == 0 ? "DC" : "AC") + " Huffman table " + std::to_string(id));
    bad[at] = uint8_t(cls << 4 | 4);  // no such id at all
    require_code(decode_image(bad.data(), bad.size()).status(), Code::corruption,
                 "Huffman table of class " + std::to_string(cls) + " id 4");
  }
}

TEST_CASE("image: truncated PNG and JPEG are corruption") {
  const RgbImage img = random_image(16, 16, 5);
  const std::vector<uint8_t> png = encode_png(img), jpg = encode_jpeg(img, 90);
  for (size_t keep : {size_t(8), size_t(20), png.size() / 2, png.size() - 1}) {
    auto r = decode_image(png.data(), keep);
    REQUIRE_FALSE(r.ok());
    require_code(r.status(), Code::corruption, "PNG");
  }
  for (size_t keep : {size_t(3), size_t(100), jpg.size() / 2, jpg.size() - 2}) {
    auto r = decode_image(jpg.data(), keep);
    REQUIRE_FALSE(r.ok());
    require_code(r.status(), Code::corruption, "JPEG");
  }
}

TEST_CASE("image: empty input and zero-sized headers are errors") {
  const uint8_t none = 0;
  require_code(decode_image(&none, 0).status(), Code::invalid_argument, "no bytes");
  require_code(decode_image(nullptr, 10).status(), Code::invalid_argument, "no bytes");
  std::vector<uint8_t> png = encode_png(random_image(4, 4, 6));
  set_png_dims(png, 0, 4);
  auto r = decode_image(png.data(), png.size());
  REQUIRE_FALSE(r.ok());
  require_code(r.status(), Code::corruption, "PNG is zero-sized (0x4)");
  std::vector<uint8_t> jpg = encode_jpeg(random_image(4, 4, 6), 90);
  size_t sof = 2;
  while (sof + 1 < jpg.size() && !(jpg[sof] == 0xFF && jpg[sof + 1] == 0xC0)) ++sof;
  REQUIRE(sof + 9 < jpg.size());
  jpg[sof + 5] = jpg[sof + 6] = 0;  // frame height 0
  auto z = decode_image(jpg.data(), jpg.size());
  REQUIRE_FALSE(z.ok());
  require_code(z.status(), Code::corruption, "JPEG is zero-sized (4x0)");
  const std::vector<uint8_t> junk = {'G', 'I', 'F', '8', '9', 'a', 0, 0, 0, 0};
  require_code(decode_image(junk.data(), junk.size()).status(), Code::unsupported, "PNG or JPEG");
}

TEST_CASE("image: oversized images are out_of_range before decoding") {
  const std::vector<uint8_t> png = encode_png(random_image(16, 8, 7));
  ImageLimits small;
  small.max_width = 15;
  require_code(decode_image(png.data(), png.size(), small).status(), Code::out_of_range, "16x8");
  small = ImageLimits{};
  small.max_bytes = png.size() - 1;
  require_code(decode_image(png.data(), png.size(), small).status(), Code::out_of_range, "bytes");
  // A header claiming 100000 x 100000 pixels: refused from the header alone.
  std::vector<uint8_t> huge = png;
  set_png_dims(huge, 100000, 100000);
  require_code(decode_image(huge.data(), huge.size()).status(), Code::out_of_range, "100000x100000");
}

TEST_CASE("image: mutated and cut PNG and JPEG files never crash the decoder") {
  const RgbImage img = random_image(24, 18, 12);
  const std::vector<std::vector<uint8_t>> files = {encode_png(img), encode_jpeg(img, 80),
                                                   encode_jpeg(img, 20)};
  uint32_t s = 12345;
  auto next = [&s] {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return s;
  };
  int ok = 0, failed = 0;
  for (const std::vector<uint8_t>& file : files) {
    for (int round = 0; round < 700; ++round) {
      std::vector<uint8_t> m = file;
      const int flips = 1 + int(next() % 8);
      for (int f = 0; f < flips; ++f) m[next() % m.size()] = uint8_t(next());
      if (round % 5 == 0) m.resize(1 + next() % m.size());
      auto r = decode_image(m.data(), m.size());
      if (r.ok()) {
        ++ok;
        CHECK(r->rgb.size() == size_t(r->width) * size_t(r->height) * 3);
      } else {
        ++failed;
        CHECK(!r.status().message().empty());
      }
    }
  }
  MESSAGE("mutations decoded: " << ok << ", refused: " << failed);
  CHECK(failed > 0);
}

TEST_CASE("image: content hash is stable and follows the pixels") {
  const RgbImage img = random_image(9, 5, 8);
  const ImageHash h = image_hash(img);
  CHECK(h == image_hash(img));
  // Same pixels, different PNG compression: same hash.
  stbi_write_png_compression_level = 1;
  const std::vector<uint8_t> fast = encode_png(img);
  stbi_write_png_compression_level = 9;
  const std::vector<uint8_t> slow = encode_png(img);
  stbi_write_png_compression_level = 8;
  auto a = decode_image(fast.data(), fast.size());
  auto b = decode_image(slow.data(), slow.size());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(image_hash(*a) == h);
  CHECK(image_hash(*b) == h);
  RgbImage changed = img;
  changed.rgb[17] ^= 1;
  CHECK_FALSE(image_hash(changed) == h);
  RgbImage reshaped = img;  // same bytes, other shape
  reshaped.width = 5;
  reshaped.height = 9;
  CHECK_FALSE(image_hash(reshaped) == h);
  // Pinned: caches keyed by this hash must survive a rebuild.
  RgbImage fixed;
  fixed.width = 2;
  fixed.height = 1;
  fixed.rgb = {1, 2, 3, 4, 5, 6};
  const ImageHash pinned = image_hash(fixed);
  CHECK(pinned.lo == 0x0d2446f2b5c0e10cull);
  CHECK(pinned.hi == 0x7eeb5e39a9ab32feull);
}

TEST_CASE("image: bilinear resize matches hand-computed values") {
  RgbImage img;
  img.width = 2;
  img.height = 1;
  img.rgb = {0, 0, 0, 100, 200, 40};
  const std::vector<float> up = resize_bilinear(img, 4, 1);
  // sx = (x + 0.5) / 2 - 0.5 = -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1)
  const std::vector<float> want = {0, 0, 0, 25, 50, 10, 75, 150, 30, 100, 200, 40};
  CHECK(up == want);
  const RgbImage r = random_image(5, 3, 9);
  const std::vector<float> same = resize_bilinear(r, 5, 3);
  for (size_t i = 0; i < same.size(); ++i) CHECK(same[i] == float(r.rgb[i]));
  // Halving averages 2x2 neighbourhoods (sample points fall between pixels).
  RgbImage sq;
  sq.width = 2;
  sq.height = 2;
  sq.rgb = {0, 0, 0, 40, 40, 40, 80, 80, 80, 120, 120, 120};
  CHECK(resize_bilinear(sq, 1, 1) == std::vector<float>{60, 60, 60});
}

TEST_CASE("image: preprocess normalises per channel in CHW order") {
  RgbImage img;
  img.width = 1;
  img.height = 1;
  img.rgb = {255, 0, 51};
  const float mean[3] = {0.5f, 0.25f, 0.f}, stdv[3] = {0.5f, 0.25f, 0.1f};
  auto px = preprocess_image(img, 2, mean, stdv);
  REQUIRE(px.ok());
  REQUIRE(px->size() == 12u);
  for (int i = 0; i < 4; ++i) {
    CHECK((*px)[size_t(i)] == doctest::Approx(1.0));
    CHECK((*px)[size_t(4 + i)] == doctest::Approx(-1.0));
    CHECK((*px)[size_t(8 + i)] == doctest::Approx(2.0));
  }
  const float bad_std[3] = {1, 0, 1};
  require_code(preprocess_image(img, 2, mean, bad_std).status(), Code::invalid_argument, "std");
  require_code(preprocess_image(img, 0, mean, stdv).status(), Code::invalid_argument, "size");
}
