// The only translation unit that includes the generated Cap'n Proto header.
// Encoding copies plain values into an Envelope; decoding parses under the
// caller's limits, converts to plain values inside one try block (kj throws
// lazily, on the access that finds the problem) and validates the result.
#include "schema/codec.h"

#include <capnp/message.h>
#include <capnp/orphan.h>
#include <capnp/serialize.h>
#include <kj/exception.h>
#include <kj/io.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>

#include "cleave.capnp.h"

namespace cleave::codec {
namespace {

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

// ---- plain -> wire -------------------------------------------------------

// By size, not c_str(): kj's std::string conversion stops at the first NUL.
capnp::Text::Reader text(const std::string& s) { return capnp::Text::Reader(s.data(), s.size()); }

void put(wire::Status::Builder b, const Status& s) {
  b.setCode(wire::StatusCode(uint16_t(s.code())));
  b.setMessage(text(s.message()));
}

template <class ListBuilder, class Vec>
void put_scalars(ListBuilder list, const Vec& values) {
  for (size_t i = 0; i < values.size(); ++i) list.set(unsigned(i), values[i]);
}

void put(wire::SamplingParams::Builder b, const SamplingParams& p) {
  b.setTemperature(p.temperature);
  b.setTopK(p.top_k);
  b.setTopP(p.top_p);
  b.setMinP(p.min_p);
  b.setRepeatPenalty(p.repeat_penalty);
  b.setRepeatLastN(p.repeat_last_n);
  b.setSeed(p.seed);
  b.setMaxTokens(p.max_tokens);
  b.setPresencePenalty(p.presence_penalty);
  b.setFrequencyPenalty(p.frequency_penalty);
  auto stop = b.initStop(unsigned(p.stop.size()));
  for (size_t i = 0; i < p.stop.size(); ++i) stop.set(unsigned(i), text(p.stop[i]));
}

// Data of float32 little-endian (this build's byte order: static_assert
// below), copied bit for bit.
static_assert(std::endian::native == std::endian::little, "embeddings travel as little-endian floats");

void put(wire::PromptImage::Builder b, const PromptImage& im) {
  b.setPosition(im.position);
  b.setNTokens(im.n_tokens);
  auto hash = b.initHash();
  hash.setLo(im.hash.lo);
  hash.setHi(im.hash.hi);
  b.setWidth(im.image.width);
  b.setHeight(im.image.height);
  b.setPixels(capnp::Data::Reader(im.image.rgb.data(), im.image.rgb.size()));
  b.setEmbeddings(capnp::Data::Reader(reinterpret_cast<const uint8_t*>(im.embeddings.data()),
                                      im.embeddings.size() * sizeof(float)));
}

void put(capnp::List<wire::PromptImage>::Builder list, const std::vector<PromptImage>& images) {
  for (size_t i = 0; i < images.size(); ++i) put(list[unsigned(i)], images[i]);
}

void put(wire::GenerateRequest::Builder b, const GenerateRequest& r) {
  put_scalars(b.initPrompt(unsigned(r.prompt.size())), r.prompt);
  put(b.initSampling(), r.sampling);
  b.setRequestId(r.request_id);
  b.setPrefillChunk(r.prefill_chunk);
  b.setIgnoreEos(r.ignore_eos);
  b.setKeepLogits(r.keep_logits);
  put(b.initImages(unsigned(r.images.size())), r.images);
  b.setHasRngStream(r.rng_stream.has_value());
  b.setRngStream(r.rng_stream.value_or(0));
  b.setLogprobs(r.logprobs);
  b.setPriority(r.priority);
  b.setTtftTargetMs(r.ttft_target_ms);
  b.setTpotTargetMs(r.tpot_target_ms);
  b.setDeadlineMs(r.deadline_ms);
}

void put(wire::EncodeRequest::Builder b, const msg::EncodeRequest& m) {
  b.setRequestId(m.request_id);
  put(b.initImages(unsigned(m.images.size())), m.images);
}

void put(wire::ImageEmbeddings::Builder b, const msg::ImageEmbeddings& m) {
  b.setRequestId(m.request_id);
  put(b.initImages(unsigned(m.images.size())), m.images);
  b.setOrigin(text(m.origin));
  b.setSeconds(m.seconds);
}

void put(wire::StreamEvent::Builder b, const msg::StreamEvent& e) {
  b.setKind(wire::StreamEvent::Kind(uint16_t(e.kind)));
  b.setRequestId(e.request_id);
  b.setIndex(e.index);
  b.setToken(e.token);
  b.setText(text(e.text));
  b.setFinishReason(text(e.finish_reason));
  put_scalars(b.initLogits(unsigned(e.logits.size())), e.logits);
  put(b.initError(), e.error);
  b.setOrigin(text(e.origin));
  b.setStageSeconds(e.stage_seconds);
  b.setEncodeOrigin(text(e.encode_origin));
  b.setEncodeSeconds(e.encode_seconds);
  b.setLogitsHash(e.logits_hash);
  b.setCachedTokens(e.cached_tokens);
  if (e.has_logprobs) {
    b.setHasLogprobs(true);
    auto chosen = b.initChosen();
    chosen.setToken(e.logprobs.chosen.token);
    chosen.setLogprob(e.logprobs.chosen.logprob);
    auto top = b.initTopLogprobs(unsigned(e.logprobs.top.size()));
    for (size_t i = 0; i < e.logprobs.top.size(); ++i) {
      top[unsigned(i)].setToken(e.logprobs.top[i].token);
      top[unsigned(i)].setLogprob(e.logprobs.top[i].logprob);
    }
  }
}

void put(wire::BlockKey::Builder b, const BlockKey& k) {
  b.setLo(k.lo);
  b.setHi(k.hi);
}

void put(capnp::List<wire::BlockKey>::Builder list, const std::vector<BlockKey>& keys) {
  for (size_t i = 0; i < keys.size(); ++i) put(list[unsigned(i)], keys[i]);
}

// BlockRecord and BlockHeader share these fields.
template <class Builder>
void put_header(Builder b, const BlockHeader& h) {
  put(b.initKey(), h.key);
  b.setModelFingerprint(h.model_fingerprint);
  auto layout = b.initLayout();
  layout.setDtype(uint32_t(h.layout.k_type));
  layout.setVDtype(uint32_t(h.layout.v_type));
  layout.setTokensPerBlock(h.layout.tokens_per_block);
  layout.setNLayers(h.layout.n_layers);
  layout.setNKvHeads(h.layout.n_kv_heads);
  layout.setHeadDim(h.layout.head_dim);
  b.setChecksum(h.checksum);
  b.setNTokens(h.n_tokens);
}

// KV bytes become a segment of their own instead of a second copy; Cap'n
// Proto needs the blob word-aligned and whole words long for that.
bool by_reference(const std::vector<uint8_t>& bytes) {
  return !bytes.empty() && bytes.size() % 8 == 0 &&
         reinterpret_cast<uintptr_t>(bytes.data()) % 8 == 0;
}

// KvChunk.data and BlockRecord.bytes.
template <class Builder>
void put_bytes(Builder b, const std::vector<uint8_t>& bytes) {
  const capnp::Data::Reader data(bytes.data(), bytes.size());
  constexpr bool chunk = requires { b.setData(data); };  // else a BlockRecord
  if (by_reference(bytes)) {
    auto blob = capnp::Orphanage::getForMessageContaining(b).referenceExternalData(data);
    if constexpr (chunk)
      b.adoptData(kj::mv(blob));
    else
      b.adoptBytes(kj::mv(blob));
  } else if constexpr (chunk) {
    b.setData(data);
  } else {
    b.setBytes(data);
  }
}

void put(wire::BlockRecord::Builder b, const BlockRecord& r) {
  put_header(b, r.header);
  put_bytes(b, r.bytes);
}

void put(wire::KvPull::Builder b, const msg::KvPull& m) {
  b.setRequestId(m.request_id);
  b.setFirstBlock(m.first_block);
  b.setChunkBytes(m.chunk_bytes);
  b.setWindow(m.window);
}

void put(wire::ExpertBatch::Builder b, const msg::ExpertBatch& m) {
  b.setLayer(m.layer);
  b.setDim(m.dim);
  auto pieces = b.initPieces(unsigned(m.pieces.size()));
  for (size_t i = 0; i < m.pieces.size(); ++i) {
    pieces[unsigned(i)].setExpert(m.pieces[i].expert);
    pieces[unsigned(i)].setRows(m.pieces[i].rows);
  }
  put_bytes(b, m.data);
  b.setChecksum(m.checksum);
}

void put(wire::StageBatch::Builder b, const msg::StageBatch& m) {
  b.setOp(wire::StageOp(uint16_t(m.op)));
  b.setFirstLayer(m.first_layer);
  b.setModelFingerprint(m.model_fingerprint);
  b.setWidth(m.width);
  put_scalars(b.initPositions(unsigned(m.positions.size())), m.positions);
  put_scalars(b.initRowTable(unsigned(m.row_table.size())), m.row_table);
  put_scalars(b.initTableOffsets(unsigned(m.table_offsets.size())), m.table_offsets);
  put_scalars(b.initTableIds(unsigned(m.table_ids.size())), m.table_ids);
  put_scalars(b.initLogitRows(unsigned(m.logit_rows.size())), m.logit_rows);
  put_scalars(b.initBlocks(unsigned(m.blocks.size())), m.blocks);
  put_bytes(b, m.data);
  b.setChecksum(m.checksum);
}

void put(wire::KvChunk::Builder b, const msg::KvChunk& m) {
  b.setRequestId(m.request_id);
  b.setSeq(m.seq);
  b.setOffset(m.offset);
  b.setTotalBytes(m.total_bytes);
  b.setChecksum(m.checksum);
  put_bytes(b, m.data);
  b.setFirstBlock(m.first_block);
  auto headers = b.initHeaders(unsigned(m.headers.size()));
  for (size_t i = 0; i < m.headers.size(); ++i) put_header(headers[unsigned(i)], m.headers[i]);
}

void put(capnp::List<wire::BlockRecord>::Builder list, const std::vector<BlockRecord>& blocks) {
  for (size_t i = 0; i < blocks.size(); ++i) put(list[unsigned(i)], blocks[i]);
}

void put(wire::Handoff::Builder b, const msg::Handoff& h) {
  put(b.initRequest(), h.request);
  put_scalars(b.initGenerated(unsigned(h.generated.size())), h.generated);
  b.setNKvTokens(h.n_kv_tokens);
  put(b.initKvKeys(unsigned(h.kv_keys.size())), h.kv_keys);
  put(b.initBlocks(unsigned(h.blocks.size())), h.blocks);
  b.setKvSource(text(h.kv_source));
}

void put(wire::KvPut::Builder b, const msg::KvPut& m) {
  put(b.initBlocks(unsigned(m.blocks.size())), m.blocks);
}

void put(wire::KvAck::Builder b, const msg::KvAck& m) {
  b.setStored(m.stored);
  b.setRejected(m.rejected);
  put(b.initFirstError(), m.first_error);
}

void put(wire::KvGet::Builder b, const msg::KvGet& m) {
  put(b.initKeys(unsigned(m.keys.size())), m.keys);
}

void put(wire::KvBlocks::Builder b, const msg::KvBlocks& m) {
  put(b.initBlocks(unsigned(m.blocks.size())), m.blocks);
}

void put(wire::Health::Builder b, const msg::Health& m) {
  b.setActor(text(m.actor));
  b.setOk(m.ok);
  b.setUptimeMs(m.uptime_ms);
  b.setQueueDepth(m.queue_depth);
  b.setRunning(m.running);
}

void put(wire::Stats::Builder b, const msg::Stats& m) {
  b.setActor(text(m.actor));
  auto counters = b.initCounters(unsigned(m.counters.size()));
  for (size_t i = 0; i < m.counters.size(); ++i) {
    counters[unsigned(i)].setName(text(m.counters[i].first));
    counters[unsigned(i)].setValue(m.counters[i].second);
  }
}

// ---- what reading an encoding back costs -------------------------------
//
// The traversal words a reader is charged for decoding encode(m): Cap'n Proto
// charges every struct, list and blob it reaches, the landing pad of every
// far pointer and, twice, the root pointer. This mirrors put() above, and
// encode() builds one segment of exactly the size counted (blobs by
// reference apart), so no other far pointers arise and the count is exact
// (tested). decode() refuses a value whose encoding would need more than
// the limit it was read under, so whatever decodes re-encodes to bytes that
// decode again: the input can be far smaller than its encoding. A list of
// structs may hold elements of zero words (Cap'n Proto charges one word
// each, where the encoder writes a BlockKey as two) or narrower than the
// schema's, and an absent struct or text reads as a default that the
// encoder writes out.

// read: charged words; by_reference: of those, the words of blobs that stay
// outside the message's segment.
struct Words {
  uint64_t read = 0;
  uint64_t by_reference = 0;
};
Words operator+(Words a, Words b) { return {a.read + b.read, a.by_reference + b.by_reference}; }
Words operator+(Words a, uint64_t b) { return {a.read + b, a.by_reference}; }
Words operator+(uint64_t a, Words b) { return {a + b.read, b.by_reference}; }

constexpr uint64_t kRootWords = 2;        // the root pointer, checked twice
constexpr uint64_t kDoubleFarWords = 2;  // landing pad of a blob by reference

template <class W>
constexpr uint64_t struct_words() {
  return uint64_t(W::_capnpPrivate::dataWordSize) + uint64_t(W::_capnpPrivate::pointerCount);
}
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

// ---- wire -> plain (may throw kj::Exception; validation comes after) ----

// A list longer than its bound: thrown from the converters (they run inside
// decode's try block) and reported as invalid_argument.
struct TooLong {
  std::string what;
};

template <class ListReader>
ListReader bounded(ListReader list, size_t limit, const char* field) {
  if (list.size() > limit)
    throw TooLong{std::string(field) + ": " + std::to_string(list.size()) + " entries, limit " +
                  std::to_string(limit)};
  return list;
}

std::string get(capnp::Text::Reader t) { return std::string(t.cStr(), t.size()); }

template <class T, class ListReader>
std::vector<T> get_scalars(ListReader list) {
  std::vector<T> out;
  out.reserve(list.size());
  for (auto v : list) out.push_back(v);
  return out;
}

// Codes outside the enum are kept as read and rejected by validation.
Status get(wire::Status::Reader r) { return Status(Code(uint16_t(r.getCode())), get(r.getMessage())); }

SamplingParams get(wire::SamplingParams::Reader r) {
  SamplingParams p;
  p.temperature = r.getTemperature();
  p.top_k = r.getTopK();
  p.top_p = r.getTopP();
  p.min_p = r.getMinP();
  p.repeat_penalty = r.getRepeatPenalty();
  p.repeat_last_n = r.getRepeatLastN();
  p.seed = r.getSeed();
  p.max_tokens = r.getMaxTokens();
  p.presence_penalty = r.getPresencePenalty();
  p.frequency_penalty = r.getFrequencyPenalty();
  for (auto s : bounded(r.getStop(), kMaxListEntries, "sampling.stop")) p.stop.push_back(get(s));
  return p;
}

// Sizes are checked here, before the copies: a hostile message must not
// make us allocate what validation would refuse.
PromptImage get(wire::PromptImage::Reader r) {
  PromptImage im;
  im.position = r.getPosition();
  im.n_tokens = r.getNTokens();
  auto hash = r.getHash();  // once: every read of a pointer is charged again
  im.hash = ImageHash{hash.getLo(), hash.getHi()};
  im.image.width = r.getWidth();
  im.image.height = r.getHeight();
  auto pixels = r.getPixels();
  if (pixels.size() > size_t(kMaxImageSide) * size_t(kMaxImageSide) * 3)
    throw TooLong{"image pixels: " + std::to_string(pixels.size()) + " bytes, limit " +
                  std::to_string(size_t(kMaxImageSide) * size_t(kMaxImageSide) * 3)};
  im.image.rgb.assign(pixels.begin(), pixels.end());
  auto emb = r.getEmbeddings();
  if (emb.size() > kMaxEmbeddingBytes)
    throw TooLong{"image embeddings: " + std::to_string(emb.size()) + " bytes, limit " +
                  std::to_string(kMaxEmbeddingBytes)};
  if (emb.size() % sizeof(float) != 0)
    throw TooLong{"image embeddings: " + std::to_string(emb.size()) +
                  " bytes is not a whole number of float32"};
  im.embeddings.resize(emb.size() / sizeof(float));
  if (!im.embeddings.empty()) std::memcpy(im.embeddings.data(), emb.begin(), emb.size());
  return im;
}

BlockRecord get(wire::BlockRecord::Reader r);

// A list of structs, each converted by its get(), at most `limit` of them.
template <class T, class ListReader>
std::vector<T> get_structs(ListReader list, size_t limit, const char* field) {
  bounded(list, limit, field);
  std::vector<T> out;
  out.reserve(list.size());
  for (auto item : list) out.push_back(get(item));
  return out;
}

std::vector<PromptImage> get(capnp::List<wire::PromptImage>::Reader list) {
  return get_structs<PromptImage>(list, kMaxImages, "images");
}

GenerateRequest get(wire::GenerateRequest::Reader r) {
  GenerateRequest out;
  out.prompt = get_scalars<int32_t>(bounded(r.getPrompt(), kMaxTokens, "prompt"));
  out.sampling = get(r.getSampling());
  out.request_id = r.getRequestId();
  out.prefill_chunk = r.getPrefillChunk();
  out.ignore_eos = r.getIgnoreEos();
  out.keep_logits = r.getKeepLogits();
  out.images = get(r.getImages());
  if (r.getHasRngStream()) out.rng_stream = r.getRngStream();
  out.logprobs = r.getLogprobs();
  out.priority = r.getPriority();
  out.ttft_target_ms = r.getTtftTargetMs();
  out.tpot_target_ms = r.getTpotTargetMs();
  out.deadline_ms = r.getDeadlineMs();
  return out;
}

msg::StreamEvent get(wire::StreamEvent::Reader r) {
  msg::StreamEvent e;
  // Kind is 8 bits wide: saturate so an unknown wire value cannot wrap to a
  // known one before validation rejects it.
  e.kind = msg::StreamEvent::Kind(std::min<uint16_t>(uint16_t(r.getKind()), 255));
  e.request_id = r.getRequestId();
  e.index = r.getIndex();
  e.token = r.getToken();
  e.text = get(r.getText());
  e.finish_reason = get(r.getFinishReason());
  e.logits = get_scalars<float>(bounded(r.getLogits(), kMaxTokens, "logits"));
  e.error = get(r.getError());
  e.origin = get(r.getOrigin());
  e.stage_seconds = r.getStageSeconds();
  e.encode_origin = get(r.getEncodeOrigin());
  e.encode_seconds = r.getEncodeSeconds();
  e.logits_hash = r.getLogitsHash();
  e.cached_tokens = r.getCachedTokens();
  if (r.getHasLogprobs()) {
    e.has_logprobs = true;
    auto chosen = r.getChosen();
    e.logprobs.chosen = {chosen.getToken(), chosen.getLogprob()};
    for (auto t : bounded(r.getTopLogprobs(), 20, "top_logprobs"))
      e.logprobs.top.push_back({t.getToken(), t.getLogprob()});
  }
  return e;
}

BlockKey get(wire::BlockKey::Reader r) { return BlockKey{r.getLo(), r.getHi()}; }

std::vector<BlockKey> get(capnp::List<wire::BlockKey>::Reader list) {
  std::vector<BlockKey> out;
  out.reserve(list.size());
  for (auto k : list) out.push_back(get(k));
  return out;
}

template <class Reader>
BlockHeader get_header(Reader r) {
  BlockHeader h;
  h.key = get(r.getKey());
  h.model_fingerprint = r.getModelFingerprint();
  auto layout = r.getLayout();
  h.layout.k_type = DType(layout.getDtype());  // validate() refuses unknown ids
  h.layout.v_type = DType(layout.getVDtype());
  h.layout.tokens_per_block = layout.getTokensPerBlock();
  h.layout.n_layers = layout.getNLayers();
  h.layout.n_kv_heads = layout.getNKvHeads();
  h.layout.head_dim = layout.getHeadDim();
  h.checksum = r.getChecksum();
  h.n_tokens = r.getNTokens();
  return h;
}

void get(wire::KvPull::Reader r, msg::KvPull& m) {
  m.request_id = r.getRequestId();
  m.first_block = r.getFirstBlock();
  m.chunk_bytes = r.getChunkBytes();
  m.window = r.getWindow();
}

void get(wire::ExpertBatch::Reader r, msg::ExpertBatch& m) {
  m.layer = r.getLayer();
  m.dim = r.getDim();
  for (auto p : bounded(r.getPieces(), kMaxListEntries, "pieces"))
    m.pieces.push_back(msg::ExpertPiece{p.getExpert(), p.getRows()});
  auto data = r.getData();
  if (data.size() > kMaxExpertBytes)
    throw TooLong{"data: " + std::to_string(data.size()) + " bytes, limit " +
                  std::to_string(kMaxExpertBytes)};
  m.data.assign(data.begin(), data.end());
  m.checksum = r.getChecksum();
}

void get(wire::StageBatch::Reader r, msg::StageBatch& m) {
  const uint16_t op = uint16_t(r.getOp());
  if (op > uint16_t(msg::StageOp::kv_copy)) throw TooLong{"op " + std::to_string(op) + " is unknown"};
  m.op = msg::StageOp(op);
  m.first_layer = r.getFirstLayer();
  m.model_fingerprint = r.getModelFingerprint();
  m.width = r.getWidth();
  auto ints = [](auto list, const char* what, auto& out) {
    for (auto v : bounded(list, kMaxStageRows, what)) out.push_back(v);
  };
  ints(r.getPositions(), "positions", m.positions);
  ints(r.getRowTable(), "rowTable", m.row_table);
  ints(r.getTableOffsets(), "tableOffsets", m.table_offsets);
  ints(r.getTableIds(), "tableIds", m.table_ids);
  ints(r.getLogitRows(), "logitRows", m.logit_rows);
  ints(r.getBlocks(), "blocks", m.blocks);
  auto data = r.getData();
  if (data.size() > kMaxStageBytes)
    throw TooLong{"data: " + std::to_string(data.size()) + " bytes, limit " +
                  std::to_string(kMaxStageBytes)};
  m.data.assign(data.begin(), data.end());
  m.checksum = r.getChecksum();
}

void get(wire::KvChunk::Reader r, msg::KvChunk& m) {
  m.request_id = r.getRequestId();
  m.seq = r.getSeq();
  m.offset = r.getOffset();
  m.total_bytes = r.getTotalBytes();
  m.checksum = r.getChecksum();
  auto data = r.getData();
  if (data.size() > kMaxKvChunkBytes)
    throw TooLong{"data: " + std::to_string(data.size()) + " bytes, limit " +
                  std::to_string(kMaxKvChunkBytes)};
  m.data.assign(data.begin(), data.end());
  m.first_block = r.getFirstBlock();
  for (auto h : bounded(r.getHeaders(), kMaxBlocks, "headers")) m.headers.push_back(get_header(h));
}

BlockRecord get(wire::BlockRecord::Reader r) {
  BlockRecord out;
  out.header = get_header(r);
  auto bytes = r.getBytes();
  out.bytes.assign(bytes.begin(), bytes.end());
  return out;
}

std::vector<BlockRecord> get(capnp::List<wire::BlockRecord>::Reader list) {
  return get_structs<BlockRecord>(list, kMaxBlocks, "blocks");
}

void get(wire::Handoff::Reader r, msg::Handoff& h) {
  h.request = get(r.getRequest());
  h.generated = get_scalars<int32_t>(bounded(r.getGenerated(), kMaxTokens, "generated"));
  h.n_kv_tokens = r.getNKvTokens();
  h.kv_keys = get(bounded(r.getKvKeys(), kMaxKeys, "kv_keys"));
  h.blocks = get(r.getBlocks());
  h.kv_source = get(r.getKvSource());
}
void get(wire::KvPut::Reader r, msg::KvPut& m) { m.blocks = get(r.getBlocks()); }
void get(wire::KvAck::Reader r, msg::KvAck& m) {
  m.stored = r.getStored();
  m.rejected = r.getRejected();
  m.first_error = get(r.getFirstError());
}
void get(wire::KvGet::Reader r, msg::KvGet& m) { m.keys = get(bounded(r.getKeys(), kMaxKeys, "keys")); }
void get(wire::KvBlocks::Reader r, msg::KvBlocks& m) { m.blocks = get(r.getBlocks()); }
void get(wire::Health::Reader r, msg::Health& m) {
  m.actor = get(r.getActor());
  m.ok = r.getOk();
  m.uptime_ms = r.getUptimeMs();
  m.queue_depth = r.getQueueDepth();
  m.running = r.getRunning();
}
void get(wire::Stats::Reader r, msg::Stats& m) {
  m.actor = get(r.getActor());
  for (auto c : bounded(r.getCounters(), kMaxListEntries, "counters")) m.counters.emplace_back(get(c.getName()), c.getValue());
}
void get(wire::EncodeRequest::Reader r, msg::EncodeRequest& m) {
  m.request_id = r.getRequestId();
  m.images = get(r.getImages());
}
void get(wire::ImageEmbeddings::Reader r, msg::ImageEmbeddings& m) {
  m.request_id = r.getRequestId();
  m.images = get(r.getImages());
  m.origin = get(r.getOrigin());
  m.seconds = r.getSeconds();
}
void get(wire::GenerateRequest::Reader r, GenerateRequest& m) { m = get(r); }
void get(wire::StreamEvent::Reader r, msg::StreamEvent& m) { m = get(r); }

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
