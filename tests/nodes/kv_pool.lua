-- The clusters of tests/nodes/check_kv_pool.py and check_kv_pool_stress.py:
-- one KV pool over a head (router, the pool's directory store, no stages)
-- and nodes A, C (and B), each with its own kv_store.
--   --set head_port=N, a_stage=0|1 (A hosts a colocated stage or only its
--   store), c=0|1 and b=0|1 (nodes C, B are in the cluster), a_dir=PATH (A's store: RocksDB alone,
--   durable),
--   tier=BYTES (each worker store's memory tiers), fetch_weight=W (kv_aware
--   placement with that weight; default round robin), preload=0|1 (the
--   router preloads a chosen stage's store: kv_preload), replicate=N
--   (kv_replicate_reads)
local router = "round_robin"
if param("fetch_weight", -1) >= 0 then router = { policy = "kv_aware", fetch_weight = param("fetch_weight", 0) } end
cluster { router = router, request_timeout_s = 60, kv_pool = true, kv_preload = param("preload", 1) == 1,
          kv_replicate_reads = param("replicate", 2) }
local tier = param("tier", 16 * MiB)
node {
  name = "head", head = true, port = param("head_port", 0),
  actors = { kv_store = 1 }, kv = { tier0 = 16 * MiB, tier1 = 16 * MiB },
}
local a_actors = { kv_store = 1 }
if param("a_stage", 1) == 1 then a_actors.colocated = 1 end
local a_kv = { tier0 = tier, tier1 = tier }
if param("a_dir", "") ~= "" then a_kv = { dir = param("a_dir", ""), durable = true } end
node { name = "A", threads = 1, actors = a_actors, kv = a_kv }
if param("c", 1) == 1 then
  node { name = "C", threads = 1, actors = { colocated = 1, kv_store = 1 }, kv = { tier0 = tier, tier1 = tier } }
end
if param("b", 0) == 1 then
  node { name = "B", threads = 1, actors = { colocated = 1, kv_store = 1 }, kv = { tier0 = tier, tier1 = tier } }
end
