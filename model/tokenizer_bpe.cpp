// "gpt2": byte-level BPE (llama.cpp's llm_tokenizer_bpe) with the GPT-2
// pre-tokeniser (hand-written, the same rules as llama.cpp's
// unicode_regex_split_custom_gpt2).
#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <queue>

#include "model/tokenizer_detail.h"
#include "model/unicode_data.h"

namespace cleave::tokenizer_detail {
namespace {

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

}  // namespace

Result<std::unique_ptr<Tokenizer>> make_bpe_tokenizer(Vocab v, const GgufFile& f) {
  auto tok = std::make_unique<BpeTokenizer>(std::move(v));
  CLEAVE_RETURN_IF_ERROR(tok->init(f));
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

}  // namespace cleave::tokenizer_detail
