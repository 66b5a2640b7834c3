// The deterministic test-model generator.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/make_model.h"

using namespace cleave;

namespace {

const std::string kLlamaVocab =
    std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";
const std::string kGpt2Vocab =
    std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-gpt-2.gguf";

std::string tmp_path(const std::string& name) {
  return "/tmp/cleave_test_make_model_" + std::to_string(::getpid()) + "_" + name;
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

ModelSpec small_dense(DType t) {
  ModelSpec s;
  s.dim = 64;
  s.n_layers = 2;
  s.n_heads = 4;
  s.n_kv_heads = 2;
  s.ffn = 96;
  s.context = 256;
  s.type = t;
  s.seed = 7;
  s.name = "tiny-dense";
  return s;
}

ModelSpec small_moe(DType t) {
  ModelSpec s = small_dense(t);
  s.n_experts = 4;
  s.n_experts_used = 2;
  s.ffn = 32;
  s.tied_output = true;
  s.name = "tiny-moe";
  return s;
}

std::vector<float> row_floats(const GgufFile& f, const GgufTensorInfo& t, int64_t row) {
  WeightView v = f.view(t);
  std::vector<float> out(static_cast<size_t>(v.cols));
  dequantize_row(v.type, static_cast<const uint8_t*>(v.data) + row * v.row_bytes, v.cols,
                 out.data());
  return out;
}

void check_shape(const GgufFile& f, const std::string& name, DType type, std::vector<int64_t> ne) {
  CAPTURE(name);
  const GgufTensorInfo* t = f.find_tensor(name);
  REQUIRE(t != nullptr);
  CHECK(t->type == type);
  CHECK(t->n_dims == ne.size());
  for (size_t d = 0; d < 4; ++d) CHECK(t->ne[d] == (d < ne.size() ? ne[d] : 1));
}

void check_model(const ModelSpec& s, const std::string& path, const GgufFile& vocab) {
  auto r = GgufFile::open(path);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  const GgufFile& f = **r;
  const int64_t nv = 32000, dim = s.dim, hd = s.dim / s.n_heads, ffn = s.ffn;
  CHECK(f.get_string("general.architecture").value() == "llama");
  CHECK(f.get_string("general.name").value() == s.name);
  CHECK(f.find("general.alignment")->value.type == GgufType::UINT32);
  CHECK(f.alignment() == 32);
  CHECK(f.find("llama.block_count")->value.type == GgufType::UINT32);
  CHECK(f.get_uint("llama.context_length").value() == uint64_t(s.context));
  CHECK(f.get_uint("llama.embedding_length").value() == uint64_t(s.dim));
  CHECK(f.get_uint("llama.block_count").value() == uint64_t(s.n_layers));
  CHECK(f.get_uint("llama.feed_forward_length").value() == uint64_t(s.ffn));
  CHECK(f.get_uint("llama.attention.head_count").value() == uint64_t(s.n_heads));
  CHECK(f.get_uint("llama.attention.head_count_kv").value() == uint64_t(s.n_kv_heads));
  CHECK(f.get_uint("llama.rope.dimension_count").value() == uint64_t(hd));
  CHECK(f.get_uint("llama.vocab_size").value() == uint64_t(nv));
  CHECK(f.get_float("llama.rope.freq_base").value() == doctest::Approx(s.rope_base));
  CHECK(f.find("llama.rope.freq_base")->value.type == GgufType::FLOAT32);
  CHECK(f.get_float("llama.attention.layer_norm_rms_epsilon").value() ==
        doctest::Approx(s.rms_eps));
  if (s.n_experts > 0) {
    CHECK(f.get_uint("llama.expert_count").value() == uint64_t(s.n_experts));
    CHECK(f.get_uint("llama.expert_used_count").value() == uint64_t(s.n_experts_used));
  } else {
    CHECK(f.find("llama.expert_count") == nullptr);
    CHECK(f.find("llama.expert_used_count") == nullptr);
  }
  // Every tokenizer.* key copied unchanged, and nothing else from the vocab.
  int copied = 0;
  for (const GgufKv& kv : vocab.metadata()) {
    if (kv.key.rfind("tokenizer.", 0) != 0) continue;
    CAPTURE(kv.key);
    const GgufKv* m = f.find(kv.key);
    REQUIRE(m != nullptr);
    CHECK(m->value.type == kv.value.type);
    CHECK(m->value.array_type == kv.value.array_type);
    CHECK(m->value.u == kv.value.u);
    CHECK(m->value.s == kv.value.s);
    CHECK(m->value.arr_s == kv.value.arr_s);
    CHECK(m->value.arr_f == kv.value.arr_f);
    CHECK(m->value.arr_i == kv.value.arr_i);
    ++copied;
  }
  CHECK(copied == 10);
  CHECK(f.find("general.file_type") == nullptr);

  // Tensors.
  const DType t = s.type;
  size_t per_layer = s.n_experts > 0 ? 10 : 9;
  CHECK(f.tensors().size() == 2 + (s.tied_output ? 0 : 1) + per_layer * s.n_layers);
  check_shape(f, "token_embd.weight", t, {dim, nv});
  check_shape(f, "output_norm.weight", DType::F32, {dim});
  if (s.tied_output) {
    CHECK(f.find_tensor("output.weight") == nullptr);
  } else {
    check_shape(f, "output.weight", t, {dim, nv});
  }
  for (int l = 0; l < s.n_layers; ++l) {
    std::string p = "blk." + std::to_string(l) + ".";
    check_shape(f, p + "attn_norm.weight", DType::F32, {dim});
    check_shape(f, p + "attn_q.weight", t, {dim, s.n_heads * hd});
    check_shape(f, p + "attn_k.weight", t, {dim, s.n_kv_heads * hd});
    check_shape(f, p + "attn_v.weight", t, {dim, s.n_kv_heads * hd});
    check_shape(f, p + "attn_output.weight", t, {s.n_heads * hd, dim});
    check_shape(f, p + "ffn_norm.weight", DType::F32, {dim});
    if (s.n_experts == 0) {
      check_shape(f, p + "ffn_gate.weight", t, {dim, ffn});
      check_shape(f, p + "ffn_up.weight", t, {dim, ffn});
      check_shape(f, p + "ffn_down.weight", t, {ffn, dim});
      CHECK(f.find_tensor(p + "ffn_gate_exps.weight") == nullptr);
    } else {
      const int64_t ne = s.n_experts;
      check_shape(f, p + "ffn_gate_inp.weight", DType::F32, {dim, ne});
      check_shape(f, p + "ffn_gate_exps.weight", t, {dim, ffn, ne});
      check_shape(f, p + "ffn_up_exps.weight", t, {dim, ffn, ne});
      check_shape(f, p + "ffn_down_exps.weight", t, {ffn, dim, ne});
      CHECK(f.find_tensor(p + "ffn_gate.weight") == nullptr);
    }
  }
}

}  // namespace

TEST_CASE("make_model: dense and MoE models in every weight type") {
  auto vocab = GgufFile::open(kLlamaVocab);
  REQUIRE(vocab.ok());
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0}) {
    for (bool moe : {false, true}) {
      ModelSpec s = moe ? small_moe(t) : small_dense(t);
      std::string tname = dtype_name(t);
      CAPTURE(tname);
      CAPTURE(moe);
      std::string p = tmp_path(std::string(dtype_name(t)) + (moe ? "_moe" : "_dense") + ".gguf");
      Status st = write_test_model(s, kLlamaVocab, p);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
      check_model(s, p, **vocab);
      std::remove(p.c_str());
    }
  }
}

TEST_CASE("make_model: weights follow the documented formula") {
  ModelSpec s = small_moe(DType::F32);
  s.tied_output = false;
  std::string p = tmp_path("formula.gguf");
  REQUIRE(write_test_model(s, kLlamaVocab, p).ok());
  auto r = GgufFile::open(p);
  REQUIRE(r.ok());
  const GgufFile& f = **r;
  auto at = [&](const char* name, uint64_t j) {
    const GgufTensorInfo* t = f.find_tensor(name);
    REQUIRE(t != nullptr);
    return reinterpret_cast<const float*>(f.tensor_data(*t))[j];
  };
  const float isd = 1.0f / std::sqrt(64.0f), isf = 1.0f / std::sqrt(32.0f);
  for (uint64_t j : {0ull, 1ull, 63ull, 64ull, 12345ull, 64ull * 32000 - 1}) {
    CHECK(at("token_embd.weight", j) == test_weight_uniform(7, "token_embd.weight", j));
    CHECK(at("output.weight", j) == isd * test_weight_uniform(7, "output.weight", j));
  }
  for (uint64_t j : {0ull, 5ull, 63ull}) {
    CHECK(at("output_norm.weight", j) ==
          1.0f + 0.1f * test_weight_uniform(7, "output_norm.weight", j));
    CHECK(at("blk.1.attn_norm.weight", j) ==
          1.0f + 0.1f * test_weight_uniform(7, "blk.1.attn_norm.weight", j));
    CHECK(at("blk.0.attn_q.weight", j) == isd * test_weight_uniform(7, "blk.0.attn_q.weight", j));
    CHECK(at("blk.0.ffn_gate_inp.weight", j) ==
          isd * test_weight_uniform(7, "blk.0.ffn_gate_inp.weight", j));
  }
  // 3-D expert tensors: flat index across experts.
  const uint64_t last = 32ull * 64 * 4 - 1;
  CHECK(at("blk.1.ffn_down_exps.weight", last) ==
        isf * test_weight_uniform(7, "blk.1.ffn_down_exps.weight", last));
  CHECK(at("blk.1.ffn_up_exps.weight", last) ==
        isd * test_weight_uniform(7, "blk.1.ffn_up_exps.weight", last));

  // Uniform in [-1, 1) and not degenerate: mean ~ 0, spread ~ 1/sqrt(3).
  double sum = 0, sq = 0, mn = 1, mx = -1;
  const int n = 100000;
  for (int j = 0; j < n; ++j) {
    float u = test_weight_uniform(3, "x", static_cast<uint64_t>(j));
    sum += u;
    sq += double(u) * u;
    mn = std::min<double>(mn, u);
    mx = std::max<double>(mx, u);
  }
  CHECK(std::fabs(sum / n) < 0.01);
  CHECK(std::sqrt(sq / n) == doctest::Approx(1.0 / std::sqrt(3.0)).epsilon(0.01));
  CHECK(mn >= -1.0);
  CHECK(mx < 1.0);
  CHECK(mn < -0.999);
  CHECK(mx > 0.999);
  std::remove(p.c_str());
}

TEST_CASE("make_model: same seed gives identical bytes, another seed differs") {
  ModelSpec s = small_dense(DType::F16);
  s.tied_output = true;
  std::string a = tmp_path("seed_a.gguf"), b = tmp_path("seed_b.gguf"), c = tmp_path("seed_c.gguf");
  REQUIRE(write_test_model(s, kLlamaVocab, a).ok());
  REQUIRE(write_test_model(s, kLlamaVocab, b).ok());
  s.seed = 8;
  REQUIRE(write_test_model(s, kLlamaVocab, c).ok());
  auto ba = read_bytes(a), bb = read_bytes(b), bc = read_bytes(c);
  CHECK(!ba.empty());
  CHECK(ba == bb);
  REQUIRE(ba.size() == bc.size());  // same layout
  CHECK(ba != bc);
  // Differs in the weights, not just somewhere: compare one tensor.
  auto fa = GgufFile::open(a), fc = GgufFile::open(c);
  REQUIRE(fa.ok());
  REQUIRE(fc.ok());
  const auto* ta = (*fa)->find_tensor("blk.0.attn_q.weight");
  const auto* tc = (*fc)->find_tensor("blk.0.attn_q.weight");
  CHECK(std::memcmp((*fa)->tensor_data(*ta), (*fc)->tensor_data(*tc), ta->bytes) != 0);
  for (auto& p : {a, b, c}) std::remove(p.c_str());
}

TEST_CASE("make_model: F16, BF16 and Q8_0 data match the F32 model's values") {
  ModelSpec s = small_dense(DType::F32);
  s.tied_output = true;
  std::string p32 = tmp_path("cmp_f32.gguf");
  REQUIRE(write_test_model(s, kLlamaVocab, p32).ok());
  auto f32 = GgufFile::open(p32);
  REQUIRE(f32.ok());
  for (DType t : {DType::F16, DType::BF16, DType::Q8_0}) {
    std::string tname = dtype_name(t);
    CAPTURE(tname);
    s.type = t;
    std::string p = tmp_path(std::string("cmp_") + dtype_name(t) + ".gguf");
    REQUIRE(write_test_model(s, kLlamaVocab, p).ok());
    auto fq = GgufFile::open(p);
    REQUIRE(fq.ok());
    for (const char* name : {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight",
                             "blk.1.attn_output.weight", "blk.0.ffn_norm.weight"}) {
      std::string tensor = name;
      CAPTURE(tensor);
      const GgufTensorInfo* ta = (*f32)->find_tensor(name);
      const GgufTensorInfo* tb = (*fq)->find_tensor(name);
      REQUIRE(ta);
      REQUIRE(tb);
      const int64_t rows = ta->ne[1];
      double worst = 0;
      for (int64_t r = 0; r < rows; r += std::max<int64_t>(1, rows / 50)) {
        auto a = row_floats(**f32, *ta, r);
        auto b = row_floats(**fq, *tb, r);
        for (size_t c = 0; c < a.size(); ++c) {
          double rel;
          if (tb->type == DType::Q8_0) {
            // Within half a quantisation step (block max / 127) plus the
            // rounding of the fp16 scale (|q| <= 127 times 2^-11 of d).
            float amax = 0;
            size_t b0 = c / 32 * 32;
            for (size_t k = b0; k < b0 + 32; ++k) amax = std::max(amax, std::fabs(a[k]));
            rel = std::fabs(a[c] - b[c]) / (amax * (0.5 / 127.0 + 1.0 / 2048) * 1.001 + 1e-6);
          } else {
            double tol = tb->type == DType::F16 ? 1.0 / 2048 : 1.0 / 256;  // half an ulp, relative
            rel = std::fabs(a[c] - b[c]) / (std::fabs(a[c]) * tol + 1e-7);
          }
          worst = std::max(worst, rel);
        }
      }
      CHECK(worst <= 1.0);
    }
    std::remove(p.c_str());
  }
  std::remove(p32.c_str());
}

TEST_CASE("make_model: the gpt-2 vocab is copied too") {
  ModelSpec s = small_dense(DType::BF16);
  s.dim = 32;
  s.n_layers = 1;
  s.tied_output = true;
  std::string p = tmp_path("gpt2.gguf");
  Status st = write_test_model(s, kGpt2Vocab, p);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  auto r = GgufFile::open(p);
  REQUIRE(r.ok());
  CHECK((*r)->get_string("tokenizer.ggml.model").value() == "gpt2");
  CHECK((*r)->get_uint("llama.vocab_size").value() == 50257);
  CHECK((*r)->get_string_array("tokenizer.ggml.merges")->size() == 50000);
  CHECK((*r)->get_uint("tokenizer.ggml.eos_token_id").value() == 50256);
  CHECK((*r)->find_tensor("token_embd.weight")->ne[1] == 50257);
  std::remove(p.c_str());
}

TEST_CASE("make_model: invalid specs are rejected naming the field") {
  auto expect_bad = [](ModelSpec s, const std::string& field, const std::string& value) {
    CAPTURE(field);
    Status st = validate_spec(s);
    CHECK(st.code() == Code::invalid_argument);
    CHECK(st.message().find(field + " = " + value) != std::string::npos);
    std::string p = tmp_path("never.gguf");
    Status w = write_test_model(s, kLlamaVocab, p);
    CHECK(w.code() == Code::invalid_argument);
    CHECK(::access(p.c_str(), F_OK) != 0);
  };
  CHECK(validate_spec(ModelSpec{}).ok());
  CHECK(validate_spec(small_moe(DType::Q8_0)).ok());
  ModelSpec s;
  s = {};
  s.dim = 0;
  expect_bad(s, "dim", "0");
  s = {};
  s.n_layers = -1;
  expect_bad(s, "n_layers", "-1");
  s = {};
  s.n_heads = 0;
  expect_bad(s, "n_heads", "0");
  s = {};
  s.n_kv_heads = 0;
  expect_bad(s, "n_kv_heads", "0");
  s = {};
  s.ffn = 0;
  expect_bad(s, "ffn", "0");
  s = {};
  s.context = 0;
  expect_bad(s, "context", "0");
  s = {};
  s.dim = 290;
  expect_bad(s, "dim", "290");  // not a multiple of 6 heads
  s = {};
  s.n_kv_heads = 4;
  expect_bad(s, "n_kv_heads", "4");  // 6 % 4 != 0
  s = {};
  s.dim = 54;
  s.n_heads = 6;
  s.n_kv_heads = 6;
  expect_bad(s, "dim", "54");  // head_dim 9
  s = {};
  s.n_experts = -2;
  expect_bad(s, "n_experts", "-2");
  s = {};
  s.n_experts_used = 2;
  expect_bad(s, "n_experts_used", "2");  // dense
  s = {};
  s.n_experts = 4;
  s.n_experts_used = 5;
  expect_bad(s, "n_experts_used", "5");
  s = {};
  s.n_experts = 4;
  s.n_experts_used = 0;
  expect_bad(s, "n_experts_used", "0");
  s = {};
  s.rope_base = 0;
  expect_bad(s, "rope_base", "0");
  s = {};
  s.rms_eps = -1;
  expect_bad(s, "rms_eps", "-1");
  s = {};
  s.rms_eps = NAN;
  expect_bad(s, "rms_eps", "nan");
  s = {};
  s.type = DType::Q8_0;
  s.dim = 48;
  s.n_heads = 4;
  s.n_kv_heads = 4;
  expect_bad(s, "dim", "48");
  s = {};
  s.type = DType::Q8_0;
  s.ffn = 100;
  expect_bad(s, "ffn", "100");
  s = {};
  s.type = static_cast<DType>(2);
  expect_bad(s, "type", "2");
  s = {};
  s.name = "";
  expect_bad(s, "name", "''");
  s = {};
  s.dim = 1 << 20;
  s.n_heads = 1 << 10;
  s.n_kv_heads = 1 << 10;
  s.ffn = 1 << 20;
  expect_bad(s, "n_layers", "6");  // too large
}

TEST_CASE("make_model: vocab problems and dtype names") {
  ModelSpec s = small_dense(DType::F32);
  Status st = write_test_model(s, "/nonexistent/vocab.gguf", tmp_path("x.gguf"));
  CHECK(st.code() == Code::io_error);
  CHECK(st.message().find("/nonexistent/vocab.gguf") != std::string::npos);
  // A valid GGUF without tokenizer.ggml.tokens.
  std::string novocab = tmp_path("novocab.gguf");
  GgufWriter w;
  w.set_string("tokenizer.ggml.model", "llama");
  REQUIRE(w.write(novocab).ok());
  st = write_test_model(s, novocab, tmp_path("y.gguf"));
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("tokenizer.ggml.tokens") != std::string::npos);
  std::remove(novocab.c_str());

  CHECK(dtype_from_name("f32").value() == DType::F32);
  CHECK(dtype_from_name("F16").value() == DType::F16);
  CHECK(dtype_from_name("Bf16").value() == DType::BF16);
  CHECK(dtype_from_name("Q8_0").value() == DType::Q8_0);
  auto bad = dtype_from_name("q4_0");
  CHECK(bad.status().code() == Code::invalid_argument);
  CHECK(bad.status().message().find("q4_0") != std::string::npos);
}
