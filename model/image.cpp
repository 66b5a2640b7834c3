#include "model/image.h"

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

// stb_image's implementation lives in this one translation unit, static so it
// cannot clash with another copy (libstb) in the same program. Only the two
// formats we accept are compiled in; no stdio.
#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_NO_STDIO
#define STBI_NO_LINEAR
#define STBI_NO_HDR
#include <stb/stb_image.h>

namespace cleave {
namespace {

constexpr uint8_t kPngSig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

bool is_png(const uint8_t* d, size_t n) { return n >= 8 && std::memcmp(d, kPngSig, 8) == 0; }
bool is_jpeg(const uint8_t* d, size_t n) { return n >= 3 && d[0] == 0xFF && d[1] == 0xD8 && d[2] == 0xFF; }

uint32_t be32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

uint32_t crc32(const uint8_t* p, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// A corrupt chunk type in a message: bytes outside printable ASCII as \xNN,
// so an error line stays valid text.
std::string printable(const uint8_t* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] >= 0x20 && p[i] < 0x7F) {
      out += char(p[i]);
    } else {
      static const char hex[] = "0123456789abcdef";
      out += {'\\', 'x', hex[p[i] >> 4], hex[p[i] & 15]};
    }
  }
  return out;
}

// stb_image checks neither chunk CRCs nor that the file is complete: walk the
// chunks so a truncated or bit-flipped PNG is an error, not garbage pixels.
Status check_png_chunks(const uint8_t* d, size_t n) {
  size_t pos = 8;
  while (true) {
    if (n - pos < 12)
      return Status(Code::corruption, "image: truncated PNG (no IEND chunk after " +
                                          std::to_string(pos) + " of " + std::to_string(n) +
                                          " bytes)");
    const uint32_t len = be32(d + pos);
    if (len > n - pos - 12)
      return Status(Code::corruption, "image: truncated PNG (chunk at byte " + std::to_string(pos) +
                                          " declares " + std::to_string(len) + " bytes, " +
                                          std::to_string(n - pos - 12) + " left)");
    const uint8_t* type = d + pos + 4;
    if (crc32(type, size_t(len) + 4) != be32(type + 4 + len))
      return Status(Code::corruption, "image: corrupt PNG (CRC mismatch in chunk '" +
                                          printable(type, 4) + "' at byte " + std::to_string(pos) +
                                          ")");
    if (std::memcmp(type, "IEND", 4) == 0) return Status::Ok();
    pos += size_t(len) + 12;
  }
}

// Width and height from the file's own header (PNG IHDR, JPEG SOFn), read
// before stb_image sees the file so limits are checked first and a zero or
// huge size gets its own error (stb reports both as a generic failure).
struct Dims {
  int64_t w = 0, h = 0;
};
Result<Dims> png_dims(const uint8_t* d, size_t n) {
  if (n < 33 || be32(d + 8) != 13 || std::memcmp(d + 12, "IHDR", 4) != 0)
    return Status(Code::corruption, "image: corrupt PNG (no IHDR chunk first)");
  return Dims{be32(d + 16), be32(d + 20)};
}
// Walks every JPEG segment (skipping entropy-coded data) before stb_image
// sees the file:
// - stb_image pads a JPEG that ends early with zeros and succeeds, so the
//   end-of-image marker must be present (entropy-coded data cannot contain
//   FF D9: 0xFF bytes there are stuffed);
// - Debian's stb_image (2.27) overflows a 257-byte table on a Huffman table
//   declaring more than 256 codes (fixed upstream later), so DHT segments
//   are checked here;
// - the frame header gives the dimensions.
Result<Dims> walk_jpeg(const uint8_t* d, size_t n) {
  auto corrupt = [](const std::string& why, size_t at) {
    return Status(Code::corruption, "image: corrupt JPEG (" + why + " at byte " + std::to_string(at) + ")");
  };
  std::optional<Dims> dims;
  bool in_scan = false;
  bool progressive = false;
  // Huffman tables (DC, AC; ids 0-3) a DHT has defined so far: stb_image
  // decodes a scan with whatever its tables hold, and one no DHT defined is
  // uninitialised memory (its decoder asserts or reads past a table).
  bool defined[2][4] = {};
  size_t pos = 2;
  while (pos + 1 < n) {
    if (d[pos] != 0xFF) {
      if (!in_scan) return corrupt("no marker", pos);
      // Entropy-coded data up to the next 0xFF.
      const void* ff = std::memchr(d + pos, 0xFF, n - pos);
      if (ff == nullptr) break;
      pos = size_t(static_cast<const uint8_t*>(ff) - d);
      continue;
    }
    const uint8_t m = d[pos + 1];
    if (m == 0xFF) {  // fill byte
      ++pos;
      continue;
    }
    if (m == 0x00 || (m >= 0xD0 && m <= 0xD7) || m == 0x01) {  // stuffed 0xFF, restart, TEM
      if (!in_scan && m == 0x00) return corrupt("stuffed byte outside a scan", pos);
      pos += 2;
      continue;
    }
    if (m == 0xD9) {
      if (!dims) return corrupt("end of image before a frame header", pos);
      return *dims;
    }
    if (m == 0xD8) return corrupt("second start-of-image marker", pos);
    if (pos + 4 > n) break;
    const size_t len = size_t(d[pos + 2]) << 8 | d[pos + 3];
    if (len < 2) return corrupt("segment length " + std::to_string(len), pos);
    if (pos + 2 + len > n) break;
    const uint8_t* seg = d + pos + 4;
    const size_t seg_len = len - 2;
    const bool sof = m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
    if (sof && !dims) {
      if (seg_len < 5) return corrupt("short frame header", pos);
      dims = Dims{int64_t(seg[3]) << 8 | seg[4], int64_t(seg[1]) << 8 | seg[2]};
      progressive = m == 0xC2;
    }
    if (m == 0xC4) {  // DHT: tables of (class/id, 16 code counts, symbols)
      size_t off = 0;
      while (off < seg_len) {
        if (seg_len - off < 17) return corrupt("short Huffman table", pos);
        const int tc = seg[off] >> 4, th = seg[off] & 15;
        if (tc > 1 || th > 3)
          return corrupt("Huffman table of class " + std::to_string(tc) + " id " + std::to_string(th), pos);
        defined[tc][th] = true;
        size_t codes = 0;
        for (int i = 1; i <= 16; ++i) codes += seg[off + size_t(i)];
        if (codes > 256)
          return corrupt("Huffman table with " + std::to_string(codes) + " codes", pos);
        off += 17 + codes;
        if (off > seg_len) return corrupt("Huffman table past its segment", pos);
      }
    }
    if (m == 0xDA) {  // SOS: the tables its components name must exist
      const size_t ns = seg_len > 0 ? seg[0] : 0;
      if (ns == 0 || seg_len < 1 + 2 * ns + 3) return corrupt("short scan header", pos);
      const uint8_t ss = seg[1 + 2 * ns], ah = seg[3 + 2 * ns] >> 4;
      // A progressive scan reads DC tables in its first DC pass only and AC
      // tables in its AC passes; a sequential one reads both.
      const bool dc = !progressive || (ss == 0 && ah == 0), ac = !progressive || ss > 0;
      for (size_t i = 0; i < ns; ++i) {
        const int td = seg[2 + 2 * i] >> 4, ta = seg[2 + 2 * i] & 15;
        for (auto [need, cls, id] : {std::tuple{dc, 0, td}, std::tuple{ac, 1, ta}})
          if (need && (id > 3 || !defined[cls][id]))
            return corrupt(std::string("scan uses ") + (cls == 0 ? "DC" : "AC") + " Huffman table " +
                               std::to_string(id) + ", which no table before it defines",
                           pos);
      }
    }
    in_scan = m == 0xDA;
    pos += 2 + len;
  }
  if (!dims) return Status(Code::corruption, "image: truncated JPEG (no frame header)");
  return Status(Code::corruption, "image: truncated JPEG (no end-of-image marker after " +
                                      std::to_string(n) + " bytes)");
}

struct StbiFree {
  void operator()(stbi_uc* p) const { stbi_image_free(p); }
};

}  // namespace

Result<RgbImage> decode_image(const uint8_t* data, size_t size, const ImageLimits& limits) {
  if (data == nullptr || size == 0) return Status(Code::invalid_argument, "image: no bytes");
  if (size > limits.max_bytes || size > size_t(INT_MAX))
    return Status(Code::out_of_range, "image: " + std::to_string(size) + " bytes exceeds the limit of " +
                                          std::to_string(limits.max_bytes));
  const bool png = is_png(data, size);
  if (!png && !is_jpeg(data, size))
    return Status(Code::unsupported, "image: not a PNG or JPEG (unknown signature)");
  if (png) CLEAVE_RETURN_IF_ERROR(check_png_chunks(data, size));

  const char* kind = png ? "PNG" : "JPEG";
  auto dims = png ? png_dims(data, size) : walk_jpeg(data, size);
  if (!dims.ok()) return dims.status();
  const int64_t w = dims->w, h = dims->h;
  if (w <= 0 || h <= 0)
    return Status(Code::corruption, std::string("image: ") + kind + " is zero-sized (" +
                                        std::to_string(w) + "x" + std::to_string(h) + ")");
  if (w > limits.max_width || h > limits.max_height)
    return Status(Code::out_of_range, std::string("image: ") + kind + " is " + std::to_string(w) + "x" +
                                          std::to_string(h) + ", over the limit of " +
                                          std::to_string(limits.max_width) + "x" +
                                          std::to_string(limits.max_height));
  int iw = 0, ih = 0, comp = 0;
  if (!stbi_info_from_memory(data, int(size), &iw, &ih, &comp))
    return Status(Code::corruption, std::string("image: corrupt ") + kind + " header (" +
                                        stbi_failure_reason() + ")");

  int dw = 0, dh = 0, dcomp = 0;
  std::unique_ptr<stbi_uc, StbiFree> px(stbi_load_from_memory(data, int(size), &dw, &dh, &dcomp, 3));
  if (!px)
    return Status(Code::corruption, std::string("image: corrupt ") + kind + " (" +
                                        stbi_failure_reason() + ")");
  if (dw != w || dh != h)  // the header said one size, the decoder another
    return Status(Code::corruption, std::string("image: ") + kind + " header says " + std::to_string(w) +
                                        "x" + std::to_string(h) + ", decoded " + std::to_string(dw) +
                                        "x" + std::to_string(dh));
  RgbImage img;
  img.width = int32_t(w);
  img.height = int32_t(h);
  img.rgb.assign(px.get(), px.get() + size_t(w) * size_t(h) * 3);
  return img;
}

ImageHash image_hash(const RgbImage& image) {
  XXH3_state_t* st = XXH3_createState();
  CLEAVE_CHECK(st != nullptr);
  XXH3_128bits_reset(st);
  uint8_t dims[8];
  for (int i = 0; i < 4; ++i) {
    dims[i] = uint8_t(uint32_t(image.width) >> (8 * i));
    dims[4 + i] = uint8_t(uint32_t(image.height) >> (8 * i));
  }
  XXH3_128bits_update(st, dims, sizeof dims);
  XXH3_128bits_update(st, image.rgb.data(), image.rgb.size());
  const XXH128_hash_t h = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  return ImageHash{h.low64, h.high64};
}

std::vector<float> resize_bilinear(const RgbImage& image, int32_t out_w, int32_t out_h) {
  const int32_t in_w = image.width, in_h = image.height;
  CLEAVE_CHECK(in_w > 0 && in_h > 0 && out_w > 0 && out_h > 0);
  CLEAVE_CHECK(image.rgb.size() == size_t(in_w) * size_t(in_h) * 3);
  struct Tap {
    int32_t i0, i1;
    double f;
  };
  auto taps = [](int32_t in, int32_t out) {
    std::vector<Tap> t(static_cast<size_t>(out));
    for (int32_t o = 0; o < out; ++o) {
      double s = (o + 0.5) * double(in) / double(out) - 0.5;
      s = std::min(std::max(s, 0.0), double(in - 1));
      const int32_t i0 = int32_t(std::floor(s));
      t[size_t(o)] = Tap{i0, std::min(i0 + 1, in - 1), s - i0};
    }
    return t;
  };
  const std::vector<Tap> tx = taps(in_w, out_w), ty = taps(in_h, out_h);
  std::vector<float> out(size_t(out_w) * size_t(out_h) * 3);
  const uint8_t* p = image.rgb.data();
  auto at = [&](int32_t y, int32_t x, int c) { return double(p[(size_t(y) * in_w + x) * 3 + c]); };
  for (int32_t y = 0; y < out_h; ++y) {
    const Tap& a = ty[size_t(y)];
    for (int32_t x = 0; x < out_w; ++x) {
      const Tap& b = tx[size_t(x)];
      for (int c = 0; c < 3; ++c) {
        const double top = (1 - b.f) * at(a.i0, b.i0, c) + b.f * at(a.i0, b.i1, c);
        const double bot = (1 - b.f) * at(a.i1, b.i0, c) + b.f * at(a.i1, b.i1, c);
        out[(size_t(y) * out_w + x) * 3 + c] = float((1 - a.f) * top + a.f * bot);
      }
    }
  }
  return out;
}

Result<std::vector<float>> preprocess_image(const RgbImage& image, int32_t size, const float mean[3],
                                            const float std[3]) {
  if (size < 1 || size > 8192)  // as ClipModel's image_size
    return Status(Code::invalid_argument, "image: target size " + std::to_string(size) + " out of range");
  if (image.width < 1 || image.height < 1 ||
      image.rgb.size() != size_t(image.width) * size_t(image.height) * 3)
    return Status(Code::invalid_argument, "image: " + std::to_string(image.width) + "x" +
                                              std::to_string(image.height) + " image with " +
                                              std::to_string(image.rgb.size()) + " RGB bytes");
  for (int c = 0; c < 3; ++c)
    if (!std::isfinite(mean[c]) || !std::isfinite(std[c]) || !(std[c] > 0))
      return Status(Code::invalid_argument, "image: channel " + std::to_string(c) + " mean " +
                                                std::to_string(mean[c]) + " / std " +
                                                std::to_string(std[c]) + " unusable");
  const std::vector<float> hwc = resize_bilinear(image, size, size);
  const size_t plane = size_t(size) * size_t(size);
  std::vector<float> chw(plane * 3);
  for (size_t i = 0; i < plane; ++i)
    for (int c = 0; c < 3; ++c)
      chw[size_t(c) * plane + i] =
          float((double(hwc[i * 3 + c]) / 255.0 - double(mean[c])) / double(std[c]));
  return chw;
}

Result<RgbImage> read_image_file(const std::string& path, const ImageLimits& limits) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return Status(Code::io_error, "image '" + path + "': cannot read it");
  const std::streamoff size = f.tellg();
  if (size < 0 || size_t(size) > limits.max_bytes)
    return Status(Code::out_of_range, "image '" + path + "': " + std::to_string(size) +
                                          " bytes, more than the limit of " +
                                          std::to_string(limits.max_bytes));
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(bytes.data()), size);
  if (!f) return Status(Code::io_error, "image '" + path + "': read failed");
  auto image = decode_image(bytes.data(), bytes.size(), limits);
  if (!image.ok()) return Status(image.status().code(), "image '" + path + "': " + image.status().message());
  return image;
}

}  // namespace cleave
