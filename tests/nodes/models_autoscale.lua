-- The cluster of tests/nodes/check_models_autoscale.py: two models in one
-- cluster, each with three colocated stages on a node of its own, under
-- one autoscale block that each model's router runs on its own (a goal of
-- 1 ns no request meets: a model's stages come up as its requests arrive,
-- and a model without requests keeps its floor of one).
--   --set head_port=N, model_a=PATH, model_b=PATH
cluster {
  router = "least_loaded", request_timeout_s = 60,
  autoscale = { ttft_ms = 1e-6, min_stages = 1, interval_s = 0.2, confirm = 1, cooldown_s = 30 },
}
node {
  name = "head", head = true, port = param("head_port", 0), model = args.model_a,
  actors = { kv_store = 1 }, kv = { tier0 = 16 * MiB, tier1 = 16 * MiB },
}
node { name = "a0", threads = 1, model = args.model_a, actors = { colocated = 3 } }
node { name = "b0", threads = 1, model = args.model_b, actors = { colocated = 3 } }
