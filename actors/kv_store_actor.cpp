// The kv_store actor: a TieredStore (actors/hosted.h makes it) behind
// KvPut -> KvAck and KvGet -> KvBlocks (the longest leading run it holds).
#include "actors/actor_types.h"
#include "schema/codec.h"
#include "storage/tiered_store.h"

namespace cleave::actors {
namespace {

struct KvStoreState {
  std::shared_ptr<TieredStore> store;
  uint64_t puts = 0, gets = 0, blocks_stored = 0, blocks_rejected = 0, blocks_served = 0;
  uint64_t bad_messages = 0;
  static inline const char* name = "cleave.kv_store";
};

kv_store_actor::behavior_type kv_store_fn(kv_store_actor::stateful_pointer<KvStoreState> self,
                                          std::shared_ptr<TieredStore> store) {
  self->state.store = std::move(store);
  return {
      [=](kv_put_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto& s = self->state;
        auto put = codec::decode_as<msg::KvPut>(bytes);
        if (!put.ok()) {
          ++s.bad_messages;
          return to_error(put.status());
        }
        ++s.puts;
        msg::KvAck ack;
        for (const BlockRecord& r : put->blocks) {
          Status st = s.store->put(r);
          if (st.ok()) {
            ++ack.stored;
          } else {
            if (ack.rejected++ == 0) ack.first_error = st;
          }
        }
        s.blocks_stored += uint64_t(ack.stored);
        s.blocks_rejected += uint64_t(ack.rejected);
        return codec::encode(ack);
      },
      [=](kv_get_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto& s = self->state;
        auto get = codec::decode_as<msg::KvGet>(bytes);
        if (!get.ok()) {
          ++s.bad_messages;
          return to_error(get.status());
        }
        ++s.gets;
        msg::KvBlocks reply;
        for (const BlockKey& key : get->keys) {  // the longest leading run
          auto r = s.store->get(key);
          if (!r.ok()) break;
          reply.blocks.push_back(std::move(r.value()));
        }
        s.blocks_served += reply.blocks.size();
        return codec::encode(reply);
      },
      [=](stats_atom) -> Bytes {
        auto& s = self->state;
        StoreCounters c = s.store->counters();
        uint64_t hits = 0;
        for (uint64_t h : c.hits) hits += h;
        std::vector<std::pair<std::string, uint64_t>> counters = {{"kv_puts", s.puts},
                                         {"kv_gets", s.gets},
                                         {"kv_blocks_stored", s.blocks_stored},
                                         {"kv_blocks_rejected", s.blocks_rejected},
                                         {"kv_blocks_served", s.blocks_served},
                                         {"store_hits", hits},
                                         {"store_misses", c.misses},
                                         {"store_drops", c.drops},
                                         {"store_corrupt_detected", c.corrupt_detected},
                                         {"failures", s.bad_messages}};
        // Every tier hop: tier_hops_A_B = blocks moved from tier A to tier B.
        for (size_t t = 0; t < c.demotions.size(); ++t)
          counters.emplace_back("tier_hops_" + std::to_string(t) + "_" + std::to_string(t + 1), c.demotions[t]);
        for (size_t t = 0; t < c.promotions.size(); ++t)
          counters.emplace_back("tier_hops_" + std::to_string(t + 1) + "_" + std::to_string(t), c.promotions[t]);
        return encode_stats("kv_store", std::move(counters));
      },
  };
}

}  // namespace

kv_store_actor spawn_kv_store(caf::actor_system& system, std::shared_ptr<TieredStore> store) {
  return system.spawn<caf::detached>(kv_store_fn, std::move(store));
}

}  // namespace cleave::actors
