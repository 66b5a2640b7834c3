// The kinds of actor a node can host: one enum, one name table. Adding a
// kind: its own actor file, one row here, one registration in
// actors/actor_set.cpp (docs/ARCHITECTURE.md, "Adding an actor kind").
// No CAF here: the topology loader and the CLI use it too.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace cleave {

enum class ActorKind : uint8_t { prefill, decode, colocated, kv_store, vision_encoder, expert, stage };

struct ActorKindInfo {
  ActorKind kind;
  const char* name;
  bool stage;       // owns an engine and serves requests (a StageCore)
  bool entry;       // takes new requests from the router
  bool continues;   // takes hand-offs (requests whose first tokens ran elsewhere)
};

inline constexpr std::array<ActorKindInfo, 7> kActorKindTable = {{
    {ActorKind::prefill, "prefill", true, true, false},
    {ActorKind::decode, "decode", true, false, true},
    {ActorKind::colocated, "colocated", true, true, true},
    {ActorKind::kv_store, "kv_store", false, false, false},
    {ActorKind::vision_encoder, "vision_encoder", false, false, false},
    {ActorKind::expert, "expert", false, false, false},  // FFN experts (model/experts.h)
    // A pipeline stage after the first: a range of layers (model/layer_stage.h).
    {ActorKind::stage, "stage", false, false, false},
}};

// Kinds the design names that later work implements: refused by the
// topology loader with the list of the implemented ones. ("attention" is a
// role, not a kind: the stages are attention actors once a cluster hosts
// expert actors; the loader says so.)
inline constexpr std::array<const char*, 0> kPlannedActorKinds = {};

inline const ActorKindInfo& actor_kind_info(ActorKind k) { return kActorKindTable[size_t(k)]; }
inline const char* actor_kind_name(ActorKind k) { return actor_kind_info(k).name; }

inline std::optional<ActorKind> parse_actor_kind(std::string_view name) {
  for (const ActorKindInfo& i : kActorKindTable)
    if (name == i.name) return i.kind;
  return std::nullopt;
}

inline bool is_planned_actor_kind(std::string_view name) {
  for (const char* p : kPlannedActorKinds)
    if (name == p) return true;
  return false;
}

// The kinds scripts may name: "prefill, decode, colocated, kv_store, vision_encoder, expert, stage"
inline std::string actor_kind_list() {
  std::string s;
  for (const ActorKindInfo& i : kActorKindTable)
    if (!is_planned_actor_kind(i.name)) s += (s.empty() ? "" : ", ") + std::string(i.name);
  return s;
}

static_assert([] {
  for (size_t i = 0; i < kActorKindTable.size(); ++i)
    if (size_t(kActorKindTable[i].kind) != i) return false;
  return true;
}(), "kActorKindTable rows are in enum order");

}  // namespace cleave
