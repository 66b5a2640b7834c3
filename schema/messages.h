// The messages actors exchange, as plain C++ values. schema/codec.h turns
// each into Cap'n Proto bytes and back; nothing outside schema/ sees a
// generated header. In-process traffic goes through the same bytes as
// cross-node traffic, so the path the tests exercise is the path used
// between machines.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "model/request.h"
#include "storage/block.h"

namespace cleave::msg {

// A request entering the pipeline (client -> router -> prefill / colocated):
// GenerateRequest itself (model/request.h).

// What a requester receives about one request, in order: token events, then
// exactly one finished or failed event.
struct StreamEvent {
  enum class Kind : uint8_t { token = 0, finished = 1, failed = 2 };
  Kind kind = Kind::token;
  uint64_t request_id = 0;
  int32_t index = 0;      // token: position among the generated tokens
  int32_t token = -1;     // token: the id
  std::string text;       // text that became safe to show (token, finished)
  std::string finish_reason;  // finished: "length", "stop", "context"
  std::vector<float> logits;  // finished: final logits row when keep_logits
  Status error;               // failed: code and message
  // Which actor produced it and the wall time of the engine step that
  // produced it (per-stage timings shown to users); informational.
  std::string origin;
  double stage_seconds = 0;
  // The vision encoder that embedded the request's images and its step
  // time: set by the router on the first token event when one ran.
  std::string encode_origin;
  double encode_seconds = 0;
  // token: XXH3-64 of the logits row the token was sampled from, so runs
  // can be compared for logits as well as tokens (0 when not computed).
  uint64_t logits_hash = 0;
  // token, when the request asked for logprobs: the chosen token's logprob
  // and the top alternatives.
  bool has_logprobs = false;
  LogprobEntry logprobs;
  // The first token event: prompt tokens whose KV came from the prefix
  // cache of the stage that ran the prompt (OpenAI's cached_tokens).
  int32_t cached_tokens = 0;
};

// Prefill -> (router) -> decode: continue a request whose first tokens were
// generated elsewhere. The KV of the first n_kv_tokens tokens of
// prompt + generated is either inline (blocks) or in the KV store under
// kv_keys (in block order); the receiver recomputes what it cannot get.
struct Handoff {
  GenerateRequest request;
  std::vector<int32_t> generated;
  int32_t n_kv_tokens = 0;
  std::vector<BlockKey> kv_keys;
  std::vector<BlockRecord> blocks;
  // "host:port" where the node of the prefill's kv_sender listens, so the
  // decoder's node connects to it directly; empty within one process.
  std::string kv_source;
};

// KV store traffic.
struct KvPut {  // store these sealed records; reply: KvAck
  std::vector<BlockRecord> blocks;
};
struct KvAck {
  int32_t stored = 0;      // newly stored or already present
  int32_t rejected = 0;    // failed verification or no room
  Status first_error;      // why the first rejected one was rejected
};
struct KvGet {  // reply: KvBlocks with the longest leading run found
  std::vector<BlockKey> keys;
};
struct KvBlocks {
  std::vector<BlockRecord> blocks;  // records for keys[0..blocks.size()), in order
};

// KV streaming, decoder <-> the prefill stage's KV sender (actors/kv_stream.h).
struct KvPull {  // stream the KV of request_id from block first_block on
  uint64_t request_id = 0;
  int32_t first_block = 0;   // leading blocks the decoder holds already: not sent
  uint32_t chunk_bytes = 0;  // KV bytes per chunk
  int32_t window = 0;        // chunks sent and not yet acknowledged, at most
};
// One piece of a KV stream, in order; the blocks' bytes layer by layer
// (layer 0 of every block, then layer 1, ...), so a layer is complete as
// soon as its chunks are in. seq 0 carries the block headers.
struct KvChunk {
  uint64_t request_id = 0;
  uint32_t seq = 0;
  uint64_t offset = 0;       // of data in the stream
  uint64_t total_bytes = 0;  // of the whole stream
  uint64_t checksum = 0;     // XXH3-64 of data
  std::vector<uint8_t> data;
  int32_t first_block = 0;   // the block headers[0] describes
  std::vector<BlockHeader> headers;
};

// Router -> vision_encoder: the images of request_id that need embeddings
// (with pixels). The reply, ImageEmbeddings, gives the same images in the
// same order with their embeddings (n_tokens x n_embd floats) and without
// pixels; the router puts them into the request it holds.
struct EncodeRequest {
  uint64_t request_id = 0;
  std::vector<PromptImage> images;
};
struct ImageEmbeddings {
  uint64_t request_id = 0;
  std::vector<PromptImage> images;
  std::string origin;   // the encoder, and the wall time of its step
  double seconds = 0;
};

// Attention <-> expert actor (model/experts.h): one layer's rows for some
// experts, each piece's rows one after the other in data (floats); the
// reply carries the same pieces with the outputs. checksum: XXH3-64 of data,
// checked on decode.
struct ExpertPiece {
  int32_t expert = 0;
  uint32_t rows = 0;
};
struct ExpertBatch {
  int32_t layer = 0;
  uint32_t dim = 0;
  std::vector<ExpertPiece> pieces;
  std::vector<uint8_t> data;
  uint64_t checksum = 0;
};

// First pipeline stage <-> a later one (schema/cleave.capnp, StageBatch).
enum class StageOp : uint8_t { layers = 0, output, kv_read, kv_write, kv_copy };
struct StageBatch {
  StageOp op = StageOp::layers;
  int32_t first_layer = 0;
  uint64_t model_fingerprint = 0;
  uint32_t width = 0;
  std::vector<int32_t> positions, row_table;
  std::vector<uint32_t> table_offsets;
  std::vector<int32_t> table_ids, logit_rows, blocks;
  std::vector<uint8_t> data;
  uint64_t checksum = 0;
};

struct Health {
  std::string actor;
  bool ok = true;
  uint64_t uptime_ms = 0;
  int32_t queue_depth = 0;
  int32_t running = 0;
};

// One actor's counters: requests, tokens, queue depth, KV blocks moved,
// failures, and whatever else the actor counts, by name.
struct Stats {
  std::string actor;
  std::vector<std::pair<std::string, uint64_t>> counters;
  uint64_t get(const std::string& name) const {
    for (const auto& [k, v] : counters)
      if (k == name) return v;
    return 0;
  }
};

}  // namespace cleave::msg
