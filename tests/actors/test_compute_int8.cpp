// --compute int8 (EngineOptions::compute) across the topologies: the int8
// path is batch-invariant, so mono, colocated, P/D, pipeline stages and
// expert hosts give the same tokens and logits bit for bit; it is a
// different computation from exact (other logits), and a model without
// Q8_0 weights is refused rather than run exactly under the flag.
#include <doctest/doctest.h>

#include "actors/pipeline.h"
#include "tests/actors/pipeline_load.h"
#include "tests/actors/pipeline_util.h"

using namespace cleave;
using namespace cleave::testing;

namespace {

ModelSpec q8(ModelSpec s, const char* name) {
  s.type = DType::Q8_0;
  s.name = name;
  return s;
}

PipelineOptions int8(PipelineOptions o) {
  o.engine.compute = Compute::int8;
  return o;
}

}  // namespace

TEST_CASE("compute int8: bit-identical across mono, colocated, pd, pipeline stages and expert hosts") {
  ModelSpec dense = small_dense();
  dense.n_layers = 4;
  dense.name = "actors-dense-4l";  // models are kept per process by name
  struct M {
    ModelSpec spec;
    std::vector<std::pair<const char*, PipelineOptions>> cases;
  };
  PipelineOptions stages = int8(base_options(Topology::pd));
  stages.prefill_pipeline = {{0, 1}, {2, 3}};
  stages.decode_pipeline = {{0, 2}, {3, 3}};
  stages.engine.pipeline_micro_batches = 2;
  PipelineOptions experts = int8(base_options(Topology::colocated, 0, 0, 2));
  experts.experts = {expert_set({0, 1}), expert_set({2, 3})};
  PipelineOptions mono_experts = int8(base_options(Topology::mono));
  mono_experts.experts = {expert_set({0, 1, 2, 3})};
  const M models[] = {
      {q8(dense, "actors-q8-dense"),
       {{"colocated 2", int8(base_options(Topology::colocated, 0, 0, 2))},
        {"pd 2+2", int8(base_options(Topology::pd, 2, 2))},
        {"pd, prefill over 2 stages -> decode over 2 cut elsewhere", stages}}},
      {q8(small_moe(), "actors-q8-moe"),
       {{"pd 2+2", int8(base_options(Topology::pd, 2, 2))},
        {"colocated 2 over 2 expert actors", experts},
        {"mono over an expert host in process", mono_experts}}},
  };
  for (const M& mm : models) {
    CAPTURE(mm.spec.name);
    const Model& m = model(mm.spec);
    const auto requests = mixed_requests(m, 40, 9000);
    auto mono = make_pipeline(m, int8(base_options(Topology::mono)));
    const auto ref = run_all(*mono, requests);
    for (const Completion& c : ref) REQUIRE_MESSAGE(c.error.ok(), c.error.to_string());
    // int8 computes other logits than exact on the same requests.
    const auto exact = mono_reference(m, requests);
    int differ = 0;
    for (size_t i = 0; i < ref.size(); ++i) differ += ref[i].logits_hashes != exact[i].logits_hashes;
    CHECK(differ == int(ref.size()));
    for (const auto& [what, o] : mm.cases) {
      auto p = make_pipeline(m, o);
      check_identical(ref, run_all(*p, requests), what);
    }
  }
}

TEST_CASE("compute int8: a model without Q8_0 weights is refused, naming the types") {
  const Model& m = model(small_dense());  // F32
  for (Topology t : {Topology::mono, Topology::pd}) {
    auto p = Pipeline::create(m.file, m.tokenizer, int8(base_options(t)));
    REQUIRE(!p.ok());
    CHECK(p.status().code() == Code::invalid_argument);
    CHECK(p.status().message().find("compute int8 needs Q8_0 weights; this model's matrices are F32") !=
          std::string::npos);
  }
}
