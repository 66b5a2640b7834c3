#!/usr/bin/env python3
"""`cluster { block_size = 64 }` across processes (tests/nodes/cluster.lua
with --set block_size=64): a head (router + KV store), a prefill node and a
decode node on loopback. Every node's KV blocks hold 64 positions: the
prefill node hands each request's prompt over in blocks of 64, and every
request has the tokens, text and per-step logits hashes of one `cleave
generate --requests --block-size 64` process, which differ from blocks of
16's (attention reduces block by block); `topology check` names the size and
refuses one outside vLLM's choices.

usage: check_block_size.py CLEAVE VOCAB WORKDIR"""
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
MODEL = os.path.join(WORK, "m.gguf")
make_model(CLEAVE, VOCAB, MODEL, "--dim", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
           "--ctx", "512")
REQ = os.path.join(WORK, "requests.jsonl")
N = 12
prompts = [[1] + [300 + (29 * i + 13 * j) % 3000 for j in range(60 + 9 * i)] for i in range(N)]  # 61-160 ids
with open(REQ, "w") as f:
    for i, prompt in enumerate(prompts):
        f.write(json.dumps({"id": i, "prompt_ids": prompt, "max_tokens": 8,
                            "temperature": 0 if i % 2 else 0.8, "seed": i}) + "\n")

try:
    want = mono_results(CLEAVE, MODEL, REQ, "--block-size", "64")
    base = mono_results(CLEAVE, MODEL, REQ)
    expect("mono answers every request in blocks of 64, with other logits than blocks of 16",
           len(want) == N and all(w["error"] is None for w in want.values()) and
           all(want[i]["logits_hash"] != base[i]["logits_hash"] for i in range(N)), (want.get(0), base.get(0)))
    rc, got, err = run_head_p0_d0(CLEAVE, TOPOLOGY, MODEL, REQ, WORK, "block_size=64")
    expect("P/D across processes in blocks of 64: mono's tokens, text and logits hashes at that size",
           rc == 0 and got == want, f"rc={rc} {err['head'][-1500:]}")
    # A prompt of n positions fills ceil(n / 64) blocks (1-3 here; 4-10 in blocks of 16).
    blocks = sum((len(p) + 63) // 64 for p in prompts)
    sent = stats_of(err["p0"], "p0/prefill/0").get("kv_blocks_sent", 0)
    expect(f"the prefill node sent the prompts in {blocks} blocks of 64", sent == blocks,
           (sent, err["p0"][-800:]))
    p = subprocess.run([CLEAVE, "topology", "check", TOPOLOGY, "--set", "block_size=64"], capture_output=True,
                       text=True, timeout=60)
    expect("`topology check` names the block size", p.returncode == 0 and ", KV blocks of 64 positions" in p.stdout,
           (p.returncode, p.stdout, p.stderr))
    p = subprocess.run([CLEAVE, "topology", "check", TOPOLOGY, "--set", "block_size=24"], capture_output=True,
                       text=True, timeout=60)
    expect("a block size outside vLLM's choices is refused when the script loads",
           p.returncode == 1 and "block_size 24 is not one of 8, 16, 32, 64 or 128" in p.stderr,
           (p.returncode, p.stderr))
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all block size node checks passed")
sys.exit(1 if failures else 0)
