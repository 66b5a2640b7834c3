-- E/P/D on three nodes: "encoder" runs the vision encoder (its actors encode
-- the images of requests the router sends them), "prefill" (the head) hosts
-- the router, prefill and the KV store, "decode" the decoders. Every node
-- gets --mmproj (scripts/demo_epd.sh runs it).
--   cleave topology show examples/epd_3nodes.lua --set prefill_port=7000
cluster { router = "least_loaded_prefix" }

-- Host and port of a node from --set NAME_host=H --set NAME_port=N (0: any free port).
local function at(name, t)
  t.name = name
  t.host = param(name .. "_host", "127.0.0.1")
  t.port = param(name .. "_port", 0)
  return t
end

node(at("encoder", { actors = { vision_encoder = 1 } }))
node(at("prefill", {
  head = true,
  actors = { prefill = 1, kv_store = 1 },
  kv = { tier0 = 256 * MiB, tier1 = 1 * GiB },
}))
node(at("decode", { actors = { decode = param("decoders", 2) } }))
