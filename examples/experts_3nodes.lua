-- Attention/FFN disaggregation on three nodes: "attn" (the head) hosts the
-- router, the KV store and the attention actors (colocated stages that send
-- each layer's FFN away); "ex0" and "ex1" host the FFN experts of a MoE
-- model, half each, and with --set replicas=true every expert on both.
--   cleave topology check examples/experts_3nodes.lua -m MOE.gguf
--   --set attn_port=N (the head's real port, for the workers), experts=8
--   (the model's experts per layer), attention=N (attention actors)
cluster { router = "least_loaded" }

local function at(name, t)
  t.name = name
  t.host = param(name .. "_host", "127.0.0.1")
  t.port = param(name .. "_port", 0)
  return t
end

local n = param("experts", 8)
local halves = { {}, {} }
for e = 0, n - 1 do table.insert(halves[e < n // 2 and 1 or 2], e) end

node(at("attn", {
  head = true,
  actors = { colocated = param("attention", 1), kv_store = 1 },
  kv = { tier0 = 256 * MiB, tier1 = 1 * GiB },
}))
for i = 1, 2 do
  local ids = halves[i]
  if param("replicas", false) then ids = nil end  -- every expert: each node a replica of the other
  node(at("ex" .. (i - 1), { actors = { expert = 1 }, expert = { experts = ids } }))
end
