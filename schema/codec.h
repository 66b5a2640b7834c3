// The codec: plain messages (schema/messages.h) <-> Cap'n Proto bytes. The
// only code that includes generated headers. Decoding never throws: a kj
// exception (malformed, truncated, over a limit) becomes a typed error, and
// values are validated after parsing (enum ranges, sizes that must agree, a
// message of another kind) so a reader gets either a complete, consistent
// value or corruption / invalid_argument naming the problem (unsupported for
// another schema version or a KV element type this build cannot hold).
//
// What decode guarantees is a well-formed value, not a trustworthy one: a
// BlockRecord's byte count matches its layout and n_tokens fits the block,
// but its checksum and fingerprints are NOT checked here. Receivers call
// verify() (storage/block.h) against the model and layout they expect.
// Likewise an image's pixels match its width and height and its embeddings
// are whole rows of its n_tokens, but the content hash is not recomputed
// (the vision encoder does that). Request fields that need the model
// (token < n_vocab, prompt length vs context, embedding width, image order)
// are validate_request()'s job.
//
// Bytes is std::vector<char>, CAF's built-in message type, so encoded
// messages cross actors and nodes with nothing to register.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "schema/messages.h"

namespace cleave::codec {

using Bytes = std::vector<char>;

// Envelope.version written by this build; other versions decode as
// unsupported.
constexpr uint16_t kSchemaVersion = 1;
// Bounds checked after parsing: any one string (text, names, stop strings,
// error messages) and the number of stop strings or stats counters.
constexpr size_t kMaxStringBytes = size_t(1) << 20;
constexpr size_t kMaxListEntries = 4096;
// Bounds on list lengths, checked before anything is allocated: Cap'n Proto
// lets a list of empty structs claim one element per traversal word, so a
// few bytes could otherwise ask for gigabytes.
constexpr size_t kMaxTokens = size_t(1) << 24;  // a token list; logits floats
constexpr size_t kMaxKeys = size_t(1) << 20;    // block keys in one message
constexpr size_t kMaxBlocks = size_t(1) << 16;  // block records in one message
// KV streams: bytes per chunk and chunks in flight a KvPull may ask for.
constexpr uint32_t kMinKvChunkBytes = 64;
constexpr uint32_t kMaxKvChunkBytes = uint32_t(64) << 20;
constexpr int32_t kMaxKvWindow = 1024;
// Images: per message, pixels per side (preprocess_image's bound), and the
// bytes of one image's embeddings.
constexpr size_t kMaxImages = 256;
constexpr int32_t kMaxImageSide = 8192;
constexpr size_t kMaxEmbeddingBytes = size_t(256) << 20;
// Expert batches: floats per row, and the bytes of one batch's rows.
constexpr uint32_t kMaxExpertDim = 1 << 16;
constexpr size_t kMaxExpertBytes = size_t(256) << 20;
// Pipeline stage batches: floats per row (a vocabulary's logits), rows and
// block ids per batch, and the bytes of its data (hidden states, logits or
// KV slices).
constexpr uint32_t kMaxStageWidth = 1 << 20;
constexpr size_t kMaxStageRows = size_t(1) << 20;
constexpr size_t kMaxStageBytes = size_t(512) << 20;

// Reader limits, set explicitly per channel (Cap'n Proto's defaults are
// 64 MiB and 64 levels).
struct Limits {
  uint64_t traversal_words = 0;
  uint32_t nesting = 0;
};
Limits control_limits();  // events, health, stats, KV gets: 16 MiB, nesting 16
Limits kv_limits();       // messages that carry KV blocks: 1 GiB, nesting 16
// Requests and the encoder's messages, which may carry pixels and
// embeddings: 512 MiB, nesting 16.
Limits image_limits();

// Every message is wrapped in one envelope whose union names its kind, so
// decoding bytes of one kind as another is an invalid_argument naming both.
Bytes encode(const GenerateRequest& m);
Bytes encode(const msg::StreamEvent& m);
Bytes encode(const msg::Handoff& m);
Bytes encode(const msg::KvPut& m);
Bytes encode(const msg::KvAck& m);
Bytes encode(const msg::KvGet& m);
Bytes encode(const msg::KvBlocks& m);
Bytes encode(const msg::Health& m);
Bytes encode(const msg::Stats& m);
Bytes encode(const msg::KvPull& m);
Bytes encode(const msg::KvChunk& m);
Bytes encode(const msg::EncodeRequest& m);
Bytes encode(const msg::ImageEmbeddings& m);
Bytes encode(const msg::ExpertBatch& m);
Bytes encode(const msg::StageBatch& m);

// The traversal words a reader needs to decode encode(m): a Limits whose
// traversal_words is at least this reads it back. decode() refuses
// (corruption) a value whose encoding needs more than the limits it was read
// under, even when the input itself fit them (lists of structs narrower on
// the wire than in the schema, absent structs): so whatever decodes
// re-encodes to bytes that decode again under the same limits.
uint64_t traversal_words(const GenerateRequest& m);
uint64_t traversal_words(const msg::StreamEvent& m);
uint64_t traversal_words(const msg::Handoff& m);
uint64_t traversal_words(const msg::KvPut& m);
uint64_t traversal_words(const msg::KvAck& m);
uint64_t traversal_words(const msg::KvGet& m);
uint64_t traversal_words(const msg::KvBlocks& m);
uint64_t traversal_words(const msg::Health& m);
uint64_t traversal_words(const msg::Stats& m);
uint64_t traversal_words(const msg::KvPull& m);
uint64_t traversal_words(const msg::KvChunk& m);
uint64_t traversal_words(const msg::EncodeRequest& m);
uint64_t traversal_words(const msg::ImageEmbeddings& m);
uint64_t traversal_words(const msg::ExpertBatch& m);
uint64_t traversal_words(const msg::StageBatch& m);

// data need not be aligned (it is copied into words when it is not).
Status decode(const char* data, size_t size, GenerateRequest& out,
              const Limits& limits = image_limits());
Status decode(const char* data, size_t size, msg::StreamEvent& out,
              const Limits& limits = control_limits());
Status decode(const char* data, size_t size, msg::Handoff& out,
              const Limits& limits = kv_limits());
Status decode(const char* data, size_t size, msg::KvPut& out, const Limits& limits = kv_limits());
Status decode(const char* data, size_t size, msg::KvAck& out,
              const Limits& limits = control_limits());
Status decode(const char* data, size_t size, msg::KvGet& out,
              const Limits& limits = control_limits());
Status decode(const char* data, size_t size, msg::KvBlocks& out,
              const Limits& limits = kv_limits());
Status decode(const char* data, size_t size, msg::Health& out,
              const Limits& limits = control_limits());
Status decode(const char* data, size_t size, msg::Stats& out,
              const Limits& limits = control_limits());
Status decode(const char* data, size_t size, msg::KvPull& out,
              const Limits& limits = control_limits());
Status decode(const char* data, size_t size, msg::KvChunk& out,
              const Limits& limits = kv_limits());
Status decode(const char* data, size_t size, msg::EncodeRequest& out,
              const Limits& limits = image_limits());
Status decode(const char* data, size_t size, msg::ImageEmbeddings& out,
              const Limits& limits = image_limits());
Status decode(const char* data, size_t size, msg::ExpertBatch& out,
              const Limits& limits = kv_limits());
Status decode(const char* data, size_t size, msg::StageBatch& out,
              const Limits& limits = kv_limits());

template <class T>
Status decode(const Bytes& bytes, T& out) {
  return decode(bytes.data(), bytes.size(), out);
}
template <class T>
Result<T> decode_as(const Bytes& bytes) {
  T out;
  Status st = decode(bytes.data(), bytes.size(), out);
  if (!st.ok()) return st;
  return out;
}

}  // namespace cleave::codec
