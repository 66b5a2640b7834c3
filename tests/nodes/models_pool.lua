-- The cluster of tests/nodes/check_models_pool.py: two models, each with a
-- KV pool of its own. The head hosts each model's router and directory
-- store; a0, a1 serve model A and b0, b1 model B, each with a colocated
-- stage and a kv_store in its model's pool.
--   --set head_port=N, model_a=PATH, model_b=PATH
cluster { router = "round_robin", request_timeout_s = 60, kv_pool = true }
node {
  name = "head", head = true, port = param("head_port", 0), model = args.model_a,
  actors = { kv_store = 1 }, kv = { tier0 = 16 * MiB, tier1 = 16 * MiB },
}
for i = 0, 1 do
  node { name = "a" .. i, threads = 1, model = args.model_a, actors = { colocated = 1, kv_store = 1 },
         kv = { tier0 = 16 * MiB, tier1 = 16 * MiB } }
  node { name = "b" .. i, threads = 1, model = args.model_b, actors = { colocated = 1, kv_store = 1 },
         kv = { tier0 = 16 * MiB, tier1 = 16 * MiB } }
end
