// The codec's entry points per message type. Encoding copies plain values
// into an Envelope (codec_write.cpp); decoding parses under the caller's
// limits, converts to plain values inside one try block (codec_read.cpp; kj
// throws lazily, on the access that finds the problem) and validates the
// result (here). codec_size.cpp counts what reading an encoding back costs.
// These files (codec_detail.h is what they share) are the only code that
// includes the generated Cap'n Proto header.
#include "schema/codec.h"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>
#include <kj/io.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>

#include "schema/codec_detail.h"

namespace cleave::codec {
namespace {

using namespace detail;

using Body = wire::Envelope::Body;

constexpr const char* kKindNames[] = {"GenerateRequest", "StreamEvent",   "Handoff",
                                      "KvPut",           "KvAck",         "KvGet",
                                      "KvBlocks",        "Health",        "Stats",
                                      "KvPull",          "KvChunk",       "EncodeRequest",
                                      "ImageEmbeddings", "ExpertBatch", "StageBatch"};
constexpr size_t kNumKinds = sizeof(kKindNames) / sizeof(kKindNames[0]);
static_assert(kNumKinds == size_t(Body::STAGE_BATCH) + 1, "a kind name per union member");

std::string kind_name(Body::Which which) {
  return size_t(which) < kNumKinds ? kKindNames[size_t(which)]
                                   : "unknown kind " + std::to_string(unsigned(which));
}

Status invalid(const std::string& what) { return Status(Code::invalid_argument, what); }

// ---- validation of decoded values ---------------------------------------

Status check_string(const char* field, const std::string& s) {
  if (s.size() > kMaxStringBytes)
    return invalid(std::string(field) + ": " + std::to_string(s.size()) + " bytes, limit " +
                   std::to_string(kMaxStringBytes));
  return Status::Ok();
}

Status check_tokens(const char* field, const std::vector<int32_t>& tokens) {
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0)
      return invalid(std::string(field) + "[" + std::to_string(i) + "] = " +
                     std::to_string(tokens[i]) + " is negative");
  return Status::Ok();
}

Status check_finite(const char* field, double v) {
  if (!std::isfinite(v)) return invalid(std::string(field) + " is not finite");
  return Status::Ok();
}

Status check_status(const char* field, const Status& s) {
  if (int(s.code()) < int(Code::ok) || int(s.code()) > int(Code::rejected))
    return invalid(std::string(field) + ": status code " + std::to_string(int(s.code())) +
                   " is not a known code");
  return check_string(field, s.message());
}

Status check_seconds(const char* field, double v) {
  if (!std::isfinite(v) || v < 0)
    return invalid(std::string(field) + " = " + std::to_string(v) + " is not a finite non-negative number");
  return Status::Ok();
}

Status check_non_negative(const char* field, int64_t v) {
  if (v < 0) return invalid(std::string(field) + " = " + std::to_string(v) + " is negative");
  return Status::Ok();
}

Status validate(const SamplingParams& p) {
  CLEAVE_RETURN_IF_ERROR(check_finite("sampling.temperature", p.temperature));
  CLEAVE_RETURN_IF_ERROR(check_finite("sampling.top_p", p.top_p));
  CLEAVE_RETURN_IF_ERROR(check_finite("sampling.min_p", p.min_p));
  CLEAVE_RETURN_IF_ERROR(check_finite("sampling.repeat_penalty", p.repeat_penalty));
  CLEAVE_RETURN_IF_ERROR(check_finite("sampling.presence_penalty", p.presence_penalty));
  CLEAVE_RETURN_IF_ERROR(check_finite("sampling.frequency_penalty", p.frequency_penalty));
  CLEAVE_RETURN_IF_ERROR(check_non_negative("sampling.max_tokens", p.max_tokens));
  for (const auto& s : p.stop) CLEAVE_RETURN_IF_ERROR(check_string("sampling.stop", s));
  return Status::Ok();
}

// One image on its own; where it sits in a prompt is validate_request()'s.
Status validate(const PromptImage& im, size_t index) {
  const std::string who = "image " + std::to_string(index) + ": ";
  if (im.position < 0) return invalid(who + "position " + std::to_string(im.position) + " is negative");
  if (im.n_tokens < 1) return invalid(who + "n_tokens " + std::to_string(im.n_tokens) + " must be >= 1");
  const RgbImage& px = im.image;
  if (px.width < 0 || px.height < 0 || px.width > kMaxImageSide || px.height > kMaxImageSide)
    return invalid(who + "size " + std::to_string(px.width) + "x" + std::to_string(px.height) +
                   " outside 0.." + std::to_string(kMaxImageSide));
  if (!px.rgb.empty() && px.rgb.size() != size_t(px.width) * size_t(px.height) * 3)
    return invalid(who + std::to_string(px.rgb.size()) + " pixel bytes, " +
                   std::to_string(px.width) + "x" + std::to_string(px.height) + " RGB needs " +
                   std::to_string(size_t(px.width) * size_t(px.height) * 3));
  if (im.embeddings.size() % size_t(im.n_tokens) != 0)
    return invalid(who + std::to_string(im.embeddings.size()) +
                   " embedding floats are not whole rows of its " + std::to_string(im.n_tokens) +
                   " tokens");
  return Status::Ok();
}

Status validate(const std::vector<PromptImage>& images) {
  for (size_t i = 0; i < images.size(); ++i) CLEAVE_RETURN_IF_ERROR(validate(images[i], i));
  return Status::Ok();
}

Status validate(const GenerateRequest& r) {
  CLEAVE_RETURN_IF_ERROR(check_tokens("prompt", r.prompt));
  if (r.prefill_chunk < 1)
    return invalid("prefill_chunk = " + std::to_string(r.prefill_chunk) + " must be >= 1");
  CLEAVE_RETURN_IF_ERROR(validate(r.images));
  if (r.logprobs < -1 || r.logprobs > 20)
    return invalid("logprobs = " + std::to_string(r.logprobs) + " outside -1..20");
  CLEAVE_RETURN_IF_ERROR(check_seconds("ttft_target_ms", r.ttft_target_ms));
  CLEAVE_RETURN_IF_ERROR(check_seconds("tpot_target_ms", r.tpot_target_ms));
  CLEAVE_RETURN_IF_ERROR(check_seconds("deadline_ms", r.deadline_ms));
  CLEAVE_RETURN_IF_ERROR(check_seconds("max_cost", r.max_cost));
  return validate(r.sampling);
}

Status validate(const msg::EncodeRequest& m) {
  for (size_t i = 0; i < m.images.size(); ++i)
    if (m.images[i].image.rgb.empty())
      return invalid("image " + std::to_string(i) + " has no pixels to encode");
  return validate(m.images);
}

Status validate(const msg::ImageEmbeddings& m) {
  CLEAVE_RETURN_IF_ERROR(check_string("origin", m.origin));
  CLEAVE_RETURN_IF_ERROR(check_seconds("seconds", m.seconds));
  for (size_t i = 0; i < m.images.size(); ++i)
    if (m.images[i].embeddings.empty())
      return invalid("image " + std::to_string(i) + " has no embeddings");
  return validate(m.images);
}

Status validate(const msg::StreamEvent& e) {
  if (uint8_t(e.kind) > uint8_t(msg::StreamEvent::Kind::failed))
    return invalid("stream event kind " + std::to_string(unsigned(e.kind)) + " is not known");
  if (e.kind == msg::StreamEvent::Kind::token) {
    CLEAVE_RETURN_IF_ERROR(check_non_negative("token event index", e.index));
    CLEAVE_RETURN_IF_ERROR(check_non_negative("token event token", e.token));
  }
  CLEAVE_RETURN_IF_ERROR(check_string("text", e.text));
  CLEAVE_RETURN_IF_ERROR(check_string("finish_reason", e.finish_reason));
  CLEAVE_RETURN_IF_ERROR(check_string("origin", e.origin));
  CLEAVE_RETURN_IF_ERROR(check_status("error", e.error));
  if (!std::isfinite(e.stage_seconds) || e.stage_seconds < 0)
    return invalid("stage_seconds = " + std::to_string(e.stage_seconds) +
                   " is not a finite non-negative number");
  CLEAVE_RETURN_IF_ERROR(check_string("encode_origin", e.encode_origin));
  CLEAVE_RETURN_IF_ERROR(check_non_negative("cached_tokens", e.cached_tokens));
  if (e.has_logprobs) {
    // -inf is a real logprob (a masked token); NaN and +inf are not.
    auto bad = [](float lp) { return std::isnan(lp) || lp > 0; };
    if (e.logprobs.chosen.token < 0 || bad(e.logprobs.chosen.logprob))
      return invalid("logprobs: chosen token " + std::to_string(e.logprobs.chosen.token) +
                     " or its logprob is not valid");
    for (const TokenLogprob& t : e.logprobs.top)
      if (t.token < 0 || bad(t.logprob))
        return invalid("logprobs: top token " + std::to_string(t.token) +
                       " or its logprob is not valid");
  }
  return check_seconds("encode_seconds", e.encode_seconds);
}

// The block's byte count must equal the layout's; the product is computed
// with overflow checks because hostile dimensions can wrap size_t to any value.
Status validate(const BlockHeader& h, const std::string& who) {
  Status st = h.layout.validate();
  if (!st.ok()) return Status(st.code(), who + st.message());
  if (h.n_tokens > uint32_t(h.layout.tokens_per_block))
    return invalid(who + "n_tokens " + std::to_string(h.n_tokens) + " exceeds tokens_per_block " +
                   std::to_string(h.layout.tokens_per_block));
  return Status::Ok();
}

Status validate(const BlockRecord& r, size_t index) {
  const BlockHeader& h = r.header;
  const std::string who = "block " + std::to_string(index) + " (" + h.key.hex() + "): ";
  CLEAVE_RETURN_IF_ERROR(validate(h, who));
  // validate() bounded head_dim to a positive int32, so the row bytes fit.
  size_t expected = h.layout.k_row_bytes() + h.layout.v_row_bytes();
  for (int32_t dim : {h.layout.n_kv_heads, h.layout.tokens_per_block, h.layout.n_layers}) {
    if (__builtin_mul_overflow(expected, size_t(dim), &expected))
      return invalid(who + "layout describes more bytes than fit in memory");
  }
  if (r.bytes.size() != expected)
    return invalid(who + std::to_string(r.bytes.size()) + " bytes, layout needs " +
                   std::to_string(expected));
  return Status::Ok();
}

Status validate(const msg::KvPull& m) {
  CLEAVE_RETURN_IF_ERROR(check_non_negative("first_block", m.first_block));
  if (m.chunk_bytes < kMinKvChunkBytes || m.chunk_bytes > kMaxKvChunkBytes)
    return invalid("chunk_bytes = " + std::to_string(m.chunk_bytes) + " is outside [" +
                   std::to_string(kMinKvChunkBytes) + ", " + std::to_string(kMaxKvChunkBytes) + "]");
  if (m.window < 1 || m.window > kMaxKvWindow)
    return invalid("window = " + std::to_string(m.window) + " is outside [1, " +
                   std::to_string(kMaxKvWindow) + "]");
  return Status::Ok();
}

Status validate(const msg::KvChunk& m) {
  CLEAVE_RETURN_IF_ERROR(check_non_negative("first_block", m.first_block));
  uint64_t end = 0;
  if (__builtin_add_overflow(m.offset, uint64_t(m.data.size()), &end) || end > m.total_bytes)
    return invalid("chunk " + std::to_string(m.seq) + ": " + std::to_string(m.data.size()) +
                   " bytes at offset " + std::to_string(m.offset) + " run past the stream's " +
                   std::to_string(m.total_bytes));
  for (size_t i = 0; i < m.headers.size(); ++i)
    CLEAVE_RETURN_IF_ERROR(
        validate(m.headers[i], "header " + std::to_string(i) + " (" + m.headers[i].key.hex() + "): "));
  return Status::Ok();
}

Status validate(const std::vector<BlockRecord>& blocks) {
  for (size_t i = 0; i < blocks.size(); ++i) CLEAVE_RETURN_IF_ERROR(validate(blocks[i], i));
  return Status::Ok();
}

Status validate(const msg::Handoff& h) {
  CLEAVE_RETURN_IF_ERROR(validate(h.request));
  CLEAVE_RETURN_IF_ERROR(check_tokens("generated", h.generated));
  CLEAVE_RETURN_IF_ERROR(check_non_negative("n_kv_tokens", h.n_kv_tokens));
  const size_t n_tokens = h.request.prompt.size() + h.generated.size();
  if (size_t(h.n_kv_tokens) > n_tokens)
    return invalid("n_kv_tokens " + std::to_string(h.n_kv_tokens) + " exceeds the " +
                   std::to_string(n_tokens) + " tokens of prompt and generated");
  CLEAVE_RETURN_IF_ERROR(check_string("kv_source", h.kv_source));
  return validate(h.blocks);
}

Status validate(const msg::KvPut& m) { return validate(m.blocks); }
Status validate(const msg::KvBlocks& m) { return validate(m.blocks); }
Status validate(const msg::KvGet&) { return Status::Ok(); }

Status validate(const msg::KvAck& m) {
  CLEAVE_RETURN_IF_ERROR(check_non_negative("stored", m.stored));
  CLEAVE_RETURN_IF_ERROR(check_non_negative("rejected", m.rejected));
  return check_status("first_error", m.first_error);
}

Status validate(const msg::Health& m) {
  CLEAVE_RETURN_IF_ERROR(check_string("actor", m.actor));
  CLEAVE_RETURN_IF_ERROR(check_non_negative("queue_depth", m.queue_depth));
  return check_non_negative("running", m.running);
}

Status validate(const msg::ExpertBatch& m) {
  CLEAVE_RETURN_IF_ERROR(check_non_negative("layer", m.layer));
  if (m.dim < 1 || m.dim > kMaxExpertDim)
    return invalid("dim = " + std::to_string(m.dim) + " is outside [1, " +
                   std::to_string(kMaxExpertDim) + "]");
  uint64_t rows = 0;
  for (const msg::ExpertPiece& p : m.pieces) {
    CLEAVE_RETURN_IF_ERROR(check_non_negative("expert", p.expert));
    rows += p.rows;  // at most kMaxListEntries * 2^32: no overflow
  }
  if (rows * m.dim * sizeof(float) != m.data.size())
    return invalid(std::to_string(rows) + " rows of " + std::to_string(m.dim) + " floats need " +
                   std::to_string(rows * m.dim * sizeof(float)) + " bytes, data has " +
                   std::to_string(m.data.size()));
  if (checksum_bytes(m.data.data(), m.data.size()) != m.checksum)
    return Status(Code::corruption, "the rows' checksum does not match");
  return Status::Ok();
}

Status validate(const msg::StageBatch& m) {
  if (m.first_layer < 1) return invalid("firstLayer = " + std::to_string(m.first_layer) +
                                        " must be at least 1 (layer 0 is the first stage's)");
  if (m.width > kMaxStageWidth)
    return invalid("width = " + std::to_string(m.width) + " is over " + std::to_string(kMaxStageWidth));
  const size_t n = m.positions.size();
  if (m.row_table.size() != n)
    return invalid(std::to_string(n) + " positions and " + std::to_string(m.row_table.size()) +
                   " row tables");
  if (!m.table_offsets.empty() && m.table_offsets.front() != 0)
    return invalid("tableOffsets must start at 0");
  for (size_t t = 1; t < m.table_offsets.size(); ++t)
    if (m.table_offsets[t] < m.table_offsets[t - 1])
      return invalid("tableOffsets must not decrease");
  if ((m.table_offsets.empty() ? 0 : m.table_offsets.back()) != m.table_ids.size())
    return invalid("tableOffsets must end at the " + std::to_string(m.table_ids.size()) +
                   " table ids");
  const size_t tables = m.table_offsets.empty() ? 0 : m.table_offsets.size() - 1;
  for (int32_t t : m.row_table)
    if (t < 0 || size_t(t) >= tables)
      return invalid("a row names table " + std::to_string(t) + " of " + std::to_string(tables));
  if ((m.op == msg::StageOp::layers || m.op == msg::StageOp::output) && m.width > 0 &&
      m.data.size() % (size_t(m.width) * sizeof(float)) != 0)
    return invalid(std::to_string(m.data.size()) + " data bytes are not whole rows of " +
                   std::to_string(m.width) + " floats");
  if (m.op == msg::StageOp::layers && m.data.size() != n * m.width * sizeof(float))
    return invalid(std::to_string(n) + " rows of " + std::to_string(m.width) + " floats need " +
                   std::to_string(n * m.width * sizeof(float)) + " bytes, data has " +
                   std::to_string(m.data.size()));
  if (m.op == msg::StageOp::kv_copy && m.blocks.size() != 2)
    return invalid("kvCopy needs 2 blocks (source, destination), not " +
                   std::to_string(m.blocks.size()));
  if (checksum_bytes(m.data.data(), m.data.size()) != m.checksum)
    return Status(Code::corruption, "the data's checksum does not match");
  return Status::Ok();
}

Status validate(const msg::Stats& m) {
  CLEAVE_RETURN_IF_ERROR(check_string("actor", m.actor));
  for (const auto& c : m.counters) CLEAVE_RETURN_IF_ERROR(check_string("counter name", c.first));
  return Status::Ok();
}

// ---- one envelope member per message type --------------------------------

template <class T>
struct Member;
#define CLEAVE_MEMBER(Type, WHICH, Name)                                      \
  template <>                                                                 \
  struct Member<Type> {                                                       \
    static constexpr Body::Which which = Body::WHICH;                         \
    static auto init(Body::Builder b) { return b.init##Name(); }              \
    static auto read(Body::Reader b) { return b.get##Name(); }                \
    using Wire = wire::Name;                                                  \
  };
CLEAVE_MEMBER(GenerateRequest, GENERATE_REQUEST, GenerateRequest)
CLEAVE_MEMBER(msg::StreamEvent, STREAM_EVENT, StreamEvent)
CLEAVE_MEMBER(msg::Handoff, HANDOFF, Handoff)
CLEAVE_MEMBER(msg::KvPut, KV_PUT, KvPut)
CLEAVE_MEMBER(msg::KvAck, KV_ACK, KvAck)
CLEAVE_MEMBER(msg::KvGet, KV_GET, KvGet)
CLEAVE_MEMBER(msg::KvBlocks, KV_BLOCKS, KvBlocks)
CLEAVE_MEMBER(msg::Health, HEALTH, Health)
CLEAVE_MEMBER(msg::Stats, STATS, Stats)
CLEAVE_MEMBER(msg::KvPull, KV_PULL, KvPull)
CLEAVE_MEMBER(msg::KvChunk, KV_CHUNK, KvChunk)
CLEAVE_MEMBER(msg::EncodeRequest, ENCODE_REQUEST, EncodeRequest)
CLEAVE_MEMBER(msg::ImageEmbeddings, IMAGE_EMBEDDINGS, ImageEmbeddings)
CLEAVE_MEMBER(msg::ExpertBatch, EXPERT_BATCH, ExpertBatch)
CLEAVE_MEMBER(msg::StageBatch, STAGE_BATCH, StageBatch)
#undef CLEAVE_MEMBER

constexpr uint64_t kRootWords = 2;        // the root pointer, checked twice

// Reading encode(m) back: the root pointer, the envelope, the member and
// what it points to.
template <class T>
Words envelope_words(const T& m) {
  using Wire = typename Member<T>::Wire;
  return Words{kRootWords + struct_words<wire::Envelope>() + struct_words<Wire>(), 0} + content(m);
}

template <class T>
Bytes encode_message(const T& m) {
  // One segment that holds everything but the blobs by reference: the root
  // pointer, the objects and the blobs' landing pads. Larger messages than
  // one segment can hold decode under no limit of ours anyway.
  const Words read = envelope_words(m);
  const uint64_t segment = 1 + read.read - kRootWords - read.by_reference;
  capnp::MallocMessageBuilder builder(unsigned(std::min<uint64_t>(segment, uint64_t(1) << 28)));
  auto envelope = builder.initRoot<wire::Envelope>();
  envelope.setVersion(kSchemaVersion);
  put(Member<T>::init(envelope.getBody()), m);
  // Serialise straight into the result: one copy of the segments.
  const size_t words = capnp::computeSerializedSizeInWords(builder);
  Bytes out(words * sizeof(capnp::word));
  kj::ArrayOutputStream stream(kj::arrayPtr(reinterpret_cast<kj::byte*>(out.data()), out.size()));
  capnp::writeMessage(stream, builder);
  CLEAVE_CHECK(stream.getArray().size() == out.size());
  return out;
}

template <class T>
Status decode_message(const char* data, size_t size, T& out, const Limits& limits) {
  const std::string expected = kKindNames[size_t(Member<T>::which)];
  auto corrupt = [&](const std::string& why) {
    return Status(Code::corruption, "decoding " + expected + ": " + why);
  };
  if (size == 0) return corrupt("empty input");
  if (size % sizeof(capnp::word) != 0)
    return corrupt(std::to_string(size) + " bytes is not a whole number of 8-byte words");

  // FlatArrayMessageReader reads words in place: copy when misaligned.
  kj::Array<capnp::word> aligned;
  const capnp::word* words = reinterpret_cast<const capnp::word*>(data);
  if (reinterpret_cast<uintptr_t>(data) % alignof(capnp::word) != 0) {
    aligned = kj::heapArray<capnp::word>(size / sizeof(capnp::word));
    std::memcpy(aligned.begin(), data, size);
    words = aligned.begin();
  }
  capnp::ReaderOptions options;
  options.traversalLimitInWords = limits.traversal_words;
  options.nestingLimit = int(limits.nesting);

  T value;
  try {
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(words, size / sizeof(capnp::word)),
                                         options);
    auto envelope = reader.getRoot<wire::Envelope>();
    if (envelope.getVersion() != kSchemaVersion)
      return Status(Code::unsupported, "decoding " + expected + ": schema version " +
                                           std::to_string(envelope.getVersion()) +
                                           ", this build reads " +
                                           std::to_string(kSchemaVersion));
    auto body = envelope.getBody();
    if (body.which() != Member<T>::which)
      return invalid("expected " + expected + ", got " + kind_name(body.which()));
    get(Member<T>::read(body), value);
  } catch (const TooLong& e) {
    return invalid("decoding " + expected + ": " + e.what);
  } catch (const kj::Exception& e) {
    return corrupt(std::string(e.getDescription().cStr()));
  } catch (const std::exception& e) {  // std::bad_alloc from a hostile list size
    return corrupt(e.what());
  }
  // Whatever decodes must re-encode to bytes that decode under the same
  // limits (a relay forwards what it read): the input may be far smaller
  // than its encoding (see words() above).
  const uint64_t needed = envelope_words(value).read;
  if (needed > limits.traversal_words)
    return corrupt("re-encoded it needs " + std::to_string(needed) +
                   " words, over the reader's traversal limit of " +
                   std::to_string(limits.traversal_words) +
                   " (lists or structs smaller on the wire than in the schema)");
  Status st = validate(value);
  if (!st.ok()) return Status(st.code(), "decoding " + expected + ": " + st.message());
  out = std::move(value);
  return Status::Ok();
}

}  // namespace

Limits control_limits() { return Limits{(uint64_t(16) << 20) / sizeof(capnp::word), 16}; }
Limits kv_limits() { return Limits{(uint64_t(1) << 30) / sizeof(capnp::word), 16}; }
Limits image_limits() { return Limits{(uint64_t(512) << 20) / sizeof(capnp::word), 16}; }

#define CLEAVE_CODEC(Type)                                                         \
  Bytes encode(const Type& m) { return encode_message(m); }                        \
  uint64_t traversal_words(const Type& m) { return envelope_words(m).read; }       \
  Status decode(const char* data, size_t size, Type& out, const Limits& limits) { \
    return decode_message(data, size, out, limits);                                \
  }
CLEAVE_CODEC(GenerateRequest)
CLEAVE_CODEC(msg::StreamEvent)
CLEAVE_CODEC(msg::Handoff)
CLEAVE_CODEC(msg::KvPut)
CLEAVE_CODEC(msg::KvAck)
CLEAVE_CODEC(msg::KvGet)
CLEAVE_CODEC(msg::KvBlocks)
CLEAVE_CODEC(msg::Health)
CLEAVE_CODEC(msg::Stats)
CLEAVE_CODEC(msg::KvPull)
CLEAVE_CODEC(msg::KvChunk)
CLEAVE_CODEC(msg::EncodeRequest)
CLEAVE_CODEC(msg::ImageEmbeddings)
CLEAVE_CODEC(msg::ExpertBatch)
CLEAVE_CODEC(msg::StageBatch)
#undef CLEAVE_CODEC

}  // namespace cleave::codec
