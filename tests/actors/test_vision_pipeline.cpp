// Image requests through vision_encoder actors (E/P/D and colocated with
// encoders) against the monolithic run fed embeddings from encode_images():
// the same tokens, text, finish reason and final logits bit for bit; a
// killed encoder's requests are re-placed (same answers) or fail with a
// typed error, never hang; bad input gets typed errors.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "actors/pipeline.h"
#include "model/make_model.h"
#include "model/multimodal.h"
#include "schema/codec.h"
#include "tests/actors/pipeline_util.h"
#include "tests/process_scratch.h"
#include "tests/same_bits.h"

using namespace cleave;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace cleave::testing;

namespace {

struct Vlm {
  std::shared_ptr<const GgufFile> lm, mmproj;
  std::shared_ptr<const Tokenizer> tokenizer;
  std::unique_ptr<ClipModel> clip;  // for the reference encoding
};

// A 64-wide llama test model and a CLIP encoder projecting to 64 (16 image
// tokens per 32x32 image), written once per process.
const Vlm& vlm() {
  static Vlm v = [] {
    Vlm m;
    const fs::path dir = test::process_scratch("cleave-vision-test");
    ModelSpec spec;
    spec.dim = 64; spec.n_layers = 2; spec.n_heads = 4; spec.n_kv_heads = 2; spec.ffn = 128;
    spec.context = 256; spec.seed = 23; spec.name = "vision-lm";
    const std::string lm_path = (dir / "lm.gguf").string();
    Status st = write_test_model(spec, std::string(CLEAVE_SOURCE_DIR) +
                                           "/models/vocab/ggml-vocab-llama-spm.gguf", lm_path);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    ClipSpec cs;
    cs.projection_dim = 64;
    cs.seed = 5;
    const std::string clip_path = (dir / "mmproj.gguf").string();
    st = write_test_clip_model(cs, clip_path);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    m.lm = GgufFile::open(lm_path).value();
    m.mmproj = GgufFile::open(clip_path).value();
    m.tokenizer = std::shared_ptr<const Tokenizer>(Tokenizer::from_gguf(*m.lm).value());
    m.clip = ClipModel::load(m.mmproj).value();
    return m;
  }();
  return v;
}

RgbImage random_image(uint32_t seed) {
  std::mt19937 rng(seed);
  RgbImage im;
  im.width = 24 + int32_t(rng() % 24);
  im.height = 24 + int32_t(rng() % 24);
  im.rgb.resize(size_t(im.width) * size_t(im.height) * 3);
  for (auto& b : im.rgb) b = uint8_t(rng());
  return im;
}

const char* kWords[] = {"what", "shape", "is", "red", "blue", "how", "many", "circles",
                        "left", "right", "top", "small", "large", "green", "the", "square"};

// n requests: every fourth text only, the rest with one or two images drawn
// from a pool of 12 (so images repeat and hit the encoders' caches), the
// marker at the start, in the middle or absent (images first); mixed
// sampling; prefill chunks that split images.
std::vector<GenerateRequest> image_requests(int n, uint64_t first_id) {
  const Vlm& m = vlm();
  std::vector<GenerateRequest> out;
  for (int i = 0; i < n; ++i) {
    std::string text;
    for (int w = 0; w < 3 + i % 9; ++w) text += std::string(w ? " " : "") + kWords[(i * 7 + w * 3) % 16];
    GenerateRequest r;
    if (i % 4 == 3) {
      r.prompt = m.tokenizer->encode(text);
    } else {
      std::vector<RgbImage> images = {random_image(uint32_t(i * 5 % 12))};
      if (i % 5 == 1) images.push_back(random_image(uint32_t(100 + i % 3)));
      if (images.size() == 2) text = "<image> and <image> " + text;
      else if (i % 3 == 0) text = "<image> " + text;
      else if (i % 3 == 1) text = text + " <image> answer";  // else: images first
      r = build_image_prompt(*m.tokenizer, text, std::move(images), m.clip->config().n_patches).value();
    }
    r.request_id = first_id + uint64_t(i);
    r.sampling.seed = uint64_t(i) * 31 + 7;
    r.sampling.max_tokens = 1 + (i * 11) % 20;
    r.sampling.temperature = i % 2 ? 0.8f : 0.f;
    r.sampling.top_k = i % 2 ? 20 : 0;
    r.prefill_chunk = i % 3 == 0 ? 5 : (i % 3 == 1 ? 24 : 512);
    r.ignore_eos = true;
    r.keep_logits = true;
    out.push_back(std::move(r));
  }
  return out;
}

PipelineOptions options(Topology t, int p, int d, int c, int encoders) {
  PipelineOptions o;
  o.topology = t;
  o.prefill_actors = p;
  o.decode_actors = d;
  o.colocated_actors = c;
  o.engine.threads = 1;
  o.engine.max_seqs = 32;
  o.engine.block_size = 16;
  o.actor_threads = 2;
  o.kv_tier0_bytes = o.kv_tier1_bytes = size_t(8) << 20;
  if (encoders > 0) {
    o.mmproj = vlm().mmproj;
    o.vision_actors = encoders;
    o.vision.max_batch = 8;
  }
  return o;
}

std::unique_ptr<Pipeline> make_pipeline(const PipelineOptions& o) {
  auto p = Pipeline::create(vlm().lm, vlm().tokenizer, o);
  REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  return std::move(p.value());
}

// The reference: encode_images() (model/multimodal.h, no actors, no cache)
// fills the embeddings, then the mono pipeline without an encoder runs them.
std::vector<Completion> reference(const std::vector<GenerateRequest>& requests) {
  std::vector<GenerateRequest> encoded = requests;
  auto backend = make_cpu_backend(1);
  Status st = encode_images(*vlm().clip, *backend, 64, encoded);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  auto mono = make_pipeline(options(Topology::mono, 1, 1, 1, 0));
  auto ref = run_all(*mono, encoded);
  for (const Completion& c : ref) REQUIRE_MESSAGE(c.error.ok(), c.error.to_string());
  return ref;
}

// Completions folded from the pipeline's events, by request id.
struct Done {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Completion> done, partial;
  EventCallback callback(uint64_t id) {
    return [this, id](const msg::StreamEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      Completion& c = partial[id];
      if (!fold_event(c, e, 0)) return;
      done[id] = c;
      cv.notify_all();
    };
  }
};

size_t count_image_requests(const std::vector<GenerateRequest>& rs) {
  size_t n = 0;
  for (const auto& r : rs) n += !r.images.empty();
  return n;
}

}  // namespace

TEST_CASE("vision pipeline invariant: E/P/D and colocated with encoders give mono's tokens and logits") {
  const auto requests = image_requests(84, 1000);
  const size_t with_images = count_image_requests(requests);
  REQUIRE(with_images >= 60);
  const auto ref = reference(requests);

  struct Case {
    Topology t;
    int p, d, c, e;
  };
  for (Case k : {Case{Topology::mono, 1, 1, 1, 1}, Case{Topology::pd, 1, 1, 0, 1},
                 Case{Topology::pd, 1, 1, 0, 2}, Case{Topology::pd, 2, 2, 0, 2},
                 Case{Topology::colocated, 0, 0, 2, 2}}) {
    const std::string what = std::string(topology_name(k.t)) + " P" + std::to_string(k.p) + " D" +
                             std::to_string(k.d) + " C" + std::to_string(k.c) + " E" +
                             std::to_string(k.e);
    const auto start = Clock::now();
    auto p = make_pipeline(options(k.t, k.p, k.d, k.c, k.e));
    const auto got = run_all(*p, requests);
    check_identical(ref, got, what);
    for (size_t i = 0; i < requests.size(); ++i)  // the encoder's timing reaches the client
      if (!requests[i].images.empty()) CHECK(!got[i].encode_origin.empty());
    if (k.t != Topology::mono) {
      const auto stats = p->stats();
      const msg::Stats* router = find_stats(stats, "router");
      REQUIRE(router);
      CHECK(router->get("finished") == requests.size());
      CHECK(router->get("encodes") == with_images);
      CHECK(router->get("alive_vision_encoder") == uint64_t(k.e));
      // Repeated images came from the caches, and every encoder worked.
      CHECK(sum_counter(stats, "vision_encoder", "cache_hits") > 0);
      CHECK(sum_counter(stats, "vision_encoder", "replies") == with_images);
      for (int e = 0; e < k.e; ++e) {
        const msg::Stats* enc = find_stats(stats, "vision_encoder/" + std::to_string(e));
        REQUIRE(enc);
        CHECK(enc->get("replies") > 0);
      }
    }
    MESSAGE(what << ": " << std::chrono::duration<double>(Clock::now() - start).count() << " s");
  }
}

TEST_CASE("vision pipeline: idle encoders take turns (ties go to the least recently given work)") {
  // One image request at a time: each finds every encoder idle. Ties to the
  // lowest index would give encoder 0 all six.
  std::vector<GenerateRequest> images;
  for (auto& r : image_requests(24, 7000))
    if (!r.images.empty() && images.size() < 6) images.push_back(std::move(r));
  REQUIRE(images.size() == 6);
  auto p = make_pipeline(options(Topology::colocated, 0, 0, 1, 2));
  for (const GenerateRequest& r : images) {
    const auto got = run_all(*p, {r});
    REQUIRE_MESSAGE(got[0].error.ok(), got[0].error.to_string());
  }
  const auto stats = p->stats();
  CHECK(find_stats(stats, "vision_encoder/0")->get("requests") == 3);
  CHECK(find_stats(stats, "vision_encoder/1")->get("requests") == 3);
}

TEST_CASE("vision pipeline failure: a killed encoder's requests finish on another identical or fail typed") {
  const auto requests = image_requests(64, 3000);
  const auto ref = reference(requests);
  auto p = make_pipeline(options(Topology::pd, 1, 1, 0, 2));
  Done d;
  for (const auto& r : requests) {
    REQUIRE(p->submit(r, d.callback(r.request_id)).ok());
    if (r.request_id == 3005) REQUIRE(hooks(*p).kill_actor("vision_encoder", 0).ok());  // with work queued behind it
  }
  {
    std::unique_lock<std::mutex> lock(d.mu);
    REQUIRE_MESSAGE(d.cv.wait_for(lock, std::chrono::seconds(120),
                                  [&] { return d.done.size() == requests.size(); }),
                    "only " << d.done.size() << " of " << requests.size() << " finished");
  }
  int identical = 0, failed = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Completion& c = d.done.at(requests[i].request_id);
    if (!c.error.ok()) {
      ++failed;
      CHECK(c.error.code() == Code::unavailable);
      continue;
    }
    CHECK(c.tokens == ref[i].tokens);
    CHECK(same_bits(c.logits, ref[i].logits));
    identical += c.tokens == ref[i].tokens;
  }
  const auto stats = p->stats();
  const msg::Stats* router = find_stats(stats, "router");
  REQUIRE(router);
  CHECK(router->get("encoder_downs") == 1);
  CHECK(router->get("alive_vision_encoder") == 1);
  CHECK(failed == 0);  // one encoder is left for them
  MESSAGE("killed encoder: " << router->get("encode_replacements") << " requests re-placed, "
                             << identical << " identical, " << failed << " failed");
  CHECK(hooks(*p).kill_actor("vision_encoder", 0).code() == Code::not_found);

  // No encoder left: image requests are refused at once, text still runs.
  REQUIRE(hooks(*p).kill_actor("vision_encoder", 1).ok());
  for (int tries = 0; p->alive("vision_encoder") > 0 && tries < 200; ++tries)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto more = image_requests(8, 4000);
  std::vector<GenerateRequest> images_only, text_only;
  for (auto& r : more) (r.images.empty() ? text_only : images_only).push_back(r);
  const auto got = run_all(*p, images_only);
  for (const Completion& c : got) {
    CHECK(c.error.code() == Code::unavailable);
    CHECK(c.error.message().find("vision_encoder") != std::string::npos);
  }
  for (const Completion& c : run_all(*p, text_only)) CHECK(c.error.ok());
}

TEST_CASE("vision pipeline: bad image input gets typed errors and fails only its request") {
  auto p = make_pipeline(options(Topology::pd, 1, 1, 0, 1));
  auto requests = image_requests(6, 5000);
  // Request 5000 (one image) now has pixels that do not match its hash.
  REQUIRE(requests[0].images.size() == 1);
  requests[0].images[0].image.rgb[7] ^= 0x40;
  const auto got = run_all(*p, requests);
  CHECK(got[0].error.code() == Code::invalid_argument);
  CHECK(got[0].error.message().find("request 5000") != std::string::npos);
  for (size_t i = 1; i < got.size(); ++i) CHECK_MESSAGE(got[i].error.ok(), got[i].error.to_string());

  // A span that is not the encoder's 16 tokens: refused at submit (mono)
  // or by the encoder (actors), typed either way.
  GenerateRequest wrong = image_requests(1, 5100)[0];
  REQUIRE(!wrong.images.empty());
  wrong.images[0].n_tokens = 8;
  const auto w = run_all(*p, {wrong});
  CHECK(w[0].error.code() == Code::invalid_argument);
  auto mono = make_pipeline(options(Topology::mono, 1, 1, 1, 1));
  bool called = false;
  CHECK(mono->submit(wrong, [&](const msg::StreamEvent&) { called = true; }).code() ==
        Code::invalid_argument);
  CHECK_FALSE(called);

  // Corrupt and foreign bytes sent straight to an encoder.
  CHECK(hooks(*p).send_raw("vision_encoder", 0, {'x', 'y', 'z', 0, 0, 0, 0, 0}).code() ==
        Code::corruption);
  msg::KvGet other;
  CHECK(hooks(*p).send_raw("vision_encoder", 0, codec::encode(other)).code() ==
        Code::invalid_argument);
  CHECK(hooks(*p).send_raw("vision_encoder", 3, codec::encode(other)).code() == Code::not_found);
  const auto stats = p->stats();
  CHECK(find_stats(stats, "vision_encoder/0")->get("bad_messages") == 2);

  // A pipeline without an mmproj refuses unencoded images; encoded ones run.
  auto text = make_pipeline(options(Topology::pd, 1, 1, 0, 0));
  GenerateRequest raw = image_requests(1, 5200)[0];
  CHECK(text->submit(raw, [](const msg::StreamEvent&) {}).code() == Code::invalid_argument);
  auto backend = make_cpu_backend(1);
  REQUIRE(encode_images(*vlm().clip, *backend, 64, raw).ok());
  CHECK(run_all(*text, {raw})[0].error.ok());
}

TEST_CASE("vision pipeline options: vision_actors and the projector width are checked") {
  PipelineOptions o = options(Topology::pd, 1, 1, 0, 1);
  o.vision_actors = 0;
  CHECK(Pipeline::create(vlm().lm, vlm().tokenizer, o).status().code() == Code::invalid_argument);
  o.vision_actors = 65;
  CHECK(Pipeline::create(vlm().lm, vlm().tokenizer, o).status().code() == Code::invalid_argument);
  // A projector of another width than the model's 64.
  const std::string path =
      (fs::temp_directory_path() / ("cleave-vision-wide-" + std::to_string(::getpid()) + ".gguf")).string();
  ClipSpec wide;
  wide.projection_dim = 96;
  REQUIRE(write_test_clip_model(wide, path).ok());
  o = options(Topology::colocated, 0, 0, 1, 1);
  o.mmproj = GgufFile::open(path).value();
  auto p = Pipeline::create(vlm().lm, vlm().tokenizer, o);
  CHECK(p.status().code() == Code::invalid_argument);
  CHECK(p.status().message().find("96") != std::string::npos);
  fs::remove(path);
}

namespace {

// Submits the requests in waves of 8, `gap` apart (each is placed on the
// encoders and stages active at that moment; within a wave the least
// loaded spread it) and returns the completions in order.
std::vector<Completion> in_waves(Pipeline& p, const std::vector<GenerateRequest>& requests,
                                 std::chrono::milliseconds gap) {
  Done d;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (i > 0 && i % 8 == 0) std::this_thread::sleep_for(gap);
    REQUIRE(p.submit(requests[i], d.callback(requests[i].request_id)).ok());
  }
  std::unique_lock<std::mutex> lock(d.mu);
  REQUIRE_MESSAGE(d.cv.wait_for(lock, std::chrono::seconds(120), [&] { return d.done.size() == requests.size(); }),
                  "only " << d.done.size() << " of " << requests.size() << " finished");
  std::vector<Completion> out;
  for (const auto& r : requests) out.push_back(d.done.at(r.request_id));
  return out;
}

uint64_t counter(Pipeline& p, const std::string& actor, const char* name) {
  const auto stats = p.stats();
  const msg::Stats* s = find_stats(stats, actor);
  REQUIRE_MESSAGE(s, actor);
  return s->get(name);
}

}  // namespace

TEST_CASE("vision pipeline autoscale: encoders follow the image load within the shared budget, answers stay mono's") {
  std::vector<GenerateRequest> images, text;
  for (auto& r : image_requests(96, 5000)) (r.images.empty() ? text : images).push_back(std::move(r));
  REQUIRE(images.size() == 72);
  const auto ref_images = reference(images), ref_text = reference(text);
  struct Case {
    const char* what;
    double ttft_ms, encode_ms;
    bool encoders_grow;
  };
  // Goals of 1 us nothing meets, 1e6 ms anything meets. Two colocated
  // stages and three encoders under a budget of three: at most one stage
  // and two encoders, or two stages and one encoder.
  for (const Case& k : {Case{"images over the encoders' goal", 1e6, 0.001, true},
                        Case{"language over its goal", 0.001, 1e6, false}}) {
    const std::string what = k.what;
    CAPTURE(what);
    PipelineOptions o = options(Topology::colocated, 0, 0, 2, 3);
    o.autoscale.ttft_ms = k.ttft_ms;
    o.autoscale.encode_ms = k.encode_ms;
    o.autoscale.max_active = 3;
    o.autoscale.interval_s = 0.1;
    o.autoscale.confirm = 1;
    o.autoscale.cooldown_s = 3;  // no step down between the image phase's waves
    auto p = make_pipeline(o);
    CHECK(counter(*p, "router", "autoscale_encoders_active") == 1);  // min_encoders; the rest parked
    CHECK(counter(*p, "router", "autoscale_encoders_parked") == 2);
    check_identical(ref_images, in_waves(*p, images, std::chrono::milliseconds(250)), what + ", images");
    check_identical(ref_text, in_waves(*p, text, std::chrono::milliseconds(250)), what + ", text");
    auto stats = p->stats();
    const msg::Stats* router = find_stats(stats, "router");
    REQUIRE(router);
    CHECK(router->get("failures") == 0);
    CHECK(router->get("finished") == images.size() + text.size());
    CHECK(sum_counter(stats, "vision_encoder", "replies") == images.size());
    CHECK(find_stats(stats, "vision_encoder/0")->get("requests") > 0);
    // Never past the budget: the third encoder takes nothing in either case.
    CHECK(find_stats(stats, "vision_encoder/2")->get("requests") == 0);
    if (k.encoders_grow) {
      CHECK(router->get("autoscale_encoder_ups") >= 1);
      CHECK(find_stats(stats, "vision_encoder/1")->get("requests") > 0);
      CHECK(find_stats(stats, "colocated/1")->get("scheduler_submitted") == 0);  // the stage gave way
      // Text only now: the encoders' controller hears nothing and parks
      // them back to min_encoders once the cooldown is over.
      const auto limit = Clock::now() + std::chrono::seconds(20);
      while (counter(*p, "router", "autoscale_encoders_active") != 1 && Clock::now() < limit)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      CHECK(counter(*p, "router", "autoscale_encoders_active") == 1);
      CHECK(counter(*p, "router", "autoscale_encoder_downs") >= 1);
    } else {
      CHECK(router->get("autoscale_encoder_ups") == 0);
      CHECK(find_stats(stats, "vision_encoder/1")->get("requests") == 0);
      CHECK(router->get("autoscale_ups") >= 1);
      CHECK(find_stats(stats, "colocated/1")->get("scheduler_submitted") > 0);
    }
    MESSAGE(what << ": encoders " << router->get("autoscale_encoder_ups") << " up, "
                 << router->get("autoscale_encoder_downs") << " down, " << router->get("autoscale_encoder_ms")
                 << " encoder-ms; stages " << router->get("autoscale_ups") << " up");
  }
}

TEST_CASE("vision pipeline autoscale: encoder fields are refused without encoders or beyond them") {
  PipelineOptions text_only = options(Topology::colocated, 0, 0, 2, 0);
  text_only.autoscale.ttft_ms = 100;
  text_only.autoscale.encode_ms = 100;
  auto p = Pipeline::create(vlm().lm, vlm().tokenizer, text_only);
  REQUIRE_FALSE(p.ok());
  CHECK(p.status().message().find("min_encoders 1 is more than the 0 vision_encoder actors") != std::string::npos);
  PipelineOptions few = options(Topology::pd, 1, 1, 0, 2);
  few.autoscale.ttft_ms = 100;
  few.autoscale.encode_ms = 100;
  few.autoscale.min_encoders = 3;
  p = Pipeline::create(vlm().lm, vlm().tokenizer, few);
  REQUIRE_FALSE(p.ok());
  CHECK(p.status().message().find("min_encoders 3 is more than the 2") != std::string::npos);
}
