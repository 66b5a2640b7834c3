// Image prompts, LLaVA style: text with `<image>` placeholders and decoded
// images become one GenerateRequest (prompt ids with a run of placeholder
// ids per image, and a PromptImage for each run), and a CLIP encoder fills
// the images' embeddings. The engine then feeds those rows instead of the
// placeholders' token embeddings (model/engine.h).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "model/clip.h"
#include "model/image.h"
#include "model/request.h"
#include "model/tokenizer.h"

namespace cleave {

// LLaVA's (and llama.cpp's mtmd) spelling of an image in the prompt text.
inline constexpr std::string_view kImageMarker = "<image>";

// Token id at image positions: never looked up (the embeddings replace it);
// 0 (<unk> in SentencePiece vocabularies) as models/shapes/train.py feeds.
inline constexpr int32_t kImagePlaceholderId = 0;

// Builds the prompt of `text` with `images`: BOS (when add_bos and the
// tokenizer has one), then the text split at each `<image>`, each piece
// tokenised on its own without BOS (so SPM gives each piece its leading
// space), and for the i-th marker n_tokens placeholder ids and images[i]
// (position, n_tokens, image_hash, the pixels; embeddings left empty). When
// the text holds no marker, the images come first, right after BOS, in the
// order given (llama.cpp's default). invalid_argument when markers and
// images differ in number (naming both counts) or n_tokens < 1.
Result<GenerateRequest> build_image_prompt(const Tokenizer& tokenizer, std::string_view text,
                                           std::vector<RgbImage> images, int32_t n_tokens,
                                           bool add_bos = true);

// invalid_argument naming both sizes when the encoder's projection_dim is
// not the language model's n_embd (the rows could not stand in for tokens).
Status check_projector_fits(const ClipModel& clip, int32_t n_embd);

// invalid_argument naming the request and image when an image that still
// needs embeddings cannot be encoded by clip: its span is not n_patches
// tokens, it has no pixels or not width x height x 3 bytes of them, or its
// content hash does not match the pixels (the hash keys the embedding
// caches and the KV blocks: a wrong one could poison both).
Status check_encodable(const ClipModel& clip, const std::vector<PromptImage>& images,
                       uint64_t request_id);

// Fills the embeddings of every image of the requests that has none: each
// is preprocessed with the encoder's size, mean and std, and all of them,
// across requests, are encoded in batches of up to max_batch through
// ClipModel::encode on `backend` (an image's rows do not depend on its
// batch); images with equal content hashes are encoded once. check_projector_fits()'s error; invalid_argument naming the
// request and image when its n_tokens is not the encoder's n_patches or it
// has no pixels; the encoder's errors. On error no request is changed.
Status encode_images(const ClipModel& clip, Backend& backend, int32_t n_embd,
                     std::span<GenerateRequest> requests, int32_t max_batch = 16);
inline Status encode_images(const ClipModel& clip, Backend& backend, int32_t n_embd,
                            GenerateRequest& request, int32_t max_batch = 16) {
  return encode_images(clip, backend, n_embd, std::span<GenerateRequest>(&request, 1), max_batch);
}

}  // namespace cleave
