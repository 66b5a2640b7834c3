// The engine end to end on generated models: batch invariance (chunked vs
// whole prefill, batched vs alone, thread counts) bit for bit, and typed
// errors for bad models and requests.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "model/engine.h"
#include "model/generate.h"
#include "model/make_model.h"
#include "tests/process_scratch.h"

using namespace cleave;
namespace fs = std::filesystem;

namespace {

const std::string kVocab = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";

fs::path test_dir() {
  return test::process_scratch("cleave-engine-test");
}

// Writes (once per process) a model for the spec and returns its path.
std::string model_path(const ModelSpec& spec, const std::string& name) {
  static std::map<std::string, std::string> made;
  auto it = made.find(name);
  if (it != made.end()) return it->second;
  std::string path = (test_dir() / (name + ".gguf")).string();
  Status st = write_test_model(spec, kVocab, path);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  made[name] = path;
  return path;
}

ModelSpec small_dense(DType type = DType::F32) {
  ModelSpec s;
  s.dim = 64; s.n_layers = 2; s.n_heads = 4; s.n_kv_heads = 2; s.ffn = 128; s.context = 256;
  s.type = type;
  return s;
}

ModelSpec small_moe(DType type = DType::F32) {
  ModelSpec s = small_dense(type);
  s.n_experts = 4; s.n_experts_used = 2; s.ffn = 96;
  return s;
}

std::unique_ptr<Engine> make_engine(const std::string& path, int threads, int max_seqs = 4,
                                    int block_size = 16) {
  auto file = GgufFile::open(path);
  REQUIRE_MESSAGE(file.ok(), file.status().to_string());
  EngineOptions o;
  o.threads = threads;
  o.max_seqs = max_seqs;
  o.block_size = block_size;
  auto e = Engine::create(*file, o);
  REQUIRE_MESSAGE(e.ok(), e.status().to_string());
  return std::move(*e);
}

std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + (i * 7919 + salt * 104729) % 31990);
  return p;
}

// Greedy generation with every step's logits.
GenerateResult run(Engine& e, const std::vector<int32_t>& prompt, int chunk, int n = 8) {
  GenerateRequest r;
  r.prompt = prompt;
  r.sampling.temperature = 0;
  r.sampling.max_tokens = n;
  r.prefill_chunk = chunk;
  r.keep_logits = true;
  r.ignore_eos = true;
  auto g = generate(e, nullptr, r);
  REQUIRE_MESSAGE(g.ok(), g.status().to_string());
  return std::move(*g);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST_CASE("engine: chunked prefill is bit-identical to whole prefill") {
  for (auto [spec, name] : {std::pair{small_dense(), "dense"}, std::pair{small_moe(), "moe"},
                            std::pair{small_dense(DType::Q8_0), "dense-q8"}}) {
    CAPTURE(name);
    auto e = make_engine(model_path(spec, name), 2);
    auto prompt = prompt_of(45, 1);
    GenerateResult whole = run(*e, prompt, 512);
    REQUIRE(whole.tokens.size() == 8);
    for (int chunk : {1, 7, 16, 20}) {
      CAPTURE(chunk);
      GenerateResult c = run(*e, prompt, chunk);
      CHECK(c.tokens == whole.tokens);
      CHECK(same_bits(c.logits, whole.logits));
    }
  }
}

TEST_CASE("engine: a sequence's logits do not depend on the batch beside it or thread count") {
  // Every --block-size: 8 splits the prompts over up to 5 blocks, 64 holds each in one.
  for (int bs : {16, 8, 64})
  for (auto [spec, name] : {std::pair{small_dense(DType::F16), "dense-f16"}, std::pair{small_moe(), "moe"}}) {
    CAPTURE(name);
    CAPTURE(bs);
    std::string path = model_path(spec, name);
    auto one = make_engine(path, 1, 4, bs);
    auto two = make_engine(path, 2, 4, bs);
    const int V = one->config().n_vocab;
    // Alone: each sequence decodes by itself.
    std::vector<std::vector<int32_t>> prompts = {prompt_of(5, 2), prompt_of(33, 3), prompt_of(17, 4)};
    std::vector<std::vector<float>> alone;
    for (auto& p : prompts) {
      auto s = one->open_sequence();
      REQUIRE(s.ok());
      std::vector<float> lg(V);
      REQUIRE(one->forward({{*s, p.data(), int32_t(p.size())}}, lg.data()).ok());
      for (int step = 0; step < 4; ++step) {
        int32_t t = 100 + step;
        REQUIRE(one->forward({{*s, &t, 1}}, lg.data()).ok());
      }
      alone.push_back(lg);
      one->close_sequence(*s);
    }
    // Together, on 2 threads: prefill all three in one batch, then decode in
    // batches of changing composition and order.
    std::vector<int32_t> seqs;
    for (size_t i = 0; i < prompts.size(); ++i) seqs.push_back(*two->open_sequence());
    std::vector<float> lg(3 * V);
    REQUIRE(two->forward({{seqs[2], prompts[2].data(), 17}, {seqs[0], prompts[0].data(), 5},
                          {seqs[1], prompts[1].data(), 33}}, lg.data()).ok());
    int32_t t0 = 100, t1 = 101, t2 = 102, t3 = 103;
    // seq 1 alone for one step, then everyone in shuffled order.
    REQUIRE(two->forward({{seqs[1], &t0, 1}}, lg.data()).ok());
    REQUIRE(two->forward({{seqs[0], &t0, 1}, {seqs[2], &t0, 1}}, lg.data()).ok());
    REQUIRE(two->forward({{seqs[2], &t1, 1}, {seqs[1], &t1, 1}, {seqs[0], &t1, 1}}, lg.data()).ok());
    REQUIRE(two->forward({{seqs[0], &t2, 1}, {seqs[1], &t2, 1}, {seqs[2], &t2, 1}}, lg.data()).ok());
    // Final step: seq 2 and 0 in a batch, seq 1 on its own.
    std::vector<float> out(2 * V);
    REQUIRE(two->forward({{seqs[2], &t3, 1}, {seqs[0], &t3, 1}}, out.data()).ok());
    std::vector<float> s2(out.begin(), out.begin() + V), s0(out.begin() + V, out.begin() + 2 * V);
    std::vector<float> o1(V);
    REQUIRE(two->forward({{seqs[1], &t3, 1}}, o1.data()).ok());
    CHECK(same_bits(s0, alone[0]));
    CHECK(same_bits(s2, alone[2]));
    CHECK(same_bits(o1, alone[1]));
  }
}

TEST_CASE("engine: prefill logits equal step-by-step decode logits") {
  auto e = make_engine(model_path(small_dense(), "dense"), 2);
  const int V = e->config().n_vocab;
  auto p = prompt_of(40, 5);
  auto a = *e->open_sequence();
  std::vector<float> whole(V), step(V);
  REQUIRE(e->forward({{a, p.data(), 40}}, whole.data()).ok());
  auto b = *e->open_sequence();
  for (int i = 0; i < 40; ++i) REQUIRE(e->forward({{b, &p[i], 1}}, step.data()).ok());
  CHECK(same_bits(whole, step));
  // Different block sizes change the attention tiles; the answer stays close.
  auto e8 = make_engine(model_path(small_dense(), "dense"), 2, 1, 8);
  auto c = *e8->open_sequence();
  std::vector<float> other(V);
  REQUIRE(e8->forward({{c, p.data(), 40}}, other.data()).ok());
  double md = 0;
  for (int i = 0; i < V; ++i) md = std::max(md, double(std::abs(other[i] - whole[i])));
  CHECK(md < 1e-4);
}

TEST_CASE("engine: typed errors for bad requests") {
  ModelSpec s = small_dense();
  auto e = make_engine(model_path(s, "dense"), 1, 1);
  auto p = prompt_of(300, 6);  // context is 256
  GenerateRequest r;
  r.prompt = p;
  auto g = generate(*e, nullptr, r);
  REQUIRE_FALSE(g.ok());
  CHECK(g.status().code() == Code::out_of_range);
  CHECK(g.status().message().find("300") != std::string::npos);
  CHECK(g.status().message().find("256") != std::string::npos);

  auto seq = e->open_sequence();
  REQUIRE(seq.ok());
  CHECK(e->open_sequence().status().code() == Code::busy);
  std::vector<float> lg(e->config().n_vocab);
  int32_t bad = 40000;
  Status st = e->forward({{*seq, &bad, 1}}, lg.data());
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("40000") != std::string::npos);
  CHECK(e->sequence_length(*seq) == 0);  // nothing appended
  // Prompt that exactly fills the context, then one more token.
  std::vector<int32_t> full = prompt_of(256, 7);
  REQUIRE(e->forward({{*seq, full.data(), 256}}, lg.data()).ok());
  int32_t one = 5;
  CHECK(e->forward({{*seq, &one, 1}}, lg.data()).code() == Code::out_of_range);
}

TEST_CASE("engine: typed errors for unsupported or broken models") {
  fs::path dir = test_dir();
  auto vocab = GgufFile::open(kVocab);
  REQUIRE(vocab.ok());
  // A vocab-only file has no architecture tensors.
  auto no_tensors = LlamaModel::load(*vocab);
  CHECK_FALSE(no_tensors.ok());

  // Rewrite a generated model with one key or tensor changed.
  auto src = GgufFile::open(model_path(small_dense(), "dense"));
  REQUIRE(src.ok());
  auto rewrite = [&](const std::string& name, auto&& edit_kv, const std::string& drop_tensor,
                     const std::string& f16_tensor) {
    GgufWriter w;
    for (const GgufKv& kv : (*src)->metadata()) {
      GgufValue v = kv.value;
      if (edit_kv(kv.key, v)) w.set(kv.key, v);
    }
    for (const GgufTensorInfo& t : (*src)->tensors()) {
      if (t.name == drop_tensor) continue;
      std::vector<int64_t> ne(t.ne, t.ne + t.n_dims);
      const uint8_t* d = (*src)->tensor_data(t);
      if (t.name == f16_tensor) {
        std::vector<uint8_t> h(t.n_elements() * 2);
        for (int64_t i = 0; i < t.n_elements(); ++i) {
          float f;
          std::memcpy(&f, d + i * 4, 4);
          uint16_t x = fp32_to_fp16(f);
          std::memcpy(h.data() + i * 2, &x, 2);
        }
        w.add_tensor(t.name, DType::F16, ne, h);
      } else {
        w.add_tensor(t.name, t.type, ne, std::vector<uint8_t>(d, d + t.bytes));
      }
    }
    std::string path = (dir / (name + ".gguf")).string();
    REQUIRE(w.write(path).ok());
    auto f = GgufFile::open(path);
    REQUIRE_MESSAGE(f.ok(), f.status().to_string());
    return LlamaModel::load(*f);
  };
  auto keep = [](const std::string&, GgufValue&) { return true; };

  auto arch = rewrite("arch", [](const std::string& k, GgufValue& v) {
    if (k == "general.architecture") v.s = "mamba";
    return true;
  }, "", "");
  REQUIRE_FALSE(arch.ok());
  CHECK(arch.status().code() == Code::unsupported);
  CHECK(arch.status().message().find("mamba") != std::string::npos);

  auto missing = rewrite("missing", keep, "blk.1.attn_v.weight", "");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == Code::not_found);
  CHECK(missing.status().message().find("blk.1.attn_v.weight") != std::string::npos);

  auto f16norm = rewrite("f16norm", keep, "", "blk.0.ffn_norm.weight");
  REQUIRE_FALSE(f16norm.ok());
  CHECK(f16norm.status().code() == Code::unsupported);
  CHECK(f16norm.status().message().find("blk.0.ffn_norm.weight") != std::string::npos);

  auto shape = rewrite("shape", [](const std::string& k, GgufValue& v) {
    if (k == "llama.feed_forward_length") v.u = 100;
    return true;
  }, "", "");
  REQUIRE_FALSE(shape.ok());
  CHECK(shape.status().code() == Code::corruption);
  CHECK(shape.status().message().find("ffn_gate") != std::string::npos);

  auto nokey = rewrite("nokey", [](const std::string& k, GgufValue&) {
    return k != "llama.block_count";
  }, "", "");
  REQUIRE_FALSE(nokey.ok());
  CHECK(nokey.status().message().find("llama.block_count") != std::string::npos);
}

TEST_CASE("engine: profile_ops times every op and changes no bit") {
  const std::string path = model_path(small_dense(DType::F16), "dense-f16");
  auto plain = make_engine(path, 2);
  CHECK(plain->op_profile() == nullptr);
  auto file = GgufFile::open(path);
  REQUIRE(file.ok());
  EngineOptions o;
  o.threads = 2;
  o.max_seqs = 4;
  o.profile_ops = true;
  auto profiled = Engine::create(*file, o);
  REQUIRE(profiled.ok());
  REQUIRE((*profiled)->op_profile() != nullptr);
  const auto prompt = prompt_of(40, 3);
  const GenerateResult a = run(*plain, prompt, 512), b = run(**profiled, prompt, 512);
  CHECK(a.tokens == b.tokens);
  CHECK(same_bits(a.logits, b.logits));
  // 40 prompt tokens in one forward, then 7 decode steps: 8 forwards of 2
  // layers, each with q, k, v (one group), o, gate and up (one group),
  // down, and the output matrix.
  const auto& t = (*profiled)->op_profile()->times();
  REQUIRE(t.count("attention"));
  CHECK(t.at("attention").calls == 8 * 2);
  CHECK(t.at("attention").rows == 2 * (40 + 7));
  REQUIRE(t.count("matmul 32000x64"));  // the output matrix, last token of each forward
  CHECK(t.at("matmul 32000x64").calls == 8);
  CHECK(t.at("matmul 32000x64").rows == 8);
  REQUIRE(t.count("matmul 128x64 x2"));  // gate and up, as one op
  CHECK(t.at("matmul 128x64 x2").calls == 8 * 2);
  CHECK(t.at("matmul 128x64 x2").rows == 2 * 2 * (40 + 7));
  REQUIRE(t.count("matmul 64x64+32x64+32x64"));  // q, k and v (2 kv heads)
  CHECK(t.at("matmul 64x64+32x64+32x64").calls == 8 * 2);
  REQUIRE(t.count("matmul 64x64"));  // o
  CHECK(t.at("matmul 64x64").calls == 8 * 2);
  CHECK_FALSE(t.count("matmul 128x64"));
  CHECK((*profiled)->op_profile()->total_seconds() > 0);
  (*profiled)->op_profile()->reset();
  CHECK((*profiled)->op_profile()->times().empty());
}
