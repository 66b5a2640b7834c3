-- 1 P + 2 D on three nodes: "p0" (the head) prefills and keeps the KV store,
-- "d0" and "d1" decode.
--   cleave topology show examples/p1_d2.lua --set p0_port=7000 --set d0_port=7001 --set d1_port=7002
cluster { router = "least_loaded_prefix" }

-- Host and port of a node from --set NAME_host=H --set NAME_port=N (0: any free port).
local function at(name, t)
  t.name = name
  t.host = param(name .. "_host", "127.0.0.1")
  t.port = param(name .. "_port", 0)
  return t
end

node(at("p0", { head = true, actors = { prefill = 1, kv_store = 1 }, kv = { tier0 = 256 * MiB } }))
for i = 0, 1 do
  node(at("d" .. i, { actors = { decode = 1 } }))
end
