// Tokenizers built from GGUF metadata, following llama.cpp's behaviour:
//  - "llama": llm_tokenizer_spm (score-driven bigram merging, byte fallback)
//  - "gpt2":  llm_tokenizer_bpe with the GPT-2 pre-tokeniser (hand-written,
//             same rules as llama.cpp's unicode_regex_split_custom_gpt2)
#include "model/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <functional>
#include <queue>
#include <unordered_map>

#include "model/unicode_data.h"

namespace cleave {
namespace {

// ---------------------------------------------------------------------------
// UTF-8 and Unicode helpers

// Length of a valid UTF-8 sequence starting at p (n bytes available), 0 when
// the bytes there are not valid UTF-8. *incomplete is set when the bytes are a
// valid but truncated prefix of a sequence (more bytes could complete it).
size_t utf8_valid_len(const uint8_t* p, size_t n, bool* incomplete) {
  *incomplete = false;
  const uint8_t c = p[0];
  if (c < 0x80) return 1;
  size_t len;
  uint8_t lo = 0x80, hi = 0xBF;  // range of the second byte (Unicode table 3-7)
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t i = 1; i < len; ++i) {
    if (i >= n) {
      *incomplete = true;
      return 0;
    }
    const uint8_t b = p[i];
    if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return 0;
  }
  return len;
}

uint32_t utf8_decode(const uint8_t* p, size_t len) {
  switch (len) {
    case 1:
      return p[0];
    case 2:
      return ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    case 3:
      return ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    default:
      return ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) |
             (p[3] & 0x3Fu);
  }
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

uint8_t cpt_flags(uint32_t cp) {
  using namespace unicode_data;
  static const std::array<uint8_t, 128> ascii = [] {
    std::array<uint8_t, 128> t{};
    for (uint32_t c = 0; c < 128; ++c) {
      for (const Range& r : kRanges) {
        if (c >= r.lo && c <= r.hi) t[c] = r.flags;
      }
    }
    return t;
  }();
  if (cp < 128) return ascii[cp];
  const Range* end = kRanges + sizeof(kRanges) / sizeof(kRanges[0]);
  const Range* it =
      std::upper_bound(kRanges, end, cp, [](uint32_t c, const Range& r) { return c < r.lo; });
  if (it == kRanges) return 0;
  --it;
  return cp <= it->hi ? it->flags : 0;
}

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

const char* kSpaceMarker = "\xE2\x96\x81";  // U+2581 LOWER ONE EIGHTH BLOCK

std::string hex_byte(uint8_t b) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "<0x%02X>", b);
  return buf;
}

// Parses "<0xXX>"; -1 when the text is not of that form.
int parse_byte_token(std::string_view t) {
  if (t.size() != 6 || t[0] != '<' || t[1] != '0' || t[2] != 'x' || t[5] != '>') return -1;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int h = hex(t[3]), l = hex(t[4]);
  if (h < 0 || l < 0) return -1;
  return h * 16 + l;
}

Status corrupt(std::string msg) {
  return Status(Code::corruption, "tokenizer: " + std::move(msg));
}

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

// Reads an optional token id; absent -> dflt. Out-of-range -> corruption.
Status read_id(const GgufFile& f, const char* key, int32_t n, int32_t dflt, int32_t* out) {
  if (!f.find(key)) {
    *out = (dflt >= 0 && dflt < n) ? dflt : -1;
    return Status::Ok();
  }
  auto v = f.get_int(key);
  if (!v.ok()) return Status(v.status().code(), "tokenizer: " + v.status().message());
  if (*v < 0 || *v >= n) {
    return corrupt(std::string(key) + " = " + std::to_string(*v) + " is out of range [0, " +
                   std::to_string(n) + ")");
  }
  *out = static_cast<int32_t>(*v);
  return Status::Ok();
}

Status read_bool(const GgufFile& f, const char* key, bool dflt, bool* out) {
  if (!f.find(key)) {
    *out = dflt;
    return Status::Ok();
  }
  auto v = f.get_bool(key);
  if (!v.ok()) return Status(v.status().code(), "tokenizer: " + v.status().message());
  *out = *v;
  return Status::Ok();
}

Status read_vocab(const GgufFile& f, bool is_spm, Vocab* v) {
  auto toks = f.get_string_array("tokenizer.ggml.tokens");
  if (!toks.ok()) return Status(toks.status().code(), "tokenizer: " + toks.status().message());
  v->tokens = std::move(toks).value();
  const size_t n = v->tokens.size();
  if (n == 0) return corrupt("tokenizer.ggml.tokens is empty");
  if (n > static_cast<size_t>(INT32_MAX)) {
    return corrupt("tokenizer.ggml.tokens has " + std::to_string(n) + " entries (too many)");
  }
  if (f.find("tokenizer.ggml.scores")) {
    auto s = f.get_float_array("tokenizer.ggml.scores");
    if (!s.ok()) return Status(s.status().code(), "tokenizer: " + s.status().message());
    if (s->size() != n) {
      return corrupt("tokenizer.ggml.scores has " + std::to_string(s->size()) +
                     " entries but tokenizer.ggml.tokens has " + std::to_string(n));
    }
    v->scores = std::move(s).value();
  } else {
    v->scores.assign(n, 0.0f);
  }
  if (f.find("tokenizer.ggml.token_type")) {
    auto t = f.get_int_array("tokenizer.ggml.token_type");
    if (!t.ok()) return Status(t.status().code(), "tokenizer: " + t.status().message());
    if (t->size() != n) {
      return corrupt("tokenizer.ggml.token_type has " + std::to_string(t->size()) +
                     " entries but tokenizer.ggml.tokens has " + std::to_string(n));
    }
    v->types = std::move(t).value();
    for (size_t i = 0; i < n; ++i) {
      if (v->types[i] < kUndefined || v->types[i] > kByte) {
        return corrupt("tokenizer.ggml.token_type[" + std::to_string(i) +
                       "] = " + std::to_string(v->types[i]) + " is not a known token type (0..6)");
      }
    }
  } else {
    v->types.assign(n, kNormal);
  }
  const int32_t ni = static_cast<int32_t>(n);
  CLEAVE_RETURN_IF_ERROR(read_id(f, "tokenizer.ggml.bos_token_id", ni, is_spm ? 1 : -1, &v->bos));
  CLEAVE_RETURN_IF_ERROR(read_id(f, "tokenizer.ggml.eos_token_id", ni, is_spm ? 2 : -1, &v->eos));
  CLEAVE_RETURN_IF_ERROR(
      read_id(f, "tokenizer.ggml.unknown_token_id", ni, is_spm ? 0 : -1, &v->unk));
  CLEAVE_RETURN_IF_ERROR(read_id(f, "tokenizer.ggml.eot_token_id", ni, -1, &v->eot));
  CLEAVE_RETURN_IF_ERROR(read_id(f, "tokenizer.ggml.eom_token_id", ni, -1, &v->eom));
  CLEAVE_RETURN_IF_ERROR(read_bool(f, "tokenizer.ggml.add_bos_token", is_spm, &v->add_bos));
  CLEAVE_RETURN_IF_ERROR(read_bool(f, "tokenizer.ggml.add_eos_token", false, &v->add_eos));
  if (v->add_bos && v->bos < 0)
    return corrupt("tokenizer.ggml.add_bos_token is set but there is no BOS token");
  if (v->add_eos && v->eos < 0)
    return corrupt("tokenizer.ggml.add_eos_token is set but there is no EOS token");
  return Status::Ok();
}

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

// ---------------------------------------------------------------------------
// "llama": SentencePiece-style tokenizer (llama.cpp's llm_tokenizer_spm)

class SpmTokenizer final : public TokenizerBase {
 public:
  SpmTokenizer(Vocab v, bool add_space_prefix)
      : TokenizerBase(std::move(v)), add_space_prefix_(add_space_prefix) {
    for (int b = 0; b < 256; ++b) {
      auto it = v_.map.find(hex_byte(static_cast<uint8_t>(b)));
      byte_token_[b] = it != v_.map.end() ? it->second : v_.unk;
    }
  }

  std::string model_name() const override { return "llama"; }

  // add_bos works like llama.cpp's add_special: BOS when the vocab's
  // add_bos_token asks for it, and EOS at the end when add_eos_token does.
  std::vector<int32_t> encode(std::string_view raw, bool add_bos) const override {
    std::vector<int32_t> out;
    if (add_bos && v_.add_bos) out.push_back(v_.bos);
    if (!raw.empty()) {
      std::string text;
      text.reserve(raw.size() * 3 + 3);
      if (add_space_prefix_) text += kSpaceMarker;
      for (char c : raw) {
        if (c == ' ') {
          text += kSpaceMarker;
        } else {
          text += c;
        }
      }
      tokenize(text, out);
    }
    if (add_bos && v_.add_eos) out.push_back(v_.eos);
    return out;
  }

  std::string token_bytes(int32_t id) const override {
    if (!in_range(id)) return "";
    const std::string& t = v_.tokens[id];
    switch (v_.types[id]) {
      case kByte: {
        const int b = parse_byte_token(t);
        return b >= 0 ? std::string(1, static_cast<char>(b)) : std::string();
      }
      case kNormal: {
        std::string r;
        r.reserve(t.size());
        for (size_t i = 0; i < t.size();) {
          if (t.compare(i, 3, kSpaceMarker) == 0) {
            r += ' ';
            i += 3;
          } else {
            r += t[i++];
          }
        }
        return r;
      }
      case kUserDefined:
        return t;
      default:  // control, unknown, unused, undefined
        return "";
    }
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    size_t first = 0;
    if (!ids.empty() && ids[0] == v_.bos) first = 1;
    for (size_t i = 0; i < ids.size(); ++i) {
      std::string piece = token_bytes(ids[i]);
      if (i == first && add_space_prefix_ && !piece.empty() && piece[0] == ' ') piece.erase(0, 1);
      out += piece;
    }
    return out;
  }

  bool strips_leading_space() const { return add_space_prefix_; }

 private:
  struct Symbol {
    int32_t prev, next;
    uint32_t off, n;
  };
  struct Bigram {
    float score;
    int32_t left, right;
    uint32_t size;
  };
  struct BigramLess {  // llama.cpp: highest score first, then leftmost
    bool operator()(const Bigram& l, const Bigram& r) const {
      return l.score < r.score || (l.score == r.score && l.left > r.left);
    }
  };
  using Queue = std::priority_queue<Bigram, std::vector<Bigram>, BigramLess>;

  void try_add_bigram(const std::string& text, const std::vector<Symbol>& syms, int32_t left,
                      int32_t right, Queue& q) const {
    if (left < 0 || right < 0) return;
    const Symbol& l = syms[left];
    const Symbol& r = syms[right];
    const uint32_t size = l.n + r.n;
    if (size > v_.max_token_len) return;
    auto it = v_.map.find(std::string_view(text).substr(l.off, size));
    if (it == v_.map.end()) return;
    q.push(Bigram{v_.scores[it->second], left, right, size});
  }

  void tokenize(const std::string& text, std::vector<int32_t>& out) const {
    std::vector<Symbol> syms;
    syms.reserve(text.size());
    size_t off = 0;
    int32_t index = 0;
    while (off < text.size()) {
      // One UTF-8 character per symbol (llama.cpp splits by the lead byte
      // alone; the same for valid UTF-8). An invalid byte is a symbol of its
      // own, so it cannot swallow a following space marker.
      bool incomplete;
      size_t len = utf8_valid_len(reinterpret_cast<const uint8_t*>(text.data()) + off,
                                  text.size() - off, &incomplete);
      const uint32_t n = static_cast<uint32_t>(len == 0 ? 1 : len);
      Symbol s;
      s.off = static_cast<uint32_t>(off);
      s.n = n;
      off += n;
      s.prev = index - 1;
      s.next = off == text.size() ? -1 : index + 1;
      ++index;
      syms.push_back(s);
    }
    std::vector<Bigram> storage;
    storage.reserve(syms.size());
    Queue q(BigramLess{}, std::move(storage));
    for (int32_t i = 1; i < static_cast<int32_t>(syms.size()); ++i)
      try_add_bigram(text, syms, i - 1, i, q);
    while (!q.empty()) {
      const Bigram b = q.top();
      q.pop();
      Symbol& l = syms[b.left];
      Symbol& r = syms[b.right];
      if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;  // stale
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) syms[r.next].prev = b.left;
      try_add_bigram(text, syms, l.prev, b.left, q);
      try_add_bigram(text, syms, b.left, l.next, q);
    }
    for (int32_t i = syms.empty() ? -1 : 0; i != -1; i = syms[i].next) {
      const Symbol& s = syms[i];
      auto it = v_.map.find(std::string_view(text).substr(s.off, s.n));
      if (it != v_.map.end()) {
        out.push_back(it->second);
      } else {
        for (uint32_t j = 0; j < s.n; ++j)
          out.push_back(byte_token_[static_cast<uint8_t>(text[s.off + j])]);
      }
    }
  }

  bool add_space_prefix_;
  int32_t byte_token_[256];
};

// ---------------------------------------------------------------------------
// "gpt2": byte-level BPE (llama.cpp's llm_tokenizer_bpe with the GPT-2 regex)

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to
// U+0100 onwards in byte order.
std::array<uint32_t, 256> gpt2_byte_to_cp() {
  std::array<uint32_t, 256> m{};
  std::array<bool, 256> direct{};
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) m[b] = direct[b] ? static_cast<uint32_t>(b) : next++;
  return m;
}

class BpeTokenizer final : public TokenizerBase {
 public:
  explicit BpeTokenizer(Vocab v) : TokenizerBase(std::move(v)) {}

  Status init(const GgufFile& f) {
    const auto b2c = gpt2_byte_to_cp();
    cp_to_byte_.assign(324, -1);
    for (int b = 0; b < 256; ++b) {
      cp_to_byte_[b2c[b]] = b;
      std::string s;
      utf8_append(s, b2c[b]);
      auto it = v_.map.find(s);
      if (it == v_.map.end()) {
        char buf[96];
        std::snprintf(buf, sizeof buf,
                      "tokenizer.ggml.tokens has no token for byte 0x%02X (\"%s\")", b, s.c_str());
        return corrupt(buf);
      }
      byte_token_[b] = it->second;
    }
    auto merges = f.get_string_array("tokenizer.ggml.merges");
    if (!merges.ok())
      return Status(merges.status().code(), "tokenizer: " + merges.status().message());
    merges_.reserve(merges->size());
    std::string joined;
    for (size_t i = 0; i < merges->size(); ++i) {
      const std::string& m = (*merges)[i];
      const size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string::npos;
      auto bad = [&](const std::string& why) {
        return corrupt("tokenizer.ggml.merges[" + std::to_string(i) + "] = \"" + m + "\" " + why);
      };
      if (sp == std::string::npos) return bad("is not of the form \"left right\"");
      const std::string_view a = std::string_view(m).substr(0, sp);
      const std::string_view b = std::string_view(m).substr(sp + 1);
      auto ia = v_.map.find(a);
      if (ia == v_.map.end()) return bad("names an unknown token \"" + std::string(a) + "\"");
      auto ib = v_.map.find(b);
      if (ib == v_.map.end()) return bad("names an unknown token \"" + std::string(b) + "\"");
      joined.assign(a);
      joined.append(b);
      auto ij = v_.map.find(joined);
      if (ij == v_.map.end()) return bad("merges into \"" + joined + "\", which is not a token");
      // The first (lowest-rank) occurrence of a pair wins.
      merges_.insert(MergeTable::key(ia->second, ib->second),
                     {static_cast<int32_t>(i), ij->second});
    }
    return Status::Ok();
  }

  std::string model_name() const override { return "gpt2"; }

  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override {
    std::vector<int32_t> out;
    if (add_bos && v_.add_bos) out.push_back(v_.bos);
    pretokenize(text,
                [&](size_t begin, size_t end) { bpe_word(text.substr(begin, end - begin), out); });
    if (add_bos && v_.add_eos) out.push_back(v_.eos);
    return out;
  }

  std::string token_bytes(int32_t id) const override {
    if (!in_range(id)) return "";
    const std::string& t = v_.tokens[id];
    switch (v_.types[id]) {
      case kNormal: {
        std::string r;
        r.reserve(t.size());
        const auto* p = reinterpret_cast<const uint8_t*>(t.data());
        for (size_t i = 0; i < t.size();) {
          bool inc;
          size_t len = utf8_valid_len(p + i, t.size() - i, &inc);
          if (len == 0) {  // not UTF-8: keep the byte
            r += t[i++];
            continue;
          }
          const uint32_t cp = utf8_decode(p + i, len);
          if (cp < cp_to_byte_.size() && cp_to_byte_[cp] >= 0) {
            r += static_cast<char>(cp_to_byte_[cp]);
          } else {
            r.append(t, i, len);
          }
          i += len;
        }
        return r;
      }
      case kUserDefined:
        return t;
      case kByte: {
        const int b = parse_byte_token(t);
        return b >= 0 ? std::string(1, static_cast<char>(b)) : std::string();
      }
      default:
        return "";
    }
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids) out += token_bytes(id);
    return out;
  }

 private:
  // GPT-2 pre-tokeniser:
  //   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  // Calls emit(begin, end) with byte offsets of each piece. Bytes that are not
  // valid UTF-8 count as one "other" character each (neither letter, number
  // nor space), so every byte of the input ends up in some piece.
  template <class F>
  void pretokenize(std::string_view text, F&& emit) const {
    struct Cp {
      uint32_t cp;
      uint32_t off;
      uint8_t flags;
    };
    std::vector<Cp> cps;
    cps.reserve(text.size() + 1);
    const auto* p = reinterpret_cast<const uint8_t*>(text.data());
    for (size_t i = 0; i < text.size();) {
      bool inc;
      size_t len = utf8_valid_len(p + i, text.size() - i, &inc);
      if (len == 0) {
        cps.push_back(Cp{0xFFFFFFFEu, static_cast<uint32_t>(i), 0});
        i += 1;
      } else {
        const uint32_t cp = utf8_decode(p + i, len);
        cps.push_back(Cp{cp, static_cast<uint32_t>(i), cpt_flags(cp)});
        i += len;
      }
    }
    const size_t n = cps.size();
    cps.push_back(Cp{0xFFFFFFFFu, static_cast<uint32_t>(text.size()), 0});  // sentinel
    using namespace unicode_data;
    constexpr uint32_t kEnd = 0xFFFFFFFFu;
    auto cpt = [&](size_t pos) { return pos < n ? cps[pos].cp : kEnd; };
    auto is = [&](size_t pos, uint8_t f) { return pos < n && (cps[pos].flags & f); };
    auto is_other = [&](size_t pos) {
      return pos < n && !(cps[pos].flags & (kLetter | kNumber | kSpace));
    };
    size_t prev = 0;
    auto add = [&](size_t end) {
      if (end > prev) emit(cps[prev].off, cps[end].off);
      prev = end;
    };
    for (size_t pos = 0; pos < n;) {
      const uint32_t c = cps[pos].cp;
      if (c == '\'' && pos + 1 < n) {
        const uint32_t c1 = cpt(pos + 1);
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
          pos += 2;
          add(pos);
          continue;
        }
        if (pos + 2 < n) {
          const uint32_t c2 = cpt(pos + 2);
          if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
            pos += 3;
            add(pos);
            continue;
          }
        }
      }
      const size_t q = (c == ' ') ? pos + 1 : pos;  // optional leading space
      if (is(q, kLetter)) {
        pos = q;
        while (is(pos, kLetter)) ++pos;
        add(pos);
        continue;
      }
      if (is(q, kNumber)) {
        pos = q;
        while (is(pos, kNumber)) ++pos;
        add(pos);
        continue;
      }
      if (is_other(q)) {
        pos = q;
        while (is_other(pos)) ++pos;
        add(pos);
        continue;
      }
      size_t ws = 0;
      while (is(pos + ws, kSpace)) ++ws;
      if (ws > 1 && pos + ws < n) {  // \s+(?!\S): leave the last space to the next piece
        pos += ws - 1;
        add(pos);
        continue;
      }
      if (ws > 0) {
        pos += ws;
        add(pos);
        continue;
      }
      add(++pos);  // unreachable in practice: every character has a class
    }
  }

  void bpe_word(std::string_view word, std::vector<int32_t>& out) const {
    struct Symbol {
      int32_t id;
      int32_t prev, next;
    };
    struct Bigram {
      int32_t rank;
      int32_t left, right;
      int32_t left_id, right_id, result;
    };
    struct Greater {  // lowest rank first, then leftmost
      bool operator()(const Bigram& l, const Bigram& r) const {
        return l.rank > r.rank || (l.rank == r.rank && l.left > r.left);
      }
    };
    const int32_t n = static_cast<int32_t>(word.size());
    if (n == 1) {
      out.push_back(byte_token_[static_cast<uint8_t>(word[0])]);
      return;
    }
    std::vector<Symbol> syms(n);
    for (int32_t i = 0; i < n; ++i) {
      syms[i] = Symbol{byte_token_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1};
    }
    std::priority_queue<Bigram, std::vector<Bigram>, Greater> q;
    auto try_add = [&](int32_t l, int32_t r) {
      if (l < 0 || r < 0) return;
      const MergeTable::Merge* m = merges_.find(MergeTable::key(syms[l].id, syms[r].id));
      if (!m) return;
      q.push(Bigram{m->rank, l, r, syms[l].id, syms[r].id, m->result});
    };
    for (int32_t i = 1; i < n; ++i) try_add(i - 1, i);
    while (!q.empty()) {
      const Bigram b = q.top();
      q.pop();
      Symbol& l = syms[b.left];
      Symbol& r = syms[b.right];
      // Stale when either side has merged since: ids only ever grow longer,
      // so unchanged ids and adjacency mean the pair is still there.
      if (l.id < 0 || r.id < 0 || l.next != b.right || l.id != b.left_id || r.id != b.right_id)
        continue;
      l.id = b.result;
      r.id = -1;
      l.next = r.next;
      if (r.next >= 0) syms[r.next].prev = b.left;
      try_add(l.prev, b.left);
      try_add(b.left, l.next);
    }
    for (int32_t i = 0; i != -1; i = syms[i].next) out.push_back(syms[i].id);
  }

  std::vector<int> cp_to_byte_;
  int32_t byte_token_[256];
  MergeTable merges_;
};

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
    return std::unique_ptr<Tokenizer>(new SpmTokenizer(std::move(v), add_space_prefix));
  }
  if (*model == "gpt2") {
    Vocab v;
    CLEAVE_RETURN_IF_ERROR(read_vocab(file, false, &v));
    auto tok = std::make_unique<BpeTokenizer>(std::move(v));
    CLEAVE_RETURN_IF_ERROR(tok->init(file));
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }
  return Status(Code::unsupported, "tokenizer: tokenizer.ggml.model \"" + *model +
                                       "\" is not supported (supported: \"llama\", \"gpt2\")");
}

std::string StreamDecoder::push(int32_t id) {
  std::string piece = tok_.token_bytes(id);
  if (first_ && !piece.empty()) {
    first_ = false;
    const auto* spm = dynamic_cast<const SpmTokenizer*>(&tok_);
    if (spm && spm->strips_leading_space() && piece[0] == ' ') piece.erase(0, 1);
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
