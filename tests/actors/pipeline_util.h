// Helpers the actor pipeline tests share (header only: the test glob
// compiles only *.cpp).
#pragma once

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "actors/pipeline.h"
#include "actors/pipeline_testing.h"
#include "tests/same_bits.h"

namespace cleave::testing {

inline std::vector<Completion> run_all(Pipeline& p, const std::vector<GenerateRequest>& requests) {
  auto r = p.run(requests);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(r.value());
}

// The actor topologies' fault-injection seam (actors/pipeline_testing.h).
inline PipelineTestHooks& hooks(Pipeline& p) {
  PipelineTestHooks* h = test_hooks(p);
  REQUIRE_MESSAGE(h != nullptr, "this topology has no actors to inject faults into");
  return *h;
}

// Kills decoder `index`: a decode actor in pd, a colocated one otherwise.
inline Status kill_decoder(Pipeline& p, int32_t index) {
  return hooks(p).kill_actor(p.options().topology == Topology::pd ? "decode" : "colocated", index);
}

// Every completion equal to the reference, bit for bit (tokens, text, the
// hash of every step's logits, the final logits row).
inline void check_identical(const std::vector<Completion>& ref, const std::vector<Completion>& got,
                            const std::string& what) {
  REQUIRE(ref.size() == got.size());
  int mismatches = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    CAPTURE(what);
    CAPTURE(i);
    REQUIRE_MESSAGE(got[i].error.ok(), got[i].error.to_string());
    const bool same = got[i].tokens == ref[i].tokens && got[i].text == ref[i].text &&
                      got[i].logits_hashes == ref[i].logits_hashes &&
                      got[i].finish_reason == ref[i].finish_reason &&
                      same_bits(got[i].logits, ref[i].logits);
    if (!same && ++mismatches <= 3) {
      CHECK(got[i].tokens == ref[i].tokens);
      CHECK(got[i].logits_hashes == ref[i].logits_hashes);
      CHECK(got[i].text == ref[i].text);
      CHECK(got[i].finish_reason == ref[i].finish_reason);
      CHECK(same_bits(got[i].logits, ref[i].logits));
    }
  }
  CHECK_MESSAGE(mismatches == 0, what << ": " << mismatches << " requests differ");
}

inline const msg::Stats* find_stats(const std::vector<msg::Stats>& all, const std::string& actor) {
  for (const auto& s : all)
    if (s.actor == actor) return &s;
  return nullptr;
}

inline uint64_t sum_counter(const std::vector<msg::Stats>& all, const std::string& prefix,
                     const std::string& name) {
  uint64_t n = 0;
  for (const auto& s : all)
    if (s.actor.rfind(prefix, 0) == 0) n += s.get(name);
  return n;
}

}  // namespace cleave::testing
