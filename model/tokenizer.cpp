// Tokenizers built from GGUF metadata, following llama.cpp's behaviour:
//  - "llama": llm_tokenizer_spm (score-driven bigram merging, byte fallback;
//             tokenizer_spm.cpp)
//  - "gpt2":  llm_tokenizer_bpe with the GPT-2 pre-tokeniser (hand-written,
//             same rules as llama.cpp's unicode_regex_split_custom_gpt2;
//             tokenizer_bpe.cpp)
// and the streaming decoder.
#include "model/tokenizer.h"

#include "model/tokenizer_detail.h"

namespace cleave {

using namespace tokenizer_detail;

namespace {

// Appends the longest complete-UTF-8 prefix of `in` to `out` (invalid bytes as
// U+FFFD) and returns how many bytes were consumed. With `final`, incomplete
// trailing sequences are replaced as well.
size_t take_utf8(const std::string& in, bool final, std::string& out) {
  const auto* p = reinterpret_cast<const uint8_t*>(in.data());
  size_t i = 0;
  while (i < in.size()) {
    bool incomplete;
    const size_t len = utf8_valid_len(p + i, in.size() - i, &incomplete);
    if (len > 0) {
      out.append(in, i, len);
      i += len;
    } else if (incomplete && !final) {
      break;
    } else {
      out += "\xEF\xBF\xBD";
      i += 1;
    }
  }
  return i;
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_gguf(const GgufFile& file) {
  auto model = file.get_string("tokenizer.ggml.model");
  if (!model.ok()) return Status(model.status().code(), "tokenizer: " + model.status().message());
  if (*model == "llama") {
    Vocab v;
    CLEAVE_RETURN_IF_ERROR(read_vocab(file, true, &v));
    bool add_space_prefix = true;
    CLEAVE_RETURN_IF_ERROR(
        read_bool(file, "tokenizer.ggml.add_space_prefix", true, &add_space_prefix));
    return make_spm_tokenizer(std::move(v), add_space_prefix);
  }
  if (*model == "gpt2") {
    Vocab v;
    CLEAVE_RETURN_IF_ERROR(read_vocab(file, false, &v));
    return make_bpe_tokenizer(std::move(v), file);
  }
  return Status(Code::unsupported, "tokenizer: tokenizer.ggml.model \"" + *model +
                                       "\" is not supported (supported: \"llama\", \"gpt2\")");
}

std::string StreamDecoder::push(int32_t id) {
  std::string piece = tok_.token_bytes(id);
  if (first_ && !piece.empty()) {
    first_ = false;
    if (spm_strips_leading_space(tok_) && piece[0] == ' ') piece.erase(0, 1);
  }
  pending_ += piece;
  std::string out;
  const size_t used = take_utf8(pending_, false, out);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  take_utf8(pending_, true, out);
  pending_.clear();
  return out;
}

}  // namespace cleave

