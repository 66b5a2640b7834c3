-- P/D on two nodes: "prefill" (the head) hosts the router, the prefill actor
-- and the KV store; "decode" hosts the decoders.
--   cleave topology show examples/pd_2nodes.lua --set prefill_port=7000 --set decode_port=7001
-- Long contexts: --set block_size=64 --set cache_type=f16 (KV blocks of 64
-- positions, K and V in F16; docs/PERFORMANCE.md "KV block size").
cluster {
  router = "least_loaded_prefix", max_pending = 1024,
  block_size = param("block_size", 16),
  cache_type_k = param("cache_type", "f32"), cache_type_v = param("cache_type", "f32"),
}

-- Host and port of a node from --set NAME_host=H --set NAME_port=N (0: any free port).
local function at(name, t)
  t.name = name
  t.host = param(name .. "_host", "127.0.0.1")
  t.port = param(name .. "_port", 0)
  return t
end

node(at("prefill", {
  head = true,
  actors = { prefill = 1, kv_store = 1 },
  kv = { tier0 = 256 * MiB, tier1 = 1 * GiB, dir = param("kv_dir", nil) },  -- no dir: no RocksDB tier
}))
node(at("decode", { actors = { decode = param("decoders", 1) } }))
