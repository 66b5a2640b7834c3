// One example of every message with non-default values in every field: the
// codec tests' round trips and the fuzzer's seed corpus
// (tests/schema/fuzz/write_seeds.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "schema/messages.h"

namespace cleave::examples {

inline KvLayout small_layout() {
  KvLayout l;
  l.tokens_per_block = 4;
  l.n_layers = 2;
  l.n_kv_heads = 1;
  l.head_dim = 2;
  return l;  // 2 * 1 * 4 * 2 * 4 bytes * 2 layers = 128 bytes
}

// A sealed-looking record (checksum is a marker, not XXH3: the codec does not
// verify checksums) whose bytes differ per `salt`.
inline BlockRecord block(uint32_t salt, KvLayout layout = small_layout()) {
  BlockRecord r;
  r.header.key = BlockKey{0x0123456789abcdefull + salt, 0xfedcba9876543210ull - salt};
  r.header.model_fingerprint = 0x5eed000000000000ull | salt;
  r.header.layout = layout;
  r.header.checksum = 0xc0ffee00ull + salt;
  r.header.n_tokens = uint32_t(layout.tokens_per_block) - (salt % 2);
  r.bytes.resize(layout.block_bytes());
  for (size_t i = 0; i < r.bytes.size(); ++i) r.bytes[i] = uint8_t(i * 31 + salt * 7 + 1);
  return r;
}

// An image with pixels (to encode) or with embeddings (encoded), values
// differing per salt; embeddings hold bit patterns that must survive
// (negative zero, subnormal, infinity, NaN).
inline PromptImage image(uint32_t salt, bool encoded) {
  PromptImage im;
  im.position = 1 + int32_t(salt % 3);
  im.n_tokens = 4;
  im.hash = ImageHash{0xabcdef0000000000ull + salt, 0x1234567800000000ull ^ salt};
  im.image.width = 3;
  im.image.height = 2;
  if (encoded) {
    for (int i = 0; i < 4 * 5; ++i) im.embeddings.push_back(float(i) * 0.5f - float(salt));
    im.embeddings[1] = -0.0f;
    im.embeddings[2] = 1e-40f;
    im.embeddings[3] = INFINITY;
    im.embeddings[4] = NAN;
  } else {
    for (int i = 0; i < 3 * 2 * 3; ++i) im.image.rgb.push_back(uint8_t(i * 13 + salt));
  }
  return im;
}

inline GenerateRequest request() {
  GenerateRequest r;
  r.prompt = {1, 15043, 3186, 0, 31999, 7};
  r.sampling.temperature = 0.65f;
  r.sampling.top_k = 17;
  r.sampling.top_p = 0.9f;
  r.sampling.min_p = 0.02f;
  r.sampling.repeat_penalty = 1.1f;
  r.sampling.repeat_last_n = 32;
  r.sampling.seed = 0xdeadbeefcafef00dull;
  r.sampling.max_tokens = 123;
  r.sampling.stop = {"\n\n", "User:", std::string("nul\0inside", 10)};
  r.request_id = 0x1122334455667788ull;
  r.prefill_chunk = 96;
  r.ignore_eos = true;
  r.keep_logits = true;
  r.images = {image(1, false), image(2, true)};
  r.sampling.presence_penalty = -0.5f;
  r.sampling.frequency_penalty = 1.25f;
  r.rng_stream = 3;
  r.logprobs = 5;
  r.priority = -7;
  r.ttft_target_ms = 250.5;
  r.tpot_target_ms = 0.125;
  r.deadline_ms = 9000;
  r.max_cost = 2.75;
  return r;
}

inline msg::StreamEvent token_event() {
  msg::StreamEvent e;
  e.kind = msg::StreamEvent::Kind::token;
  e.request_id = 42;
  e.index = 5;
  e.token = 29871;
  e.text = std::string(" h\xc3\xa9llo\0!", 9);  // byte tokens can be NUL
  e.origin = "decode-3";
  e.stage_seconds = 0.00125;
  e.encode_origin = "vision_encoder/0";
  e.encode_seconds = 0.0031;
  e.cached_tokens = 48;
  e.has_logprobs = true;
  e.logprobs.chosen = {29871, -0.25f};
  e.logprobs.top = {{29871, -0.25f}, {13, -1.75f}, {2, -std::numeric_limits<float>::infinity()}};
  return e;
}

inline msg::StreamEvent finished_event() {
  msg::StreamEvent e;
  e.kind = msg::StreamEvent::Kind::finished;
  e.request_id = 43;
  e.index = 64;
  e.text = "tail";
  e.finish_reason = "length";
  // Values that must survive bit for bit: subnormal, negative zero, infinity, extremes.
  e.logits = {1.5f, -0.0f, 1e-40f, -3.25e7f, INFINITY, -INFINITY, 3.4028235e38f, 0.1f};
  for (int i = 0; i < 100; ++i) e.logits.push_back(std::sin(float(i)) * 10.0f);
  e.origin = "colocated-0";
  e.stage_seconds = 2.5;
  return e;
}

inline msg::StreamEvent failed_event() {
  msg::StreamEvent e;
  e.kind = msg::StreamEvent::Kind::failed;
  e.request_id = 44;
  e.error = Status(Code::unavailable, "no decode actor left for request 44");
  e.origin = "router";
  return e;
}

inline msg::Handoff handoff() {
  msg::Handoff h;
  h.request = request();
  h.generated = {306, 626, 0, 263};
  h.n_kv_tokens = 8;  // of 6 prompt + 4 generated
  h.kv_keys = {BlockKey{1, 2}, BlockKey{~0ull, 0}};
  h.blocks = {block(1), block(2)};
  return h;
}

inline msg::KvPut kv_put() { return msg::KvPut{{block(3), block(4), block(5)}}; }

inline msg::KvAck kv_ack() {
  msg::KvAck a;
  a.stored = 7;
  a.rejected = 2;
  a.first_error = Status(Code::corruption, "block 00ff: checksum mismatch");
  return a;
}

inline msg::KvGet kv_get() { return msg::KvGet{{BlockKey{3, 4}, BlockKey{5, 6}, BlockKey{0, ~0ull}}}; }

inline msg::KvBlocks kv_blocks() { return msg::KvBlocks{{block(6)}}; }

inline msg::Health health() {
  msg::Health h;
  h.actor = "prefill-1";
  h.ok = false;
  h.uptime_ms = 86400123;
  h.queue_depth = 12;
  h.running = 3;
  return h;
}

inline msg::Stats stats() {
  msg::Stats s;
  s.actor = "kv_store";
  s.counters = {{"requests", 1000}, {"tokens", 123456789012ull}, {"kv_blocks_moved", 0},
                {"failures", ~0ull}};
  return s;
}

inline msg::KvPull kv_pull() {
  msg::KvPull p;
  p.request_id = 77;
  p.first_block = 2;
  p.chunk_bytes = 4096;
  p.window = 8;
  return p;
}

inline msg::KvChunk kv_chunk() {
  msg::KvChunk c;
  BlockRecord b = block(7);
  c.request_id = 77;
  c.seq = 0;
  c.offset = 0;
  c.total_bytes = b.bytes.size();
  c.data.assign(b.bytes.begin(), b.bytes.begin() + 64);
  c.checksum = checksum_bytes(c.data.data(), c.data.size());
  c.first_block = 2;
  c.headers = {b.header};
  return c;
}

inline msg::EncodeRequest encode_request() {
  msg::EncodeRequest m;
  m.request_id = 77;
  m.images = {image(3, false), image(4, false)};
  return m;
}

inline msg::ImageEmbeddings image_embeddings() {
  msg::ImageEmbeddings m;
  m.request_id = 77;
  m.images = {image(3, true), image(4, true)};
  m.origin = "vision_encoder/1";
  m.seconds = 0.0042;
  return m;
}

// Layer 2: 3 rows for expert 5, 1 for expert 0, of 4 floats each.
inline msg::ExpertBatch expert_batch() {
  msg::ExpertBatch m;
  m.layer = 2;
  m.dim = 4;
  m.pieces = {{5, 3}, {0, 1}};
  std::vector<float> rows;
  for (int i = 0; i < 16; ++i) rows.push_back(float(i) * 0.25f - 1.5f);
  rows[3] = -0.0f;
  m.data.resize(rows.size() * sizeof(float));
  std::memcpy(m.data.data(), rows.data(), m.data.size());
  m.checksum = checksum_bytes(m.data.data(), m.data.size());
  return m;
}

inline msg::StageBatch stage_batch() {
  msg::StageBatch m;
  m.op = msg::StageOp::layers;
  m.first_layer = 3;
  m.model_fingerprint = 0x1234567890abcdefULL;
  m.width = 4;
  m.positions = {16, 17, 5};
  m.row_table = {0, 0, 1};
  m.table_offsets = {0, 2, 3};
  m.table_ids = {7, 2, 9};
  m.logit_rows = {1, 2};
  std::vector<float> rows;
  for (int i = 0; i < 12; ++i) rows.push_back(float(i) * 0.5f - 2.f);
  rows[5] = -0.0f;
  m.data.resize(rows.size() * sizeof(float));
  std::memcpy(m.data.data(), rows.data(), m.data.size());
  m.checksum = checksum_bytes(m.data.data(), m.data.size());
  return m;
}

}  // namespace cleave::examples
