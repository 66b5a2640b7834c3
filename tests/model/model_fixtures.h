// Small generated models, engines and a tokenizer for the request and
// scheduler tests (header-only: the test glob compiles only *.cpp).
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/engine.h"
#include "model/make_model.h"
#include "model/tokenizer.h"
#include "tests/process_scratch.h"
#include "tests/same_bits.h"

namespace cleave::fixtures {

inline const std::string& vocab_path() {
  static const std::string p = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";
  return p;
}

// Writes (once per process) a model for the spec and returns its path.
inline std::string model_path(const ModelSpec& spec, const std::string& name) {
  static std::map<std::string, std::string> made;
  auto it = made.find(name);
  if (it != made.end()) return it->second;
  namespace fs = std::filesystem;
  const fs::path dir = test::process_scratch("cleave-sched-test");
  std::string path = (dir / (name + ".gguf")).string();
  Status st = write_test_model(spec, vocab_path(), path);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  made[name] = path;
  return path;
}

inline ModelSpec small_dense() {
  ModelSpec s;
  s.dim = 64; s.n_layers = 2; s.n_heads = 4; s.n_kv_heads = 2; s.ffn = 128; s.context = 256;
  return s;
}

inline ModelSpec small_moe() {
  ModelSpec s = small_dense();
  s.n_experts = 4; s.n_experts_used = 2; s.ffn = 96;
  return s;
}

inline std::shared_ptr<const GgufFile> open_model(const std::string& path) {
  auto file = GgufFile::open(path);
  REQUIRE_MESSAGE(file.ok(), file.status().to_string());
  return *file;
}

inline std::unique_ptr<Engine> make_engine(const std::string& path, EngineOptions o) {
  auto e = Engine::create(open_model(path), o);
  REQUIRE_MESSAGE(e.ok(), e.status().to_string());
  return std::move(*e);
}

inline std::unique_ptr<Engine> make_engine(const std::string& path, int threads, int max_seqs = 1) {
  EngineOptions o;
  o.threads = threads;
  o.max_seqs = max_seqs;
  return make_engine(path, o);
}

inline std::unique_ptr<Tokenizer> make_tokenizer() {
  auto t = Tokenizer::from_gguf(*open_model(vocab_path()));
  REQUIRE_MESSAGE(t.ok(), t.status().to_string());
  return std::move(*t);
}

// Deterministic prompt tokens in [3, 31993): no BOS/EOS, no control tokens.
inline std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + (i * 7919 + salt * 104729) % 31990);
  return p;
}

using cleave::testing::same_bits;

}  // namespace cleave::fixtures
