#include "model/multimodal.h"

#include <algorithm>
#include <map>
#include <utility>

namespace cleave {

Result<GenerateRequest> build_image_prompt(const Tokenizer& tokenizer, std::string_view text,
                                           std::vector<RgbImage> images, int32_t n_tokens,
                                           bool add_bos) {
  if (n_tokens < 1)
    return Status(Code::invalid_argument,
                  "image prompt: images need at least one token each, got " + std::to_string(n_tokens));
  std::vector<std::string_view> pieces;  // text around the markers: markers + 1 pieces
  for (size_t from = 0;;) {
    const size_t at = text.find(kImageMarker, from);
    pieces.push_back(text.substr(from, at == std::string_view::npos ? std::string_view::npos : at - from));
    if (at == std::string_view::npos) break;
    from = at + kImageMarker.size();
  }
  const size_t markers = pieces.size() - 1;
  if (markers > 0 && markers != images.size())
    return Status(Code::invalid_argument,
                  "image prompt: the text has " + std::to_string(markers) + " " +
                      std::string(kImageMarker) + " markers but " + std::to_string(images.size()) +
                      " images were given");
  GenerateRequest r;
  if (add_bos && tokenizer.bos() >= 0) r.prompt.push_back(tokenizer.bos());
  auto add_image = [&](RgbImage image) {
    PromptImage im;
    im.position = int32_t(r.prompt.size());
    im.n_tokens = n_tokens;
    im.hash = image_hash(image);
    im.image = std::move(image);
    r.prompt.insert(r.prompt.end(), size_t(n_tokens), kImagePlaceholderId);
    r.images.push_back(std::move(im));
  };
  auto add_text = [&](std::string_view piece) {
    if (piece.empty()) return;
    const std::vector<int32_t> ids = tokenizer.encode(piece, /*add_bos=*/false);
    r.prompt.insert(r.prompt.end(), ids.begin(), ids.end());
  };
  if (markers == 0) {
    for (RgbImage& image : images) add_image(std::move(image));
    add_text(pieces[0]);
    return r;
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    add_text(pieces[i]);
    if (i < markers) add_image(std::move(images[i]));
  }
  return r;
}

Status check_projector_fits(const ClipModel& clip, int32_t n_embd) {
  if (clip.config().projection_dim != n_embd)
    return Status(Code::invalid_argument,
                  "mmproj projection_dim " + std::to_string(clip.config().projection_dim) +
                      " differs from the language model's n_embd " + std::to_string(n_embd));
  return Status::Ok();
}

Status check_encodable(const ClipModel& clip, const std::vector<PromptImage>& images,
                       uint64_t request_id) {
  const ClipConfig& c = clip.config();
  for (size_t i = 0; i < images.size(); ++i) {
    const PromptImage& im = images[i];
    if (!im.embeddings.empty()) continue;
    const std::string who = "image prompt: request " + std::to_string(request_id) + " image " +
                            std::to_string(i);
    if (im.n_tokens != c.n_patches)
      return Status(Code::invalid_argument, who + " spans " + std::to_string(im.n_tokens) +
                                                " tokens, the encoder gives " +
                                                std::to_string(c.n_patches));
    if (im.image.rgb.empty()) return Status(Code::invalid_argument, who + " has no pixels to encode");
    if (im.image.width < 1 || im.image.height < 1 ||
        im.image.rgb.size() != size_t(im.image.width) * size_t(im.image.height) * 3)
      return Status(Code::invalid_argument,
                    who + " has " + std::to_string(im.image.rgb.size()) + " pixel bytes for " +
                        std::to_string(im.image.width) + "x" + std::to_string(im.image.height));
    if (!(image_hash(im.image) == im.hash))
      return Status(Code::invalid_argument, who + ": its content hash does not match its pixels");
  }
  return Status::Ok();
}

Status encode_images(const ClipModel& clip, Backend& backend, int32_t n_embd,
                     std::span<GenerateRequest> requests, int32_t max_batch) {
  CLEAVE_RETURN_IF_ERROR(check_projector_fits(clip, n_embd));
  if (max_batch < 1)
    return Status(Code::invalid_argument,
                  "encode_images: max_batch must be positive, got " + std::to_string(max_batch));
  std::vector<PromptImage*> todo;
  for (GenerateRequest& r : requests) {
    CLEAVE_RETURN_IF_ERROR(check_encodable(clip, r.images, r.request_id));
    for (PromptImage& im : r.images)
      if (im.embeddings.empty()) todo.push_back(&im);
  }
  // One encode per distinct image (equal hashes, equal pixels): the rest copy its rows.
  std::vector<PromptImage*> unique;
  std::vector<size_t> source(todo.size());
  std::map<std::pair<uint64_t, uint64_t>, size_t> seen;
  for (size_t k = 0; k < todo.size(); ++k) {
    auto [it, added] = seen.try_emplace({todo[k]->hash.lo, todo[k]->hash.hi}, unique.size());
    if (added) unique.push_back(todo[k]);
    source[k] = it->second;
  }
  const size_t per_image = clip.output_floats();
  std::vector<float> pixels, out(unique.size() * per_image);
  for (size_t first = 0; first < unique.size(); first += size_t(max_batch)) {
    const size_t n = std::min(unique.size() - first, size_t(max_batch));
    pixels.clear();
    for (size_t k = first; k < first + n; ++k) {
      auto px = clip.preprocess(unique[k]->image);
      if (!px.ok()) return Status(px.status().code(), "encode_images: " + px.status().message());
      pixels.insert(pixels.end(), px->begin(), px->end());
    }
    CLEAVE_RETURN_IF_ERROR(clip.encode(backend, pixels.data(), int64_t(n), out.data() + first * per_image));
  }
  for (size_t k = 0; k < todo.size(); ++k)
    todo[k]->embeddings.assign(out.begin() + int64_t(source[k] * per_image),
                               out.begin() + int64_t((source[k] + 1) * per_image));
  return Status::Ok();
}

}  // namespace cleave
