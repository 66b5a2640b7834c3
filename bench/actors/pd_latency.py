#!/usr/bin/env python3
"""TTFT and TPOT (p50 / p90) of the same requests in one process against P/D
across processes, with `cleave node --requests` (results carry ttft_ms and
total_ms per request; TPOT = (total - ttft) / (tokens - 1)).

  one process      examples/one_process.lua (colocated), and --set split=true (prefill + decode)
  2 processes      examples/pd_2nodes.lua: prefill + store (head), decode
  3 processes      examples/p1_d2.lua: prefill + store (head), decode, decode

usage: pd_latency.py CLEAVE VOCAB WORKDIR [--requests 64] [--dim 256] [--layers 4]
                     [--prompt 200] [--max-tokens 32] [--threads 1] [--json FILE]"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--requests", type=int, default=64)
ap.add_argument("--dim", type=int, default=256)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--prompt", type=int, default=200, help="mean prompt tokens")
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--json")
a = ap.parse_args()
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
os.makedirs(a.work, exist_ok=True)

model = os.path.join(a.work, "latency.gguf")
subprocess.run([a.cleave, "make-model", "--out", model, "--vocab", a.vocab, "--dim", str(a.dim), "--layers",
                str(a.layers), "--heads", str(a.dim // 64), "--kv-heads", str(max(1, a.dim // 128)), "--ffn",
                str(a.dim * 3), "--ctx", "1024", "--type", "f16"], check=True, capture_output=True, timeout=300)
rng = random.Random(7)
req_path = os.path.join(a.work, "latency.jsonl")
with open(req_path, "w") as f:
    for i in range(a.requests):
        n = max(2, int(rng.gauss(a.prompt, a.prompt / 4)))
        prompt = [1] + [rng.randrange(3, 32000) for _ in range(n - 1)]
        f.write(json.dumps({"id": i + 1, "prompt_ids": prompt, "max_tokens": a.max_tokens, "temperature": 0,
                            "ignore_eos": True}) + "\n")


def run(name, script, head, workers, sets=()):
    out = os.path.join(a.work, name + ".out.jsonl")
    topo = os.path.join(EXAMPLES, script)
    common = ["--topology", topo, "-m", model, "-t", str(a.threads), "--max-seqs", "16", *sets]
    h = subprocess.Popen([a.cleave, "node", "--name", head, *common, "--requests", req_path, "--out", out,
                          "--wait-stages", str(1 + len(workers) if workers else 1)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    m = re.search(r"listening on [0-9.]+:(\d+)", h.stdout.readline())
    ws = [subprocess.Popen([a.cleave, "node", "--name", w, *common, "--set", f"{head}_port={m.group(1)}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for w in workers]
    t0 = time.time()
    _, err = h.communicate(timeout=1800)
    wall = time.time() - t0
    for w in ws:
        w.wait(timeout=30)
    if h.returncode != 0:
        sys.exit(f"{name}: head exited {h.returncode}: {err[-2000:]}")
    results = [json.loads(l) for l in open(out)]
    return results, wall


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else 0.0


rows = []
tokens = {}
for name, script, head, workers, sets in (
        ("one process, colocated", "one_process.lua", "head", [], ()),
        ("one process, P + D actors", "one_process.lua", "head", [], ("--set", "split=true")),
        ("P/D, 2 processes", "pd_2nodes.lua", "prefill", ["decode"], ()),
        ("1 P + 2 D, 3 processes", "p1_d2.lua", "p0", ["d0", "d1"], ())):
    results, wall = run(re.sub(r"\W+", "_", name), script, head, workers, sets)
    bad = [r["id"] for r in results if "error" in r]
    if bad:
        sys.exit(f"{name}: requests failed: {bad[:5]}")
    ttft = [r["ttft_ms"] for r in results]
    tpot = [(r["total_ms"] - r["ttft_ms"]) / (len(r["tokens"]) - 1) for r in results if len(r["tokens"]) > 1]
    for r in results:
        tokens.setdefault(r["id"], r["tokens"])
        if tokens[r["id"]] != r["tokens"]:
            sys.exit(f"{name}: request {r['id']} gave other tokens than the first run")
    rows.append({"setup": name, "requests": len(results), "wall_s": wall, "ttft_p50_ms": pct(ttft, 0.5),
                 "ttft_p90_ms": pct(ttft, 0.9), "tpot_p50_ms": pct(tpot, 0.5), "tpot_p90_ms": pct(tpot, 0.9)})

print(f"{a.requests} requests, prompts ~{a.prompt} tokens, {a.max_tokens} new tokens each, model dim {a.dim} x "
      f"{a.layers} layers, {a.threads} thread(s) per engine; identical tokens in every setup")
print(f"{'setup':28s} {'TTFT p50':>9s} {'p90':>8s} {'TPOT p50':>9s} {'p90':>8s} {'wall s':>7s}")
for r in rows:
    print(f"{r['setup']:28s} {r['ttft_p50_ms']:9.1f} {r['ttft_p90_ms']:8.1f} {r['tpot_p50_ms']:9.2f} "
          f"{r['tpot_p90_ms']:8.2f} {r['wall_s']:7.1f}")
if a.json:
    with open(a.json, "w") as f:
        json.dump(rows, f, indent=2)
