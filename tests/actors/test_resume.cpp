// Frontend::resume: a request continued in a new pipeline after the tokens
// an earlier one sampled gives the rest of the uninterrupted run's tokens
// and logits, bit for bit, with its KV read back from the durable store
// (kv_durable) the earlier pipeline filled; without a store it recomputes.
#include <doctest/doctest.h>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <mutex>

#include "actors/pipeline.h"
#include "model/make_model.h"
#include "tests/process_scratch.h"

using namespace cleave;
namespace fs = std::filesystem;

namespace {

const std::string kVocab = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";

struct Model {
  std::shared_ptr<const GgufFile> file;
  std::shared_ptr<const Tokenizer> tokenizer;
};

const Model& model() {
  static Model m = [] {
    ModelSpec s;
    s.dim = 64; s.n_layers = 2; s.n_heads = 4; s.n_kv_heads = 2; s.ffn = 128; s.context = 256;
    s.seed = 23;
    s.name = "resume-dense";
    const fs::path dir = test::process_scratch("cleave-resume-test");
    const std::string path = (dir / "m.gguf").string();
    Status st = write_test_model(s, kVocab, path);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    auto file = GgufFile::open(path);
    REQUIRE(file.ok());
    auto tok = Tokenizer::from_gguf(**file);
    REQUIRE(tok.ok());
    return Model{*file, std::shared_ptr<const Tokenizer>(std::move(tok.value()))};
  }();
  return m;
}

PipelineOptions options(Topology t, const std::string& kv_dir) {
  PipelineOptions o;
  o.topology = t;
  o.engine.threads = 1;
  o.engine.max_seqs = 8;
  o.engine.block_size = 16;
  o.actor_threads = 2;
  o.kv_dir = kv_dir;
  o.kv_durable = !kv_dir.empty();
  return o;
}

std::vector<GenerateRequest> requests() {
  std::vector<GenerateRequest> out;
  for (int i = 0; i < 4; ++i) {
    GenerateRequest r;
    for (int k = 0; k < 40 + 9 * i; ++k) r.prompt.push_back(1 + (k * 37 + i * 11) % 900);
    r.request_id = uint64_t(100 + i);
    r.sampling.max_tokens = 48;
    r.sampling.temperature = i % 2 ? 0.9f : 0.0f;
    r.sampling.seed = uint64_t(7 + i);
    r.ignore_eos = true;
    out.push_back(r);
  }
  return out;
}

// Resumes each request after its first `cut[i]` tokens and waits for all.
std::vector<Completion> resume_all(Frontend& f, const std::vector<GenerateRequest>& rs,
                                   const std::vector<std::vector<int32_t>>& generated) {
  std::vector<Completion> out(rs.size());
  std::mutex mu;
  std::condition_variable cv;
  size_t done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < rs.size(); ++i) {
    Status st = f.resume(rs[i], generated[i], [&, i](const msg::StreamEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (fold_event(out[i], e, s)) {
        ++done;
        cv.notify_all();
      }
    });
    REQUIRE_MESSAGE(st.ok(), st.to_string());
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done == rs.size(); });
  return out;
}

uint64_t stat_sum(Frontend& f, const std::string& name) {
  uint64_t n = 0;
  for (const msg::Stats& s : f.stats()) n += s.get(name);
  return n;
}

}  // namespace

TEST_CASE("resume: after a restart, the rest of every request's tokens and logits, its KV read from the store") {
  for (Topology t : {Topology::mono, Topology::colocated, Topology::pd}) {
    CAPTURE(std::string(topology_name(t)));
    const fs::path dir = fs::temp_directory_path() /
                         ("cleave-resume-" + std::to_string(::getpid()) + "-" + topology_name(t));
    fs::remove_all(dir);
    const auto rs = requests();
    std::vector<Completion> full;
    {
      auto p = Pipeline::create(model().file, model().tokenizer, options(t, dir.string()));
      REQUIRE_MESSAGE(p.ok(), p.status().to_string());
      auto r = (*p)->run(rs);
      REQUIRE(r.ok());
      full = std::move(r.value());
      for (const Completion& c : full) REQUIRE_MESSAGE(c.error.ok(), c.error.to_string());
    }  // the process "dies": only the store's directory is left
    const std::vector<int32_t> cuts = {1, 17, 33, 47};
    std::vector<std::vector<int32_t>> generated;
    for (size_t i = 0; i < rs.size(); ++i)
      generated.emplace_back(full[i].tokens.begin(), full[i].tokens.begin() + cuts[i]);
    auto p = Pipeline::create(model().file, model().tokenizer, options(t, dir.string()));
    REQUIRE_MESSAGE(p.ok(), p.status().to_string());
    const auto got = resume_all(**p, rs, generated);
    for (size_t i = 0; i < rs.size(); ++i) {
      CAPTURE(i);
      REQUIRE_MESSAGE(got[i].error.ok(), got[i].error.to_string());
      const std::vector<int32_t> rest(full[i].tokens.begin() + cuts[i], full[i].tokens.end());
      const std::vector<uint64_t> hashes(full[i].logits_hashes.begin() + cuts[i], full[i].logits_hashes.end());
      CHECK(got[i].tokens == rest);
      CHECK(got[i].logits_hashes == hashes);
      CHECK(got[i].finish_reason == full[i].finish_reason);
    }
    // The KV came from the store, not from recomputation: every full block
    // of prompt + replayed tokens was imported, less than a block per request recomputed.
    const uint64_t imported = stat_sum(**p, "imported_tokens");
    const uint64_t recomputed = stat_sum(**p, "recomputed_tokens");
    MESSAGE(std::string(topology_name(t)), ": imported ", imported, " tokens, recomputed ", recomputed);
    uint64_t full_blocks = 0, with_kv = 0;  // tokens of prompt + replayed whose KV a resume needs
    for (size_t i = 0; i < rs.size(); ++i) {
      with_kv += rs[i].prompt.size() + size_t(cuts[i]) - 1;
      full_blocks += (rs[i].prompt.size() + size_t(cuts[i]) - 1) / 16 * 16;
    }
    // pd's prefill also hands off the partly filled block, which the store keeps.
    CHECK(imported >= full_blocks);
    CHECK(imported + recomputed == with_kv);
    CHECK(recomputed < 16 * rs.size());
    fs::remove_all(dir);
  }
}

TEST_CASE("resume: without a store the tokens are the same, recomputed, a resume past the end fails") {
  const auto rs = requests();
  auto p = Pipeline::create(model().file, model().tokenizer, options(Topology::mono, ""));
  REQUIRE(p.ok());
  auto full = (*p)->run(rs);
  REQUIRE(full.ok());
  std::vector<std::vector<int32_t>> generated;
  std::vector<GenerateRequest> again = rs;
  for (size_t i = 0; i < rs.size(); ++i) {
    again[i].request_id += 1000;
    again[i].rng_stream = rs[i].request_id;  // the same draws under another id
    generated.emplace_back((*full)[i].tokens.begin(), (*full)[i].tokens.begin() + 20);
  }
  const auto got = resume_all(**p, again, generated);
  for (size_t i = 0; i < rs.size(); ++i) {
    REQUIRE_MESSAGE(got[i].error.ok(), got[i].error.to_string());
    CHECK(got[i].tokens == std::vector<int32_t>((*full)[i].tokens.begin() + 20, (*full)[i].tokens.end()));
  }
  // One token more than max_tokens: the request would have finished before it.
  std::vector<GenerateRequest> past = {rs[0]};
  past[0].request_id = 5000;
  std::vector<int32_t> too_many = (*full)[0].tokens;
  too_many.push_back(too_many.back());
  const auto failed = resume_all(**p, past, {too_many});
  CHECK(failed[0].error.code() == Code::invalid_argument);
}
