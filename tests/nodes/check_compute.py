#!/usr/bin/env python3
"""`cluster { compute = "int8" }` across processes (tests/nodes/cluster.lua
with --set compute=int8): a head (router + KV store), a prefill node and a
decode node on loopback, a Q8_0 model. The prefill node's int8 KV moves to
the decoder, and every request has the tokens, text and per-step logits
hashes of one `cleave generate --requests --compute int8` process, which
differ from the exact compute's; `topology check` names the compute and
refuses an unknown one.

usage: check_compute.py CLEAVE VOCAB WORKDIR"""
import json
import os
import subprocess
import sys

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "cluster.lua")
sys.path.insert(0, HERE)
from node_process import expect, failures, make_model, mono_results, run_head_p0_d0, stats_of, stop_all  # noqa: E402,E501

os.makedirs(WORK, exist_ok=True)
MODEL = os.path.join(WORK, "q8.gguf")
make_model(CLEAVE, VOCAB, MODEL, "--dim", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
           "--ctx", "512", "--type", "q8_0")
REQ = os.path.join(WORK, "requests.jsonl")
N = 16
with open(REQ, "w") as f:
    for i in range(N):
        prompt = [1] + [300 + (31 * i + 11 * j) % 3000 for j in range(40 + i % 7)]
        f.write(json.dumps({"id": i, "prompt_ids": prompt, "max_tokens": 8,
                            "temperature": 0 if i % 2 else 0.8, "seed": i}) + "\n")

try:
    want = mono_results(CLEAVE, MODEL, REQ, "--compute", "int8")
    exact = mono_results(CLEAVE, MODEL, REQ)
    expect("mono int8 answers every request, with other logits than exact",
           len(want) == N and all(w["error"] is None for w in want.values()) and
           all(want[i]["logits_hash"] != exact[i]["logits_hash"] for i in range(N)), (want.get(0), exact.get(0)))
    rc, got, err = run_head_p0_d0(CLEAVE, TOPOLOGY, MODEL, REQ, WORK, "compute=int8")
    expect("P/D across processes under int8: mono int8's tokens, text and logits hashes", rc == 0 and got == want,
           f"rc={rc} {err['head'][-1500:]}")
    sent = stats_of(err["p0"], "p0/prefill/0").get("kv_blocks_sent", 0)
    expect("the prefill node sent its int8 KV to the decoder", sent > 0, err["p0"][-800:])
    p = subprocess.run([CLEAVE, "topology", "check", TOPOLOGY, "--set", "compute=int8"], capture_output=True,
                       text=True, timeout=60)
    expect("`topology check` names the compute", p.returncode == 0 and ", compute int8" in p.stdout,
           (p.returncode, p.stdout, p.stderr))
    p = subprocess.run([CLEAVE, "topology", "check", TOPOLOGY, "--set", "compute=int4"], capture_output=True,
                       text=True, timeout=60)
    expect("an unknown compute is refused when the script loads",
           p.returncode == 1 and "unknown compute 'int4' (expected exact or int8)" in p.stderr,
           (p.returncode, p.stderr))
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all int8 compute node checks passed")
sys.exit(1 if failures else 0)
