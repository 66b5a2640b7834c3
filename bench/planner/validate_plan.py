#!/usr/bin/python3
"""`cleave plan` against real runs: the planner's predicted SLO attainment
and goodput of P/D with one prefill and one decode stage, against `cleave
serve --topology pd` (1 thread per engine) driven by bench/serve/serve_bench.py
with fixed lengths. The profile comes from `cleave plan -m` on the same
machine in the same run; it is then calibrated (`--calibrate-metrics`) from
the stages' own step counters while the server serves loads of its own
(--calibrate-rates, other seeds), snapshots of /metrics before and after
each; with two or more rates the calibration also fits how much slower
the steps get per request/s (the HTTP front and the load generator share
the machine's cores with both engines), and the first load alone gives
the one-factor calibration to compare with.
Each measured run is simulated on its own trace (`--trace`: the same
arrivals and lengths, so both sides see the same bursts), with the raw and
the calibrated profile (and the same without the steps' spread); goodput on both sides is attainment x the trace's
rate. Each run is also simulated calibrated on its own counters (the
step costs and spread that run had): the simulation's own error, apart
from how far the machine's speed drifts between calibrating and serving.
And each run is predicted calibrated just ahead: on the same server,
seconds before the measured load, a short load of its own (--ahead-prompts
requests at the first calibration rate, another seed) calibrates the
profile (one factor, as the first load alone does), so the prediction is
made before the run but on the machine's speed of that minute.
Then the planner's front for a 64-stage cluster at a rate 32 times
the largest here.

usage: validate_plan.py CLEAVE VOCAB WORKDIR [--rates 8,16,24,32,36,40] [--prompts 120] [--runs 3]
       [--dim 256] [--layers 4] [--ffn 768]
       [--calibrate-rates 16,32] [--prompt-tokens 128] [--output-tokens 64] [--slo-ttft-ms 100]
       [--slo-tpot-ms 10] [--ahead-prompts 60] [--json FILE] [--plot FILE.png]"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--rates", default="8,16,24,32,36,40")
ap.add_argument("--prompts", type=int, default=120)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--calibrate-rates", default="16,32")
ap.add_argument("--prompt-tokens", type=int, default=128)
ap.add_argument("--output-tokens", type=int, default=64)
ap.add_argument("--slo-ttft-ms", type=float, default=100)
ap.add_argument("--slo-tpot-ms", type=float, default=10)
ap.add_argument("--dim", type=int, default=256)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--ffn", type=int, default=768)
ap.add_argument("--ahead-prompts", type=int, default=60,
                help="requests of the load that calibrates each run just ahead, on its server")
ap.add_argument("--json")
ap.add_argument("--plot", help="goodput measured and predicted, each run's error (plot_validation.py)")
a = ap.parse_args()
os.makedirs(a.work, exist_ok=True)
model = os.path.join(a.work, "plan.gguf")
subprocess.run([a.cleave, "make-model", "--out", model, "--vocab", a.vocab, "--dim", str(a.dim), "--layers",
                str(a.layers), "--heads", "4", "--kv-heads", "2", "--ffn", str(a.ffn), "--ctx", "1024", "--type", "f16"],
               check=True, capture_output=True, timeout=300)
profile = os.path.join(a.work, "profile.json")
calibrated = os.path.join(a.work, "calibrated.json")
goals = ["--slo-ttft-ms", str(a.slo_ttft_ms), "--slo-tpot-ms", str(a.slo_tpot_ms)]
lengths = ["--prompt-tokens", str(a.prompt_tokens), "--output-tokens", str(a.output_tokens)]


def plan(args, stages=2):
    p = subprocess.run([a.cleave, "plan", *args, "--max-stages", str(stages), *goals],
                       capture_output=True, text=True, timeout=600, check=True)
    rows = []
    for line in p.stdout.splitlines():
        f = line.split()
        if len(f) == 11 and f[0].isdigit() and f[1].isdigit():
            rows.append({"prefill": int(f[0]), "decode": int(f[1]), "cost": float(f[2]), "goodput": float(f[3]),
                         "attainment": float(f[4]), "ttft_p90_ms": float(f[6]), "tpot_p90_ms": float(f[8])})
    return p.stdout, rows


class Server:
    def __enter__(self):
        self.proc = subprocess.Popen([a.cleave, "serve", "-m", model, "--topology", "pd", "-t", "1", "--parallel",
                                      "8", "--port", "0", "--metrics"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.url = None
        deadline = time.time() + 60
        while time.time() < deadline and self.url is None:
            m = re.search(r"listening on (http://[0-9.]+:\d+)", self.proc.stdout.readline())
            self.url = m.group(1) if m else None
        return self

    def metrics(self, path):
        with open(path, "w") as f:
            f.write(urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode())

    def bench(self, rate, seed, out, prompts=None):
        subprocess.run(["/usr/bin/python3", os.path.join(HERE, "..", "serve", "serve_bench.py"), "--base-url",
                        self.url, "--model", "plan", "--num-prompts", str(prompts or a.prompts), "--request-rate",
                        str(rate),
                        "--input-mean", str(a.prompt_tokens), "--input-sigma", "0", "--output-mean",
                        str(a.output_tokens), "--output-sigma", "0", "--slo-ttft-ms", str(a.slo_ttft_ms),
                        "--slo-tpot-ms", str(a.slo_tpot_ms), "--seed", str(seed), "--json", out],
                       check=True, capture_output=True, timeout=1800)
        return json.load(open(out))["runs"][0]

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


out, _ = plan(["-m", model, "--save-profile", profile, "-t", "1", "--max-seqs", "8", "--rate", "1", *lengths])
print(out.splitlines()[0])
# Calibration: a warm server's step counters over loads of its own, each at
# the rate its trace really had.
cal_args = []
with Server() as s:
    s.bench(float(a.calibrate_rates.split(",")[0]), 100, os.path.join(a.work, "warm.json"))
    for i, rate in enumerate(float(r) for r in a.calibrate_rates.split(",")):
        before, after = os.path.join(a.work, f"before_{i}.txt"), os.path.join(a.work, f"after_{i}.txt")
        s.metrics(before)
        res = s.bench(rate, 101 + i, os.path.join(a.work, f"calibrate_{i}.json"))
        s.metrics(after)
        sched = [r["scheduled_s"] for r in res["requests"]]
        cal_args += ["--calibrate-metrics", after, "--calibrate-baseline", before]
        if "," in a.calibrate_rates:
            cal_args += ["--calibrate-rate", str((len(sched) - 1) / (max(sched) - min(sched)))]
out, _ = plan(["--profile", profile, *cal_args, "--save-profile", calibrated, "--rate", "1", *lengths])
print("\n".join(line for line in out.splitlines() if line.startswith(("load ", "calibrated", "profile"))))
# The same calibration without the steps' spread (every step its mean):
# what modelling the spread changes.
no_spread = os.path.join(a.work, "calibrated_no_spread.json")
with open(calibrated) as f:
    flat = json.load(f)
print(f"spread (coefficient of variation): prefill {flat.get('prefill_step_cv', 0):.3f}, "
      f"decode {flat.get('decode_step_cv', 0):.3f}")
flat["prefill_step_cv"] = flat["decode_step_cv"] = 0
with open(no_spread, "w") as f:
    json.dump(flat, f)
# The first load alone: step costs scaled by one factor at any load.
one_load = os.path.join(a.work, "calibrated_one.json")
if "," in a.calibrate_rates:
    plan(["--profile", profile, *cal_args[:4], "--save-profile", one_load, "--rate", "1", *lengths])

rows = []
for rate in [float(r) for r in a.rates.split(",")]:
    runs = []
    for run in range(a.runs):
        own_before = os.path.join(a.work, f"serve_{rate}_{run}_before.txt")
        own_after = os.path.join(a.work, f"serve_{rate}_{run}_after.txt")
        ahead_before = os.path.join(a.work, f"ahead_{rate}_{run}_before.txt")
        ahead_after = os.path.join(a.work, f"ahead_{rate}_{run}_after.txt")
        ahead_profile = os.path.join(a.work, f"ahead_{rate}_{run}.json")
        with Server() as s:
            s.metrics(ahead_before)
            s.bench(float(a.calibrate_rates.split(",")[0]), 200 + run, os.path.join(a.work, f"ahead_{rate}_{run}_load.json"),
                    a.ahead_prompts)
            s.metrics(ahead_after)
            plan(["--profile", profile, "--calibrate-metrics", ahead_after, "--calibrate-baseline", ahead_before,
                  "--save-profile", ahead_profile, "--rate", "1", *lengths])
            s.metrics(own_before)
            res = s.bench(rate, 1 + run, os.path.join(a.work, f"serve_{rate}_{run}.json"))
            s.metrics(own_after)
        trace = os.path.join(a.work, f"trace_{rate}_{run}.jsonl")
        with open(trace, "w") as f:
            for r in res["requests"]:
                f.write(json.dumps({"arrival_s": r["scheduled_s"], "prompt_tokens": r["prompt_len"],
                                    "output_tokens": r["expected_output_len"]}) + "\n")
        _, raw = plan(["--profile", profile, "--trace", trace])
        _, cal = plan(["--profile", calibrated, "--trace", trace])
        one = plan(["--profile", one_load, "--trace", trace])[1] if "," in a.calibrate_rates else cal
        _, flat = plan(["--profile", no_spread, "--trace", trace])
        _, ahead = plan(["--profile", ahead_profile, "--trace", trace])
        # Calibrated on this run's own counters: the simulation's error with
        # the step costs (and spread) this run really had, apart from how
        # far this VM's speed drifts between the calibrating loads and now.
        own_profile = os.path.join(a.work, f"own_{rate}_{run}.json")
        _, own = plan(["--profile", profile, "--calibrate-metrics", own_after, "--calibrate-baseline", own_before,
                       "--save-profile", own_profile, "--trace", trace])
        with open(own_profile) as f:
            own_flat_profile = json.load(f)
        own_flat_profile["prefill_step_cv"] = own_flat_profile["decode_step_cv"] = 0
        with open(own_profile + ".no_spread.json", "w") as f:
            json.dump(own_flat_profile, f)
        _, own_flat = plan(["--profile", own_profile + ".no_spread.json", "--trace", trace])
        span = max(r["scheduled_s"] for r in res["requests"]) - min(r["scheduled_s"] for r in res["requests"])
        trace_rate = (len(res["requests"]) - 1) / span
        sm = res["summary"]
        measured = {"attainment": sm["slo_attainment"], "goodput": trace_rate * sm["slo_attainment"],
                    "ttft_p90_ms": sm["ttft_ms"]["p90"], "tpot_p90_ms": sm["tpot_ms"]["p90"]}
        err = lambda p: abs(p["goodput"] - measured["goodput"]) / measured["goodput"] if measured["goodput"] else None
        runs.append({"measured": measured, "raw": raw[0], "calibrated": cal[0], "one_load": one[0],
                     "no_spread": flat[0], "own_run": own[0], "own_run_no_spread": own_flat[0], "ahead": ahead[0],
                     "ahead_error": err(ahead[0]),
                     "raw_error": err(raw[0]), "calibrated_error": err(cal[0]), "one_load_error": err(one[0]),
                     "no_spread_error": err(flat[0]), "own_run_error": err(own[0]),
                     "own_run_no_spread_error": err(own_flat[0])})
        c = cal[0]
        print(f"rate {rate:5.1f}/s run {run}: goodput measured {measured['goodput']:6.2f}, calibrated "
              f"{c['goodput']:6.2f} ({runs[-1]['calibrated_error'] * 100:.1f} %), one load {one[0]['goodput']:6.2f} "
              f"({runs[-1]['one_load_error'] * 100:.1f} %), no spread {flat[0]['goodput']:6.2f} "
              f"({runs[-1]['no_spread_error'] * 100:.1f} %), own run {own[0]['goodput']:6.2f} "
              f"({runs[-1]['own_run_error'] * 100:.1f} %; {own_flat[0]['goodput']:6.2f} without spread, "
              f"{runs[-1]['own_run_no_spread_error'] * 100:.1f} %), just ahead {ahead[0]['goodput']:6.2f} "
              f"({runs[-1]['ahead_error'] * 100:.1f} %), raw {raw[0]['goodput']:6.2f} "
              f"({runs[-1]['raw_error'] * 100:.1f} %); TTFT p90 {measured['ttft_p90_ms']:.1f} / {c['ttft_p90_ms']:.1f} ms, "
              f"TPOT p90 {measured['tpot_p90_ms']:.2f} / {c['tpot_p90_ms']:.2f} ms (no spread: "
              f"{flat[0]['ttft_p90_ms']:.1f}, {flat[0]['tpot_p90_ms']:.2f}; own run: {own[0]['ttft_p90_ms']:.1f} "
              f"({own_flat[0]['ttft_p90_ms']:.1f} without spread), "
              f"{own[0]['tpot_p90_ms']:.2f})", flush=True)
    med = lambda k: statistics.median(r[k] for r in runs)
    gp = lambda k: statistics.median(r[k]["goodput"] for r in runs)
    rows.append({"rate": rate, "runs": runs, "median_calibrated_error": med("calibrated_error"),
                 "median_one_load_error": med("one_load_error"), "median_no_spread_error": med("no_spread_error"),
                 "median_own_run_error": med("own_run_error"),
                 "median_own_run_no_spread_error": med("own_run_no_spread_error"), "median_raw_error": med("raw_error"),
                 "median_ahead_error": med("ahead_error"),
                 "median_goodput": {k: gp(k) for k in ("measured", "calibrated", "one_load", "no_spread", "own_run",
                                                       "own_run_no_spread", "raw", "ahead")}})
    m = rows[-1]["median_goodput"]
    print(f"rate {rate:5.1f}/s: median goodput measured {m['measured']:.2f}, calibrated {m['calibrated']:.2f}, one "
          f"load {m['one_load']:.2f}, no spread {m['no_spread']:.2f}, raw {m['raw']:.2f}; median of the runs' errors "
          f"calibrated {rows[-1]['median_calibrated_error'] * 100:.1f} %, one load "
          f"{rows[-1]['median_one_load_error'] * 100:.1f} %, no spread {rows[-1]['median_no_spread_error'] * 100:.1f} %, "
          f"own run {rows[-1]['median_own_run_error'] * 100:.1f} % "
          f"({rows[-1]['median_own_run_no_spread_error'] * 100:.1f} % without spread), just ahead "
          f"{m['ahead']:.2f} ({rows[-1]['median_ahead_error'] * 100:.1f} %), "
          f"raw {rows[-1]['median_raw_error'] * 100:.1f} %", flush=True)
big_rate = 32 * max(float(r) for r in a.rates.split(","))
big, _ = plan(["--profile", calibrated, "--rate", str(big_rate), "--requests", "4000", *lengths], 64)
print(big)
if a.json:
    json.dump({"rows": rows, "cluster64": big}, open(a.json, "w"), indent=1)
if a.plot:
    import sys
    sys.path.insert(0, HERE)
    from plot_validation import plot  # matplotlib only where a plot is asked for
    plot({"rows": rows}, a.plot)
    print("plot:", a.plot)
