-- The E/P/D cluster of tests/nodes/check_epd.py's encoder-kill checks:
-- encoder nodes e0..e(N-1) (one vision_encoder each), the head "prefill"
-- (router, prefill, KV store) and "decode". Like examples/epd_3nodes.lua,
-- with the number of encoder nodes from --set encoders=N (default 2).
--   --set prefill_port=N (the head's real port, for the workers), encoders=N, decoders=N
cluster { router = "least_loaded_prefix" }

local function at(name, t)
  t.name = name
  t.host = "127.0.0.1"
  t.port = param(name .. "_port", 0)
  return t
end

for i = 0, param("encoders", 2) - 1 do
  node(at("e" .. i, { actors = { vision_encoder = 1 } }))
end
node(at("prefill", {
  head = true,
  actors = { prefill = 1, kv_store = 1 },
  kv = { tier0 = 256 * MiB, tier1 = 1 * GiB },
}))
node(at("decode", { actors = { decode = param("decoders", 1) } }))
