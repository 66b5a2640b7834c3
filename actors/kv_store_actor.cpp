// The kv_store actor: a TieredStore (actors/hosted.h makes it) behind
// KvPut -> KvAck and KvGet -> KvBlocks (the longest leading run it holds,
// then what the pool's other stores hold). In a pool every store tells the
// directory (the head's store, which keeps the KvPoolIndex) what it stored
// and what left it; the directory monitors the stores, so a dead one's
// blocks leave the index at once.
#include "actors/actor_types.h"

#include <cstdio>
#include <functional>
#include <unordered_map>

#include "actors/kv_socket.h"
#include "schema/codec.h"
#include "storage/tiered_store.h"

namespace cleave::actors {
namespace {

struct Fetch;

struct KvStoreState {
  std::shared_ptr<TieredStore> store;
  KvStoreRole role;
  std::string holder;                              // this store's name in the index
  std::unordered_map<std::string, caf::actor> members;  // the directory's: every store of the pool
  std::unordered_map<BlockKey, int32_t, BlockKeyHash> remote_reads;  // fetched for this node's stages
  // Preloads in flight, by their first key: a get that misses there waits
  // for the preload instead of fetching the same blocks again.
  std::unordered_map<BlockKey, std::shared_ptr<Fetch>, BlockKeyHash> preloading;
  uint64_t puts = 0, gets = 0, blocks_stored = 0, blocks_rejected = 0, blocks_served = 0;
  uint64_t peer_gets = 0, peer_blocks_served = 0;
  uint64_t pool_fetches = 0, pool_blocks_fetched = 0, pool_blocks_corrupt = 0, pool_holder_errors = 0;
  uint64_t pool_short_answers = 0, pool_replicas = 0, preloads = 0, preload_blocks = 0, preload_waits = 0;
  uint64_t peer_offers = 0, pool_socket_reads = 0;
  uint64_t bad_messages = 0;
  // Blocks between processes: this store's offers on its KV data socket
  // (listening from the first offer), and its reads of other stores'
  // offers, each on a thread of its own, by ticket until peer_done.
  std::unique_ptr<KvSocketServer> socket;
  std::shared_ptr<KvStreamCounters> socket_counters = std::make_shared<KvStreamCounters>();
  uint64_t next_offer = 0, next_read = 0;
  std::unordered_map<uint64_t, std::shared_ptr<Fetch>> reading;
  std::shared_ptr<KvInbox> read_results = std::make_shared<KvInbox>();
  // Last member: destroyed first, joining the read threads before the rest goes.
  std::unique_ptr<KvSocketJobs> jobs = std::make_unique<KvSocketJobs>();
  static inline const char* name = "cleave.kv_store";
};
using store_pointer = kv_store_actor::stateful_pointer<KvStoreState>;

bool in_pool(const KvStoreState& s) { return s.role.index || s.role.directory; }

msg::KvGet key_list(std::vector<BlockKey> keys) {
  msg::KvGet m;
  m.keys = std::move(keys);
  return m;
}

// Tells the index what this store now holds and what left it.
void publish(store_pointer self, std::vector<BlockKey> added) {
  auto& s = self->state;
  if (!in_pool(s)) return;
  std::vector<BlockKey> gone = s.store->take_gone();
  if (s.role.fault_stale_index) gone.clear();
  if (s.role.index) {
    s.role.index->add(s.holder, added);
    s.role.index->remove(s.holder, gone);
    return;
  }
  auto me = caf::actor_cast<caf::actor>(self);
  if (!added.empty()) self->send(s.role.directory, pool_add_atom::value, me, codec::encode(key_list(std::move(added))));
  if (!gone.empty()) self->send(s.role.directory, pool_gone_atom::value, me, codec::encode(key_list(std::move(gone))));
}

// The directory's answer to pool_find: the other stores holding a leading
// run of `keys`, the longest first, then those on the asker's node.
std::vector<caf::actor> find_holders(store_pointer self, const std::vector<BlockKey>& keys,
                                     const caf::actor_addr& asker) {
  auto& s = self->state;
  std::vector<caf::actor> out, far;
  const std::string asker_name = pool_holder_name(asker);
  int32_t run = -1;
  auto flush = [&] {
    out.insert(out.end(), far.begin(), far.end());
    far.clear();
  };
  for (const auto& [name, n] : s.role.index->leading_runs(keys)) {
    auto m = s.members.find(name);
    if (name == asker_name || m == s.members.end()) continue;
    if (n != run) flush();
    run = n;
    if (m->second.node() == asker.node()) out.push_back(m->second);
    else far.push_back(m->second);
  }
  flush();
  return out;
}

struct Fetch {
  std::vector<BlockKey> keys;
  std::vector<BlockRecord> got;  // records of keys[0..got.size())
  std::vector<caf::actor> holders;
  size_t next_holder = 0;
  bool keep = false;  // a preload: keep every fetched block
  std::function<void(std::vector<BlockRecord>)> done;
  std::vector<std::function<void()>> after;  // gets that wait for this preload
};

void finish_fetch(store_pointer self, std::shared_ptr<Fetch> f) {
  publish(self, {});
  if (f->keep && !f->keys.empty()) {
    auto it = self->state.preloading.find(f->keys.front());
    if (it != self->state.preloading.end() && it->second == f) self->state.preloading.erase(it);
  }
  f->done(std::move(f->got));
  for (auto& run : f->after) run();
}

void fetch_next(store_pointer self, std::shared_ptr<Fetch> f);

// A holder's answer: the leading records that are the keys asked for and
// verify; the first that does not ends the answer (the next holder, or the
// stage computes the rest).
void take_answer(store_pointer self, std::shared_ptr<Fetch> f, std::vector<BlockRecord> blocks) {
  auto& s = self->state;
  std::vector<BlockKey> kept;
  for (BlockRecord& r : blocks) {
    const BlockKey& want = f->keys[f->got.size()];
    if (!(r.header.key == want) || !verify(r, s.store->model_fingerprint(), s.store->layout()).ok()) {
      ++s.pool_blocks_corrupt;
      break;
    }
    ++s.pool_blocks_fetched;
    int32_t& reads = s.remote_reads[want];
    ++reads;
    if ((f->keep || reads >= s.role.replicate_reads) && s.store->put(r).ok()) {
      ++s.pool_replicas;
      kept.push_back(want);
    }
    f->got.push_back(std::move(r));
    if (f->got.size() == f->keys.size()) break;
  }
  if (s.remote_reads.size() > (size_t(1) << 16)) s.remote_reads.clear();
  if (f->got.size() < f->keys.size()) ++s.pool_short_answers;
  publish(self, std::move(kept));
  fetch_next(self, f);
}

// The holder's blocks as one CAF message (a holder in this process, or one
// without a data socket).
void fetch_by_message(store_pointer self, std::shared_ptr<Fetch> f, kv_store_actor holder, Bytes keys) {
  self->request(holder, kKvTimeout, peer_get_atom::value, std::move(keys))
      .then(
          [=](const Bytes& reply) {
            auto blocks = codec::decode_as<msg::KvBlocks>(reply);
            if (!blocks.ok()) {
              ++self->state.pool_holder_errors;
              return fetch_next(self, f);
            }
            take_answer(self, f, std::move(blocks->blocks));
          },
          [=](caf::error&) {
            ++self->state.pool_holder_errors;  // gone or slow: the next holder
            fetch_next(self, f);
          });
}

// A holder in another process offers its blocks on its KV data socket;
// they are read (layer-major chunks, checksummed) on a thread of ours.
void fetch_by_socket(store_pointer self, std::shared_ptr<Fetch> f, kv_store_actor holder, Bytes keys) {
  self->request(holder, kKvTimeout, peer_offer_atom::value, keys)
      .then(
          [=](const std::string& where, const std::string& token, uint64_t id) {
            if (where.empty()) return take_answer(self, f, {});
            auto& s = self->state;
            const uint64_t ticket = ++s.next_read;
            s.reading.emplace(ticket, f);
            ++s.pool_socket_reads;
            msg::KvPull pull;
            pull.request_id = id;
            pull.chunk_bytes = kDefaultKvChunkBytes;
            pull.window = kDefaultKvWindow;
            auto results = s.read_results;
            auto counters = s.socket_counters;
            auto me = caf::actor_cast<kv_store_actor>(self);
            s.jobs->run([=] {
              results->put(ticket, fetch_kv_socket(where, token, pull, kKvMaxStreamBytes, *counters));
              caf::anon_send(me, peer_done_atom::value, ticket);
            });
          },
          [=](caf::error& e) {
            if (from_error(e).code() == Code::unsupported) return fetch_by_message(self, f, holder, keys);
            ++self->state.pool_holder_errors;
            fetch_next(self, f);
          });
}

// Asks the holders in turn for the keys still missing.
void fetch_next(store_pointer self, std::shared_ptr<Fetch> f) {
  auto& s = self->state;
  if (f->got.size() == f->keys.size() || f->next_holder == f->holders.size()) return finish_fetch(self, f);
  const caf::actor& next = f->holders[f->next_holder++];
  auto holder = caf::actor_cast<kv_store_actor>(next);
  std::vector<BlockKey> rest(f->keys.begin() + long(f->got.size()), f->keys.end());
  ++s.pool_fetches;
  Bytes keys = codec::encode(key_list(std::move(rest)));
  if (next.node() != self->node()) return fetch_by_socket(self, f, holder, std::move(keys));
  fetch_by_message(self, f, holder, std::move(keys));
}

// The longest leading run of keys this store holds, for another store.
std::vector<BlockRecord> held_run(KvStoreState& s, const std::vector<BlockKey>& keys) {
  std::vector<BlockRecord> out;
  for (const BlockKey& key : keys) {
    auto r = s.store->get(key);
    if (!r.ok()) break;
    if (s.role.fault_corrupt_served && !r->bytes.empty()) r->bytes[r->bytes.size() / 2] ^= 0x10;
    out.push_back(std::move(r.value()));
  }
  s.peer_blocks_served += out.size();
  return out;
}

// The leading run of `keys` from this store's tiers, then from the pool.
void pool_get(store_pointer self, std::vector<BlockKey> keys, bool keep,
              std::function<void(std::vector<BlockRecord>)> done, bool waited = false) {
  auto& s = self->state;
  auto f = std::make_shared<Fetch>();
  f->keys = std::move(keys);
  f->keep = keep;
  f->done = std::move(done);
  for (const BlockKey& key : f->keys) {
    auto r = s.store->get(key);
    if (!r.ok()) break;
    f->got.push_back(std::move(r.value()));
  }
  if (f->got.size() == f->keys.size() || !in_pool(s)) return finish_fetch(self, f);
  const BlockKey& missing = f->keys[f->got.size()];
  if (auto p = s.preloading.find(missing); p != s.preloading.end() && !keep && !waited) {
    ++s.preload_waits;
    p->second->after.push_back([=] { pool_get(self, f->keys, false, f->done, true); });
    return;
  }
  if (keep) s.preloading.emplace(missing, f);
  std::vector<BlockKey> rest(f->keys.begin() + long(f->got.size()), f->keys.end());
  if (s.role.index) {
    f->holders = find_holders(self, rest, self->address());
    return fetch_next(self, f);
  }
  self->request(s.role.directory, kKvTimeout, pool_find_atom::value, codec::encode(key_list(std::move(rest))))
      .then(
          [=](const std::vector<caf::actor>& holders) {
            f->holders = holders;
            fetch_next(self, f);
          },
          [=](caf::error&) {
            ++self->state.pool_holder_errors;
            finish_fetch(self, f);
          });
}

Result<msg::KvGet> decode_keys(store_pointer self, const Bytes& bytes) {
  auto get = codec::decode_as<msg::KvGet>(bytes);
  if (!get.ok()) ++self->state.bad_messages;
  return get;
}

// A member store of the directory's pool (this one included).
void add_member(store_pointer self, const caf::actor& member) {
  auto& s = self->state;
  const std::string name = pool_holder_name(member.address());
  if (s.members.emplace(name, member).second && member.address() != self->address())
    self->monitor(member);
}

kv_store_actor::behavior_type kv_store_fn(store_pointer self, std::shared_ptr<TieredStore> store,
                                          KvStoreRole role) {
  auto& st = self->state;
  st.store = std::move(store);
  st.role = std::move(role);
  st.holder = pool_holder_name(self->address());
  if (in_pool(st)) st.store->track_gone(true);
  if (st.role.index) {
    add_member(self, caf::actor_cast<caf::actor>(self));
    st.role.index->reset(st.holder, st.store->keys());  // what survived on its disk
    self->set_down_handler([=](caf::down_msg& dm) {
      auto& s = self->state;
      const std::string name = pool_holder_name(dm.source);
      s.members.erase(name);
      s.role.index->drop(name);
    });
  }
  if (st.role.directory) {
    // Before any pool_add (messages between two actors keep their order):
    // what survived on its disk goes into the index again.
    self->request(st.role.directory, kJoinTimeout, pool_join_atom::value, caf::actor_cast<caf::actor>(self),
                  codec::encode(key_list(st.store->keys())))
        .then([](bool) {}, [=](caf::error& e) {
          ++self->state.pool_holder_errors;
          std::fprintf(stderr, "cleave kv_store: joining the pool failed: %s\n",
                       caf::to_string(e).c_str());
        });
  }
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
        std::vector<BlockKey> added;
        for (const BlockRecord& r : put->blocks) {
          Status st = s.store->put(r);
          if (st.ok()) {
            ++ack.stored;
            added.push_back(r.header.key);
          } else {
            if (ack.rejected++ == 0) ack.first_error = st;
          }
        }
        s.blocks_stored += uint64_t(ack.stored);
        s.blocks_rejected += uint64_t(ack.rejected);
        publish(self, std::move(added));
        return codec::encode(ack);
      },
      [=](kv_get_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto get = decode_keys(self, bytes);
        if (!get.ok()) return to_error(get.status());
        ++self->state.gets;
        auto rp = self->make_response_promise<Bytes>();
        pool_get(self, std::move(get->keys), false, [=](std::vector<BlockRecord> blocks) mutable {
          self->state.blocks_served += blocks.size();
          msg::KvBlocks reply;
          reply.blocks = std::move(blocks);
          rp.deliver(codec::encode(reply));
        });
        return rp;
      },
      [=](kv_preload_atom, const Bytes& bytes) {
        auto get = decode_keys(self, bytes);
        if (!get.ok()) return;
        ++self->state.preloads;
        pool_get(self, std::move(get->keys), true, [=](std::vector<BlockRecord> blocks) {
          self->state.preload_blocks += blocks.size();
        });
      },
      [=](peer_get_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto& s = self->state;
        auto get = decode_keys(self, bytes);
        if (!get.ok()) return to_error(get.status());
        ++s.peer_gets;
        msg::KvBlocks reply;
        reply.blocks = held_run(s, get->keys);
        publish(self, {});
        return codec::encode(reply);
      },
      [=](peer_offer_atom, const Bytes& bytes) -> caf::result<std::string, std::string, uint64_t> {
        auto& s = self->state;
        auto get = decode_keys(self, bytes);
        if (!get.ok()) return to_error(get.status());
        if (s.role.data_host.empty())
          return to_error(Status(Code::unsupported, "this kv_store has no KV data socket"));
        if (!s.socket) {
          auto server = KvSocketServer::listen(s.role.data_host, s.socket_counters);
          if (!server.ok())  // the asker falls back to messages
            return to_error(Status(Code::unsupported, "kv_store data socket: " + server.status().to_string()));
          s.socket = std::move(server.value());
        }
        ++s.peer_offers;
        auto records = std::make_shared<const std::vector<BlockRecord>>(held_run(s, get->keys));
        publish(self, {});
        if (records->empty()) return caf::result<std::string, std::string, uint64_t>(std::string(), std::string(), 0);
        const uint64_t id = ++s.next_offer;
        const std::string token = s.socket->offer(id, records, 0, kDefaultKvChunkBytes, [](bool) {});
        return caf::result<std::string, std::string, uint64_t>(s.socket->address(), token, id);
      },
      [=](peer_done_atom, uint64_t ticket) {
        auto& s = self->state;
        auto it = s.reading.find(ticket);
        if (it == s.reading.end()) return;
        auto f = it->second;
        s.reading.erase(it);
        auto records = s.read_results->take(ticket);
        if (!records.ok()) {  // a bad stream or a holder gone: the next holder
          if (records.status().code() == Code::corruption) ++s.pool_blocks_corrupt;
          else ++s.pool_holder_errors;
          return fetch_next(self, f);
        }
        take_answer(self, f, std::move(records.value()));
      },
      [=](pool_join_atom, const caf::actor& member, const Bytes& bytes) -> caf::result<bool> {
        auto& s = self->state;
        if (!s.role.index) return to_error(Status(Code::unsupported, "this kv_store is not the pool's directory"));
        auto keys = decode_keys(self, bytes);
        if (!keys.ok()) return to_error(keys.status());
        add_member(self, member);
        s.role.index->reset(pool_holder_name(member.address()), keys->keys);
        std::fprintf(stderr, "cleave kv_store: a store joined the pool with %zu blocks (%zu stores)\n",
                     keys->keys.size(), s.members.size());
        return true;
      },
      [=](pool_add_atom, const caf::actor& member, const Bytes& bytes) {
        auto& s = self->state;
        auto keys = decode_keys(self, bytes);
        if (!s.role.index || !keys.ok() || !s.members.count(pool_holder_name(member.address()))) return;
        s.role.index->add(pool_holder_name(member.address()), keys->keys);
      },
      [=](pool_gone_atom, const caf::actor& member, const Bytes& bytes) {
        auto& s = self->state;
        auto keys = decode_keys(self, bytes);
        if (!s.role.index || !keys.ok()) return;
        s.role.index->remove(pool_holder_name(member.address()), keys->keys);
      },
      [=](pool_find_atom, const Bytes& bytes) -> caf::result<std::vector<caf::actor>> {
        auto& s = self->state;
        if (!s.role.index) return to_error(Status(Code::unsupported, "this kv_store is not the pool's directory"));
        auto keys = decode_keys(self, bytes);
        if (!keys.ok()) return to_error(keys.status());
        return find_holders(self, keys->keys, caf::actor_cast<caf::actor_addr>(self->current_sender()));
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
                                         {"kv_blocks_held", s.store->keys().size()},
                                         {"peer_gets", s.peer_gets},
                                         {"peer_blocks_served", s.peer_blocks_served},
                                         {"peer_offers", s.peer_offers},
                                         {"pool_socket_reads", s.pool_socket_reads},
                                         {"pool_fetches", s.pool_fetches},
                                         {"pool_blocks_fetched", s.pool_blocks_fetched},
                                         {"pool_blocks_corrupt", s.pool_blocks_corrupt},
                                         {"pool_short_answers", s.pool_short_answers},
                                         {"pool_holder_errors", s.pool_holder_errors},
                                         {"pool_replicas", s.pool_replicas},
                                         {"preloads", s.preloads},
                                         {"preload_blocks", s.preload_blocks},
                                         {"preload_waits", s.preload_waits},
                                         {"store_hits", hits},
                                         {"store_misses", c.misses},
                                         {"store_drops", c.drops},
                                         {"store_corrupt_detected", c.corrupt_detected},
                                         {"failures", s.bad_messages}};
        if (s.role.index) {
          counters.emplace_back("pool_members", s.members.size());
          counters.emplace_back("pool_index_blocks", s.role.index->blocks());
        }
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

kv_store_actor spawn_kv_store(caf::actor_system& system, std::shared_ptr<TieredStore> store,
                              KvStoreRole role) {
  return system.spawn<caf::detached>(kv_store_fn, std::move(store), std::move(role));
}

}  // namespace cleave::actors
