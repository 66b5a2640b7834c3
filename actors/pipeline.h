// One inference topology in one process, behind a CAF-free interface: the
// CLI, the benchmarks and the tests use this header; CAF stays inside
// actors/*.cpp.
//
//   mono       one Engine + Scheduler on a thread, no actors between stages
//   colocated  N actors that each prefill and decode (chunked prefill, so a
//              long prompt never stalls decoding), behind the router
//   pd         prefill actors -> KV through the kv_store actor -> decode
//              actors, behind the router
//
// Every message between actors is Cap'n Proto bytes (schema/codec.h), in
// process too. For one backend, a request's tokens and logits are the same
// in every topology (DESIGN.md invariant 1).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/kv_stream.h"
#include "common/status.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/request.h"
#include "model/scheduler.h"
#include "model/tokenizer.h"
#include "schema/messages.h"

namespace cleave {

enum class Topology { mono, colocated, pd };
const char* topology_name(Topology t);
// invalid_argument naming the accepted values for anything else.
Result<Topology> parse_topology(const std::string& name);

struct PipelineOptions {
  Topology topology = Topology::mono;
  int32_t prefill_actors = 1;    // pd
  int32_t decode_actors = 1;     // pd
  int32_t colocated_actors = 1;  // colocated
  EngineOptions engine;          // per engine (each actor owns one)
  SchedulerOptions scheduler;    // per scheduler (prefill_only is set for pd prefill)
  int32_t max_pending = 1024;    // requests admitted and not finished; beyond: busy
  // KV store tiers: tier 0 and tier 1 capacities in bytes (0: 64 MiB each),
  // and the RocksDB directory of tier 2 (empty: no disk tier).
  size_t kv_tier0_bytes = 0, kv_tier1_bytes = 0;
  std::string kv_dir;
  // pd: how KV moves from prefill to decode actors (actors/kv_stream.h).
  KvStreamOptions kv_stream;
  int32_t actor_threads = 0;     // CAF scheduler workers; 0: CAF's default
  // A request that makes no progress (no token, handoff or re-placement)
  // for this long fails with timed_out: the last guard against a hang.
  double request_timeout_s = 300;
};

// Receives a request's events in order (token..., then finished or failed),
// on an actor thread; must not block.
using EventCallback = std::function<void(const msg::StreamEvent&)>;

// What run() collects for one request.
struct Completion {
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish_reason;
  std::vector<float> logits;  // final logits row when keep_logits
  Status error;               // not ok when the request failed
  double ttft_seconds = 0;    // submit -> first token
  double total_seconds = 0;   // submit -> finished
};

class Pipeline {
 public:
  // tokenizer may be null. invalid_argument for bad counts or options.
  static Result<std::unique_ptr<Pipeline>> create(std::shared_ptr<const GgufFile> file,
                                                  std::shared_ptr<const Tokenizer> tokenizer,
                                                  const PipelineOptions& options);
  virtual ~Pipeline() = default;

  // Admits a request: busy when max_pending requests are in flight (the
  // callback is not called then), validate_request()'s errors for a bad one,
  // unavailable when no actor of a needed kind is alive. Otherwise every
  // admitted request gets exactly one finished or failed event, never none.
  virtual Status submit(GenerateRequest request, EventCallback on_event) = 0;
  // Submits all and waits for every one to finish or fail.
  Result<std::vector<Completion>> run(std::vector<GenerateRequest> requests);

  // Each actor's counters (requests, tokens, queue depth, KV blocks moved,
  // failures, ...), gathered through the stats message.
  virtual std::vector<msg::Stats> stats() = 0;
  // Live actors of a kind ("prefill", "decode", "colocated", "kv_store").
  virtual int32_t alive(const std::string& kind) = 0;
  // Fault injection for tests: kills decode actor `index` (0-based) as if it
  // crashed (exit_reason::kill). not_found when there is no such live actor.
  // In colocated, the colocated actors are the decoders.
  virtual Status kill_decode_actor(int32_t index) = 0;
  // Fault injection for tests: sends `bytes` as the main message of actor
  // `index` of `kind` (stage and router: a request; kv_store: a KvPut) and
  // returns its answer as a Status (a typed error for bytes that do not
  // decode). unsupported for mono.
  virtual Status send_raw_for_test(const std::string& kind, int32_t index,
                                   const std::vector<char>& bytes) = 0;
  virtual const PipelineOptions& options() const = 0;
};

}  // namespace cleave
