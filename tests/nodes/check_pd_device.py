#!/usr/bin/env python3
"""P/D on one device across two `cleave node` processes (tests/nodes/pd_device.lua):
every request's tokens equal `cleave generate` on the same device alone (the
topology invariant holds per backend), and the decoder took every stream
through shared memory with no fallback (on a GPU: device memory to device
memory, CUDA IPC). scripts/gpu_check.sh runs it on cuda:0; on cpu it checks
the script itself.
Usage: check_pd_device.py CLEAVE MODEL DEVICE   (MODEL is made when missing)"""
import atexit, json, os, re, shutil, subprocess, sys, tempfile, time

cleave, model, device = sys.argv[1:4]
here = os.path.dirname(os.path.abspath(__file__))
topo = os.path.join(here, "pd_device.lua")
work = tempfile.mkdtemp(prefix="cleave-pd-device-")
atexit.register(shutil.rmtree, work, True)
env = dict(os.environ, CLEAVE_CLUSTER_SECRET="pd-device-check")
if not os.path.exists(model):
    vocab = os.path.join(here, "..", "..", "models", "vocab", "ggml-vocab-llama-spm.gguf")
    subprocess.run([cleave, "make-model", "--out", model, "--vocab", vocab, "--dim", "256", "--layers", "4",
                    "--heads", "8", "--kv-heads", "4", "--ffn", "512", "--ctx", "256", "--type", "f16"],
                   check=True, capture_output=True)
prompts = [[1, 50, 60, 70, 80, 90, 100], [1] + list(range(200, 240)), [1, 7, 7, 7], [1] + list(range(300, 330))]
n_tokens = 16

want = []
for p in prompts:
    out = subprocess.run([cleave, "generate", "-m", model, "--device", device, "--prompt-ids", ",".join(map(str, p)),
                          "-n", str(n_tokens), "--temp", "0", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"generate failed: {out.stderr}")
    want.append(json.loads(out.stdout)["generated_ids"])

with open(os.path.join(work, "requests.jsonl"), "w") as f:
    for i, p in enumerate(prompts):
        f.write(json.dumps({"id": i + 1, "prompt_ids": p, "max_tokens": n_tokens, "temperature": 0,
                            "ignore_eos": True}) + "\n")
head_err = open(os.path.join(work, "head.err"), "w+")
head = subprocess.Popen([cleave, "node", "--topology", topo, "--name", "prefill", "-m", model,
                         "--set", f"device={device}", "--requests", os.path.join(work, "requests.jsonl"),
                         "--out", os.path.join(work, "out.jsonl"), "--wait-stages", "2"],
                        stdout=subprocess.PIPE, stderr=head_err, text=True, env=env)
port = None
deadline = time.time() + 120
while port is None and time.time() < deadline:
    line = head.stdout.readline()
    m = re.search(r"listening on .*:(\d+)$", line.strip())
    if m:
        port = m.group(1)
    elif not line and head.poll() is not None:
        break
if port is None:
    head.kill()
    head_err.seek(0)
    sys.exit(f"the head did not listen: {head_err.read()}")
dec_err = open(os.path.join(work, "decode.err"), "w+")
dec = subprocess.Popen([cleave, "node", "--topology", topo, "--name", "decode", "-m", model, "--set", f"device={device}",
                        "--set", f"prefill_port={port}"], stdout=subprocess.DEVNULL, stderr=dec_err, env=env)
rc = head.wait(timeout=600)
dec.wait(timeout=60)
head_err.seek(0)
dec_err.seek(0)
herr, derr = head_err.read(), dec_err.read()
if rc != 0:
    sys.exit(f"the head failed ({rc}): {herr}\n{derr}")
results = {r["id"]: r for r in (json.loads(l) for l in open(os.path.join(work, "out.jsonl")) if l.strip())}
failures = []
for i, w in enumerate(want):
    got = results.get(i + 1, {}).get("tokens")
    if got != w:
        failures.append(f"request {i + 1}: {got} != generate's {w}")
m = re.search(r"stats decode/decode/0 (.*)", derr) or re.search(r"stats \S*decode/0 (.*)", derr)
stats = dict(kv.split("=") for kv in m.group(1).split()) if m else {}
received, shared = int(stats.get("kv_transfers_received", -1)), int(stats.get("kv_shared_received", -2))
if not (received == shared == len(prompts)) or int(stats.get("kv_shared_fallbacks", 1)) != 0:
    failures.append(f"the decoder's streams: {stats}")
for f in failures:
    print("FAILED:", f)
print(f"pd on {device}: {len(prompts)} requests, {len(failures)} failed; decoder {received} streams, "
      f"{shared} through shared memory")
sys.exit(1 if failures else 0)
