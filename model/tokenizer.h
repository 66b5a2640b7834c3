// Tokenizers built from GGUF metadata (tokenizer.ggml.*):
//  - "llama": SentencePiece-style BPE over scores, with byte fallback (<0xXX>)
//  - "gpt2":  byte-level BPE with merges and the GPT-2 pre-tokeniser
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/gguf.h"

namespace cleave {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // unsupported for an unknown tokenizer.ggml.model; corruption for
  // inconsistent metadata (array lengths differ, ids out of range, ...).
  static Result<std::unique_ptr<Tokenizer>> from_gguf(const GgufFile& file);

  virtual std::string model_name() const = 0;  // "llama" or "gpt2"
  // add_bos: prepend BOS when the vocabulary's rule asks for it
  // (tokenizer.ggml.add_bos_token, default true for llama, false for gpt2).
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos = true) const = 0;
  // Raw bytes of one token (byte-fallback tokens give their byte; the SPM
  // space marker becomes ' '). Special tokens (BOS/EOS) decode to "".
  virtual std::string token_bytes(int32_t id) const = 0;
  // Text of a sequence; a leading space from SPM's dummy prefix is dropped
  // when the sequence starts with BOS or is the start of the text.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;

  virtual int32_t n_vocab() const = 0;
  virtual int32_t bos() const = 0;  // -1 when none
  virtual int32_t eos() const = 0;
  virtual bool is_eog(int32_t id) const = 0;  // end of generation (EOS, EOT)
};

// Turns a token stream into valid UTF-8 text pieces as they arrive: bytes of
// an incomplete UTF-8 sequence are held until it completes.
class StreamDecoder {
 public:
  // at_text_start: the first piece starts the text, so SPM's dummy-prefix
  // space is dropped from it; false when the tokens continue a prompt.
  explicit StreamDecoder(const Tokenizer& tok, bool at_text_start = true)
      : tok_(tok), first_(at_text_start) {}
  std::string push(int32_t id);
  std::string flush();  // what is held, with invalid bytes as U+FFFD

 private:
  const Tokenizer& tok_;
  std::string pending_;
  bool first_;
};

}  // namespace cleave
