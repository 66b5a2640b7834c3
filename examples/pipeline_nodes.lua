-- Pipeline parallelism over processes: the model's layers cut into stages,
-- each on its own node. The head hosts the router and the KV store; every
-- pipeline's first stage (a prefill, decode or colocated actor, with the
-- embeddings) and each later stage (a stage actor) is a node of its own.
-- Prefill and decode are cut on their own: prefill over 2 nodes and decode
-- on 1 (the defaults), or the reverse, or a colocated pipeline.
--   cleave topology check examples/pipeline_nodes.lua -m MODEL.gguf --set layers=12
--   --set mode=pd|colocated, prefill_stages=N, decode_stages=N, stages=N
--   (colocated), pipelines=N (replicas of each), layers=N (the model's),
--   NAME_port=N (the head's real port, head_port, for the workers)
cluster { router = "least_loaded" }

local function at(name, t)
  t.name = name
  t.host = param(name .. "_host", "127.0.0.1")
  t.port = param(name .. "_port", 0)
  return t
end

local layers = param("layers", 12)
-- n stages, as even as they go (the first ones one layer longer).
local function cut(n)
  local out, first = {}, 0
  for s = 0, n - 1 do
    local len = layers // n + (s < layers % n and 1 or 0)
    out[#out + 1] = { first, first + len - 1 }
    first = first + len
  end
  return out
end

node(at("head", { head = true, actors = { kv_store = 1 }, kv = { tier0 = 256 * MiB, tier1 = 256 * MiB } }))

local roles
if param("mode", "pd") == "colocated" then
  roles = { colocated = param("stages", 2) }
else
  roles = { prefill = param("prefill_stages", 2), decode = param("decode_stages", 1) }
end
for _, role in ipairs({ "prefill", "decode", "colocated" }) do
  local n = roles[role]
  if n then
    for r = 1, param("pipelines", 1) do
      for s, range in ipairs(cut(n)) do
        local name = role .. r .. "_" .. s
        local actors = s == 1 and { [role] = 1 } or { stage = 1 }
        node(at(name, { actors = actors, stage = { layers = range, pipeline = role .. r } }))
      end
    end
  end
end
