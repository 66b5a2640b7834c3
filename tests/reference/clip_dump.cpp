// Test helper for reference_clip.py: writes test mmproj files and dumps what
// cleave computes for an image, so the float64 numpy reference can check it.
//
//   clip_dump make OUT.gguf f32|f16 SEED [field=value ...]
//     fields: image_size patch_size dim layers heads ffn proj hidden
//             feature_layer use_gelu class_embd pre_ln post_ln patch_bias
//   clip_dump encode MMPROJ IMAGE PREFIX
//     writes PREFIX.rgb (decoded uint8 HWC), PREFIX.pixels (float32 CHW
//     encoder input) and PREFIX.emb (float32 n_patches x projection_dim),
//     and prints one JSON line (width, height, n_patches, projection_dim, hash,
//     encode_ms: the encoder alone on 2 threads).
// Exit status 1 with the error on stderr for any failure.
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "model/clip.h"
#include "model/image.h"
#include "model/make_model.h"

using namespace cleave;

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "clip_dump: %s\n", msg.c_str());
  return 1;
}

bool write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), std::streamsize(bytes));
  return bool(out);
}

int make(int argc, char** argv) {
  if (argc < 5) return fail("usage: make OUT TYPE SEED [field=value ...]");
  ClipSpec s;
  auto type = dtype_from_name(argv[3]);
  if (!type.ok()) return fail(type.status().to_string());
  s.type = *type;
  s.seed = std::stoull(argv[4]);
  for (int i = 5; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    if (eq == std::string::npos) return fail("expected field=value, got '" + a + "'");
    const std::string k = a.substr(0, eq);
    const int v = std::stoi(a.substr(eq + 1));
    if (k == "image_size") s.image_size = v;
    else if (k == "patch_size") s.patch_size = v;
    else if (k == "dim") s.dim = v;
    else if (k == "layers") s.n_layers = v;
    else if (k == "heads") s.n_heads = v;
    else if (k == "ffn") s.ffn = v;
    else if (k == "proj") s.projection_dim = v;
    else if (k == "hidden") s.mm_hidden = v;
    else if (k == "feature_layer") s.feature_layer = v;
    else if (k == "use_gelu") s.use_gelu = v != 0;
    else if (k == "class_embd") s.class_embd = v != 0;
    else if (k == "pre_ln") s.pre_ln = v != 0;
    else if (k == "post_ln") s.post_ln = v != 0;
    else if (k == "patch_bias") s.patch_bias = v != 0;
    else return fail("unknown field '" + k + "'");
  }
  Status st = write_test_clip_model(s, argv[2]);
  return st.ok() ? 0 : fail(st.to_string());
}

int encode(int argc, char** argv) {
  if (argc != 5) return fail("usage: encode MMPROJ IMAGE PREFIX");
  const std::string prefix = argv[4];
  auto file = GgufFile::open(argv[2]);
  if (!file.ok()) return fail(file.status().to_string());
  auto model = ClipModel::load(*file);
  if (!model.ok()) return fail(model.status().to_string());
  const ClipConfig& c = (*model)->config();

  std::ifstream in(argv[3], std::ios::binary);
  if (!in) return fail(std::string("cannot read ") + argv[3]);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
  auto img = decode_image(bytes.data(), bytes.size());
  if (!img.ok()) return fail(img.status().to_string());
  auto px = (*model)->preprocess(*img);
  if (!px.ok()) return fail(px.status().to_string());
  std::vector<float> emb((*model)->output_floats());
  auto backend = make_cpu_backend(2);
  const auto t0 = std::chrono::steady_clock::now();
  Status st = (*model)->encode(*backend, px->data(), 1, emb.data());
  const double encode_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!st.ok()) return fail(st.to_string());

  if (!write_file(prefix + ".rgb", img->rgb.data(), img->rgb.size()) ||
      !write_file(prefix + ".pixels", px->data(), px->size() * sizeof(float)) ||
      !write_file(prefix + ".emb", emb.data(), emb.size() * sizeof(float)))
    return fail("cannot write " + prefix + ".*");
  const ImageHash h = image_hash(*img);
  std::printf("{\"width\": %d, \"height\": %d, \"n_patches\": %d, \"projection_dim\": %d, "
              "\"hash\": \"%016" PRIx64 "%016" PRIx64 "\", \"encode_ms\": %.1f}\n",
              img->width, img->height, c.n_patches, c.projection_dim, h.hi, h.lo, encode_ms);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "make") return make(argc, argv);
    if (cmd == "encode") return encode(argc, argv);
    return fail("usage: clip_dump make|encode ...");
  } catch (const std::exception& e) {  // std::stoi on a bad number
    return fail(std::string("bad argument: ") + e.what());
  }
}
