// "llama": SentencePiece-style tokenizer (llama.cpp's llm_tokenizer_spm):
// score-driven bigram merging, byte fallback.
#include <algorithm>
#include <cstring>
#include <functional>
#include <queue>

#include "model/tokenizer_detail.h"

namespace cleave::tokenizer_detail {
namespace {

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

}  // namespace

std::unique_ptr<Tokenizer> make_spm_tokenizer(Vocab v, bool add_space_prefix) {
  return std::make_unique<SpmTokenizer>(std::move(v), add_space_prefix);
}

bool spm_strips_leading_space(const Tokenizer& t) {
  const auto* spm = dynamic_cast<const SpmTokenizer*>(&t);
  return spm && spm->strips_leading_space();
}

}  // namespace cleave::tokenizer_detail
