-- One process: the head hosts the router and every actor.
--   cleave topology show examples/one_process.lua
--   cleave topology show examples/one_process.lua --set split=true --set head_port=7000
local split = param("split", false)  -- true: prefill + decode actors instead of colocated ones

node {
  name = "head",
  head = true,
  host = param("head_host", "127.0.0.1"),
  port = param("head_port", 0),  -- 0: any free port (the head prints the one it bound)
  actors = split and { prefill = 1, decode = 1, kv_store = 1 } or { colocated = 1, kv_store = 1 },
  kv = { tier0 = 256 * MiB, tier1 = 1 * GiB },
}
