#!/usr/bin/python3
"""Server overhead: the same requests, one at a time, timed by an HTTP client
against `cleave serve --topology mono` and timed inside the process by
`cleave generate`.

  overhead.py --cleave build/apps/cleave --model M.gguf --threads 2 \\
      --num-requests 20 --input-scale 0.795 --output-scale 0.1894 \\
      --max-input-len 512 --max-output-len 256 --json overhead.json

Three measurements of each request (its prompt ids and max_tokens come from
serve_bench.py's synthetic dataset with the same flags and --seed):

  http      serve_bench.py --max-concurrency 1 against `cleave serve` (mono,
            -t THREADS): TTFT = send -> first SSE token chunk, TPOT =
            (E2E - TTFT) / (n - 1), as the client sees them.
  pipeline  `cleave generate --requests FILE` with that one request: the same
            Pipeline (mono actor, scheduler) the server runs, no HTTP;
            ttft_ms and total_ms are measured inside the process from submit,
            TPOT = (total - ttft) / (n - 1).
  engine    `cleave generate --prompt-ids IDS -n N --temp 0 --ignore-eos --json`
            (mono runs the engine loop directly, no actors): TTFT =
            prefill_seconds, TPOT = decode_seconds / decode_tokens (n - 1
            forwards), i.e. (total - ttft) / (n - 1).

Each `cleave generate` is a fresh process, so its first forward also touches
every weight page of the mmapped model for the first time; the server's
pages are warm. `cold_first_forward` measures that cost separately: a 1-token
prompt's forward (cold) against the next 1-token decode step (warm) in the
same process.

Reports per path and metric the median, p10, p90, min, max over the requests,
and the per-request differences http - pipeline and http - engine.
Debian's /usr/bin/python3 with python3-aiohttp (serve_bench.py needs it).
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import serve_bench  # noqa: E402  (the dataset, so the prompts are the same ones)


def pct(xs, q):
    """numpy's default (linear) interpolation, without numpy."""
    s = sorted(xs)
    if not s:
        return None
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def describe(xs):
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": statistics.median(xs), "p10": pct(xs, 10), "p90": pct(xs, 90),
            "min": min(xs), "max": max(xs), "mean": statistics.fmean(xs)}


def dataset_argv(a, num, seed, vocab_range):
    return ["--num-prompts", str(num), "--seed", str(seed),
            "--vocab-range", f"{vocab_range[0]},{vocab_range[1]}",
            "--input-mean", str(a.input_mean), "--input-sigma", str(a.input_sigma),
            "--output-mean", str(a.output_mean), "--output-sigma", str(a.output_sigma),
            "--input-scale", str(a.input_scale), "--output-scale", str(a.output_scale),
            "--max-input-len", str(a.max_input_len), "--max-output-len", str(a.max_output_len),
            *(["--max-model-len", str(a.max_model_len)] if a.max_model_len else [])]


def get(url, timeout=2.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except Exception:  # noqa: BLE001  (not up yet)
        return 0, ""


def start_server(a, log_path):
    cmd = [a.cleave, "serve", "-m", a.model, "--port", "0", "--topology", "mono",
           "-t", str(a.threads), "--parallel", str(a.parallel)]
    log = open(log_path, "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = None
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None:
        m = re.search(r"listening on (http://[0-9.]+:\d+)", open(log_path).read())
        if m:
            url = m.group(1)
            if get(url + "/health")[0] == 200:
                break
        time.sleep(0.1)
    if url is None or get(url + "/health")[0] != 200:
        p.kill()
        raise SystemExit(f"cleave serve did not come up: {open(log_path).read()[-2000:]}")
    models = json.loads(get(url + "/v1/models")[1])
    return p, url, models["data"][0]["id"], cmd


def stop(p):
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cleave", default="build/apps/cleave")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=16, help="cleave serve --parallel")
    ap.add_argument("--num-requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="HTTP requests first (other prompts), not measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-range", default="100,31900")
    ap.add_argument("--input-mean", type=float, default=serve_bench.SHAREGPT_INPUT_MEAN)
    ap.add_argument("--input-sigma", type=float, default=serve_bench.SHAREGPT_INPUT_SIGMA)
    ap.add_argument("--output-mean", type=float, default=serve_bench.SHAREGPT_OUTPUT_MEAN)
    ap.add_argument("--output-sigma", type=float, default=serve_bench.SHAREGPT_OUTPUT_SIGMA)
    ap.add_argument("--input-scale", type=float, default=1.0)
    ap.add_argument("--output-scale", type=float, default=1.0)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--cold-probes", type=int, default=3)
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="cleave-overhead-")
    os.makedirs(work, exist_ok=True)
    vr = tuple(int(x) for x in a.vocab_range.split(","))

    ds = serve_bench.build_parser().parse_args(dataset_argv(a, a.num_requests, a.seed, vr))
    prompts = serve_bench.synthetic_dataset(ds)
    t_start = time.time()

    # 1. HTTP, one request at a time (warm-up prompts are other ones: the
    # server's prefix cache must not see the measured prompts before).
    server, url, name, serve_cmd = start_server(a, os.path.join(work, "serve.log"))
    bench = [sys.executable, os.path.join(HERE, "serve_bench.py"), "--base-url", url, "--model", name,
             "--request-rate", "inf", "--max-concurrency", "1"]
    try:
        if a.warmup > 0:
            subprocess.run(bench + dataset_argv(a, a.warmup, a.seed + 1000, (vr[0] + 500, vr[1] - 500))
                           + ["--json", os.path.join(work, "warmup.json")],
                           check=True, stdout=subprocess.DEVNULL)
        http_json = os.path.join(work, "http.json")
        subprocess.run(bench + dataset_argv(a, a.num_requests, a.seed, vr) + ["--json", http_json],
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        stop(server)
    http = json.load(open(http_json))["runs"][0]["requests"]
    bad = [r["index"] for r in http if not r["success"]]
    if bad:
        raise SystemExit(f"HTTP requests failed: {bad}")

    # 2. In process, the server stopped: the pipeline, then the engine loop.
    rows = []
    for i, p in enumerate(prompts):
        h = http[i]
        assert h["prompt_len"] == p.prompt_len and h["expected_output_len"] == p.output_len
        n = p.output_len
        req = os.path.join(work, f"req{i}.jsonl")
        with open(req, "w") as fh:
            fh.write(json.dumps({"id": i, "prompt_ids": p.prompt, "max_tokens": n, "temperature": 0,
                                 "ignore_eos": True}) + "\n")
        pl = run_json([a.cleave, "generate", "-m", a.model, "--requests", req, "-t", str(a.threads)])
        eng = run_json([a.cleave, "generate", "-m", a.model, "--prompt-ids", ",".join(map(str, p.prompt)),
                        "-n", str(n), "--temp", "0", "--ignore-eos", "--json", "-t", str(a.threads)])
        tm = eng["timings"]
        row = {
            "index": i, "prompt_len": p.prompt_len, "output_len": n,
            "http": {"ttft_ms": h["ttft_s"] * 1e3, "tpot_ms": h["tpot_s"] * 1e3 if n > 1 else None,
                     "e2e_ms": h["e2e_s"] * 1e3, "output_tokens": h["output_tokens"]},
            "pipeline": {"ttft_ms": pl["ttft_ms"], "total_ms": pl["total_ms"],
                         "tpot_ms": (pl["total_ms"] - pl["ttft_ms"]) / (n - 1) if n > 1 else None,
                         "output_tokens": len(pl["tokens"])},
            "engine": {"ttft_ms": tm["prefill_seconds"] * 1e3,
                       "total_ms": (tm["prefill_seconds"] + tm["decode_seconds"]) * 1e3,
                       "tpot_ms": tm["decode_seconds"] / tm["decode_tokens"] * 1e3 if tm["decode_tokens"] else None,
                       "output_tokens": len(eng["generated_ids"])},
        }
        for path in ("http", "pipeline", "engine"):
            if row[path]["output_tokens"] != n:
                raise SystemExit(f"request {i}: {path} gave {row[path]['output_tokens']} tokens, want {n}")
        rows.append(row)

    # 3. A fresh process's first forward (cold weight pages) against the next step.
    cold = []
    for k in range(a.cold_probes):
        e = run_json([a.cleave, "generate", "-m", a.model, "--prompt-ids", str(vr[0] + 7 + k), "-n", "2",
                      "--temp", "0", "--ignore-eos", "--json", "-t", str(a.threads)])
        t = e["timings"]
        cold.append({"first_forward_ms": t["prefill_seconds"] * 1e3,
                     "next_forward_ms": t["decode_seconds"] / max(1, t["decode_tokens"]) * 1e3})

    stats = {}
    for path in ("http", "pipeline", "engine"):
        stats[path] = {m: describe([r[path][m] for r in rows if r[path][m] is not None])
                       for m in ("ttft_ms", "tpot_ms")}
    diffs = {}
    for path in ("pipeline", "engine"):
        diffs[f"http_minus_{path}"] = {
            m: describe([r["http"][m] - r[path][m] for r in rows
                         if r["http"][m] is not None and r[path][m] is not None])
            for m in ("ttft_ms", "tpot_ms")}
    doc = {
        "tool": "cleave bench/serve/overhead.py", "created": time.time(),
        "wall_s": time.time() - t_start,
        "config": {k: v for k, v in vars(a).items()},
        "serve_command": serve_cmd,
        "pipeline_command": [a.cleave, "generate", "-m", a.model, "--requests", "REQ.jsonl", "-t", str(a.threads)],
        "engine_command": [a.cleave, "generate", "-m", a.model, "--prompt-ids", "IDS", "-n", "N", "--temp", "0",
                           "--ignore-eos", "--json", "-t", str(a.threads)],
        "stats": stats, "diffs": diffs,
        "cold_first_forward": {"probes": cold,
                               "first_forward_ms": describe([c["first_forward_ms"] for c in cold]),
                               "next_forward_ms": describe([c["next_forward_ms"] for c in cold])},
        "requests": rows,
    }
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")

    def f(d, k):
        return "-" if d.get(k) is None else f"{d[k]:.2f}"
    print(f"{len(rows)} requests one at a time (prompt {min(r['prompt_len'] for r in rows)}-"
          f"{max(r['prompt_len'] for r in rows)}, output {min(r['output_len'] for r in rows)}-"
          f"{max(r['output_len'] for r in rows)} tokens), -t {a.threads}; ms, median [p10, p90] (min-max)")
    for path, d in list(stats.items()) + list(diffs.items()):
        print(f"  {path:22s} " + "  ".join(
            f"{m[:-3].upper()} {f(d[m], 'median')} [{f(d[m], 'p10')}, {f(d[m], 'p90')}] "
            f"({f(d[m], 'min')}-{f(d[m], 'max')})" for m in ("ttft_ms", "tpot_ms")))
    cf = doc["cold_first_forward"]
    print(f"  fresh process: first 1-token forward {f(cf['first_forward_ms'], 'median')} ms, "
          f"next {f(cf['next_forward_ms'], 'median')} ms (median of {len(cold)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
