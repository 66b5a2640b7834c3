-- The clusters of tests/nodes/check_nodes.py: a head that hosts the router
-- and the KV store (no stages), prefill nodes p0.., decode nodes d0...
--   --set head_port=N (the head's real port, for workers), prefills=N, decoders=N,
--   compute=exact|int8 (check_compute.py), block_size=N (check_block_size.py),
--   connection_timeout_s=S (check_streams.py)
cluster { router = "least_loaded_prefix", request_timeout_s = 60, compute = param("compute", "exact"),
          block_size = param("block_size", 16),
          connection_timeout_s = param("connection_timeout_s", 0.5) }
node {
  name = "head", head = true, port = param("head_port", 0),
  actors = { kv_store = 1 }, kv = { tier0 = 64 * MiB, tier1 = 64 * MiB },
}
for i = 0, param("prefills", 1) - 1 do
  node { name = "p" .. i, threads = 1, actors = { prefill = 1 } }
end
for i = 0, param("decoders", 1) - 1 do
  node { name = "d" .. i, threads = 1, actors = { decode = 1 } }
end
