-- The cluster of tests/nodes/check_models_vision.py: the shapes VLM's dense
-- and MoE language models in one cluster, each with a vision encoder node
-- of its own (node{}.mmproj names the model's encoder). The head (router
-- and KV store of each model, no stages) serves the dense one.
--   --set head_port=N, dense=PATH, moe=PATH, mmproj=PATH
cluster { router = "least_loaded_prefix", request_timeout_s = 60 }
node {
  name = "head", head = true, port = param("head_port", 0), model = args.dense, mmproj = args.mmproj,
  actors = { kv_store = 1 }, kv = { tier0 = 16 * MiB, tier1 = 16 * MiB },
}
node { name = "d0", threads = 1, model = args.dense, actors = { colocated = 1 } }
node { name = "de", threads = 1, model = args.dense, actors = { vision_encoder = 1 } }
node { name = "m0", threads = 1, model = args.moe, mmproj = args.mmproj, actors = { colocated = 1 } }
node { name = "me", threads = 1, model = args.moe, actors = { vision_encoder = 1 } }
