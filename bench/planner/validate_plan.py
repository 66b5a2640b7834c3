#!/usr/bin/python3
"""`cleave plan` against real runs: the planner's predicted SLO attainment
and goodput of P/D with one prefill and one decode stage, against `cleave
serve --topology pd` (1 thread per engine) driven by bench/serve/serve_bench.py
at the same Poisson rates with fixed lengths; the profile comes from
`cleave plan -m` on the same machine in the same run. Then the planner's
front for a 64-stage cluster at a rate 32 times the largest here.

usage: validate_plan.py CLEAVE VOCAB WORKDIR [--rates 4,8,12,16,20] [--prompts 200]
       [--prompt-tokens 128] [--output-tokens 64] [--slo-ttft-ms 100] [--slo-tpot-ms 10] [--json FILE]"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--rates", default="4,8,12,16,20")
ap.add_argument("--prompts", type=int, default=200)
ap.add_argument("--prompt-tokens", type=int, default=128)
ap.add_argument("--output-tokens", type=int, default=64)
ap.add_argument("--slo-ttft-ms", type=float, default=100)
ap.add_argument("--slo-tpot-ms", type=float, default=10)
ap.add_argument("--json")
a = ap.parse_args()
os.makedirs(a.work, exist_ok=True)
model = os.path.join(a.work, "plan.gguf")
subprocess.run([a.cleave, "make-model", "--out", model, "--vocab", a.vocab, "--dim", "256", "--layers", "4",
                "--heads", "4", "--kv-heads", "2", "--ffn", "768", "--ctx", "1024", "--type", "f16"],
               check=True, capture_output=True, timeout=300)
profile = os.path.join(a.work, "profile.json")
common = ["--prompt-tokens", str(a.prompt_tokens), "--output-tokens", str(a.output_tokens),
          "--slo-ttft-ms", str(a.slo_ttft_ms), "--slo-tpot-ms", str(a.slo_tpot_ms)]


def plan(rate, stages, extra):
    p = subprocess.run([a.cleave, "plan", *extra, "--rate", str(rate), "--max-stages", str(stages), *common],
                       capture_output=True, text=True, timeout=600, check=True)
    rows = []
    for line in p.stdout.splitlines():
        f = line.split()
        if len(f) == 11 and f[0].isdigit() and f[1].isdigit():
            rows.append({"prefill": int(f[0]), "decode": int(f[1]), "cost": float(f[2]), "goodput": float(f[3]),
                         "attainment": float(f[4]), "ttft_p90_ms": float(f[6]), "tpot_p90_ms": float(f[8])})
    return p.stdout, rows


out, _ = plan(1, 2, ["-m", model, "--save-profile", profile, "-t", "1", "--max-seqs", "8"])
print(out.splitlines()[0])
rows = []
for rate in [float(r) for r in a.rates.split(",")]:
    _, pred = plan(rate, 2, ["--profile", profile])
    serve = subprocess.Popen([a.cleave, "serve", "-m", model, "--topology", "pd", "-t", "1", "--parallel", "8",
                              "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = None
    deadline = time.time() + 60
    while time.time() < deadline and url is None:
        m = re.search(r"listening on (http://[0-9.]+:\d+)", serve.stdout.readline())
        url = m.group(1) if m else None
    res = os.path.join(a.work, f"serve_{rate}.json")
    subprocess.run(["/usr/bin/python3", os.path.join(HERE, "..", "serve", "serve_bench.py"), "--base-url", url,
                    "--model", "plan", "--num-prompts", str(a.prompts), "--request-rate", str(rate),
                    "--input-mean", str(a.prompt_tokens), "--input-sigma", "0", "--output-mean",
                    str(a.output_tokens), "--output-sigma", "0", "--slo-ttft-ms", str(a.slo_ttft_ms),
                    "--slo-tpot-ms", str(a.slo_tpot_ms), "--seed", "1", "--json", res],
                   check=True, capture_output=True, timeout=1800)
    serve.send_signal(signal.SIGTERM)
    serve.wait(timeout=60)
    s = json.load(open(res))["runs"][0]["summary"] if "runs" in json.load(open(res)) else json.load(open(res))["summary"]
    measured = {"attainment": s["slo_attainment"], "goodput": rate * s["slo_attainment"],
                "ttft_p90_ms": s["ttft_ms"]["p90"], "tpot_p90_ms": s["tpot_ms"]["p90"]}
    p = pred[0]
    err = abs(p["goodput"] - measured["goodput"]) / measured["goodput"] if measured["goodput"] else None
    rows.append({"rate": rate, "predicted": p, "measured": measured, "goodput_error": err})
    print(f"rate {rate:5.1f}/s  goodput predicted {p['goodput']:6.2f} measured {measured['goodput']:6.2f} "
          f"({'-' if err is None else f'{err * 100:.1f} %'})  attainment {p['attainment']:.3f} / "
          f"{measured['attainment']:.3f}  TTFT p90 {p['ttft_p90_ms']:.1f} / {measured['ttft_p90_ms']:.1f} ms  "
          f"TPOT p90 {p['tpot_p90_ms']:.2f} / {measured['tpot_p90_ms']:.2f} ms")
big_rate = 32 * max(float(r) for r in a.rates.split(","))
big, _ = plan(big_rate, 64, ["--profile", profile, "--requests", "4000"])
print(big)
if a.json:
    json.dump({"rows": rows, "cluster64": big}, open(a.json, "w"), indent=1)
