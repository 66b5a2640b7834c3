// The device path through whole actor topologies: with a stand-in for
// cuda:0 (kernels/device_testing.h: DeviceLike, the CPU's kernels behind a
// device's contract, so the CPU's bits), engines, pipeline stages, expert
// hosts and the kv_store's tiers all take their device paths, and the KV a
// device prefill hands off leaves its device memory only for the stream
// (a kv_sender in this process streams CAF chunks: it downloads the kept
// blocks once) and the store's copy. Every topology gives mono on the CPU's
// tokens and logits bit for bit.
#include <doctest/doctest.h>

#include <atomic>

#include "actors/pipeline.h"
#include "kernels/device_testing.h"
#include "tests/actors/device_like_backend.h"
#include "tests/actors/pipeline_load.h"
#include "tests/actors/pipeline_util.h"

using namespace cleave;
using namespace cleave::testing;

namespace {

PipelineOptions on_device(PipelineOptions o) {
  o.engine.device = "cuda:0";
  return o;
}

}  // namespace

TEST_CASE("device path across the topologies: a stand-in GPU gives mono on the CPU's bits") {
  static std::atomic<int> made{0};
  set_cuda_stand_in([](int) -> std::unique_ptr<Backend> {
    ++made;
    return std::make_unique<cleave::test::DeviceLike>();
  });
  ModelSpec dense = small_dense();
  dense.n_layers = 4;
  dense.name = "actors-dense-4l";  // models are kept per process by name
  PipelineOptions stages = on_device(base_options(Topology::pd));
  stages.prefill_pipeline = {{0, 1}, {2, 3}};
  stages.decode_pipeline = {{0, 2}, {3, 3}};
  stages.engine.pipeline_micro_batches = 2;
  PipelineOptions experts = on_device(base_options(Topology::colocated, 0, 0, 2));
  experts.experts = {expert_set({0, 1}), expert_set({2, 3})};
  struct Case {
    const char* what;
    PipelineOptions o;
    bool handoffs;
  };
  struct M {
    ModelSpec spec;
    std::vector<Case> cases;
  };
  ModelSpec moe = small_moe();
  const M models[] = {
      {dense,
       {{"pd 2+2", on_device(base_options(Topology::pd, 2, 2)), true},
        {"colocated 2", on_device(base_options(Topology::colocated, 0, 0, 2)), false},
        {"pd, prefill over 2 stages -> decode over 2 cut elsewhere", stages, true}}},
      {moe,
       {{"pd 1+1", on_device(base_options(Topology::pd)), true},
        {"colocated 2 over 2 expert actors", experts, false}}},
  };
  for (const M& mm : models) {
    CAPTURE(mm.spec.name);
    const Model& m = model(mm.spec);
    const auto requests = mixed_requests(m, 24, 7000);
    const auto ref = mono_reference(m, requests);
    for (const Case& c : mm.cases) {
      CAPTURE(c.what);
      const int before = made.load();
      auto p = make_pipeline(m, c.o);
      CHECK(made.load() > before);  // its backends are the stand-in's
      check_identical(ref, run_all(*p, requests), c.what);
      if (c.handoffs) {
        // Every request that goes on past its first token is handed off
        // with its KV: streamed from the prefill's device memory, and a
        // copy downloaded for the store.
        uint64_t past_first = 0;
        for (const Completion& r : ref) past_first += r.tokens.size() > 1;
        const auto stats = p->stats();
        CHECK(sum_counter(stats, "prefill", "handoffs") == past_first);
        CHECK(sum_counter(stats, "decode", "kv_transfers_received") > 0);
        CHECK(sum_counter(stats, "decode", "kv_transfers_failed") == 0);
        CHECK(sum_counter(stats, "prefill", "kv_blocks_put") > 0);
      }
    }
  }
  set_cuda_stand_in(nullptr);
}
