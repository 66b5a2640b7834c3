-- One KV cache over serving nodes: a head (router, the pool's directory
-- store, the HTTP server with --http-port) and N nodes, each a colocated
-- stage with a kv_store of its own. A prompt prefix computed on one node is
-- fetched by the others from its store instead of computed again.
--   cleave topology check examples/kv_pool_nodes.lua --set nodes=3
--   cleave node --topology examples/kv_pool_nodes.lua -m MODEL.gguf --name head --http-port 8080
--   cleave node --topology examples/kv_pool_nodes.lua -m MODEL.gguf --name n1 --set head_port=PORT
--   --set nodes=N (serving nodes n1..nN, default 3), pool=0|1 (1: the KV
--   pool; 0: each node keeps only its own engine's prefix cache),
--   preload=0|1 (the router preloads the chosen node's store), router=NAME
--   (round_robin, least_loaded, least_loaded_prefix, kv_aware), tier_mib=M
--   (each node store's two memory tiers), NAME_host / NAME_port (head, n1, ...)
local pool = param("pool", 1) == 1
local c = { router = param("router", "round_robin"), kv_pool = pool }
if pool then c.kv_preload = param("preload", 1) == 1 end
cluster(c)
node {
  name = "head", head = true, host = param("head_host", "127.0.0.1"), port = param("head_port", 0),
  actors = { kv_store = 1 }, kv = { tier0 = 64 * MiB, tier1 = 64 * MiB },
}
local tier = param("tier_mib", 256) * MiB
for i = 1, param("nodes", 3) do
  local name = "n" .. i
  local n = { name = name, host = param(name .. "_host", "127.0.0.1"), port = param(name .. "_port", 0),
              threads = 1, actors = { colocated = 1 } }
  if pool then
    n.actors.kv_store = 1
    n.kv = { tier0 = tier, tier1 = tier }
  end
  node(n)
end
