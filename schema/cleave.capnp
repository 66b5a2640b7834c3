# Every message between cleave actors (schema/messages.h mirrors them as plain
# C++ values; schema/codec.cpp is the only code that includes the generated
# header). Field numbers are the wire contract: add fields with new numbers,
# never renumber; bump Envelope.version only for changes old readers would
# misread.
@0xfd74a39e18da11d3;

$import "/capnp/c++.capnp".namespace("cleave::wire");

# common/status.h Code, in the same order (ordinals must match).
enum StatusCode {
  ok @0;
  notFound @1;
  invalidArgument @2;
  outOfMemory @3;
  outOfRange @4;
  unsupported @5;
  busy @6;
  ioError @7;
  corruption @8;
  unavailable @9;
  timedOut @10;
  aborted @11;
}

struct Status {
  code @0 :StatusCode;
  message @1 :Text;
}

struct SamplingParams {
  temperature @0 :Float32;
  topK @1 :Int32;
  topP @2 :Float32;
  minP @3 :Float32;
  repeatPenalty @4 :Float32;
  repeatLastN @5 :Int32;
  seed @6 :UInt64;
  maxTokens @7 :Int32;
  stop @8 :List(Text);
  presencePenalty @9 :Float32;
  frequencyPenalty @10 :Float32;
}

# model/request.h PromptImage: prompt[position, position + nTokens) take the
# image's rows. pixels: RGB, row-major, width * height * 3 bytes, or empty
# once encoded; embeddings: float32 little-endian, nTokens x n_embd, or
# empty before encoding.
struct ImageHash {
  lo @0 :UInt64;
  hi @1 :UInt64;
}

struct PromptImage {
  position @0 :Int32;
  nTokens @1 :Int32;
  hash @2 :ImageHash;
  width @3 :Int32;
  height @4 :Int32;
  pixels @5 :Data;
  embeddings @6 :Data;
}

struct GenerateRequest {
  prompt @0 :List(Int32);
  sampling @1 :SamplingParams;
  requestId @2 :UInt64;
  prefillChunk @3 :Int32;
  ignoreEos @4 :Bool;
  keepLogits @5 :Bool;
  images @6 :List(PromptImage);
  hasRngStream @7 :Bool;      # rngStream keys the sampler's RNG instead of requestId
  rngStream @8 :UInt64;
  logprobs @9 :Int32 = -1;    # top alternatives to report per token; -1: no logprobs
  priority @10 :Int32;        # vLLM's: lower first under the priority scheduling policy
  ttftTargetMs @11 :Float64;  # service goals in ms, 0: none (the router rejects early)
  tpotTargetMs @12 :Float64;
  deadlineMs @13 :Float64;
  maxCost @14 :Float64;       # cost budget in cost-seconds, 0: none (cost_aware router)
}

# Router -> vision_encoder: the images of one request that need embeddings
# (with pixels). The reply is ImageEmbeddings: the same images, in order,
# with embeddings and without pixels.
struct EncodeRequest {
  requestId @0 :UInt64;
  images @1 :List(PromptImage);
}

struct ImageEmbeddings {
  requestId @0 :UInt64;
  images @1 :List(PromptImage);
  origin @2 :Text;        # which encoder
  seconds @3 :Float64;    # its step's wall time
}

struct StreamEvent {
  enum Kind {
    token @0;
    finished @1;
    failed @2;
  }
  kind @0 :Kind;
  requestId @1 :UInt64;
  index @2 :Int32;
  token @3 :Int32;
  text @4 :Text;
  finishReason @5 :Text;
  logits @6 :List(Float32);
  error @7 :Status;
  origin @8 :Text;
  stageSeconds @9 :Float64;
  encodeOrigin @10 :Text;     # the vision encoder of the request's images (first token)
  encodeSeconds @11 :Float64;
  logitsHash @12 :UInt64;     # token: XXH3-64 of the logits row it was sampled from
  hasLogprobs @13 :Bool;      # token: the request asked for logprobs
  chosen @14 :TokenLogprob;   # set when hasLogprobs
  topLogprobs @15 :List(TokenLogprob);  # set when hasLogprobs
  cachedTokens @16 :Int32;    # first token: prompt tokens from the prefix cache
}

# model/sampler.h TokenLogprob
struct TokenLogprob {
  token @0 :Int32;
  logprob @1 :Float32;
}

# storage/block.h
struct BlockKey {
  lo @0 :UInt64;
  hi @1 :UInt64;
}

struct KvLayout {
  dtype @0 :UInt32;  # K rows' element type (ggml type id: F32 0, F16 1, Q8_0 8)
  tokensPerBlock @1 :Int32;
  nLayers @2 :Int32;
  nKvHeads @3 :Int32;
  headDim @4 :Int32;
  vDtype @5 :UInt32;  # V rows' element type
}

# BlockHeader's fields and the block's bytes (layout.block_bytes() of them).
struct BlockRecord {
  key @0 :BlockKey;
  modelFingerprint @1 :UInt64;
  layout @2 :KvLayout;
  checksum @3 :UInt64;  # XXH3-64 of bytes; receivers verify() it
  nTokens @4 :UInt32;
  bytes @5 :Data;
}

struct Handoff {
  request @0 :GenerateRequest;
  generated @1 :List(Int32);
  nKvTokens @2 :Int32;
  kvKeys @3 :List(BlockKey);
  blocks @4 :List(BlockRecord);
  kvSource @5 :Text;  # "host:port" of the node whose kv_sender holds the KV
}

struct KvPut {
  blocks @0 :List(BlockRecord);
}

struct KvAck {
  stored @0 :Int32;
  rejected @1 :Int32;
  firstError @2 :Status;
}

struct KvGet {
  keys @0 :List(BlockKey);
}

struct KvBlocks {
  blocks @0 :List(BlockRecord);
}

struct Health {
  actor @0 :Text;
  ok @1 :Bool;
  uptimeMs @2 :UInt64;
  queueDepth @3 :Int32;
  running @4 :Int32;
}

struct Counter {
  name @0 :Text;
  value @1 :UInt64;
}

struct Stats {
  actor @0 :Text;
  counters @1 :List(Counter);
}

# BlockRecord without its bytes (they travel in KvChunks).
struct BlockHeader {
  key @0 :BlockKey;
  modelFingerprint @1 :UInt64;
  layout @2 :KvLayout;
  checksum @3 :UInt64;
  nTokens @4 :UInt32;
}

# Decoder -> the prefill stage's KV sender: stream the KV of a handed-off
# request, from block firstBlock on (the decoder holds the ones before).
struct KvPull {
  requestId @0 :UInt64;
  firstBlock @1 :Int32;
  chunkBytes @2 :UInt32;  # KV bytes per chunk
  window @3 :Int32;       # chunks sent and not yet acknowledged, at most
}

# One piece of a KV stream, sender -> decoder in order (seq 0, 1, ...); the
# reply acknowledges it. The stream is the blocks' bytes layer by layer
# (layer 0 of every block, then layer 1, ...); seq 0 carries the headers.
struct KvChunk {
  requestId @0 :UInt64;
  seq @1 :UInt32;
  offset @2 :UInt64;      # of data in the stream
  totalBytes @3 :UInt64;  # of the whole stream
  checksum @4 :UInt64;    # XXH3-64 of data
  data @5 :Data;
  firstBlock @6 :Int32;
  headers @7 :List(BlockHeader);
}

# Attention -> expert actor: one layer's rows for some of the experts it
# hosts, each piece's rows one after the other in data; the reply is an
# ExpertBatch of the same pieces with the experts' outputs.
struct ExpertPiece {
  expert @0 :Int32;
  rows @1 :UInt32;
}

struct ExpertBatch {
  layer @0 :Int32;
  dim @1 :UInt32;         # floats per row
  pieces @2 :List(ExpertPiece);
  data @3 :Data;          # sum(rows) x dim floats, little endian
  checksum @4 :UInt64;    # XXH3-64 of data
}

# Pipeline stages (model/layer_stage.h): the first stage -> a later one.
# layers: a micro-batch of rows (positions, each row's block table, the
# hidden states after the layers before) that the stage runs through its
# layers and hands on; the last stage answers with output: the logits of
# logitRows. kvRead / kvWrite: the slices of `blocks` of the stage's
# layers (the answer to kvRead is an output carrying them); kvCopy: block
# blocks[0] to blocks[1]. firstLayer names the stage meant, the model
# fingerprint the weights.
enum StageOp {
  layers @0;
  output @1;
  kvRead @2;
  kvWrite @3;
  kvCopy @4;
}

struct StageBatch {
  op @0 :StageOp;
  firstLayer @1 :Int32;
  modelFingerprint @2 :UInt64;
  width @3 :UInt32;              # floats per row of data (dim, or n_vocab for logits)
  positions @4 :List(Int32);     # per row
  rowTable @5 :List(Int32);      # per row: its table
  tableOffsets @6 :List(UInt32); # tables t: tableIds[tableOffsets[t] .. tableOffsets[t+1])
  tableIds @7 :List(Int32);
  logitRows @8 :List(Int32);
  blocks @9 :List(Int32);
  data @10 :Data;                # little-endian floats, or KV slices
  checksum @11 :UInt64;          # XXH3-64 of data
}

# The root of every encoded message: the union names its kind, so bytes of
# one kind decoded as another are an error naming both.
struct Envelope {
  version @0 :UInt16;
  body :union {
    generateRequest @1 :GenerateRequest;
    streamEvent @2 :StreamEvent;
    handoff @3 :Handoff;
    kvPut @4 :KvPut;
    kvAck @5 :KvAck;
    kvGet @6 :KvGet;
    kvBlocks @7 :KvBlocks;
    health @8 :Health;
    stats @9 :Stats;
    kvPull @10 :KvPull;
    kvChunk @11 :KvChunk;
    encodeRequest @12 :EncodeRequest;
    imageEmbeddings @13 :ImageEmbeddings;
    expertBatch @14 :ExpertBatch;
    stageBatch @15 :StageBatch;
  }
}
