// wire -> plain: converts an Envelope's member into its plain value (may
// throw kj::Exception or TooLong: codec.cpp's decode catches them and
// validates what comes out).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "schema/codec_detail.h"

namespace cleave::codec::detail {
namespace {

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
  out.max_cost = r.getMaxCost();
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

}  // namespace

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

}  // namespace cleave::codec::detail
