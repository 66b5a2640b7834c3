// plain -> wire: copies plain values into an Envelope's member (codec.cpp
// builds the message around it).
#include <capnp/orphan.h>

#include <bit>
#include <cstdint>
#include <string>
#include <vector>

#include "schema/codec_detail.h"

namespace cleave::codec::detail {
namespace {

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

void put(capnp::List<wire::BlockRecord>::Builder list, const std::vector<BlockRecord>& blocks) {
  for (size_t i = 0; i < blocks.size(); ++i) put(list[unsigned(i)], blocks[i]);
}

}  // namespace

// KV bytes become a segment of their own instead of a second copy; Cap'n
// Proto needs the blob word-aligned and whole words long for that.
bool by_reference(const std::vector<uint8_t>& bytes) {
  return !bytes.empty() && bytes.size() % 8 == 0 &&
         reinterpret_cast<uintptr_t>(bytes.data()) % 8 == 0;
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
  b.setMaxCost(r.max_cost);
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

}  // namespace cleave::codec::detail
