// libFuzzer target for the image decoder (model/image.h): PNG/JPEG bytes
// decode under limits to pixels that match their size (then hashed and
// preprocessed, so ASan sees every pixel) or to a Status of a documented
// code. PNG chunk CRCs stop almost every mutation before stb_image runs, so
// each PNG input is also decoded with its CRCs recomputed: that half fuzzes
// stb_image's inflate, filters and interlacing behind the structure checks.
#include <array>
#include <cstring>
#include <vector>

#include "fuzz_check.h"
#include "model/image.h"
#include "tests/png_util.h"

namespace {

using namespace cleave;
using fuzz::fail;

// Small limits keep each run fast; they are checked before stb_image runs.
constexpr ImageLimits kLimits{size_t(1) << 20, 256, 256};

using testing::be32;
using testing::png_crc32;
using testing::put_be32;

// Rewrites the CRC of every whole chunk; false when there is nothing to fix.
bool fix_png_crcs(std::vector<uint8_t>& png) {
  static constexpr uint8_t kSig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (png.size() < 8 || std::memcmp(png.data(), kSig, 8) != 0) return false;
  bool changed = false;
  for (size_t pos = 8; png.size() - pos >= 12;) {
    const uint32_t len = be32(&png[pos]);
    if (len > png.size() - pos - 12) break;
    const uint32_t crc = png_crc32(&png[pos + 4], size_t(len) + 4);
    uint8_t* at = &png[pos + 8 + len];
    if (be32(at) != crc) {
      put_be32(at, crc);
      changed = true;
    }
    pos += size_t(len) + 12;
  }
  return changed;
}

void check_decode(const uint8_t* data, size_t size) {
  auto img = decode_image(data, size, kLimits);
  if (!img.ok()) {
    fuzz::expect_error(img.status(),
                       {Code::invalid_argument, Code::out_of_range, Code::unsupported, Code::corruption},
                       "decode_image");
    if (img.status().message().rfind("image: ", 0) != 0)
      fail("message without 'image: ': %s", img.status().message().c_str());
    return;
  }
  const RgbImage& im = *img;
  if (im.width < 1 || im.height < 1 || im.width > kLimits.max_width || im.height > kLimits.max_height)
    fail("decoded %dx%d, limits %dx%d", im.width, im.height, kLimits.max_width, kLimits.max_height);
  if (im.rgb.size() != size_t(im.width) * size_t(im.height) * 3)
    fail("%dx%d image with %zu RGB bytes", im.width, im.height, im.rgb.size());
  volatile uint64_t hash = image_hash(im).lo;  // reads every pixel
  (void)hash;
  static constexpr float kMean[3] = {0.5f, 0.5f, 0.5f}, kStd[3] = {0.25f, 0.25f, 0.25f};
  auto chw = preprocess_image(im, 7, kMean, kStd);
  if (!chw.ok() || chw->size() != 3 * 7 * 7)
    fail("preprocess_image of a decoded image: %s", chw.status().to_string().c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check_decode(data, size);
  std::vector<uint8_t> fixed(data, data + size);
  if (fix_png_crcs(fixed)) check_decode(fixed.data(), fixed.size());
  return 0;
}
