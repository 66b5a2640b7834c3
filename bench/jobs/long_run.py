#!/usr/bin/env python3
"""A long batch job killed with SIGKILL and restarted every few minutes, with
its disk use sampled every second: the job directory's KV store (capped by
--kv-disk-mib, least recently used blocks dropped), its journal and the
output. Writes a CSV and a plot (matplotlib).

usage: long_run.py CLEAVE VOCAB WORKDIR [--requests 20000] [--restart-every 120]
       [--kv-disk-mib 64] --csv out.csv [--plot docs/jobs/disk_use.png]"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time

from bench_jobs_util import du

ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--requests", type=int, default=20000)
ap.add_argument("--restart-every", type=float, default=120)
ap.add_argument("--kv-disk-mib", type=int, default=64)
ap.add_argument("--plot", default="")
ap.add_argument("--csv", required=True)
args = ap.parse_args()

W = os.path.abspath(args.work)
shutil.rmtree(W, ignore_errors=True)
os.makedirs(W)
MODEL = os.path.join(W, "m.gguf")
subprocess.run([args.cleave, "make-model", "-o", MODEL, "--vocab", args.vocab, "--dim", "128", "--layers", "2",
                "--heads", "4", "--kv-heads", "2", "--ffn", "256", "--ctx", "512", "--seed", "4"], check=True,
               stdout=subprocess.DEVNULL)
rng = random.Random(1)
WORDS = "the a small large red green blue square circle shape sits above below left right of and".split()
SYSTEM = " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(120))
inp = os.path.join(W, "in.jsonl")
with open(inp, "w") as f:
    for i in range(args.requests):
        body = {"prompt": (SYSTEM + " " if i % 3 == 0 else "") + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))),
                "max_tokens": rng.randint(8, 24), "temperature": rng.choice([0, 0.8])}
        f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
out, job = os.path.join(W, "out.jsonl"), os.path.join(W, "out.job")
cmd = [args.cleave, "run-batch", "-i", inp, "-o", out, "--job-dir", job, "-m", MODEL, "-t", str(os.cpu_count()),
       "--parallel", "32", "--kv-disk-mib", str(args.kv_disk_mib)]


samples, restarts = [], []
t0 = time.time()
stop = threading.Event()


def sample():
    while not stop.is_set():
        done = 0
        s = subprocess.run([args.cleave, "job", "status", job, "--json"], capture_output=True, text=True)
        if s.returncode == 0:
            c = json.loads(s.stdout)["request_counts"]
            done = c["completed"] + c["failed"]
        samples.append((time.time() - t0, du(os.path.join(job, "kv")), du(os.path.join(job, "journal")),
                        os.path.getsize(out) if os.path.exists(out) else 0, done))
        stop.wait(1.0)


threading.Thread(target=sample, daemon=True).start()
while True:
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rc = p.wait(timeout=args.restart_every)
        break
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        p.wait()
        restarts.append(time.time() - t0)
stop.set()
time.sleep(1.2)
lines = sum(1 for _ in open(out))
ids = set(json.loads(l)["custom_id"] for l in open(out))
print(f"exit {rc}: {lines} lines, {len(ids)} custom_ids, {len(restarts)} restarts, {time.time() - t0:.0f} s; "
      f"peak KV {max(s[1] for s in samples) / 2**20:.1f} MiB, peak journal {max(s[2] for s in samples) / 2**20:.1f} MiB, "
      f"output {samples[-1][3] / 2**20:.1f} MiB")
assert rc == 0 and lines == len(ids) == args.requests, "the job did not end with each custom_id once"
if args.csv:
    with open(args.csv, "w") as f:
        f.write("seconds,kv_bytes,journal_bytes,output_bytes,lines_done\n")
        for s in samples:
            f.write(",".join(str(x) for x in s) + "\n")
if args.csv:
    with open(args.csv + ".restarts.json", "w") as f:
        json.dump(restarts, f)
if args.plot:
    # Debian's python3-matplotlib (setup.sh installs it) under /usr/bin/python3.
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    subprocess.run(["/usr/bin/python3", os.path.join(os.path.dirname(os.path.abspath(__file__)), "plot_disk_use.py"),
                    args.csv, args.plot, "--kv-disk-mib", str(args.kv_disk_mib), "--restarts", args.csv + ".restarts.json",
                    "--title", f"cleave run-batch: {args.requests} requests, kill -9 every {args.restart_every:.0f} s "
                               f"({len(restarts)} restarts)"], check=True)
