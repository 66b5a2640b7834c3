// The front-end contract: what the CLI, the HTTP server and the job runner
// talk to, whatever the topology behind it (one engine, actors in one
// process, or a cluster's head). No CAF here.
//
//   submit(request, on_event)  admission: busy, unavailable or a typed
//                              validation error comes back at once (and the
//                              callback is never called); otherwise the
//                              callback gets the request's token events in
//                              order, then exactly one finished or failed
//                              event, never none.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/request.h"
#include "schema/messages.h"

namespace cleave {

// Receives a request's events in order, on a thread of the front end's;
// must not block.
using EventCallback = std::function<void(const msg::StreamEvent&)>;

class Frontend {
 public:
  virtual ~Frontend() = default;
  virtual Status submit(GenerateRequest request, EventCallback on_event) = 0;
  // Ends an admitted request early (its client went away): its stage drops
  // it within one step and frees its KV; the callback then gets a failed
  // event with code aborted (still exactly one terminal event, which may
  // also be a finished one that was already on its way). not_found when the
  // request is not in flight (finished meanwhile, or never admitted).
  virtual Status cancel(uint64_t request_id) = 0;
  // Continues a request that an earlier run began (a batch job restarted
  // after a kill): `generated` are the tokens that run sampled. They are
  // replayed, not sampled again, and sampling goes on at index
  // generated.size() (the RNG is keyed by (seed, rng_stream or request id,
  // position), so the tokens are those of an uninterrupted run). The KV of
  // prompt + generated is read back from the front end's KV store where it
  // holds it (blocks persisted by the earlier run) and recomputed where not.
  // Token events start at index generated.size(); the text of `generated`
  // is not sent again. Admission and terminal events as submit();
  // `generated` empty is submit(). unsupported where there is no such path.
  virtual Status resume(GenerateRequest request, std::vector<int32_t> generated,
                        EventCallback on_event) = 0;
  // Each actor's counters (requests, tokens, queue depth, KV blocks moved,
  // failures, ...).
  virtual std::vector<msg::Stats> stats() = 0;
};

// What one request's events add up to.
struct Completion {
  std::vector<int32_t> tokens;
  std::vector<uint64_t> logits_hashes;  // XXH3-64 of each token's logits row
  std::string text;
  std::string finish_reason;
  std::vector<float> logits;  // final logits row when keep_logits
  Status error;               // not ok when the request failed
  double ttft_seconds = 0;    // submit -> first token
  double total_seconds = 0;   // submit -> finished
  std::string encode_origin;  // the vision encoder that ran (and its step time)
  double encode_seconds = 0;
  struct StageTime {
    int32_t tokens = 0;
    double seconds = 0;  // wall time of the engine steps that produced them
  };
  std::map<std::string, StageTime> stages;  // origin ("decode/0", "NODE/prefill/0") -> time
  int32_t cached_tokens = 0;                // prompt tokens served from the prefix cache
  std::vector<LogprobEntry> logprobs;       // per token, when the request asked for them
  bool done = false;
};

// The one fold of stream events into a Completion. `seconds` is the time
// since the request was submitted. Returns true on the terminal event.
bool fold_event(Completion& c, const msg::StreamEvent& e, double seconds);

// Submits every request (retrying while the front end answers busy) and
// waits until each has its terminal event; results in input order. A
// request refused at admission gets that error as its result. With `stop`,
// returns aborted once it turns true (requests still running are left to
// the front end, which ends them when it goes). on_submitted runs once
// every request has been handed over.
Result<std::vector<Completion>> run_to_completion(Frontend& frontend, const std::vector<GenerateRequest>& requests,
                                        const std::atomic<bool>* stop = nullptr,
                                        const std::function<void()>& on_submitted = {});

}  // namespace cleave
