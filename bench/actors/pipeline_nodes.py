#!/usr/bin/env python3
"""Pipeline parallelism across processes (examples/pipeline_nodes.lua,
colocated pipelines) on the 100M GQA shape (F16: dim 768, 12 layers, 12
heads, 4 kv heads, ffn 2048): the model in one stage process against 2 and 3
stage processes, with 1, 2 and 4 micro-batches. Two loads: the prefill of one
2,048-token prompt (TTFT) and decode at batch 32 (16-token prompts, --steps
tokens each; tok/s = 32 / median TPOT). Per run: each stage's busy fraction
(the first stage: step time minus the time it waited on the later stages;
a later stage: its compute time; over the run's wall time) and each stage
process's resident memory while serving (peak RssAnon + RssFile), beside the
whole model's weight bytes. Every setup must give the one-stage run's tokens.
Each cell is the median of --reps runs with their range. The limits are
measured in the same run (cleave_actors_bench --limits, before and after;
the better kept): read bandwidth (the batch-1 decode limit) and the FP32 FMA
peak of one thread (the prefill limit: 2 x parameters x tokens FLOPs).

usage: pipeline_nodes.py CLEAVE ACTORS_BENCH VOCAB WORKDIR [--reps 3] [--steps 32] [--json FILE]"""
import argparse
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import node_bench  # noqa: E402
from node_bench import Peak, median_range  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("actors_bench")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--steps", type=int, default=32)
ap.add_argument("--prompt", type=int, default=2048)
ap.add_argument("--setups", default="1x1,2x1,2x2,2x4,3x1,3x2,3x4", help="STAGESxMICRO_BATCHES,...")
ap.add_argument("--json")
a = ap.parse_args()
TOPOLOGY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "pipeline_nodes.lua")
os.makedirs(a.work, exist_ok=True)
CTX = a.prompt + 64
model = os.path.join(a.work, f"pipeline-100m-gqa-f16-ctx{CTX}.gguf")
if not os.path.exists(model):
    subprocess.run([a.cleave, "make-model", "--out", model, "--vocab", a.vocab, "--dim", "768", "--layers", "12",
                    "--heads", "12", "--kv-heads", "4", "--ffn", "2048", "--ctx", str(CTX), "--type", "f16"],
                   check=True, capture_output=True, timeout=600)
weights_mib = os.path.getsize(model) / 2**20


def requests(kind):
    path = os.path.join(a.work, f"{kind}.jsonl")
    with open(path, "w") as f:
        if kind == "prefill":
            f.write(json.dumps({"id": 1, "prompt_ids": [1] + [300 + 7 * j % 30000 for j in range(a.prompt - 1)],
                                "max_tokens": 1, "temperature": 0}) + "\n")
        else:
            for i in range(32):
                f.write(json.dumps({"id": i + 1, "prompt_ids": [1] + [300 + 11 * j + 97 * i for j in range(15)],
                                    "max_tokens": a.steps, "temperature": 0, "ignore_eos": True}) + "\n")
    return path


def stats_line(err, actor):
    m = re.search(r"stats " + re.escape(actor) + r" (.*)", err)
    return {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())} if m else {}


def run(name, stages, micro, req, seqs):
    out = os.path.join(a.work, name + ".out.jsonl")
    common = ["--topology", TOPOLOGY, "-m", model, "-t", "1", "--max-seqs", str(seqs), "-c", str(CTX),
              "--set", "mode=colocated", "--set", f"stages={stages}", "--set", "layers=12"]
    h = subprocess.Popen([a.cleave, "node", "--name", "head", *common, "--requests", req, "--out", out,
                          "--wait-stages", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = re.search(r"listening on [0-9.]+:(\d+)", h.stdout.readline()).group(1)
    names = [f"colocated1_{s}" for s in range(1, stages + 1)]
    ws, peaks = [], []
    for n in names:
        extra = ["--pipeline-micro-batches", str(micro)] if n.endswith("_1") and stages > 1 else []
        w = subprocess.Popen([a.cleave, "node", "--name", n, *common, "--set", f"head_port={port}", "--no-rejoin",
                              *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ws.append(w)
        peaks.append(Peak(w.pid))
    for line in h.stdout:
        if "submitted" in line:
            for p in peaks:
                p.serving = True
    _, err = h.communicate(timeout=1800)
    errs = [w.communicate(timeout=60)[1] for w in ws]
    mems = [p.done() for p in peaks]
    if h.returncode != 0:
        sys.exit(f"{name}: head exited {h.returncode}: {err[-2000:]}")
    results = {r["id"]: r for r in (json.loads(l) for l in open(out))}
    wall_ms = max(r["total_ms"] for r in results.values())
    busy = []
    for i, (n, e) in enumerate(zip(names, errs)):
        if i == 0:
            s = stats_line(e, n + "/colocated/0")
            busy.append((s.get("step_us", 0) - s.get("pipeline_wait_us", 0)) / 1e3 / wall_ms)
        else:
            s = stats_line(e, n + "/stage/0")
            busy.append(s.get("stage_busy_us", 0) / 1e3 / wall_ms)
    return results, busy, mems


lim0 = node_bench.limits(a.actors_bench, model, a.work)
rows, ref = [], {}
for kind in ("prefill", "decode"):
    req = requests(kind)
    for setup in a.setups.split(","):
        stages, micro = (int(x) for x in setup.split("x"))
        metric, busy_all, mem_all = [], [], []
        for rep in range(a.reps):
            results, busy, mems = run(f"{kind}_{setup}_{rep}", stages, micro, req, 1 if kind == "prefill" else 32)
            bad = [i for i, r in results.items() if "error" in r]
            if bad:
                sys.exit(f"{setup}: requests failed: {bad[:5]}")
            for i, r in results.items():
                if ref.setdefault((kind, i), r["tokens"]) != r["tokens"]:
                    sys.exit(f"{kind} {setup}: request {i} gave other tokens than the one-stage run")
            if kind == "prefill":
                metric.append(results[1]["ttft_ms"])
            else:
                tpot = sorted((r["total_ms"] - r["ttft_ms"]) / (len(r["tokens"]) - 1) for r in results.values())
                metric.append(32 / (tpot[len(tpot) // 2] / 1e3))
            busy_all.append(busy)
            mem_all.append(mems)
        row = {"load": kind, "stages": stages, "micro_batches": micro,
               ("ttft_ms" if kind == "prefill" else "tok_s"): median_range(metric),
               "busy": [median_range([b[s] for b in busy_all]) for s in range(stages)],
               "rss_mib": [median_range([m[s]["anon_mib"] + m[s]["file_mib"] for m in mem_all])
                           for s in range(stages)]}
        rows.append(row)
        v = row["ttft_ms" if kind == "prefill" else "tok_s"]
        unit = "ms TTFT" if kind == "prefill" else "tok/s"
        busy_txt = " ".join(f"{b['median'] * 100:.0f}%" for b in row["busy"])
        rss_txt = " ".join(f"{r['median']:.0f}" for r in row["rss_mib"])
        print(f"{kind:7s} {stages} stage(s) x {micro} micro-batch(es): {v['median']:8.1f} {unit} "
              f"({v['min']:.1f}-{v['max']:.1f})  busy {busy_txt}  RSS MiB {rss_txt} (weights {weights_mib:.0f})",
              flush=True)
lim1 = node_bench.limits(a.actors_bench, model, a.work)
bw = max(lim0["read_bandwidth_GBs"], lim1["read_bandwidth_GBs"])
peak = max(lim0["fma_peak_GFLOPs"], lim1["fma_peak_GFLOPs"])
params = lim0["weight_bytes_per_token"] / 2  # F16: 2 bytes a parameter read per token
prefill_limit_ms = 2 * params * a.prompt / (peak * 1e9) * 1e3
print(f"read bandwidth {bw:.1f} GB/s, FP32 FMA peak {peak:.1f} GFLOP/s (1 thread); one thread's prefill limit "
      f"{prefill_limit_ms:.0f} ms for {a.prompt} tokens, batch-1 decode limit "
      f"{bw * 1e9 / lim0['weight_bytes_per_token']:.1f} tok/s; model weights {weights_mib:.0f} MiB; "
      f"identical tokens in every setup")
if a.json:
    with open(a.json, "w") as f:
        json.dump({"rows": rows, "read_bandwidth_GBs": bw, "fma_peak_GFLOPs": peak,
                   "prefill_limit_ms": prefill_limit_ms, "weights_mib": weights_mib}, f, indent=2)
