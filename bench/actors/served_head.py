"""Helpers of the served-cluster benchmarks (autoscale_ramp.py, pd_shift.py):
one `cleave node` head that hosts every stage and serves HTTP, driven by
bench/serve/serve_bench.py; its router's counters read from /metrics."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SERVE_BENCH = os.path.join(HERE, "..", "serve", "serve_bench.py")


def make_model(cleave, vocab, path):
    """The benchmarks' model: dim 256, 4 layers, GQA 4/2, F16."""
    subprocess.run([cleave, "make-model", "--out", path, "--vocab", vocab, "--dim", "256", "--layers", "4",
                    "--heads", "4", "--kv-heads", "2", "--ffn", "768", "--ctx", "1024", "--type", "f16"],
                   check=True, capture_output=True, timeout=300)


def head_script(path, actors, cluster=""):
    """A one-node topology: the head with `actors` (Lua table body) and a KV store."""
    with open(path, "w") as f:
        f.write((f"cluster {{ {cluster} }}\n" if cluster else "") +
                "node { name = 'head', head = true, host = '127.0.0.1', port = 0, "
                f"actors = {{ {actors}, kv_store = 1 }} }}\n")
    return path


def serve(cleave, model, topology, alias):
    """Starts the head; (process, base URL) once it prints its HTTP address."""
    p = subprocess.Popen([cleave, "node", "--topology", topology, "--name", "head", "-m", model, "-t", "1",
                          "--max-seqs", "16", "--http-port", "0", "--metrics", "--alias", alias],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        m = re.search(r"serve listening on (http://[0-9.]+:\d+)", p.stdout.readline())
        if m:
            return p, m.group(1)
    p.kill()
    sys.exit("the head did not print its HTTP address")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def pd_controller_fields(slo, interval_s, confirm, cooldown_s, switch_grace_s):
    """The pd_controller table's fields of the shifting-load benchmarks
    (pd_shift.py, pd_trace.py): slo is per phase (TTFT ms, TPOT ms); the
    goals are the prompt-heavy phase's TTFT and the decode-heavy one's TPOT."""
    return (f"ttft_ms = {slo[0][0]:.3f}, tpot_ms = {slo[1][1]:.3f}, interval_s = {interval_s:g}, "
            f"confirm = {confirm}, cooldown_s = {cooldown_s:g}, switch_grace_s = {switch_grace_s:g}")


def misses_by_arrival(requests, bucket_s):
    """Requests that missed a goal, counted per bucket_s of arrival time
    (serve_bench's per-request records)."""
    counts = []
    for r in requests:
        if not r["meets_slo"]:
            k = int(r["scheduled_s"] / bucket_s)
            counts += [0] * (k + 1 - len(counts))
            counts[k] += 1
    return counts


def run_bench(url, alias, json_path, prompt, output, extra):
    """serve_bench.py with fixed prompt / output lengths; its first run."""
    subprocess.run(["/usr/bin/python3", SERVE_BENCH, "--base-url", url, "--model", alias, "--input-mean",
                    str(prompt), "--input-sigma", "0", "--output-mean", str(output), "--output-sigma", "0",
                    "--max-input-len", "1000", "--seed", "1", "--json", json_path, *extra],
                   check=True, capture_output=True, timeout=1800)
    return json.load(open(json_path))["runs"][0]


def router_stats(url):
    """The router's counters (cleave_actor_stat{actor="router"}) by name."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'cleave_actor_stat\{actor="router",name="(\w+)"\} (\S+)', text)}
