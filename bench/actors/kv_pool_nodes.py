#!/usr/bin/env python3
"""The distributed KV pool across processes (examples/kv_pool_nodes.lua) on
the 100M GQA shape (F16: dim 768, 12 layers, 12 heads, 4 kv heads, ffn 2048;
F32 KV: 384 KiB a 16-token block). Every node process runs 1 thread.

1. A long prefix fetched against computed: 2 serving nodes, round robin,
   one request at a time. Per rep a new 2,047-token prefix: its first
   request (prefix + 1 token, max_tokens 1) is computed on one node, its
   second (another last token) lands on the other node, whose store fetches
   the prefix's 127 blocks from the first node's store. Latency of each
   (max_tokens 1: the TTFT). The second request's answer (text and
   logprob) must equal the one of the same cluster without the pool, where
   the second node computes the prefix itself.
2. A cache-heavy load (bench/serve/serve_bench.py: --prefix-groups shared
   prefixes, Poisson arrivals, streamed, greedy) over 3 serving nodes: each
   node's own engine prefix cache (no pool) with round robin and with
   least_loaded_prefix, against the pool with round robin, without and with
   the router's preloads. Per config: TTFT p50 / p90, the prompt tokens
   served from the node's own engine cache (local hits) and from the pool
   (imported) over all prompt tokens, and the KV bytes the pool moved per
   request (blocks fetched x block bytes).

Limits measured in the same run: read bandwidth and one thread's FP32 FMA
peak (cleave_actors_bench --limits: the compute bound of a prefill, 2 x
parameters x tokens FLOPs) and raw TCP over loopback (cleave_kv_bench: the
bound on moving a prefix's KV between processes). Each cell is the median
of --reps runs with their range.

usage: kv_pool_nodes.py CLEAVE ACTORS_BENCH KV_BENCH VOCAB WORKDIR [--reps 3] [--json FILE]"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import node_bench  # noqa: E402
from node_bench import median_range  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("actors_bench")
ap.add_argument("kv_bench")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--prefix", type=int, default=2047, help="part 1: prefix tokens")
ap.add_argument("--prompts", type=int, default=48, help="part 2: requests per run")
ap.add_argument("--groups", type=int, default=6, help="part 2: shared prefixes")
ap.add_argument("--shared", type=int, default=512, help="part 2: shared prefix tokens")
ap.add_argument("--input", type=int, default=544, help="part 2: prompt tokens")
ap.add_argument("--output", type=int, default=16, help="part 2: tokens generated per request")
ap.add_argument("--rate", type=float, default=1.5, help="part 2: requests per second (Poisson)")
ap.add_argument("--parts", default="1,2")
ap.add_argument("--json")
a = ap.parse_args()
TOPOLOGY = os.path.join(HERE, "..", "..", "examples", "kv_pool_nodes.lua")
SERVE_BENCH = os.path.join(HERE, "..", "serve", "serve_bench.py")
os.makedirs(a.work, exist_ok=True)
CTX = 2048 + 128
model = os.path.join(a.work, f"kvpool-100m-gqa-f16-ctx{CTX}.gguf")
if not os.path.exists(model):
    subprocess.run([a.cleave, "make-model", "--out", model, "--vocab", a.vocab, "--dim", "768", "--layers", "12",
                    "--heads", "12", "--kv-heads", "4", "--ffn", "2048", "--ctx", str(CTX), "--type", "f16"],
                   check=True, capture_output=True, timeout=600)
BLOCK_BYTES = 2 * 4 * 16 * 64 * 4 * 12  # K and V, 4 kv heads x 16 tokens x 64 dims, F32, 12 layers
ALIAS = "kvpool"


def stats_of(err, actor):
    m = re.search(r"stats " + re.escape(actor) + r" (.*)", err)
    return {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())} if m else {}


class Cluster:
    """A head serving HTTP and `nodes` serving node processes."""

    def __init__(self, name, nodes, sets):
        self.name, self.nodes = name, [f"n{i}" for i in range(1, nodes + 1)]
        common = ["--topology", TOPOLOGY, "-m", model, "-t", "1", "-c", str(CTX), "--set", f"nodes={nodes}", *sets]
        self.errs = {n: open(os.path.join(a.work, f"{name}.{n}.err"), "w+") for n in ["head", *self.nodes]}
        self.head = subprocess.Popen([a.cleave, "node", *common, "--name", "head", "--http-port", "0",
                                      "--alias", ALIAS],
                                     stdout=subprocess.PIPE, stderr=self.errs["head"], text=True)
        port = re.search(r"listening on [0-9.]+:(\d+)", self.head.stdout.readline()).group(1)
        self.url = re.search(r"(http://[0-9.]+:\d+)", self.head.stdout.readline()).group(1)
        self.workers = [subprocess.Popen([a.cleave, "node", *common, "--name", n, "--set", f"head_port={port}",
                                          "--no-rejoin"], stdout=subprocess.DEVNULL, stderr=self.errs[n])
                        for n in self.nodes]
        deadline = time.time() + 300
        while len(re.findall(r"node \w+ joined$", self.err("head"), re.M)) < nodes:
            if time.time() > deadline or self.head.poll() is not None:
                sys.exit(f"{name}: the nodes did not join: {self.err('head')[-2000:]}")
            time.sleep(0.1)

    def err(self, n):
        f = self.errs[n]
        f.flush()
        f.seek(0)
        return f.read()

    def stop(self):
        """Stops the head; every process's stats lines."""
        self.head.send_signal(signal.SIGTERM)
        self.head.wait(120)
        for w in self.workers:
            try:
                w.wait(60)
            except subprocess.TimeoutExpired:
                w.kill()
        return {n: self.err(n) for n in self.errs}


def complete(url, prompt):
    body = {"model": ALIAS, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        c = json.loads(r.read())["choices"][0]
    return (time.perf_counter() - t0) * 1e3, (c["text"], c["logprobs"]["token_logprobs"])


def part1():
    """A prefix computed on one node, then fetched by the other."""
    prompts = []
    for rep in range(a.reps):
        prefix = [1] + [300 + (7 * j + 1009 * rep) % 30000 for j in range(a.prefix - 1)]
        prompts.append((prefix + [777], prefix + [778]))
    out = {}
    for pool in (1, 0):
        c = Cluster(f"fetch_pool{pool}", 2, ["--set", f"pool={pool}"])
        computed, second, answers = [], [], []
        for first, again in prompts:
            computed.append(complete(c.url, first)[0])
            time.sleep(0.3)  # the index hears of the blocks from the node's store, not with the answer
            ms, ans = complete(c.url, again)
            second.append(ms)
            answers.append(ans)
        errs = c.stop()
        got = sum(stats_of(errs[n], f"{n}/colocated/0").get("pool_blocks_got", 0) for n in c.nodes)
        out[pool] = {"computed_ms": computed, "second_ms": second, "answers": answers, "pool_blocks_got": got}
    if out[1]["answers"] != out[0]["answers"]:
        sys.exit("part 1: the fetched prefix gave another answer than the computed one")
    blocks = a.prefix // 16  # the full blocks both prompts share
    if out[1]["pool_blocks_got"] < a.reps * blocks or out[0]["pool_blocks_got"] != 0:
        sys.exit(f"part 1: blocks got from the pool {out[1]['pool_blocks_got']} (want {a.reps * blocks}), "
                 f"without it {out[0]['pool_blocks_got']}")
    row = {"prefix_tokens": a.prefix, "blocks": blocks, "kv_mib": blocks * BLOCK_BYTES / 2**20,
           "computed_ms": median_range(out[1]["computed_ms"] + out[0]["computed_ms"]),
           "fetched_ms": median_range(out[1]["second_ms"]),
           "recomputed_ms": median_range(out[0]["second_ms"])}
    print(f"{a.prefix}-token prefix ({row['kv_mib']:.1f} MiB of KV, {blocks} blocks): computed "
          f"{row['computed_ms']['median']:.0f} ms ({row['computed_ms']['min']:.0f}-{row['computed_ms']['max']:.0f}),"
          f" fetched from the other node {row['fetched_ms']['median']:.0f} ms "
          f"({row['fetched_ms']['min']:.0f}-{row['fetched_ms']['max']:.0f}), recomputed there without the pool "
          f"{row['recomputed_ms']['median']:.0f} ms; same answers", flush=True)
    return row


CONFIGS = [("per-node, round_robin", ["--set", "pool=0"]),
           ("per-node, least_loaded_prefix", ["--set", "pool=0", "--set", "router=least_loaded_prefix"]),
           ("pool, round_robin, no preload", ["--set", "pool=1", "--set", "preload=0"]),
           ("pool, round_robin, preload", ["--set", "pool=1", "--set", "preload=1"])]


def part2():
    rows = []
    for label, sets in CONFIGS:
        runs = []
        for rep in range(a.reps):
            tag = re.sub(r"[^a-z0-9]+", "_", label) + f"_{rep}"
            c = Cluster(tag, 3, sets)
            out = os.path.join(a.work, tag + ".json")
            p = subprocess.run([sys.executable, SERVE_BENCH, "--base-url", c.url, "--model", ALIAS,
                                "--num-prompts", str(a.prompts), "--request-rate", str(a.rate), "--seed", str(rep),
                                "--shared-prefix-len", str(a.shared), "--prefix-groups", str(a.groups),
                                "--input-mean", str(a.input), "--input-sigma", "0", "--output-mean",
                                str(a.output), "--output-sigma", "0", "--max-input-len", str(a.input),
                                "--max-output-len", str(a.output), "--vocab-range", "300,30000",
                                "--json", out], capture_output=True, text=True, timeout=1800)
            errs = c.stop()
            if p.returncode != 0:
                sys.exit(f"{label}: serve_bench exited {p.returncode}: {p.stderr[-2000:]}")
            s = json.load(open(out))["runs"][0]["summary"]
            if s["failed"]:
                sys.exit(f"{label}: {s['failed']} requests failed: {s['errors']}")
            stages = [stats_of(errs[n], f"{n}/colocated/0") for n in c.nodes]
            stores = [stats_of(errs[n], "kv_store") for n in c.nodes]
            local = sum(st.get("prefix_hit_tokens", 0) for st in stages)
            pooled = sum(st.get("imported_tokens", 0) for st in stages)
            computed = sum(st.get("prefill_tokens", 0) for st in stages)
            fetched = sum(st.get("pool_blocks_fetched", 0) for st in stores)
            runs.append({"ttft_p50": s["ttft_ms"]["p50"], "ttft_p90": s["ttft_ms"]["p90"],
                         "local": local / s["total_input_tokens"], "pool": pooled / s["total_input_tokens"],
                         "computed": computed / s["total_input_tokens"],
                         "kib_per_request": fetched * BLOCK_BYTES / 1024 / a.prompts,
                         "throughput": s["request_throughput"]})
        row = {"config": label, **{k: median_range([r[k] for r in runs]) for k in runs[0]}}
        rows.append(row)
        m = {k: row[k]["median"] for k in runs[0]}
        print(f"{label:32s} TTFT p50 {m['ttft_p50']:7.0f} ms ({row['ttft_p50']['min']:.0f}-"
              f"{row['ttft_p50']['max']:.0f}) p90 {m['ttft_p90']:7.0f} ms  hits: local {m['local'] * 100:4.1f} % "
              f"pool {m['pool'] * 100:4.1f} % (computed {m['computed'] * 100:4.1f} %)  "
              f"{m['kib_per_request']:6.0f} KiB moved/request  {m['throughput']:.2f} req/s", flush=True)
    return rows


def tcp_limit():
    out = os.path.join(a.work, "kv_bench.json")
    subprocess.run([a.kv_bench, "--mib", "64", "--reps", "5", "--chunks", "1048576", "--json", out],
                   check=True, capture_output=True, timeout=600)
    return json.load(open(out))


lim0 = node_bench.limits(a.actors_bench, model, a.work)
tcp0 = tcp_limit()
doc = {}
if "1" in a.parts.split(","):
    doc["fetch"] = part1()
if "2" in a.parts.split(","):
    doc["load"] = part2()
lim1 = node_bench.limits(a.actors_bench, model, a.work)
tcp1 = tcp_limit()
bw = max(lim0["read_bandwidth_GBs"], lim1["read_bandwidth_GBs"])
peak = max(lim0["fma_peak_GFLOPs"], lim1["fma_peak_GFLOPs"])
raw = [r["raw_tcp_gb_s"] for t in (tcp0, tcp1) for r in t]
params = lim0["weight_bytes_per_token"] / 2  # F16
prefill_limit_ms = 2 * params * (a.prefix + 1) / (peak * 1e9) * 1e3
kv_bytes = a.prefix // 16 * BLOCK_BYTES
print(f"read bandwidth {bw:.1f} GB/s, FP32 FMA peak {peak:.1f} GFLOP/s (1 thread): computing "
      f"{a.prefix + 1} tokens needs >= {prefill_limit_ms:.0f} ms; raw TCP over loopback {max(raw):.2f} GB/s: "
      f"moving their {kv_bytes / 2**20:.1f} MiB of KV needs >= {kv_bytes / (max(raw) * 1e9) * 1e3:.1f} ms")
doc.update({"read_bandwidth_GBs": bw, "fma_peak_GFLOPs": peak, "raw_tcp_GBs": max(raw),
            "prefill_limit_ms": prefill_limit_ms, "kv_move_limit_ms": kv_bytes / (max(raw) * 1e9) * 1e3})
if a.json:
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=2)
