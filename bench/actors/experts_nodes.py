#!/usr/bin/env python3
"""Attention/FFN disaggregation across processes: decode tok/s at batch 1, 8
and 32 on the 100M MoE shape (F16: dim 512, 6 layers, 8 experts, top-2, ffn
1024), one process against 1 attention + 2 expert processes
(examples/experts_3nodes.lua, half the experts on each), with and without
micro-batch ping-pong; the per-layer expert round trip p50 / p99 the
attention actor measures (expert_layer_p50_us / p99_us: send, compute on
the expert nodes, answer) beside a loopback TCP echo of one host's bytes;
the attention node's resident memory while serving (peak RssAnon and
RssFile after the requests were submitted)
against the one process. Every setup must give the one process's tokens.

Decode tok/s = batch / median TPOT, TPOT = (total - ttft) / (tokens - 1)
per request; each cell is the median of --reps runs with their range. The
limits are measured in the same run (cleave_actors_bench --limits, before
and after; the better kept): read bandwidth, and the batch-1 decode limit
= weight bytes one token reads / bandwidth.

usage: experts_nodes.py CLEAVE ACTORS_BENCH VOCAB WORKDIR [--reps 3] [--steps 64] [--json FILE]"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import node_bench  # noqa: E402
from node_bench import Peak, median_range  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("actors_bench")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--batches", default="1,8,32")
ap.add_argument("--json")
a = ap.parse_args()
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
os.makedirs(a.work, exist_ok=True)

model = os.path.join(a.work, "experts-100m-moe-f16.gguf")
if not os.path.exists(model):
    subprocess.run([a.cleave, "make-model", "--out", model, "--vocab", a.vocab, "--dim", "512", "--layers", "6",
                    "--heads", "8", "--kv-heads", "2", "--ffn", "1024", "--experts", "8", "--experts-used", "2",
                    "--ctx", "1024", "--type", "f16"], check=True, capture_output=True, timeout=600)


def limits():
    return node_bench.limits(a.actors_bench, model, a.work)


def tcp_round_trip_us(nbytes, reps=300):
    """Median round trip of nbytes each way over loopback TCP (a Python echo
    peer, TCP_NODELAY): the transport's floor for one host's layer batch."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def echo():
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reps):
            got = 0
            while got < nbytes:
                got += len(c.recv(nbytes - got))
            c.sendall(b"y" * nbytes)
        c.close()

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    c = socket.create_connection(srv.getsockname())
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b"x" * nbytes
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        c.sendall(payload)
        got = 0
        while got < nbytes:
            got += len(c.recv(nbytes - got))
        times.append((time.perf_counter() - t0) * 1e6)
    c.close()
    t.join()
    srv.close()
    return sorted(times)[len(times) // 2]


def requests(batch):
    path = os.path.join(a.work, f"batch{batch}.jsonl")
    with open(path, "w") as f:
        for i in range(batch):
            f.write(json.dumps({"id": i + 1, "prompt_ids": [1] + [300 + 11 * j + 97 * i for j in range(15)],
                                "max_tokens": a.steps, "temperature": 0, "ignore_eos": True}) + "\n")
    return path


def run(name, script, head, workers, req, sets=(), head_flags=()):
    out = os.path.join(a.work, name + ".out.jsonl")
    topo = os.path.join(EXAMPLES, script)
    common = ["--topology", topo, "-m", model, "-t", "1", "--max-seqs", "32", *sets]
    h = subprocess.Popen([a.cleave, "node", "--name", head, *common, "--requests", req, "--out", out,
                          "--wait-stages", str(1 + len(workers)), *head_flags],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = Peak(h.pid)
    m = re.search(r"listening on [0-9.]+:(\d+)", h.stdout.readline())
    ws = [subprocess.Popen([a.cleave, "node", "--name", w, *common, "--set", f"{head}_port={m.group(1)}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for w in workers]
    for line in h.stdout:
        if "submitted" in line:
            peak.serving = True
    _, err = h.communicate(timeout=1800)
    mem = peak.done()
    for w in ws:  # workers would wait to rejoin a restarted head
        w.kill()
        w.wait(timeout=30)
    if h.returncode != 0:
        sys.exit(f"{name}: head exited {h.returncode}: {err[-2000:]}")
    results = {r["id"]: r for r in (json.loads(l) for l in open(out))}
    stats = {}
    for line in err.splitlines():
        s = re.match(r".*stats (\S+/colocated/0) (.*)", line)
        if s:
            stats = {k: int(v) for k, v in (kv.split("=") for kv in s.group(2).split())}
    return results, stats, mem


lim0 = limits()
setups = (("one process (colocated)", "one_process.lua", "head", [], (), ()),
          ("1 attention + 2 expert processes", "experts_3nodes.lua", "attn", ["ex0", "ex1"], (), ()),
          ("  same, 2 micro-batches", "experts_3nodes.lua", "attn", ["ex0", "ex1"], (),
           ("--expert-micro-batches", "2")),
          # One expert process holding every expert: attention and experts
          # each get one of the two cores, so ping-pong has idle time to fill.
          ("1 attention + 1 expert process", "experts_3nodes.lua", "attn", ["ex0"], ("--set", "replicas=true"), ()),
          ("  same, 2 micro-batches", "experts_3nodes.lua", "attn", ["ex0"], ("--set", "replicas=true"),
           ("--expert-micro-batches", "2")))
rows = []
ref = {}
for batch in (int(b) for b in a.batches.split(",")):
    req = requests(batch)
    for name, script, head, workers, sets, head_flags in setups:
        tok_s, p50, p99, mems = [], [], [], []
        for rep in range(a.reps):
            results, stats, mem = run(re.sub(r"\W+", "_", name.strip()) + f"_b{batch}", script, head, workers, req,
                                      sets, head_flags)
            bad = [i for i, r in results.items() if "error" in r]
            if bad or len(results) != batch:
                sys.exit(f"{name}: requests failed or missing: {bad[:5]}")
            for i, r in results.items():
                if ref.setdefault((batch, i), r["tokens"]) != r["tokens"]:
                    sys.exit(f"{name}, batch {batch}: request {i} gave other tokens than the one process")
            tpot = sorted((r["total_ms"] - r["ttft_ms"]) / (len(r["tokens"]) - 1) for r in results.values())
            tok_s.append(batch / (tpot[len(tpot) // 2] / 1e3))
            if workers:
                if stats.get("expert_fallback_rows", 1) != 0 or stats.get("expert_rows", 0) == 0:
                    sys.exit(f"{name}: the expert rows did not all run on the expert nodes: {stats}")
                p50.append(stats["expert_layer_p50_us"])
                p99.append(stats["expert_layer_p99_us"])
            mems.append(mem)
        row = {"setup": name.strip(), "batch": batch, "tok_s": median_range(tok_s),
               "vm_hwm_mib": median_range([m["hwm_mib"] for m in mems]),
               "rss_anon_mib": median_range([m["anon_mib"] for m in mems]),
               "rss_file_mib": median_range([m["file_mib"] for m in mems])}
        if p50:
            row["layer_round_trip_p50_us"] = median_range(p50)
            row["layer_round_trip_p99_us"] = median_range(p99)
            # Each host gets about batch x top-2 / 2 rows of 512 floats per layer.
            row["tcp_echo_us_same_bytes"] = tcp_round_trip_us(batch * 512 * 4)
        rows.append(row)
        t = row["tok_s"]
        rt = (f"  layer round trip p50 {row['layer_round_trip_p50_us']['median'] / 1e3:.2f} ms, "
              f"p99 {row['layer_round_trip_p99_us']['median'] / 1e3:.2f} ms (TCP echo of "
              f"{batch * 2} KiB: {row['tcp_echo_us_same_bytes'] / 1e3:.3f} ms)") if p50 else ""
        print(f"batch {batch:2d}  {name:34s} {t['median']:7.1f} tok/s ({t['min']:.1f}-{t['max']:.1f})  "
              f"head RSS serving: anon {row['rss_anon_mib']['median']:.0f} + file {row['rss_file_mib']['median']:.0f} MiB "
              f"(VmHWM {row['vm_hwm_mib']['median']:.0f}){rt}", flush=True)
lim1 = limits()
bw = max(lim0["read_bandwidth_GBs"], lim1["read_bandwidth_GBs"])
limit = bw * 1e9 / lim0["weight_bytes_per_token"]
print(f"read bandwidth {bw:.1f} GB/s (before {lim0['read_bandwidth_GBs']:.1f}, after "
      f"{lim1['read_bandwidth_GBs']:.1f}); batch-1 decode limit {limit:.1f} tok/s "
      f"({lim0['weight_bytes_per_token'] / 1e6:.1f} MB of weights per token); identical tokens in every setup")
if a.json:
    with open(a.json, "w") as f:
        json.dump({"rows": rows, "read_bandwidth_GBs": bw, "decode_limit_tok_s": limit}, f, indent=2)
