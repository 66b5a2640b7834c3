-- P/D on two nodes of one host, both on param("device") (scripts/gpu_check.sh
-- runs it on cuda:0 through tests/nodes/check_pd_device.py): the hand-off's
-- KV goes device to device through shared (CUDA IPC) memory.
cluster { router = "least_loaded" }
local device = param("device", "cpu")
node { name = "prefill", head = true, host = "127.0.0.1", port = param("prefill_port", 0), device = device,
       actors = { prefill = 1, kv_store = 1 }, kv = { tier0 = 256 * MiB, tier1 = 512 * MiB } }
node { name = "decode", host = "127.0.0.1", port = 0, device = device, actors = { decode = 1 } }
