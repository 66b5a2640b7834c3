// What reading an encoding back costs.
//
// The traversal words a reader is charged for decoding encode(m): Cap'n Proto
// charges every struct, list and blob it reaches, the landing pad of every
// far pointer and, twice, the root pointer. This mirrors put()
// (codec_write.cpp), and encode() builds one segment of exactly the size
// counted (blobs by reference apart), so no other far pointers arise and the
// count is exact (tested). decode() refuses a value whose encoding would need
// more than the limit it was read under, so whatever decodes re-encodes to
// bytes that decode again: the input can be far smaller than its encoding. A
// list of structs may hold elements of zero words (Cap'n Proto charges one
// word each, where the encoder writes a BlockKey as two) or narrower than the
// schema's, and an absent struct or text reads as a default that the encoder
// writes out.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "schema/codec_detail.h"

namespace cleave::codec::detail {
namespace {

constexpr uint64_t kDoubleFarWords = 2;  // landing pad of a blob by reference

constexpr uint64_t blob_words(uint64_t bytes) { return (bytes + 7) / 8; }
uint64_t text_words(const std::string& s) { return blob_words(uint64_t(s.size()) + 1); }  // + NUL
template <class T>
uint64_t scalar_list_words(const std::vector<T>& v) {
  return blob_words(uint64_t(v.size()) * sizeof(T));
}
Words bytes_words(const std::vector<uint8_t>& bytes) {  // as put_bytes() writes them
  const uint64_t w = blob_words(bytes.size());
  if (by_reference(bytes)) return Words{w + kDoubleFarWords, w};
  return Words{w, 0};
}

// content(x): the words of what x's struct points to (its own data and
// pointer sections are counted by whoever holds the pointer or the list).
uint64_t content(const Status& s) { return text_words(s.message()); }
uint64_t content(const SamplingParams& p) {
  uint64_t w = p.stop.size();  // List(Text): one pointer each
  for (const std::string& s : p.stop) w += text_words(s);
  return w;
}
uint64_t content(const PromptImage& im) {
  return struct_words<wire::ImageHash>() + blob_words(im.image.rgb.size()) +
         blob_words(uint64_t(im.embeddings.size()) * sizeof(float));
}
uint64_t content(const BlockKey&) { return 0; }
uint64_t content(const BlockHeader&) {
  return struct_words<wire::BlockKey>() + struct_words<wire::KvLayout>();
}
Words content(const BlockRecord& r) { return content(r.header) + bytes_words(r.bytes); }
uint64_t content(const std::pair<std::string, uint64_t>& counter) {
  return text_words(counter.first);
}

// A list of structs: its tag word, the elements, then what they point to.
template <class W, class T>
Words struct_list_words(const std::vector<T>& items) {
  Words w{1 + uint64_t(items.size()) * struct_words<W>(), 0};
  for (const T& x : items) w = w + content(x);
  return w;
}

}  // namespace

Words content(const GenerateRequest& r) {
  return scalar_list_words(r.prompt) + struct_words<wire::SamplingParams>() + content(r.sampling) +
         struct_list_words<wire::PromptImage>(r.images);
}
Words content(const msg::EncodeRequest& m) {
  return struct_list_words<wire::PromptImage>(m.images);
}
Words content(const msg::ImageEmbeddings& m) {
  return struct_list_words<wire::PromptImage>(m.images) + text_words(m.origin);
}
uint64_t content(const msg::StreamEvent& e) {
  uint64_t logprobs = 0;
  if (e.has_logprobs)
    logprobs = struct_words<wire::TokenLogprob>() +
               (1 + uint64_t(e.logprobs.top.size()) * struct_words<wire::TokenLogprob>());
  return text_words(e.text) + text_words(e.finish_reason) + scalar_list_words(e.logits) +
         struct_words<wire::Status>() + content(e.error) + text_words(e.origin) +
         text_words(e.encode_origin) + logprobs;
}
uint64_t content(const msg::KvPull&) { return 0; }
Words content(const msg::ExpertBatch& m) {
  return Words{1 + uint64_t(m.pieces.size()) * struct_words<wire::ExpertPiece>(), 0} +
         bytes_words(m.data);
}
Words content(const msg::StageBatch& m) {
  return scalar_list_words(m.positions) + scalar_list_words(m.row_table) +
         scalar_list_words(m.table_offsets) + scalar_list_words(m.table_ids) +
         scalar_list_words(m.logit_rows) + scalar_list_words(m.blocks) + bytes_words(m.data);
}
Words content(const msg::KvChunk& m) {
  return bytes_words(m.data) + struct_list_words<wire::BlockHeader>(m.headers);
}
Words content(const msg::Handoff& h) {
  return struct_words<wire::GenerateRequest>() + content(h.request) +
         scalar_list_words(h.generated) + struct_list_words<wire::BlockKey>(h.kv_keys) +
         struct_list_words<wire::BlockRecord>(h.blocks) + text_words(h.kv_source);
}
Words content(const msg::KvPut& m) { return struct_list_words<wire::BlockRecord>(m.blocks); }
Words content(const msg::KvBlocks& m) { return struct_list_words<wire::BlockRecord>(m.blocks); }
uint64_t content(const msg::KvAck& m) {
  return struct_words<wire::Status>() + content(m.first_error);
}
Words content(const msg::KvGet& m) { return struct_list_words<wire::BlockKey>(m.keys); }
uint64_t content(const msg::Health& m) { return text_words(m.actor); }
Words content(const msg::Stats& m) {
  return text_words(m.actor) + struct_list_words<wire::Counter>(m.counters);
}

}  // namespace cleave::codec::detail
