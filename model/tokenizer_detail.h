// The pieces the two tokenizers share, internal to model/tokenizer*.cpp:
// UTF-8 helpers, the vocabulary read from GGUF metadata, BPE's merge table,
// the base class, and the makers of the "llama" (tokenizer_spm.cpp) and
// "gpt2" (tokenizer_bpe.cpp) tokenizers that Tokenizer::from_gguf
// (tokenizer.cpp) picks between.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

namespace cleave::tokenizer_detail {

// Length of a valid UTF-8 sequence starting at p (n bytes available), 0 when
// the bytes there are not valid UTF-8. *incomplete is set when the bytes are a
// valid but truncated prefix of a sequence (more bytes could complete it).
size_t utf8_valid_len(const uint8_t* p, size_t n, bool* incomplete);
uint32_t utf8_decode(const uint8_t* p, size_t len);
void utf8_append(std::string& out, uint32_t cp);
// The code point's Unicode class flags (model/unicode_data.h).
uint8_t cpt_flags(uint32_t cp);

// Token text -> id; the keys view the strings of Vocab::tokens.
using TokenMap = std::unordered_map<std::string_view, int32_t>;

// Open-addressing map from a (left id, right id) pair to its merge.
class MergeTable {
 public:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap *= 2;
    slots_.assign(cap, Slot{kEmpty, {0, 0}});
    mask_ = cap - 1;
  }
  // Keeps the first insertion of a key; false if the key was present.
  bool insert(uint64_t k, Merge m) {
    for (size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmpty) {
        slots_[i] = Slot{k, m};
        return true;
      }
      if (slots_[i].key == k) return false;
    }
  }
  const Merge* find(uint64_t k) const {
    if (slots_.empty()) return nullptr;
    for (size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == k) return &slots_[i].m;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;  // ids are < 2^31: never a key
  static size_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xFF51AFD7ED558CCDull;
    k ^= k >> 33;
    return static_cast<size_t>(k);
  }
  struct Slot {
    uint64_t key;
    Merge m;
  };
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};


// llama.cpp's token types (tokenizer.ggml.token_type).
enum TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

inline constexpr const char* kSpaceMarker = "\xE2\x96\x81";  // U+2581 LOWER ONE EIGHTH BLOCK

// "<0xXX>"
std::string hex_byte(uint8_t b);
// Parses "<0xXX>"; -1 when the text is not of that form.
int parse_byte_token(std::string_view t);
// corruption, "tokenizer: " + msg
Status corrupt(std::string msg);

// Common metadata shared by both tokenizers.
struct Vocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  TokenMap map;
  int32_t bos = -1, eos = -1, unk = -1, eot = -1, eom = -1;
  bool add_bos = false, add_eos = false;
  size_t max_token_len = 0;
};

// An optional boolean key; absent -> dflt.
Status read_bool(const GgufFile& f, const char* key, bool dflt, bool* out);
// The tokens, scores, types and special ids (corruption naming the key).
Status read_vocab(const GgufFile& f, bool is_spm, Vocab* v);

class TokenizerBase : public Tokenizer {
 public:
  explicit TokenizerBase(Vocab v) : v_(std::move(v)) {
    // Built here, once the strings have their final addresses.
    const int32_t n = static_cast<int32_t>(v_.tokens.size());
    v_.map.reserve(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
      v_.map[v_.tokens[i]] = i;  // llama.cpp: a later duplicate wins
      v_.max_token_len = std::max(v_.max_token_len, v_.tokens[i].size());
    }
  }
  TokenizerBase(const TokenizerBase&) = delete;
  TokenizerBase& operator=(const TokenizerBase&) = delete;
  int32_t n_vocab() const override { return static_cast<int32_t>(v_.tokens.size()); }
  int32_t bos() const override { return v_.bos; }
  int32_t eos() const override { return v_.eos; }
  bool is_eog(int32_t id) const override {
    return id >= 0 && (id == v_.eos || id == v_.eot || id == v_.eom);
  }

 protected:
  bool in_range(int32_t id) const { return id >= 0 && id < n_vocab(); }
  Vocab v_;
};

std::unique_ptr<Tokenizer> make_spm_tokenizer(Vocab v, bool add_space_prefix);
// Whether t is an SPM tokenizer that adds a space prefix, whose first
// decoded piece drops its leading space.
bool spm_strips_leading_space(const Tokenizer& t);
Result<std::unique_ptr<Tokenizer>> make_bpe_tokenizer(Vocab v, const GgufFile& f);

}  // namespace cleave::tokenizer_detail
