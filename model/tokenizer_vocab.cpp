// The tokenizers' shared pieces (model/tokenizer_detail.h): UTF-8 helpers
// and the vocabulary read from GGUF metadata.
#include "model/tokenizer_detail.h"

#include <algorithm>
#include <array>
#include <cstdio>

#include "model/unicode_data.h"

namespace cleave::tokenizer_detail {

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


std::string hex_byte(uint8_t b) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "<0x%02X>", b);
  return buf;
}

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


// Reads an optional token id; absent -> dflt. Out-of-range -> corruption.
static Status read_id(const GgufFile& f, const char* key, int32_t n, int32_t dflt, int32_t* out) {
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

}  // namespace cleave::tokenizer_detail
