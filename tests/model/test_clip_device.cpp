// The vision encoder on a device (ClipModel::on): the CPU backend's kernels
// behind tests/fenced_backend.h give the bits of the plain CPU backend,
// the host touches no device memory (it faults) and hands no host pointer
// to an op, and an encode moves the patches up and the features down only.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>

#include "model/clip.h"
#include "model/gguf.h"
#include "model/make_model.h"
#include "model/vision_encoder.h"
#include "tests/fenced_backend.h"

using namespace cleave;
using cleave::testing::FencedBackend;

namespace {

std::unique_ptr<ClipModel> clip_of(const ClipSpec& spec, const std::string& name) {
  const std::string path = "/tmp/cleave_test_clip_device_" + std::to_string(::getpid()) + "_" + name + ".gguf";
  Status st = write_test_clip_model(spec, path);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  auto f = GgufFile::open(path);
  REQUIRE(f.ok());
  auto m = ClipModel::load(*f);
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  return std::move(*m);
}

std::vector<float> pixels(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (float& x : v) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    x = float(seed >> 40) / float(1 << 24) * 4.0f - 2.0f;
  }
  return v;
}

}  // namespace

TEST_CASE("clip on a device: the CPU backend's bits, patches up and features down only") {
  ClipSpec plain;  // class token, pre and post LayerNorm, F32
  plain.projection_dim = 48;
  plain.mm_hidden = 80;
  ClipSpec bare = plain;  // no class token, no norms around the blocks, F16 matrices, a patch bias
  bare.class_embd = false;
  bare.pre_ln = bare.post_ln = false;
  bare.patch_bias = true;
  bare.use_gelu = false;
  bare.type = DType::F16;
  for (auto [spec, name] : {std::pair{plain, "plain"}, std::pair{bare, "bare"}}) {
    CAPTURE(name);
    auto cpu_model = clip_of(spec, name);
    const int64_t n = 3;
    const auto px = pixels(cpu_model->input_floats() * size_t(n), 7);
    auto cpu = make_cpu_backend(2);
    std::vector<float> want(cpu_model->output_floats() * size_t(n));
    REQUIRE(cpu_model->encode(*cpu, px.data(), n, want.data()).ok());

    FencedBackend fenced(make_cpu_backend(2));
    const auto log = fenced.log();
    // Not placed yet: refused, naming why.
    std::vector<float> got(want.size(), 0.f);
    Status st = cpu_model->encode(fenced, px.data(), n, got.data());
    CHECK(st.code() == Code::invalid_argument);
    CHECK(st.message().find("ClipModel::on()") != std::string::npos);
    auto placed = cpu_model->on(fenced);
    REQUIRE_MESSAGE(placed.ok(), placed.status().to_string());
    CHECK(log->traffic.downloads == 0);
    log->traffic = {};
    REQUIRE((*placed)->encode(fenced, px.data(), n, got.data()).ok());
    CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
    const FencedBackend::Traffic t = log->traffic;
    CHECK(t.uploads == 1);  // the patches (the pixels, rearranged)
    CHECK(t.upload_bytes == px.size() * sizeof(float));
    CHECK(t.downloads == 1);
    CHECK(t.download_bytes == want.size() * sizeof(float));
    CHECK_MESSAGE(log->violations.empty(), log->violations.size());
    // One image alone on the device: the bits it has in the batch.
    std::vector<float> one(cpu_model->output_floats());
    REQUIRE((*placed)->encode(fenced, px.data() + cpu_model->input_floats(), 1, one.data()).ok());
    CHECK(std::memcmp(one.data(), want.data() + one.size(), one.size() * sizeof(float)) == 0);
    // The placed model refuses another backend.
    CHECK((*placed)->encode(*cpu, px.data(), n, got.data()).code() == Code::invalid_argument);
  }
}

TEST_CASE("vision encoder: device option") {
  ClipSpec spec;
  spec.projection_dim = 48;
  const std::string path = "/tmp/cleave_test_clip_device_" + std::to_string(::getpid()) + "_opt.gguf";
  REQUIRE(write_test_clip_model(spec, path).ok());
  auto f = GgufFile::open(path);
  REQUIRE(f.ok());
  VisionEncoderOptions o;
  o.device = "gpu";
  auto bad = VisionEncoder::create(*f, o);
  CHECK(bad.status().code() == Code::invalid_argument);
  CHECK(bad.status().message().rfind("vision encoder: device 'gpu'", 0) == 0);
  if (!make_cuda_backend(0).ok()) {
    o.device = "cuda:0";
    auto none = VisionEncoder::create(*f, o);
    CHECK(none.status().code() == Code::unavailable);
    CHECK(none.status().message().rfind("vision encoder: cuda backend: ", 0) == 0);
  }
  o.device = "cpu";
  auto cpu = VisionEncoder::create(*f, o);
  REQUIRE(cpu.ok());
}
