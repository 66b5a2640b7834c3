#!/usr/bin/python3
"""Autoscaling on a ramp: SLO misses and stage-time of a reactive autoscaler
against one with Holt's forecast (cluster { autoscale = {...} },
actors/scale_controller.h), beside fixed clusters of 1 and of `--stages`
colocated stages, all served by one `cleave node` head over HTTP and driven
by bench/serve/serve_bench.py with the same Poisson ramp.

First the capacity of one stage is measured in the same run (closed loop,
`--calibrate-concurrency` requests in flight): C req/s. The ramp rises from
`--ramp-from` x C to `--ramp-to` x C over `--ramp-s` seconds and holds for
`--hold-s`; holt's stage_rps is `--stage-share` x C. A miss is a request
whose TTFT is over `--slo-ttft-ms` (or that failed). Stage-time is the
router's autoscale_stage_ms (entry stages taking requests, integrated over
time over the run; a fixed cluster's is its stages x the run's length). Each
configuration runs `--runs` times; the table gives the median and the
range.

usage: autoscale_ramp.py CLEAVE VOCAB WORKDIR [--runs 3] [--stages 2] [--slo-ttft-ms 250]
       [--json FILE] [--plot FILE.png]"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served_head import head_script, make_model, router_stats, run_bench, serve, stop  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--stages", type=int, default=2, help="colocated stages (one engine thread each)")
ap.add_argument("--slo-ttft-ms", type=float, default=250)
ap.add_argument("--prompt-tokens", type=int, default=128)
ap.add_argument("--output-tokens", type=int, default=32)
ap.add_argument("--calibrate-concurrency", type=int, default=16)
ap.add_argument("--ramp-from", type=float, default=0.2)
ap.add_argument("--ramp-to", type=float, default=1.6)
ap.add_argument("--ramp-s", type=float, default=30)
ap.add_argument("--hold-s", type=float, default=10)
ap.add_argument("--stage-share", type=float, default=0.7)
ap.add_argument("--horizon-s", type=float, default=4)
ap.add_argument("--json")
ap.add_argument("--plot")
a = ap.parse_args()
os.makedirs(a.work, exist_ok=True)
model = os.path.join(a.work, "ramp.gguf")
make_model(a.cleave, a.vocab, model)


def script(stages, autoscale):
    return head_script(os.path.join(a.work, f"ramp_{stages}_{len(autoscale)}.lua"), f"colocated = {stages}",
                       f"autoscale = {{ {autoscale} }}" if autoscale else "")


def bench(url, tag, extra):
    return run_bench(url, "ramp", os.path.join(a.work, tag + ".json"), a.prompt_tokens, a.output_tokens,
                     ["--slo-ttft-ms", str(a.slo_ttft_ms), *extra])


# One stage's capacity, closed loop.
head, url = serve(a.cleave, model, script(1, ""), "ramp")
cal = bench(url, "calibrate", ["--num-prompts", str(8 * a.calibrate_concurrency), "--max-concurrency",
                               str(a.calibrate_concurrency)])["summary"]
stop(head)
C = cal["request_throughput"]
r0, r1 = a.ramp_from * C, a.ramp_to * C
n = int(r0 * a.ramp_s + (r1 - r0) * a.ramp_s / 2 + r1 * a.hold_s)
print(f"one stage: {C:.2f} req/s closed loop at {a.calibrate_concurrency} in flight "
      f"({a.prompt_tokens} prompt, {a.output_tokens} output tokens); ramp {r0:.2f} -> {r1:.2f} req/s over "
      f"{a.ramp_s:g} s, then {a.hold_s:g} s: {n} requests; TTFT goal {a.slo_ttft_ms:g} ms; {os.cpu_count()} cores")

goal = f"ttft_ms = {a.slo_ttft_ms:g}, interval_s = 0.5, confirm = 2, cooldown_s = 5"
configs = [
    ("fixed 1", 1, ""),
    ("reactive", a.stages, goal),
    ("holt", a.stages, goal + f", forecast = 'holt', stage_rps = {a.stage_share * C:.3f}, horizon_s = {a.horizon_s:g}"),
    (f"fixed {a.stages}", a.stages, ""),
]
results = {name: [] for name, _, _ in configs}
records = {}
for run in range(a.runs):
    for name, stages, auto in configs:
        head, url = serve(a.cleave, model, script(stages, auto), "ramp")
        before = router_stats(url) if auto else {}
        out = bench(url, f"{name.replace(' ', '_')}_{run}", ["--num-prompts", str(n), "--ramp",
                                                             f"{r0}:{r1}:{a.ramp_s}"])
        st = router_stats(url) if auto else {}
        stop(head)
        s = out["summary"]
        misses = s["num_requests"] - s["good_requests"]
        # What the run itself used (the head idles before and after it).
        stage_s = ((st.get("autoscale_stage_ms", 0) - before.get("autoscale_stage_ms", 0)) / 1e3 if auto
                   else stages * s["duration_s"])
        row = {"misses": misses, "requests": s["num_requests"], "failed": s["failed"],
               "ttft_p90_ms": s["ttft_ms"]["p90"], "ttft_p99_ms": s["ttft_ms"]["p99"], "stage_s": stage_s,
               "duration_s": s["duration_s"], "ups": st.get("autoscale_ups"), "downs": st.get("autoscale_downs")}
        results[name].append(row)
        if run == 0:
            records[name] = [(r["scheduled_s"], r["ttft_s"]) for r in out["requests"]]
        print(f"run {run + 1} {name:9s} misses {misses:4d}/{s['num_requests']} (failed {s['failed']}), "
              f"TTFT p90 {s['ttft_ms']['p90']:.0f} ms p99 {s['ttft_ms']['p99']:.0f} ms, "
              f"stage-time {stage_s:.1f} s", flush=True)


def med(rows, key):
    v = [r[key] for r in rows]
    return statistics.median(v), min(v), max(v)


print(f"\n| configuration | SLO misses (of {n}) | TTFT p90 ms | TTFT p99 ms | stage-seconds |")
print("|---|---|---|---|---|")
for name, _, _ in configs:
    rows = results[name]
    cells = []
    for key, fmt in (("misses", "{:.0f}"), ("ttft_p90_ms", "{:.0f}"), ("ttft_p99_ms", "{:.0f}"), ("stage_s", "{:.1f}")):
        m, lo, hi = med(rows, key)
        cells.append(f"{fmt.format(m)} ({fmt.format(lo)}-{fmt.format(hi)})")
    print(f"| {name} | " + " | ".join(cells) + " |")
print(f"(median over {a.runs} runs, range in brackets; one stage serves {C:.2f} req/s closed loop)")

if a.json:
    json.dump({"capacity_rps": C, "ramp": [r0, r1, a.ramp_s, a.hold_s], "requests": n,
               "slo_ttft_ms": a.slo_ttft_ms, "results": results}, open(a.json, "w"), indent=1)
if a.plot:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, color in (("reactive", "tab:red"), ("holt", "tab:blue"), ("fixed 1", "tab:gray")):
        pts = [(t, ttft * 1e3) for t, ttft in records.get(name, []) if ttft is not None]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, color=color, label=name, alpha=0.6)
    ax.axhline(a.slo_ttft_ms, color="black", linestyle="--", linewidth=1, label="TTFT goal")
    ax.set_yscale("log")
    ax.set_xlabel("arrival (s after the start)")
    ax.set_ylabel("TTFT (ms)")
    rate = ax.twinx()
    ts = [i * 0.5 for i in range(int((a.ramp_s + a.hold_s) * 2) + 1)]
    rate.plot(ts, [r0 + (r1 - r0) * min(t, a.ramp_s) / a.ramp_s for t in ts], color="tab:green", label="rate")
    rate.set_ylabel("offered rate (req/s)")
    ax.legend(loc="upper left", markerscale=3)
    ax.set_title(f"Autoscaling on a ramp (first run): TTFT of each request, {a.stages} stages at most")
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)
    print("plot:", a.plot)
