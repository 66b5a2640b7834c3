// GGUF reader/writer: round trip, the real vocab files, and corrupted images.
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
#include "tests/gguf_util.h"

using namespace cleave;

namespace {

std::string tmp_path(const std::string& name) {
  return "/tmp/cleave_test_gguf_" + std::to_string(::getpid()) + "_" + name;
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

// Byte-level builder of GGUF images.
struct B {
  std::vector<uint8_t> b;
  template <class T>
  B& put(T v) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
    return *this;
  }
  B& u8(uint8_t v) { return put(v); }
  B& u32(uint32_t v) { return put(v); }
  B& u64(uint64_t v) { return put(v); }
  B& raw(const std::string& s) {
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  B& str(const std::string& s) { return u64(s.size()).raw(s); }
  B& cat(const B& o) {
    b.insert(b.end(), o.b.begin(), o.b.end());
    return *this;
  }
  B& pad(size_t a) {
    while (b.size() % a) b.push_back(0);
    return *this;
  }
  B& zeros(size_t n) {
    b.insert(b.end(), n, 0);
    return *this;
  }
};

B header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
  B h;
  h.raw("GGUF").u32(version).u64(n_tensors).u64(n_kv);
  return h;
}
B kv_u32(const std::string& k, uint32_t v) {
  return B().str(k).u32(4).u32(v);
}
B kv_str(const std::string& k, const std::string& v) {
  return B().str(k).u32(8).str(v);
}
B tinfo(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
  B t;
  t.str(name).u32(static_cast<uint32_t>(ne.size()));
  for (uint64_t d : ne) t.u64(d);
  t.u32(type).u64(offset);
  return t;
}
// header + kvs + infos, padded to 32, then `data_bytes` zero bytes.
std::vector<uint8_t> image(const std::vector<B>& kvs, const std::vector<B>& infos,
                           size_t data_bytes, size_t align = 32) {
  B img = header(infos.size(), kvs.size());
  for (const B& k : kvs) img.cat(k);
  for (const B& t : infos) img.cat(t);
  img.pad(align).zeros(data_bytes);
  return img.b;
}

Status parse_status(const std::vector<uint8_t>& img) {
  auto r = GgufFile::parse(img.data(), img.size());
  return r.ok() ? Status::Ok() : r.status();
}

void expect_corrupt(const std::vector<uint8_t>& img, const std::string& needle) {
  Status st = parse_status(img);
  INFO("expected substring: " << needle << "; got: " << st.to_string());
  CHECK(st.code() == Code::corruption);
  CHECK(st.message().rfind("gguf: ", 0) == 0);
  CHECK(st.message().find(needle) != std::string::npos);
}

using cleave::testing::gguf_scalar;

std::vector<uint8_t> bytes_of(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
  return v;
}

// A writer with every value type and four tensors of different types.
GgufWriter full_writer() {
  GgufWriter w;
  w.set("u8", gguf_scalar(GgufType::UINT8, 200));
  w.set("i8", gguf_scalar(GgufType::INT8, 0, -100));
  w.set("u16", gguf_scalar(GgufType::UINT16, 60000));
  w.set("i16", gguf_scalar(GgufType::INT16, 0, -30000));
  w.set_u32("u32", 4000000000u);
  w.set_i32("i32", -2000000000);
  w.set_f32("f32", 1.5f);
  w.set_bool("bool_t", true);
  w.set_bool("bool_f", false);
  w.set_string("str", "hello \xe2\x9c\x93");
  w.set_string("empty_str", "");
  w.set("u64", gguf_scalar(GgufType::UINT64, 0xFFFFFFFFFFFFFFF0ull));
  w.set("i64", gguf_scalar(GgufType::INT64, 0, INT64_MIN + 5));
  w.set("f64", gguf_scalar(GgufType::FLOAT64, 0, 0, 3.141592653589793));
  w.set_string_array("arr_str", {"a", "", "ccc"});
  w.set_f32_array("arr_f32", {0.5f, -2.25f});
  w.set_i32_array("arr_i32", {1, -2, 3});
  GgufValue a;
  a.type = GgufType::ARRAY;
  a.array_type = GgufType::UINT8;
  a.arr_u = {1, 2, 255};
  w.set("arr_u8", a);
  a = GgufValue();
  a.type = GgufType::ARRAY;
  a.array_type = GgufType::BOOL;
  a.arr_u = {1, 0, 1};
  w.set("arr_bool", a);
  a = GgufValue();
  a.type = GgufType::ARRAY;
  a.array_type = GgufType::INT64;
  a.arr_i = {INT64_MAX, -1};
  w.set("arr_i64", a);
  a = GgufValue();
  a.type = GgufType::ARRAY;
  a.array_type = GgufType::FLOAT64;
  a.arr_f = {1e300, -0.125};
  w.set("arr_f64", a);
  a = GgufValue();
  a.type = GgufType::ARRAY;
  a.array_type = GgufType::UINT64;
  a.arr_u = {};
  w.set("arr_empty", a);
  w.add_tensor("t_f32", DType::F32, {4, 3}, bytes_of(48, 1));
  w.add_tensor("t_f16", DType::F16, {8, 2}, bytes_of(32, 2));
  w.add_tensor("t_q8", DType::Q8_0, {64, 2, 1}, bytes_of(2 * 2 * 34, 3));
  w.add_tensor("t_bf16", DType::BF16, {16, 1, 1, 2}, bytes_of(64, 4));  // 64: no trailing pad
  return w;
}

std::vector<uint8_t> full_image() {
  std::string p = tmp_path("full.gguf");
  REQUIRE(full_writer().write(p).ok());
  auto img = read_bytes(p);
  std::remove(p.c_str());
  return img;
}

}  // namespace

TEST_CASE("gguf: writer/reader round trip of every value type and tensor type") {
  std::string p = tmp_path("rt.gguf");
  REQUIRE(full_writer().write(p).ok());
  auto r = GgufFile::open(p);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  const GgufFile& f = **r;
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.metadata().size() == 22);
  CHECK(f.data_offset() % 32 == 0);

  CHECK(f.get_uint("u8").value() == 200);
  CHECK(f.find("u8")->value.type == GgufType::UINT8);
  CHECK(f.get_int("i8").value() == -100);
  CHECK(f.find("i8")->value.type == GgufType::INT8);
  CHECK(f.get_uint("u16").value() == 60000);
  CHECK(f.get_int("i16").value() == -30000);
  CHECK(f.get_uint("u32").value() == 4000000000u);
  CHECK(f.get_int("u32").value() == 4000000000);
  CHECK(f.get_int("i32").value() == -2000000000);
  CHECK(f.get_float("f32").value() == 1.5);
  CHECK(f.find("f32")->value.type == GgufType::FLOAT32);
  CHECK(f.get_bool("bool_t").value() == true);
  CHECK(f.get_bool("bool_f").value() == false);
  CHECK(f.get_string("str").value() == "hello \xe2\x9c\x93");
  CHECK(f.get_string("empty_str").value().empty());
  CHECK(f.get_uint("u64").value() == 0xFFFFFFFFFFFFFFF0ull);
  CHECK(f.get_int("i64").value() == INT64_MIN + 5);
  CHECK(f.get_float("f64").value() == 3.141592653589793);
  CHECK(f.get_string_array("arr_str").value() == std::vector<std::string>{"a", "", "ccc"});
  CHECK(f.get_float_array("arr_f32").value() == std::vector<float>{0.5f, -2.25f});
  CHECK(f.get_int_array("arr_i32").value() == std::vector<int32_t>{1, -2, 3});
  CHECK(f.find("arr_i32")->value.array_type == GgufType::INT32);
  CHECK(f.get_int_array("arr_u8").value() == std::vector<int32_t>{1, 2, 255});
  CHECK(f.find("arr_u8")->value.array_type == GgufType::UINT8);
  CHECK(f.find("arr_bool")->value.arr_u == std::vector<uint64_t>{1, 0, 1});
  CHECK(f.find("arr_bool")->value.array_type == GgufType::BOOL);
  CHECK(f.find("arr_i64")->value.arr_i == std::vector<int64_t>{INT64_MAX, -1});
  CHECK(f.find("arr_f64")->value.arr_f == std::vector<double>{1e300, -0.125});
  CHECK(f.get_float_array("arr_f64").value()[1] == -0.125f);
  CHECK(f.find("arr_empty")->value.array_len() == 0);
  CHECK(f.find("arr_empty")->value.array_type == GgufType::UINT64);
  CHECK(f.find("arr_str")->value.array_len() == 3);
  // Key order is preserved.
  CHECK(f.metadata()[0].key == "u8");
  CHECK(f.metadata().back().key == "arr_empty");

  REQUIRE(f.tensors().size() == 4);
  struct Want {
    const char* name;
    DType type;
    uint32_t n_dims;
    int64_t ne[4];
    size_t bytes;
    uint8_t seed;
  } want[] = {{"t_f32", DType::F32, 2, {4, 3, 1, 1}, 48, 1},
              {"t_f16", DType::F16, 2, {8, 2, 1, 1}, 32, 2},
              {"t_q8", DType::Q8_0, 3, {64, 2, 1, 1}, 136, 3},
              {"t_bf16", DType::BF16, 4, {16, 1, 1, 2}, 64, 4}};
  for (size_t k = 0; k < 4; ++k) {
    const GgufTensorInfo& t = f.tensors()[k];
    CAPTURE(t.name);
    CHECK(t.name == want[k].name);
    CHECK(t.type == want[k].type);
    CHECK(t.n_dims == want[k].n_dims);
    for (int d = 0; d < 4; ++d) CHECK(t.ne[d] == want[k].ne[d]);
    CHECK(t.bytes == want[k].bytes);
    CHECK(t.offset % 32 == 0);
    CHECK(f.find_tensor(want[k].name) == &t);
    auto expect = bytes_of(want[k].bytes, want[k].seed);
    CHECK(std::memcmp(f.tensor_data(t), expect.data(), expect.size()) == 0);
  }
  CHECK(f.find_tensor("nope") == nullptr);
  WeightView v = f.view(*f.find_tensor("t_q8"));
  CHECK(v.type == DType::Q8_0);
  CHECK(v.rows == 2);
  CHECK(v.cols == 64);
  CHECK(v.row_bytes == 68);
  CHECK(v.data == f.tensor_data(*f.find_tensor("t_q8")));
  v = f.view(*f.find_tensor("t_bf16"));
  CHECK(v.rows == 2);
  CHECK(v.cols == 16);
  CHECK(v.row_bytes == 32);

  // parse() of the same bytes agrees with open().
  auto img = read_bytes(p);
  auto r2 = GgufFile::parse(img.data(), img.size());
  REQUIRE(r2.ok());
  CHECK((*r2)->tensors().size() == 4);
  CHECK((*r2)->data_offset() == f.data_offset());
  std::remove(p.c_str());
}

TEST_CASE("gguf: writer honours general.alignment and pads tensor data") {
  GgufWriter w;
  w.set_u32("general.alignment", 64);
  w.add_tensor("a", DType::F32, {3}, bytes_of(12, 5));
  w.add_tensor("b", DType::F16, {5}, bytes_of(10, 6));
  std::string p = tmp_path("align.gguf");
  REQUIRE(w.write(p).ok());
  auto r = GgufFile::open(p);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  CHECK((*r)->alignment() == 64);
  CHECK((*r)->data_offset() % 64 == 0);
  CHECK((*r)->tensors()[0].offset == 0);
  CHECK((*r)->tensors()[1].offset == 64);
  CHECK((*r)->file_size() == (*r)->data_offset() + 128);
  std::remove(p.c_str());
}

TEST_CASE("gguf: writer rejects bad input and unwritable paths") {
  {
    GgufWriter w;
    w.add_tensor("a", DType::F32, {4}, bytes_of(15, 0));
    Status st = w.write(tmp_path("bad1.gguf"));
    CHECK(st.code() == Code::invalid_argument);
    CHECK(st.message().find("'a'") != std::string::npos);
  }
  {
    GgufWriter w;
    w.add_tensor("a", DType::F32, {4}, bytes_of(16, 0));
    w.add_tensor("a", DType::F32, {4}, bytes_of(16, 0));
    CHECK(w.write(tmp_path("bad2.gguf")).code() == Code::invalid_argument);
  }
  {
    GgufWriter w;
    w.set_u32("general.alignment", 24);
    CHECK(w.write(tmp_path("bad3.gguf")).code() == Code::invalid_argument);
  }
  {
    GgufWriter w;
    Status st = w.write("/nonexistent_dir_cleave/x.gguf");
    CHECK(st.code() == Code::io_error);
    CHECK(st.message().find("/nonexistent_dir_cleave/x.gguf") != std::string::npos);
  }
}

TEST_CASE("gguf: open() failures are io_error naming the path") {
  auto r = GgufFile::open("/nonexistent_cleave_file.gguf");
  REQUIRE(!r.ok());
  CHECK(r.status().code() == Code::io_error);
  CHECK(r.status().message().find("/nonexistent_cleave_file.gguf") != std::string::npos);
  CHECK(r.status().message().find("No such file") != std::string::npos);
  // A corrupt file on disk: corruption, with the path appended.
  std::string p = tmp_path("corrupt.gguf");
  {
    std::ofstream o(p, std::ios::binary);
    o << "GGUF";
  }
  auto r2 = GgufFile::open(p);
  REQUIRE(!r2.ok());
  CHECK(r2.status().code() == Code::corruption);
  CHECK(r2.status().message().find(p) != std::string::npos);
  std::remove(p.c_str());
  // An empty file.
  { std::ofstream o(p, std::ios::binary); }
  auto r3 = GgufFile::open(p);
  REQUIRE(!r3.ok());
  CHECK(r3.status().message().find("empty file") != std::string::npos);
  std::remove(p.c_str());
}

TEST_CASE("gguf: the real llama-spm vocab file") {
  auto r =
      GgufFile::open(std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf");
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  const GgufFile& f = **r;
  CHECK(f.tensors().empty());
  CHECK(f.get_string("general.architecture").value() == "llama");
  CHECK(f.get_string("tokenizer.ggml.model").value() == "llama");
  auto tokens = f.get_string_array("tokenizer.ggml.tokens");
  REQUIRE(tokens.ok());
  CHECK(tokens->size() == 32000);
  CHECK((*tokens)[0] == "<unk>");
  CHECK((*tokens)[1] == "<s>");
  CHECK((*tokens)[2] == "</s>");
  auto scores = f.get_float_array("tokenizer.ggml.scores");
  REQUIRE(scores.ok());
  CHECK(scores->size() == 32000);
  auto types = f.get_int_array("tokenizer.ggml.token_type");
  REQUIRE(types.ok());
  CHECK(types->size() == 32000);
  CHECK((*types)[0] == 2);
  CHECK(f.get_uint("tokenizer.ggml.bos_token_id").value() == 1);
  CHECK(f.get_uint("tokenizer.ggml.eos_token_id").value() == 2);
  CHECK(f.get_bool("tokenizer.ggml.add_bos_token").value() == true);
  CHECK(f.get_uint("llama.vocab_size").value() == 32000);
  CHECK(std::fabs(f.get_float("llama.attention.layer_norm_rms_epsilon").value() - 1e-5) < 1e-9);
}

TEST_CASE("gguf: the real gpt-2 vocab file") {
  auto r = GgufFile::open(std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-gpt-2.gguf");
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  const GgufFile& f = **r;
  CHECK(f.tensors().empty());
  CHECK(f.get_string("tokenizer.ggml.model").value() == "gpt2");
  auto tokens = f.get_string_array("tokenizer.ggml.tokens");
  REQUIRE(tokens.ok());
  CHECK(tokens->size() == 50257);
  CHECK((*tokens)[0] == "!");
  auto merges = f.get_string_array("tokenizer.ggml.merges");
  REQUIRE(merges.ok());
  CHECK(merges->size() == 50000);
  CHECK((*merges)[2] == "h e");
  CHECK(f.get_int_array("tokenizer.ggml.token_type")->size() == 50257);
  CHECK(f.get_uint("tokenizer.ggml.eos_token_id").value() == 50256);
  CHECK(f.find("tokenizer.ggml.scores") == nullptr);
}

TEST_CASE("gguf: getters reject absent keys and wrong types, naming both types") {
  auto img = full_image();
  auto r = GgufFile::parse(img.data(), img.size());
  REQUIRE(r.ok());
  const GgufFile& f = **r;
  auto expect_invalid = [](const Status& st, std::vector<std::string> needles) {
    INFO(st.to_string());
    CHECK(st.code() == Code::invalid_argument);
    CHECK(st.message().rfind("gguf: ", 0) == 0);
    for (const auto& n : needles) CHECK(st.message().find(n) != std::string::npos);
  };
  auto nf = f.get_string("missing.key");
  CHECK(nf.status().code() == Code::not_found);
  CHECK(nf.status().message().find("missing.key") != std::string::npos);
  CHECK(f.get_uint("missing").status().code() == Code::not_found);
  CHECK(f.get_int_array("missing").status().code() == Code::not_found);

  expect_invalid(f.get_string("u32").status(), {"'u32'", "UINT32", "STRING"});
  expect_invalid(f.get_uint("str").status(), {"'str'", "STRING", "unsigned"});
  expect_invalid(f.get_uint("i32").status(), {"'i32'", "negative", "-2000000000"});
  expect_invalid(f.get_int("u64").status(), {"'u64'", "INT64"});
  expect_invalid(f.get_int("f32").status(), {"FLOAT32", "integer"});
  expect_invalid(f.get_float("u32").status(), {"UINT32", "FLOAT32"});
  expect_invalid(f.get_bool("u8").status(), {"UINT8", "BOOL"});
  expect_invalid(f.get_string_array("arr_i32").status(), {"ARRAY of INT32", "ARRAY of STRING"});
  expect_invalid(f.get_string_array("str").status(), {"STRING", "ARRAY of STRING"});
  expect_invalid(f.get_float_array("arr_i32").status(), {"ARRAY of INT32", "FLOAT32"});
  expect_invalid(f.get_int_array("arr_f32").status(), {"ARRAY of FLOAT32", "integer"});
  expect_invalid(f.get_int_array("arr_i64").status(), {"'arr_i64'", "INT32", "element 0"});
  expect_invalid(f.get_int_array("u32").status(), {"UINT32", "ARRAY"});
  // Integer getters accept any integer type that fits.
  CHECK(f.get_uint("i8").status().code() == Code::invalid_argument);  // negative
  CHECK(f.get_uint("u8").value() == 200);
  CHECK(f.get_int("u16").value() == 60000);
}

TEST_CASE("gguf: minimal images parse (builder sanity)") {
  // The corruption cases below mutate these; they must be valid as built.
  CHECK(parse_status(image({}, {}, 0)).ok());
  CHECK(parse_status(header(0, 0).b).ok());  // vocab-only: no padding needed
  CHECK(parse_status(image({kv_u32("a", 1), kv_str("b", "x")}, {tinfo("t", {32, 2}, 8, 0)}, 68))
            .ok());
  CHECK(parse_status(image({}, {tinfo("t", {4}, 0, 0), tinfo("u", {4}, 0, 32)}, 48)).ok());
  CHECK(parse_status(header(0, 0, 2).b).ok());  // v2 has the same layout
}

TEST_CASE("gguf: corrupted images are rejected with a message naming the problem") {
  SUBCASE("empty file") {
    expect_corrupt({}, "empty file");
  }
  SUBCASE("truncated magic") {
    expect_corrupt({'G', 'G'}, "truncated reading magic");
  }
  SUBCASE("truncated header") {
    B h;
    h.raw("GGUF").u32(3).u32(0);
    expect_corrupt(h.b, "truncated reading tensor count at offset 8");
  }
  SUBCASE("truncated header n_kv") {
    B h;
    h.raw("GGUF").u32(3).u64(0).u32(0);
    expect_corrupt(h.b, "truncated reading metadata count");
  }
  SUBCASE("bad magic") {
    auto img = image({}, {}, 0);
    img[3] = 'X';
    expect_corrupt(img, "bad magic 47 47 55 58");
  }
  SUBCASE("version 1") {
    expect_corrupt(header(0, 0, 1).b, "unsupported version 1");
  }
  SUBCASE("version 99") {
    expect_corrupt(header(0, 0, 99).b, "unsupported version 99");
  }
  SUBCASE("huge n_kv") {
    auto img = header(0, 1ull << 40).cat(kv_u32("a", 1)).b;
    expect_corrupt(img, "n_kv 1099511627776 is too large");
  }
  SUBCASE("huge n_tensors") {
    auto img = header(1ull << 40, 0).zeros(64).b;
    expect_corrupt(img, "n_tensors 1099511627776 is too large");
  }
  SUBCASE("n_tensors too large for what is left after the metadata") {
    auto img = header(2, 1).cat(kv_str("k", std::string(64, 'x'))).b;
    expect_corrupt(img, "bytes left after the metadata");
  }
  SUBCASE("huge key length") {
    auto img = header(0, 1).u64(1ull << 40).u32(4).u32(0).b;
    expect_corrupt(img, "key length 1099511627776 at offset 24 exceeds the limit 65536");
  }
  SUBCASE("huge string value length") {
    auto img = header(0, 1).str("k").u32(8).u64(1ull << 30).zeros(16).b;
    expect_corrupt(img, "length 1073741824");
    expect_corrupt(img, "exceeds the limit 16777216");
  }
  SUBCASE("truncated string") {
    auto img = header(0, 1).u64(100).raw("general.al").b;
    expect_corrupt(img, "truncated reading key of 100 bytes at offset 32");
  }
  SUBCASE("truncated string value") {
    auto img = header(0, 1).str("k").u32(8).u64(20).raw("abc").b;
    expect_corrupt(img, "truncated reading value of key 'k'");
  }
  SUBCASE("truncated scalar value") {
    auto img = header(0, 1).str("k").u32(10).u32(7).b;
    expect_corrupt(img, "truncated reading value of key 'k'");
  }
  SUBCASE("huge array count") {
    auto img = header(0, 1).str("arr").u32(9).u32(4).u64(1ull << 40).zeros(32).b;
    expect_corrupt(img, "array count 1099511627776");
  }
  SUBCASE("array count too large for the remaining bytes") {
    // 10 strings need >= 80 bytes; only 40 are left.
    auto img = header(0, 1).str("arr").u32(9).u32(8).u64(10).zeros(40).b;
    expect_corrupt(img, "array count 10");
  }
  SUBCASE("unknown value type") {
    auto img = header(0, 1).str("k").u32(13).u32(0).b;
    expect_corrupt(img, "unknown value type 13");
  }
  SUBCASE("unknown array element type") {
    auto img = header(0, 1).str("k").u32(9).u32(77).u64(1).zeros(8).b;
    expect_corrupt(img, "unknown array element type 77");
  }
  SUBCASE("nested array") {
    auto img = header(0, 1).str("k").u32(9).u32(9).u64(1).u32(4).u64(1).u32(5).b;
    expect_corrupt(img, "nested array");
  }
  SUBCASE("bool not 0 or 1") {
    auto img = header(0, 1).str("flag").u32(7).u8(2).b;
    expect_corrupt(img, "bool value 2");
  }
  SUBCASE("duplicate key") {
    expect_corrupt(image({kv_u32("dup", 1), kv_u32("dup", 2)}, {}, 0), "duplicate key 'dup'");
  }
  SUBCASE("alignment not a power of two") {
    expect_corrupt(image({kv_u32("general.alignment", 24)}, {}, 0),
                   "general.alignment 24 is not a positive power of two");
  }
  SUBCASE("alignment zero") {
    expect_corrupt(image({kv_u32("general.alignment", 0)}, {}, 0),
                   "general.alignment 0 is not a positive power of two");
  }
  SUBCASE("alignment of wrong type") {
    expect_corrupt(image({kv_str("general.alignment", "32")}, {}, 0),
                   "general.alignment has type STRING");
    auto f = B().str("general.alignment").u32(6).put<float>(32.f);
    expect_corrupt(image({f}, {}, 0), "general.alignment has type FLOAT32");
  }
  SUBCASE("n_dims 0") {
    expect_corrupt(image({}, {tinfo("t", {}, 0, 0).zeros(8)}, 64), "tensor 't' has n_dims 0");
  }
  SUBCASE("n_dims 5") {
    expect_corrupt(image({}, {tinfo("t", {1, 1, 1, 1, 1}, 0, 0)}, 64), "tensor 't' has n_dims 5");
  }
  SUBCASE("zero dim") {
    expect_corrupt(image({}, {tinfo("t", {4, 0}, 0, 0)}, 64), "tensor 't' dim 1 is 0");
  }
  SUBCASE("negative dim") {
    expect_corrupt(image({}, {tinfo("t", {~0ull}, 0, 0)}, 64), "tensor 't' dim 0 is -1");
  }
  SUBCASE("element count overflow") {
    expect_corrupt(image({}, {tinfo("t", {1ull << 32, 1ull << 32}, 0, 0)}, 64),
                   "tensor 't' element count overflows");
  }
  SUBCASE("byte size overflow") {
    expect_corrupt(image({}, {tinfo("t", {1ull << 31, 1ull << 31}, 0, 0)}, 64),
                   "tensor 't' byte size overflows");
  }
  SUBCASE("unknown tensor type") {
    expect_corrupt(image({}, {tinfo("w", {4}, 2, 0)}, 64),
                   "tensor 'w' has unknown or unsupported type id 2");
    expect_corrupt(image({}, {tinfo("w", {4}, 1000, 0)}, 64), "type id 1000");
  }
  SUBCASE("Q8_0 ne[0] not a multiple of 32") {
    expect_corrupt(image({}, {tinfo("q", {48, 2}, 8, 0)}, 256),
                   "ne[0] 48 is not a multiple of the block size 32");
  }
  SUBCASE("offset not aligned") {
    expect_corrupt(image({}, {tinfo("t", {4}, 0, 4)}, 64),
                   "tensor 't' offset 4 is not aligned to 32");
    // With a custom alignment the check uses it.
    expect_corrupt(image({kv_u32("general.alignment", 64)}, {tinfo("t", {4}, 0, 32)}, 128, 64),
                   "offset 32 is not aligned to 64");
  }
  SUBCASE("offset beyond data") {
    expect_corrupt(image({}, {tinfo("t", {4}, 0, 1024)}, 64),
                   "tensor 't' offset 1024 is beyond the end of the data section (64 bytes)");
  }
  SUBCASE("size beyond data") {
    expect_corrupt(image({}, {tinfo("t", {32}, 0, 0)}, 64),
                   "tensor 't' data [0, +128) exceeds the data section size 64");
  }
  SUBCASE("overlapping tensors") {
    expect_corrupt(
        image({}, {tinfo("a", {16}, 0, 32), tinfo("b", {4}, 0, 64), tinfo("c", {4}, 0, 0)}, 128),
        "tensors 'a' [32, 96) and 'b' [64, 80) overlap");
  }
  SUBCASE("duplicate tensor name") {
    expect_corrupt(image({}, {tinfo("t", {4}, 0, 0), tinfo("t", {4}, 0, 32)}, 64),
                   "duplicate tensor name 't'");
  }
  SUBCASE("truncated in the middle of tensor infos") {
    auto img = header(2, 0)
                   .cat(tinfo("a_long_tensor_name_xxxxxxxx", {4}, 0, 0))
                   .cat(tinfo("b", {4, 4}, 0, 32))
                   .b;
    img.erase(img.end() - 14, img.end());  // cut inside b's dims
    expect_corrupt(img, "truncated reading tensor dimension");
  }
  SUBCASE("data section start beyond the file end") {
    auto img = header(1, 0).cat(tinfo("a", {4}, 0, 0)).b;  // no padding, no data
    expect_corrupt(img, "data section start 64");
    expect_corrupt(img, "beyond the file end 57");
  }
}

TEST_CASE("gguf: every prefix of a valid file is rejected, never read past") {
  auto img = full_image();
  auto full = GgufFile::parse(img.data(), img.size());
  REQUIRE(full.ok());
  uint64_t data_end = 0;
  for (const auto& t : (*full)->tensors()) data_end = std::max(data_end, t.offset + t.bytes);
  const size_t needed = (*full)->data_offset() + data_end;
  CHECK(needed == img.size());  // last tensor has no trailing padding
  int failures = 0;
  for (size_t len = 0; len < img.size(); ++len) {
    // Exact-size heap copy so ASan catches any read past the end.
    std::vector<uint8_t> cut(img.begin(), img.begin() + static_cast<std::ptrdiff_t>(len));
    auto r = GgufFile::parse(cut.data(), cut.size());
    if (r.ok() || r.status().code() != Code::corruption ||
        r.status().message().rfind("gguf: ", 0) != 0) {
      ++failures;
      MESSAGE("prefix " << len << ": " << (r.ok() ? "ok" : r.status().to_string()));
    }
  }
  CHECK(failures == 0);
}

TEST_CASE("gguf: random byte mutations never crash") {
  auto img = full_image();
  uint64_t s = 12345;
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return s >> 33;
  };
  int rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<uint8_t> m = img;
    int n = 1 + static_cast<int>(next() % 4);
    for (int k = 0; k < n; ++k) {
      size_t at = next() % std::min<size_t>(m.size(), 700);  // mostly the header
      m[at] = static_cast<uint8_t>(next());
    }
    auto r = GgufFile::parse(m.data(), m.size());
    if (!r.ok()) {
      ++rejected;
      CHECK(r.status().code() == Code::corruption);
    } else {
      // Whatever parsed must be readable in bounds.
      for (const auto& t : (*r)->tensors()) {
        CHECK((*r)->data_offset() + t.offset + t.bytes <= m.size());
      }
    }
  }
  CHECK(rejected > 100);
}
