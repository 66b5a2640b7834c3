// Image input for vision encoders: decode PNG/JPEG bytes (stb_image) under
// limits, hash the decoded pixels, resize and normalise to the encoder's
// CHW float tensor. Every bad input is a Status naming the problem.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace cleave {

struct ImageLimits {
  size_t max_bytes = size_t(16) << 20;  // encoded size
  int32_t max_width = 4096;
  int32_t max_height = 4096;
};

// Decoded pixels, 8-bit RGB, row-major HWC (rgb.size() == width * height * 3).
struct RgbImage {
  int32_t width = 0;
  int32_t height = 0;
  std::vector<uint8_t> rgb;
};

// Decodes a PNG or JPEG and converts it to RGB (grey is replicated, alpha is
// dropped without compositing). The header is read first, so dimensions are
// checked before any pixel memory is allocated. Errors:
//   invalid_argument  no bytes
//   out_of_range      more than max_bytes, or width/height over the limits
//   unsupported       neither PNG nor JPEG
//   corruption        zero-sized, corrupt or truncated. Before stb_image
//                     runs, a PNG's chunks are walked (CRCs checked, IEND
//                     required) and a JPEG's segments (end-of-image marker
//                     required, Huffman tables of at most 256 codes: Debian's
//                     stb_image 2.27 overflows a table on more)
Result<RgbImage> decode_image(const uint8_t* data, size_t size, const ImageLimits& limits = {});

// Reads and decodes an image file (decode_image under `limits`); every
// error names the file: io_error when it cannot be read, out_of_range when
// it is larger than max_bytes (checked before reading it).
Result<RgbImage> read_image_file(const std::string& path, const ImageLimits& limits = {});

// Content hash of the decoded image: XXH3-128 over width and height (uint32
// little-endian each) followed by the RGB bytes. Equal pixels give equal
// hashes whatever the file encoding (PNG vs PNG with other compression).
struct ImageHash {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool operator==(const ImageHash&) const = default;
};
ImageHash image_hash(const RgbImage& image);

// Bilinear resize to out_w x out_h, values in [0, 255] as float (HWC). The
// mapping is the half-pixel one (align_corners = false, no antialiasing, as
// torch.nn.functional.interpolate(mode="bilinear", align_corners=False)):
//   sx = (x + 0.5) * in_w / out_w - 0.5, clamped to [0, in_w - 1]
//   x0 = floor(sx), x1 = min(x0 + 1, in_w - 1), fx = sx - x0   (same for y)
//   out = (1-fy) * ((1-fx) p[y0][x0] + fx p[y0][x1]) + fy * ((1-fx) p[y1][x0] + fx p[y1][x1])
// computed in double and rounded to float once. Same size is the identity.
// The image must hold width * height pixels and the sizes be positive (an
// invariant, checked: callers validate first, as preprocess_image does).
std::vector<float> resize_bilinear(const RgbImage& image, int32_t out_w, int32_t out_h);

// The encoder input: resize to size x size, then per channel
// (v / 255 - mean[c]) / std[c] in double, rounded to float; CHW layout
// (3 x size x size). invalid_argument for a size outside [1, 8192], an
// image without pixels, or a mean/std that is not finite (std must be > 0).
Result<std::vector<float>> preprocess_image(const RgbImage& image, int32_t size,
                                            const float mean[3], const float std[3]);

}  // namespace cleave
