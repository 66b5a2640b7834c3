-- The cluster of tests/nodes/check_cost.py: a head (router and KV store, no
-- stages) and colocated nodes A and B, each with its node's cost.
--   --set head_port=N, a_cost=C, b_cost=C, router=NAME (default cost_aware)
cluster { router = param("router", "cost_aware"), request_timeout_s = 60 }
node {
  name = "head", head = true, port = param("head_port", 0),
  actors = { kv_store = 1 }, kv = { tier0 = 16 * MiB, tier1 = 16 * MiB },
}
node { name = "A", threads = 1, cost = param("a_cost", 1.0), actors = { colocated = 1 } }
node { name = "B", threads = 1, cost = param("b_cost", 1.0), actors = { colocated = 1 } }
