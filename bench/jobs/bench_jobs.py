#!/usr/bin/env python3
"""Durable batch jobs against the in-memory path, on one machine, in one run.

  throughput  the same N requests (completions, greedy, fixed lengths) through
              `cleave generate --requests` (results kept in memory, written at
              the end) and through `cleave run-batch` (journal, durable KV
              store, fsync'd output): wall time, tokens/s, median of R runs
              with min..max.
  persistence bytes the job wrote per generated token (journal + KV store +
              output, from the job directory's size) and the time it added
              per token, beside this disk's write bandwidth (dd of 256 MiB with
              fdatasync, same run).
  resume      a job whose N requests are all admitted and generating, killed
              with SIGKILL, started again: seconds from the restart to its
              first new token and to the end, with its KV store (read back)
              and with the store deleted (every resumed request recomputes
              its prompt and tokens).

usage: bench_jobs.py CLEAVE VOCAB WORKDIR [--requests 1000] [--runs 3] [--out results.json]"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

from bench_jobs_util import du

ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--requests", type=int, default=1000)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--resume-tokens", type=int, default=64, help="max_tokens of the resume job's requests")
ap.add_argument("--resume-runs", type=int, default=2)
ap.add_argument("--out", default="")
args = ap.parse_args()

W = os.path.abspath(args.work)
shutil.rmtree(W, ignore_errors=True)
os.makedirs(W)
MODEL = os.path.join(W, "m.gguf")
subprocess.run([args.cleave, "make-model", "-o", MODEL, "--vocab", args.vocab, "--dim", "256", "--layers", "4",
                "--heads", "8", "--kv-heads", "4", "--ffn", "768", "--ctx", "1024", "--type", "f16", "--seed", "3",
                "--name", "bench"], check=True, stdout=subprocess.DEVNULL)
rng = random.Random(1)
WORDS = "the a small large red green blue square circle shape sits above below left right of and".split()
prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60))) for _ in range(args.requests)]
COMMON = ["-m", MODEL, "-t", str(os.cpu_count())]
PARALLEL = ["--parallel", "64"]  # what `generate --requests` runs: min(requests, 64) sequences


def write_inputs(max_tokens):
    req = os.path.join(W, f"requests-{max_tokens}.jsonl")
    bat = os.path.join(W, f"batch-{max_tokens}.jsonl")
    with open(req, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True}) + "\n")
    with open(bat, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True}}) + "\n")
    return req, bat


def timed(cmd):
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed: {r.stderr[-1500:]}")
    return dt, r.stderr


def med(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)}


def disk_bandwidth():
    path = os.path.join(W, "dd.bin")
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=256", "conv=fdatasync"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    os.remove(path)
    return 256 * 2**20 / dt


results = {"requests": args.requests, "max_tokens": args.max_tokens, "model": "dim 256, 4 layers, F16"}
req, bat = write_inputs(args.max_tokens)
tokens = args.requests * args.max_tokens
mem, job, job_bytes = [], [], []
for r in range(args.runs):
    dt, _ = timed([args.cleave, "generate", "--requests", req, "--out", os.path.join(W, "mem.jsonl"), *COMMON])
    mem.append(dt)
    out, jd = os.path.join(W, f"job{r}.jsonl"), os.path.join(W, f"job{r}.job")
    dt, _ = timed([args.cleave, "run-batch", "-i", bat, "-o", out, "--job-dir", jd, *COMMON, *PARALLEL])
    job.append(dt)
    job_bytes.append(du(jd) + os.path.getsize(out))
    shutil.rmtree(jd)
results["in_memory_s"] = med(mem)
results["job_s"] = med(job)
results["in_memory_tok_s"] = tokens / statistics.median(mem)
results["job_tok_s"] = tokens / statistics.median(job)
results["job_vs_in_memory"] = statistics.median(mem) / statistics.median(job)
results["bytes_per_token"] = statistics.median(job_bytes) / tokens
results["seconds_per_token_added"] = (statistics.median(job) - statistics.median(mem)) / tokens
results["disk_write_bytes_s"] = disk_bandwidth()
print(json.dumps(results, indent=1), flush=True)

# Resume: long outputs so that every request is admitted and generating at the kill.
long_tokens = args.resume_tokens
_, bat_long = write_inputs(long_tokens)
resume = {"warm": [], "cold": [], "warm_total": [], "cold_total": [], "resumed": []}
for r in range(args.resume_runs):
    for mode in ("warm", "cold"):
        out, jd = os.path.join(W, f"res-{mode}{r}.jsonl"), os.path.join(W, f"res-{mode}{r}.job")
        cmd = [args.cleave, "run-batch", "-i", bat_long, "-o", out, "--job-dir", jd, *COMMON,
               "--parallel", str(min(args.requests, 1024))]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Kill once every request has tokens journaled (they all run at once).
        deadline = time.time() + 600
        while time.time() < deadline:
            time.sleep(0.5)
            s = subprocess.run([args.cleave, "job", "status", jd, "--json"], capture_output=True, text=True)
            if s.returncode == 0 and json.loads(s.stdout)["cleave"]["generated_tokens"] >= args.requests * 8:
                break
        p.send_signal(signal.SIGKILL)
        p.wait()
        if mode == "cold":
            shutil.rmtree(os.path.join(jd, "kv"))
        dt, err = timed(cmd)
        m = re.search(r"first new token ([0-9.]+) s", err)
        st = json.loads(subprocess.run([args.cleave, "job", "status", jd, "--json"], capture_output=True,
                                       text=True).stdout)["cleave"]
        resume[mode].append(float(m.group(1)) if m else float("nan"))
        resume[f"{mode}_total"].append(dt)
        if mode == "warm":
            resume["resumed"].append(st["resumed_requests"])
        shutil.rmtree(jd)
results["resume"] = {k: med(v) for k, v in resume.items()}
print(json.dumps(results["resume"], indent=1), flush=True)
if args.out:
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
