// Writes the seed corpus of a fuzz target into DIR (scripts/fuzz.sh runs it
// at build time): small valid inputs made by the code itself, so they follow
// the formats as the writers write them.
//   fuzz_seeds gguf DIR    GGUF files: every metadata type, tensors of every
//                          element type, an alignment key, a vocab-only file
//   fuzz_seeds image DIR   PNG (RGB, RGBA, grey, grey + alpha) and JPEG
//                          (colour and grey, two qualities) from stb_image_write
//   fuzz_seeds request DIR JSONL request lines using every field, and a file
//                          of several
//   fuzz_seeds openai DIR  OpenAI bodies: completions (text, token ids,
//                          sampling, logprobs, streaming), chat (roles,
//                          content parts, PNG and JPEG data URLs), /tokenize
//                          and /detokenize, and near misses of each
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "model/gguf.h"
#include "tests/gguf_util.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#define STBI_WRITE_NO_STDIO
#include <stb/stb_image_write.h>

namespace {

using namespace cleave;

bool write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

std::vector<uint8_t> pattern(size_t n, uint32_t salt) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = uint8_t(i * 37 + salt * 11 + 3);
  return b;
}

using cleave::testing::gguf_scalar;

int write_gguf(const std::string& dir) {
  std::vector<std::pair<std::string, GgufWriter>> files;

  GgufWriter all;  // every value type, and a tensor of each element type
  all.set_string("general.architecture", "llama");
  all.set_u32("general.alignment", 64);
  all.set("t.u8", gguf_scalar(GgufType::UINT8, 200));
  all.set("t.i8", gguf_scalar(GgufType::INT8, 0, -100));
  all.set("t.u16", gguf_scalar(GgufType::UINT16, 60000));
  all.set("t.i16", gguf_scalar(GgufType::INT16, 0, -30000));
  all.set_i32("t.i32", -7);
  all.set("t.u64", gguf_scalar(GgufType::UINT64, uint64_t(1) << 40));
  all.set("t.i64", gguf_scalar(GgufType::INT64, 0, -(int64_t(1) << 40)));
  all.set_f32("t.f32", 0.5f);
  all.set("t.f64", gguf_scalar(GgufType::FLOAT64, 0, 0, -2.25));
  all.set_bool("t.bool", true);
  all.set_string_array("t.strings", {"a", "", "bc"});
  all.set_f32_array("t.floats", {1.0f, -0.0f, 3.5f});
  all.set_i32_array("t.ints", {1, -2, 3});
  GgufValue u8s;
  u8s.type = GgufType::ARRAY;
  u8s.array_type = GgufType::UINT8;
  u8s.arr_u = {1, 2, 255};
  all.set("t.u8s", u8s);
  all.add_tensor("f32", DType::F32, {3, 2}, pattern(3 * 2 * 4, 1));
  all.add_tensor("f16", DType::F16, {4}, pattern(4 * 2, 2));
  all.add_tensor("bf16", DType::BF16, {2, 2, 2}, pattern(8 * 2, 3));
  all.add_tensor("q8_0", DType::Q8_0, {32, 2}, pattern(2 * 34, 4));
  files.emplace_back("seed_all_types.gguf", std::move(all));

  GgufWriter vocab;  // tokenizer metadata and no tensors, as vocab files are
  vocab.set_string("general.architecture", "llama");
  vocab.set_string("tokenizer.ggml.model", "llama");
  vocab.set_string_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "\xe2\x96\x81" "a", "b"});
  vocab.set_f32_array("tokenizer.ggml.scores", {0, 0, 0, -1, -2});
  vocab.set_i32_array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1});
  vocab.set_u32("tokenizer.ggml.bos_token_id", 1);
  files.emplace_back("seed_vocab.gguf", std::move(vocab));

  GgufWriter model;  // a tiny llama-shaped header
  model.set_string("general.architecture", "llama");
  model.set_u32("llama.embedding_length", 8);
  model.set_u32("llama.block_count", 1);
  model.set_u32("llama.attention.head_count", 2);
  model.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  model.add_tensor("token_embd.weight", DType::F32, {8, 4}, pattern(8 * 4 * 4, 5));
  model.add_tensor("blk.0.attn_q.weight", DType::F16, {8, 8}, pattern(8 * 8 * 2, 6));
  files.emplace_back("seed_model.gguf", std::move(model));

  files.emplace_back("seed_empty.gguf", GgufWriter());

  for (auto& [name, w] : files) {
    Status st = w.write(dir + "/" + name);
    if (!st.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), st.to_string().c_str());
      return 1;
    }
  }
  std::printf("%zu gguf seeds in %s\n", files.size(), dir.c_str());
  return 0;
}

void append(void* ctx, void* data, int size) {
  auto* out = static_cast<std::vector<uint8_t>*>(ctx);
  out->insert(out->end(), static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
}

int write_images(const std::string& dir) {
  struct Seed {
    const char* name;
    bool png;
    int w, h, comp, quality;
  };
  const Seed seeds[] = {
      {"seed_rgb.png", true, 3, 2, 3, 0},      {"seed_rgba.png", true, 5, 3, 4, 0},
      {"seed_grey.png", true, 4, 4, 1, 0},     {"seed_grey_alpha.png", true, 2, 3, 2, 0},
      {"seed_q90.jpg", false, 8, 8, 3, 90},    {"seed_q30.jpg", false, 17, 9, 3, 30},
      {"seed_grey.jpg", false, 16, 16, 1, 75},
  };
  for (const Seed& s : seeds) {
    const std::vector<uint8_t> px = pattern(size_t(s.w) * size_t(s.h) * size_t(s.comp), uint32_t(s.w));
    std::vector<uint8_t> out;
    const int ok = s.png ? stbi_write_png_to_func(append, &out, s.w, s.h, s.comp, px.data(), s.w * s.comp)
                         : stbi_write_jpg_to_func(append, &out, s.w, s.h, s.comp, px.data(), s.quality);
    if (!ok || !write_file(dir + "/" + s.name, out)) {
      std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), s.name);
      return 1;
    }
  }
  std::printf("%zu image seeds in %s\n", sizeof(seeds) / sizeof(seeds[0]), dir.c_str());
  return 0;
}

int write_requests(const std::string& dir) {
  const std::pair<const char*, const char*> seeds[] = {
      {"seed_ids.jsonl", R"({"id": 1, "prompt_ids": [1, 450, 4996, 17354], "max_tokens": 8})"},
      {"seed_text.jsonl", R"({"id": 2, "prompt": "The quick brown fox", "add_bos": false})"},
      {"seed_sampling.jsonl",
       R"({"id": 3, "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.7, )"
       R"("top_k": 20, "top_p": 0.9, "min_p": 0.1, "repeat_penalty": 1.1, "repeat_last_n": 32, )"
       R"("seed": 42, "stop": ["\n", "."], "ignore_eos": true, "prefill_chunk": 64})"},
      {"seed_images.jsonl",
       R"({"id": 4, "prompt": "What is in <image> and in <image>?", "images": ["a.png", "bb.jpg"]})"},
      {"seed_image_first.jsonl", R"({"id": 5, "prompt": "Describe it.", "images": ["shape.png"]})"},
      {"seed_unicode.jsonl", R"({"id": 6, "prompt": "caf\u00e9 \ud83d\ude00 na\u00efve", "stop": "END"})"},
      {"seed_file.jsonl",
       "{\"id\": 7, \"prompt_ids\": [2, 3]}\n\n{\"id\": 8, \"prompt\": \"hi\", \"max_tokens\": 0}\n"
       "{\"id\": 7, \"prompt_ids\": []}\n"},
  };
  for (const auto& [name, line] : seeds) {
    const std::vector<uint8_t> bytes(line, line + std::strlen(line));
    if (!write_file(dir + "/" + name, bytes)) {
      std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name);
      return 1;
    }
  }
  std::printf("%zu request seeds in %s\n", sizeof(seeds) / sizeof(seeds[0]), dir.c_str());
  return 0;
}

std::string base64(const std::vector<uint8_t>& bytes) {
  static const char kDigits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const uint32_t n = uint32_t(bytes[i]) << 16 | (i + 1 < bytes.size() ? uint32_t(bytes[i + 1]) << 8 : 0) |
                       (i + 2 < bytes.size() ? uint32_t(bytes[i + 2]) : 0);
    out += kDigits[n >> 18 & 63];
    out += kDigits[n >> 12 & 63];
    out += i + 1 < bytes.size() ? kDigits[n >> 6 & 63] : '=';
    out += i + 2 < bytes.size() ? kDigits[n & 63] : '=';
  }
  return out;
}

// A data URL of a tiny image (stb_image_write).
std::string image_url(bool png, int w, int h) {
  const std::vector<uint8_t> px = pattern(size_t(w) * size_t(h) * 3, uint32_t(w + h));
  std::vector<uint8_t> out;
  const int ok = png ? stbi_write_png_to_func(append, &out, w, h, 3, px.data(), w * 3)
                     : stbi_write_jpg_to_func(append, &out, w, h, 3, px.data(), 80);
  if (!ok) return "";
  return std::string(png ? "data:image/png;base64," : "data:image/jpeg;base64,") + base64(out);
}

int write_openai(const std::string& dir) {
  const std::string png = image_url(true, 2, 2), jpeg = image_url(false, 8, 8);
  if (png.empty() || jpeg.empty()) {
    std::fprintf(stderr, "cannot write the seed images\n");
    return 1;
  }
  auto image_part = [](const std::string& url) {
    return R"({"type": "image_url", "image_url": {"url": ")" + url + R"(", "detail": "auto"}})";
  };
  const std::vector<std::pair<std::string, std::string>> seeds = {
      // /v1/completions
      {"cmpl_text.json", R"({"model": "cleave", "prompt": "The quick brown fox", "max_tokens": 8})"},
      {"cmpl_ids.json", R"({"prompt": [1, 450, 4996, 17354], "max_tokens": 4, "temperature": 0})"},
      {"cmpl_nested_ids.json", R"({"prompt": [[1, 2, 3]], "n": 2, "best_of": 2, "seed": -5})"},
      {"cmpl_sampling.json",
       R"({"prompt": ["Once upon a time"], "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, )"
       R"("min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, )"
       R"("stop": ["\n", "."], "ignore_eos": true, "user": "u-1", "logit_bias": {}, "echo": false, "suffix": ""})"},
      {"cmpl_stream_logprobs.json",
       R"({"prompt": "caf\u00e9 \ud83d\ude00", "logprobs": 3, "n": 3, "stream": true, )"
       R"("stream_options": {"include_usage": true}, "seed": 18446744073709551615, "stop": "END"})"},
      {"cmpl_nulls.json", R"({"prompt": "hi", "model": null, "max_tokens": null, "stop": null, "top_k": -1})"},
      // /v1/chat/completions
      {"chat_simple.json",
       R"({"model": "cleave", "messages": [{"role": "system", "content": "Be brief."}, )"
       R"({"role": "user", "content": "Hi"}], "max_tokens": 8})"},
      {"chat_turns.json",
       R"({"messages": [{"role": "user", "content": "One?"}, {"role": "assistant", "content": "Two."}, )"
       R"({"role": "user", "content": "Three?"}], "max_completion_tokens": 4, "logprobs": true, "top_logprobs": 5})"},
      {"chat_image.json",
       R"({"messages": [{"role": "user", "content": [)" + image_part(png) +
           R"(, {"type": "text", "text": "What shape?"}]}], "max_tokens": 2})"},
      {"chat_two_images.json",
       R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "Compare"}, )" + image_part(png) +
           R"(, {"type": "text", "text": "and"}, )" + image_part(jpeg) + R"(]}], "temperature": 0, "seed": 7})"},
      {"chat_parts.json",
       R"({"messages": [{"role": "developer", "content": [{"type": "text", "text": "Rules"}, )"
       R"({"type": "text", "text": "more rules"}]}, {"role": "user", "content": "Go"}], "n": 3, "stream": true, )"
       R"("stream_options": {"include_usage": false}, "response_format": {"type": "text"}, "ignore_eos": true})"},
      {"chat_unicode.json",
       R"({"messages": [{"role": "user", "content": "na\u00efve \u4e2d\u6587 \ud83d\ude00 <s> <|im_start|>"}], )"
       R"("stop": ["\u00e9"], "max_tokens": 3})"},
      // /tokenize, /detokenize
      {"tokenize.json", R"({"content": "Hello world", "add_special": true, "with_pieces": true})"},
      {"detokenize.json", R"({"tokens": [1, 15043, 3186, 29871, 243, 162]})"},
      // Near misses
      {"miss_duplicate.json", R"({"prompt": "a", "prompt": "b"})"},
      {"miss_assistant_image.json",
       R"({"messages": [{"role": "assistant", "content": [)" + image_part(png) + R"(]}]})"},
      {"miss_stops.json", R"({"prompt": "a", "stop": ["a", "b", "c", "d", ""]})"},
      {"miss_top_logprobs.json", R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})"},
      {"miss_url.json",
       R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": )"
       R"({"url": "https://example.com/a.png"}}, {"type": "image_url", "image_url": )"
       R"({"url": "data:image/png;base64,iVBORw0KGgo="}}]}]})"},
      {"miss_context.json", R"({"prompt": "The quick brown fox", "max_tokens": 1000})"},
      {"miss_marker.json", R"({"messages": [{"role": "user", "content": "look: <image>"}], "tools": null})"},
      {"miss_vocab.json", R"({"prompt": [1, 40000], "max_tokens": 1})"},
      {"miss_utf8.json", "{\"prompt\": \"\xff\xfe\", \"max_tokens\": 1"},
  };
  for (const auto& [name, body] : seeds) {
    const std::vector<uint8_t> bytes(body.begin(), body.end());
    if (!write_file(dir + "/" + name, bytes)) {
      std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
      return 1;
    }
  }
  std::printf("%zu openai seeds in %s\n", seeds.size(), dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "gguf") == 0) return write_gguf(argv[2]);
  if (argc == 3 && std::strcmp(argv[1], "image") == 0) return write_images(argv[2]);
  if (argc == 3 && std::strcmp(argv[1], "request") == 0) return write_requests(argv[2]);
  if (argc == 3 && std::strcmp(argv[1], "openai") == 0) return write_openai(argv[2]);
  std::fprintf(stderr, "usage: %s gguf|image|request|openai DIR\n", argv[0]);
  return 2;
}
