-- The cluster of tests/netns/check_netns.py: each node on its own host (a
-- network namespace); the head runs prefill and the KV store, d0 and d1
-- decode. Fast heartbeats, so a cut link is noticed in about half a second.
--   --set head_host=IP, head_port=N (where this process finds the head: a
--   worker behind a relay names the relay), d0_host=IP, d1_host=IP,
--   connection_timeout=S (0.5 unless set)
cluster { router = "least_loaded", request_timeout_s = 60, heartbeat_interval_s = 0.1,
          connection_timeout_s = param("connection_timeout", 0.5) }
node {
  name = "head", head = true, host = param("head_host", "127.0.0.1"), port = param("head_port", 0),
  actors = { prefill = 1, kv_store = 1 }, kv = { tier0 = 64 * MiB, tier1 = 64 * MiB },
}
for _, d in ipairs({ "d0", "d1" }) do
  node { name = d, host = param(d .. "_host", "127.0.0.1"), threads = 1, actors = { decode = 1 } }
end
