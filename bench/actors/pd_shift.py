#!/usr/bin/python3
"""Adaptive P:D against fixed ratios on a load that shifts: prompt-heavy,
then decode-heavy, then prompt-heavy again, each phase an open-loop Poisson
load from bench/serve/serve_bench.py against one `cleave node` head that
hosts `--stages` stage actors (one engine thread each) split into prefill
and decode. Every fixed split P:D with P + D = stages runs the three phases
back to back on one server, and so does the adaptive cluster
(cluster { pd_controller = {...} } with the same goals, starting from the
split given by --adaptive-start); goodput is the requests per second of a
phase that met both the TTFT and the TPOT goal. For the adaptive cluster
the JSON also holds its stage counts over time (`timeline`: phase, seconds
into it, prefill and decode stages, at each change seen by polling the
router's /metrics every 0.25 s).

Goals and rates come from this machine in the same run: each phase's
unloaded TTFT and TPOT on P1 D1 (4 requests one by one) times --slo-factor
are its goals, and each phase's rate is --load x the best closed-loop
throughput of the fixed splits in that phase (--closed-concurrency in
flight: 8 by default; more in the decode-heavy phase, e.g. 8,32, offers a
decode load that one decode stage's --max-seqs cannot hold, so that the
phase calls for a move to decode).

usage: pd_shift.py CLEAVE VOCAB WORKDIR [--stages 3] [--runs 3] [--phase-s 20] [--interval-s 1]
       [--closed-concurrency 8,8] [--confirm 2] [--cooldown-s 4] [--switch-grace-s 2] [--json FILE] [--plot FILE.png]"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served_head import (head_script, make_model, misses_by_arrival, pd_controller_fields, router_stats,  # noqa: E402
                         run_bench, serve, stop)


def two_counts(text):
    """--closed-concurrency: prompt-heavy,decode-heavy, each >= 1."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) != 2 or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"two counts >= 1 (prompt-heavy,decode-heavy), got {text!r}")
    return counts


ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--stages", type=int, default=3)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--phase-s", type=float, default=20, help="seconds of arrivals per phase")
ap.add_argument("--load", type=float, default=0.8)
ap.add_argument("--closed-concurrency", type=two_counts, default=[8, 8],
                help="requests in flight when measuring the best split's throughput: prompt-heavy,decode-heavy")
ap.add_argument("--slo-factor", type=float, default=4)
ap.add_argument("--adaptive-start", default="2:1")
ap.add_argument("--interval-s", type=float, default=1, help="the controller's interval")
ap.add_argument("--confirm", type=int, default=2, help="intervals a verdict must hold")
ap.add_argument("--cooldown-s", type=float, default=4, help="no move this long after one")
ap.add_argument("--switch-grace-s", type=float, default=2, help="a switching stage finishes its work this long")
ap.add_argument("--json")
ap.add_argument("--plot", help="goodput per phase and cluster (plot_pd_shift.py)")
a = ap.parse_args()
closed_conc = a.closed_concurrency
os.makedirs(a.work, exist_ok=True)
model = os.path.join(a.work, "shift.gguf")
make_model(a.cleave, a.vocab, model)
# The JSON's "misses": per phase, the requests that missed a goal per
# MISS_BUCKET_S of arrival time (the first bucket holds a move's cost).
MISS_BUCKET_S = 10
# (name, prompt tokens, output tokens)
PHASES = [("prompt-heavy", 480, 8), ("decode-heavy", 24, 96), ("prompt-heavy again", 480, 8)]


def script(p, d, controller):
    return head_script(os.path.join(a.work, f"shift_{p}_{d}_{int(bool(controller))}.lua"),
                       f"prefill = {p}, decode = {d}", f"pd_controller = {{ {controller} }}" if controller else "")


def start(p, d, controller=""):
    return serve(a.cleave, model, script(p, d, controller), "shift")


class RoleTimeline:
    """Polls the router's live stage counts every `every` seconds while a
    phase runs: (phase, seconds into it, prefill stages, decode stages) at
    the start and at each change, so a move's timing can be read."""

    def __init__(self, url, every=0.25):
        self.url, self.every, self.rows, self._stop = url, every, [], None

    def start(self, phase):
        self._stop, t0, last = threading.Event(), time.monotonic(), [None]

        def poll():
            while not self._stop.is_set():
                try:
                    rs = router_stats(self.url)
                    now = (int(rs.get("alive_prefill", 0)), int(rs.get("alive_decode", 0)))
                    if now != last[0]:
                        self.rows.append([phase, round(time.monotonic() - t0, 2), *now])
                        last[0] = now
                except OSError:
                    pass
                self._stop.wait(self.every)
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()


def bench(url, tag, phase, extra, slo=None, records=False):
    """serve_bench's summary; with records, also its per-request records."""
    _, prompt, output = phase
    slo_args = ["--slo-ttft-ms", f"{slo[0]:.3f}", "--slo-tpot-ms", f"{slo[1]:.3f}"] if slo else []
    run = run_bench(url, "shift", os.path.join(a.work, tag + ".json"), prompt, output, [*slo_args, *extra])
    return (run["summary"], run["requests"]) if records else run["summary"]


splits = [(p, a.stages - p) for p in range(1, a.stages)]
# Goals: unloaded latency on P1 D1, times the factor.
proc, url = start(1, 1)
slo = []
for i, ph in enumerate(PHASES[:2]):
    s = bench(url, f"unloaded_{i}", ph, ["--num-prompts", "4", "--max-concurrency", "1"])
    slo.append((a.slo_factor * s["ttft_ms"]["p50"], a.slo_factor * s["tpot_ms"]["p50"]))
stop(proc)
slo.append(slo[0])
# Rates: the best fixed split's closed-loop throughput in each phase.
best = [0.0, 0.0]
for p, d in splits:
    proc, url = start(p, d)
    for i, ph in enumerate(PHASES[:2]):
        s = bench(url, f"closed_{p}_{d}_{i}", ph, ["--num-prompts", str(max(48, 3 * closed_conc[i])),
                                                                "--max-concurrency", str(closed_conc[i])])
        best[i] = max(best[i], s["request_throughput"])
    stop(proc)
rates = [a.load * best[0], a.load * best[1], a.load * best[0]]
for ph, r, g in zip(PHASES, rates, slo):
    print(f"{ph[0]:19s} {ph[1]} prompt / {ph[2]} output tokens at {r:.2f} req/s for {a.phase_s:g} s; "
          f"goals TTFT {g[0]:.1f} ms, TPOT {g[1]:.2f} ms")

p0, d0 = (int(x) for x in a.adaptive_start.split(":"))
controller = pd_controller_fields(slo, a.interval_s, a.confirm, a.cooldown_s, a.switch_grace_s)
configs = [(f"fixed P{p}:D{d}", p, d, "") for p, d in splits] + [(f"adaptive from P{p0}:D{d0}", p0, d0, controller)]
results = {c[0]: [] for c in configs}
for run in range(a.runs):
    # Each run starts with another cluster: a later cluster on a shared VM
    # can meet a busier machine, so no cluster always runs in one place.
    for name, p, d, ctl in configs[run % len(configs):] + configs[:run % len(configs)]:
        proc, url = start(p, d, ctl)
        goodput, misses, moves, before = [], [], [], (0, 0)
        timeline = RoleTimeline(url)
        for i, (ph, r, g) in enumerate(zip(PHASES, rates, slo)):
            n = max(1, int(r * a.phase_s))
            if ctl:
                timeline.start(i)
            s, records = bench(url, f"{name.replace(' ', '_').replace(':', '')}_{run}_{i}", ph,
                               ["--num-prompts", str(n), "--request-rate", f"{r:.4f}"], g, records=True)
            misses.append(misses_by_arrival(records, MISS_BUCKET_S))
            if ctl:
                timeline.stop()
            goodput.append(s["good_requests"] / s["duration_s"])
            # The moves made during this phase (and its drain), by direction.
            rs = router_stats(url) if ctl else {}
            now = (int(rs.get("role_switches_to_decode", 0)), int(rs.get("role_switches_to_prefill", 0)))
            moves.append(f"{now[0] - before[0]}d{now[1] - before[1]}p")
            before = now
        switches = sum(before)
        stop(proc)
        results[name].append({"goodput": goodput, "misses": misses, "switches": switches, "moves": moves})
        if ctl:
            results[name][-1]["timeline"] = timeline.rows
        print(f"run {run + 1} {name:20s} goodput " + "  ".join(f"{x:.2f}" for x in goodput) +
              f"  misses of the first {MISS_BUCKET_S} s / later arrivals: " +
              "  ".join(f"{m[0] if m else 0}/{sum(m[1:])}" for m in misses) +
              (f"  ({switches} role switches; per phase to decode / to prefill: {' '.join(moves)};"
               f" stages over time [phase, s, P, D]: {timeline.rows})" if ctl else ""), flush=True)

print("\n| cluster | " + " | ".join(f"{ph[0]} goodput (req/s)" for ph in PHASES) + " | role switches |")
print("|---|" + "---|" * (len(PHASES) + 1))
for name, *_ in configs:
    rows = results[name]
    cells = []
    for i in range(len(PHASES)):
        v = [r["goodput"][i] for r in rows]
        cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
    sw = [r["switches"] for r in rows]
    print(f"| {name} | " + " | ".join(cells) + f" | {statistics.median(sw):g} |")
print(f"(median over {a.runs} runs, range in brackets; offered "
      + ", ".join(f"{r:.2f}" for r in rates) + " req/s)")
data = {"phases": PHASES, "rates": rates, "slo": slo, "closed_concurrency": closed_conc,
        "miss_bucket_s": MISS_BUCKET_S, "results": results}
if a.json:
    json.dump(data, open(a.json, "w"), indent=1)
if a.plot:
    from plot_pd_shift import plot  # matplotlib only where a plot is asked for
    plot(data, a.plot)
    print("plot:", a.plot)
