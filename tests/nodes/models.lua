-- The cluster of tests/nodes/check_models.py: two models in one cluster.
-- The head (router and KV store of each model, no stages) serves model A;
-- a0 serves A colocated; bp / bd0 / bd1 serve B as prefill and decoders.
--   --set head_port=N, model_a=PATH, model_b=PATH
cluster { router = "least_loaded_prefix", request_timeout_s = 60 }
node {
  name = "head", head = true, port = param("head_port", 0), model = args.model_a,
  actors = { kv_store = 1 }, kv = { tier0 = 16 * MiB, tier1 = 16 * MiB },
}
node { name = "a0", threads = 1, model = args.model_a, actors = { colocated = 1 } }
node { name = "bp", threads = 1, model = args.model_b, actors = { prefill = 1 } }
for i = 0, 1 do
  node { name = "bd" .. i, threads = 1, model = args.model_b, actors = { decode = 1 } }
end
