-- tests/nodes/check_join.py: a cluster with a secret of a head (router and
-- KV store), p0 (prefill) and d0 (decode); more decoders join it with
-- `cleave node --join HOST:PORT --actors decode=1`, undeclared here.
--   --set head_port=N (the head's real port, for p0 and d0)
cluster { router = "least_loaded_prefix", request_timeout_s = 60, secret_env = "CLEAVE_JOIN_TEST_SECRET" }
node {
  name = "head", head = true, port = param("head_port", 0),
  actors = { kv_store = 1 }, kv = { tier0 = 64 * MiB, tier1 = 64 * MiB },
}
node { name = "p0", threads = 1, actors = { prefill = 1 } }
node { name = "d0", threads = 1, actors = { decode = 1 } }
