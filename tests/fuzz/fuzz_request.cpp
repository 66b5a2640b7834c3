// libFuzzer target for the JSONL request reader (frontend/request_codec.h):
// any line, read with a SentencePiece (llama) and a byte-level BPE (GPT-2)
// tokenizer and images from a stub loader, gives invalid_argument (or the
// loader's own error) or a request that keeps the documented ranges and that
// the wire codec carries: it encodes, decodes and re-encodes to the same
// bytes. The same bytes as a file go through read_request_file (one request
// per line, duplicate ids refused).
#include <memory>
#include <string>
#include <string_view>

#include "frontend/request_codec.h"
#include "fuzz_check.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "schema/codec.h"

namespace {

using namespace cleave;
using fuzz::fail;

constexpr int32_t kImageTokens = 3;

struct Vocab {
  std::shared_ptr<const GgufFile> file;
  std::unique_ptr<Tokenizer> tokenizer;
};

Vocab load_vocab(const char* name) {
  const std::string path = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/" + name;
  auto file = GgufFile::open(path);
  if (!file.ok()) fail("%s", file.status().to_string().c_str());
  auto tok = Tokenizer::from_gguf(**file);
  if (!tok.ok()) fail("%s", tok.status().to_string().c_str());
  return Vocab{std::move(file.value()), std::move(tok.value())};
}

// Images come from the stub: "missing..." is an io_error, any other name a
// small image whose size depends on the name.
Result<RgbImage> stub_image(const std::string& path) {
  if (path.rfind("missing", 0) == 0) return Status(Code::io_error, "image '" + path + "': cannot read it");
  RgbImage im;
  im.width = 1 + int32_t(path.size() % 4);
  im.height = 1 + int32_t(path.size() % 3);
  im.rgb.assign(size_t(im.width) * size_t(im.height) * 3, uint8_t(path.size()));
  return im;
}

// (Token ids against the vocabulary are validate_request()'s: "prompt_ids" may
// hold any id.)
void check_request(const GenerateRequest& r, const char* who) {
  const SamplingParams& s = r.sampling;
  if (s.max_tokens < 0 || s.max_tokens > (1 << 24) || s.top_k < 0 || s.repeat_last_n < 0 ||
      !(s.temperature >= 0 && s.temperature <= 100) || !(s.top_p >= 0 && s.top_p <= 1) ||
      !(s.min_p >= 0 && s.min_p <= 1) || !(s.repeat_penalty >= 0.01f && s.repeat_penalty <= 100) ||
      r.prefill_chunk < 1 || r.prefill_chunk > (1 << 20))
    fail("%s: sampling outside the documented ranges", who);
  for (int32_t t : r.prompt)
    if (t < 0) fail("%s: negative token id %d", who, t);
  for (const PromptImage& im : r.images) {
    if (im.n_tokens != kImageTokens || im.position < 0 ||
        size_t(im.position) + size_t(im.n_tokens) > r.prompt.size())
      fail("%s: image span [%d, +%d) in a prompt of %zu", who, im.position, im.n_tokens,
           r.prompt.size());
    if (im.image.rgb.size() != size_t(im.image.width) * size_t(im.image.height) * 3)
      fail("%s: image pixels do not match its size", who);
  }
  // What the reader accepts, the wire carries.
  const codec::Bytes bytes = codec::encode(r);
  GenerateRequest back;
  Status st = codec::decode(bytes, back);
  if (!st.ok()) fail("%s: the codec refuses an accepted request: %s", who, st.to_string().c_str());
  if (codec::encode(back) != bytes) fail("%s: the request changed on the wire", who);
}

void parse(std::string_view line, const RequestContext& ctx, const char* who) {
  auto r = parse_request_line(line, ctx);
  if (r.ok()) return check_request(*r, who);
  fuzz::expect_error(r.status(), {Code::invalid_argument, Code::io_error}, who);
  if (r.status().code() == Code::io_error && r.status().message().find("missing") == std::string::npos)
    fail("%s: io_error not from the image loader: %s", who, r.status().message().c_str());
}

const Vocab* g_llama = nullptr;
const Vocab* g_gpt2 = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_llama = new Vocab(load_vocab("ggml-vocab-llama-spm.gguf"));
  g_gpt2 = new Vocab(load_vocab("ggml-vocab-gpt-2.gguf"));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  RequestContext llama{g_llama->tokenizer.get(), kImageTokens, stub_image};
  RequestContext gpt2{g_gpt2->tokenizer.get(), 0, stub_image};
  RequestContext ids_only{nullptr, 0, stub_image};
  parse(text, llama, "parse_request_line (llama, images)");
  parse(text, gpt2, "parse_request_line (gpt-2)");
  parse(text, ids_only, "parse_request_line (no tokenizer)");

  auto file = read_request_file(fuzz::as_file(data, size), llama);
  if (file.ok()) {
    for (const GenerateRequest& r : *file) check_request(r, "read_request_file");
  } else {
    fuzz::expect_error(file.status(), {Code::invalid_argument, Code::io_error}, "read_request_file");
  }
  return 0;
}
