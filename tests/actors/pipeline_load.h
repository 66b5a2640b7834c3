// The models, options and loads the actor pipeline tests share: small
// generated models, mixed greedy / sampled requests, the mono reference
// (header only: the test glob compiles only *.cpp).
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actors/pipeline.h"
#include "model/make_model.h"
#include "tests/actors/pipeline_util.h"
#include "tests/process_scratch.h"

namespace cleave::testing {

inline const std::string kVocab =
    std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";

struct Model {
  std::shared_ptr<const GgufFile> file;
  std::shared_ptr<const Tokenizer> tokenizer;
};

inline ModelSpec small_dense() {
  ModelSpec s;
  s.dim = 64; s.n_layers = 2; s.n_heads = 4; s.n_kv_heads = 2; s.ffn = 128; s.context = 256;
  s.seed = 11;
  s.name = "actors-dense";
  return s;
}

inline ModelSpec small_moe() {
  ModelSpec s = small_dense();
  s.n_experts = 4; s.n_experts_used = 2; s.ffn = 64;
  s.name = "actors-moe";
  return s;
}

// Writes (once per process) the model and loads it with its tokenizer.
inline const Model& model(const ModelSpec& spec) {
  static std::map<std::string, Model> made;
  auto it = made.find(spec.name);
  if (it != made.end()) return it->second;
  const std::filesystem::path dir = test::process_scratch("cleave-actors-test");
  std::string path = (dir / (spec.name + ".gguf")).string();
  Status st = write_test_model(spec, kVocab, path);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  auto file = GgufFile::open(path);
  REQUIRE_MESSAGE(file.ok(), file.status().to_string());
  auto tok = Tokenizer::from_gguf(**file);
  REQUIRE_MESSAGE(tok.ok(), tok.status().to_string());
  Model m{*file, std::shared_ptr<const Tokenizer>(std::move(tok.value()))};
  return made.emplace(spec.name, std::move(m)).first->second;
}

inline PipelineOptions base_options(Topology t, int prefill = 1, int decode = 1, int colocated = 1) {
  PipelineOptions o;
  o.topology = t;
  o.prefill_actors = prefill;
  o.decode_actors = decode;
  o.colocated_actors = colocated;
  o.engine.threads = 1;
  o.engine.max_seqs = 32;
  o.engine.block_size = 16;
  o.actor_threads = 2;
  o.kv_tier0_bytes = o.kv_tier1_bytes = size_t(8) << 20;
  return o;
}

// Pipeline::create refuses `o` with invalid_argument naming `needle`.
inline void check_refused(const Model& m, const PipelineOptions& o, const char* needle) {
  auto p = Pipeline::create(m.file, m.tokenizer, o);
  REQUIRE_FALSE(p.ok());
  CHECK(p.status().code() == Code::invalid_argument);
  CHECK_MESSAGE(p.status().message().find(needle) != std::string::npos, p.status().message());
}

inline std::unique_ptr<Pipeline> make_pipeline(const Model& m, const PipelineOptions& o) {
  auto p = Pipeline::create(m.file, m.tokenizer, o);
  REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  return std::move(p.value());
}

inline const char* kWords[] = {"the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell",
                        "over", "quiet", "hills", "and", "old", "roads", "near", "sea"};

inline std::string sentence(int n_words, int salt) {
  std::string s;
  for (int i = 0; i < n_words; ++i) {
    if (i) s += ' ';
    s += kWords[(i * 5 + salt * 3 + (i * salt) % 7) % 17];
  }
  return s;
}

// A mixed load: prompt lengths 1..~150 tokens (some sharing a prefix),
// greedy and sampled settings, repeat penalty, stop strings, max_tokens
// 1..32, distinct seeds.
inline std::vector<GenerateRequest> mixed_requests(const Model& m, int n, uint64_t first_id) {
  const std::string shared_prefix = sentence(30, 1);  // > 2 blocks of tokens
  std::vector<GenerateRequest> out;
  for (int i = 0; i < n; ++i) {
    GenerateRequest r;
    r.request_id = first_id + uint64_t(i);
    if (i % 10 == 3) {
      r.prompt = {m.tokenizer->bos() >= 0 ? m.tokenizer->bos() : 1};  // one token
    } else {
      std::string text = (i % 3 == 0 ? shared_prefix + " " : std::string()) +
                         sentence(1 + (i * 37) % 100, i);
      r.prompt = m.tokenizer->encode(text);
      if (r.prompt.size() > 150) r.prompt.resize(150);
    }
    SamplingParams& s = r.sampling;
    s.seed = uint64_t(i) * 7919 + 1;
    s.max_tokens = 1 + (i * 13) % 32;
    switch (i % 5) {
      case 0: s.temperature = 0; break;  // greedy
      case 1: s.temperature = 0.8f; s.top_k = 40; s.top_p = 0.9f; s.min_p = 0.05f; break;
      case 2: s.temperature = 1.1f; s.top_k = 0; s.top_p = 1; s.min_p = 0.1f;
              s.repeat_penalty = 1.3f; s.repeat_last_n = 16; break;
      case 3: s.temperature = 0.7f; s.top_k = 8; s.repeat_penalty = 1.1f;
              s.stop = {"e", "an"}; break;
      case 4: s.temperature = 0; s.repeat_penalty = 1.2f; s.stop = {"a"}; break;
    }
    r.prefill_chunk = (i % 4 == 1) ? 7 : (i % 4 == 2 ? 32 : 512);
    r.keep_logits = true;
    r.ignore_eos = i % 7 == 0;
    out.push_back(std::move(r));
  }
  return out;
}

inline std::vector<Completion> mono_reference(const Model& m, const std::vector<GenerateRequest>& rs) {
  auto mono = make_pipeline(m, base_options(Topology::mono));
  auto ref = run_all(*mono, rs);
  for (const Completion& c : ref) REQUIRE_MESSAGE(c.error.ok(), c.error.to_string());
  return ref;
}

// Collects streamed events of requests submitted one by one.
struct Collector {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Completion> done;
  std::map<uint64_t, std::chrono::steady_clock::time_point> done_at;
  std::map<uint64_t, Completion> partial;
  size_t tokens = 0;

  EventCallback callback(uint64_t id) {
    return [this, id](const msg::StreamEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      Completion& c = partial[id];
      if (!fold_event(c, e, 0)) {
        ++tokens;
      } else {
        CHECK_MESSAGE(done.count(id) == 0, "second final event for request " << id);
        done[id] = c;
        done_at[id] = std::chrono::steady_clock::now();
      }
      cv.notify_all();
    };
  }
  bool wait_done(size_t n, std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return done.size() >= n; });
  }
  // The completions of `requests`, in their order (each must be done).
  std::vector<Completion> in_order(const std::vector<GenerateRequest>& requests) {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<Completion> got;
    for (const GenerateRequest& r : requests) got.push_back(done.at(r.request_id));
    return got;
  }
  bool wait_tokens(size_t n, std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return tokens >= n; });
  }
};

// The requests that failed (each must be unavailable) and the latest
// failure's delay after `since`, in seconds.
struct Failures {
  size_t failed = 0;
  double worst_s = 0;
};
inline Failures unavailable_failures(Collector& col, std::chrono::steady_clock::time_point since) {
  Failures f;
  std::lock_guard<std::mutex> lock(col.mu);
  for (const auto& [id, c] : col.done) {
    if (c.error.ok()) continue;  // finished before the kill
    ++f.failed;
    CHECK_MESSAGE(c.error.code() == Code::unavailable, c.error.to_string());
    f.worst_s = std::max(f.worst_s, std::chrono::duration<double>(col.done_at[id] - since).count());
  }
  return f;
}

// Long, plain requests (no stop, no EOS) so generation is in full swing
// when something is killed.
inline std::vector<GenerateRequest> long_requests(const Model& m, int n, uint64_t first_id) {
  std::vector<GenerateRequest> rs = mixed_requests(m, n, first_id);
  for (auto& r : rs) {
    r.sampling.max_tokens = 32;
    r.sampling.stop.clear();
    r.ignore_eos = true;
    if (r.prompt.size() < 20) r.prompt = m.tokenizer->encode(sentence(25, int(r.request_id)));
  }
  return rs;
}


}  // namespace cleave::testing
