#!/usr/bin/python3
"""One adaptive cluster through pd_shift.py's phases, traced: every
decision of the P:D controller (the router's pd_*_milli gauges and stage
counts, polled from /metrics until pd_decisions moves) beside the requests
of each phase that missed a goal, by arrival time. It shows when a load
shift becomes visible to the controller, when the move comes, and which
arrivals paid for the wait. Phases, rates and goals come from a
pd_shift.py JSON (its --json), so the trace runs the load that set did.

usage: pd_trace.py CLEAVE VOCAB WORKDIR --from SET.json [--phase-s 12] [--interval-s 0.25]
       [--confirm 2] [--adaptive-start 2:1] [--bucket-s 0.25] [--json FILE]"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served_head import head_script, make_model, pd_controller_fields, router_stats, run_bench, serve, stop  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--from", dest="source", required=True, help="a pd_shift.py JSON: phases, rates, goals")
ap.add_argument("--phase-s", type=float, default=12, help="seconds of arrivals per phase")
ap.add_argument("--interval-s", type=float, default=0.25)
ap.add_argument("--confirm", type=int, default=2)
ap.add_argument("--cooldown-s", type=float, default=4)
ap.add_argument("--switch-grace-s", type=float, default=2)
ap.add_argument("--adaptive-start", default="2:1")
ap.add_argument("--bucket-s", type=float, default=0.25, help="arrival buckets of the misses table")
ap.add_argument("--json")
a = ap.parse_args()
src = json.load(open(a.source))
phases, rates, slo = src["phases"], src["rates"], src["slo"]
os.makedirs(a.work, exist_ok=True)
model = os.path.join(a.work, "shift.gguf")
make_model(a.cleave, a.vocab, model)
p0, d0 = (int(x) for x in a.adaptive_start.split(":"))
controller = pd_controller_fields(slo, a.interval_s, a.confirm, a.cooldown_s, a.switch_grace_s)
topology = head_script(os.path.join(a.work, "trace.lua"), f"prefill = {p0}, decode = {d0}",
                       f"pd_controller = {{ {controller} }}")
proc, url = serve(a.cleave, model, topology, "shift")

decisions, done = [], threading.Event()
t0 = time.monotonic()


def poll():
    seen = None
    while not done.wait(0.02):
        try:
            rs = router_stats(url)
        except OSError:  # a poll that failed is retried at the next one
            continue
        n = int(rs.get("pd_decisions", 0))
        if n != seen:
            seen = n
            milli = [rs.get(f"pd_{k}_milli") for k in ("ttft_pressure", "tpot_pressure", "prefill_busy", "prefill_load")]
            decisions.append([round(time.monotonic() - t0, 3), n, int(rs.get("alive_prefill", 0)),
                              int(rs.get("alive_decode", 0)),
                              *[None if v is None else v / 1000 for v in milli]])


poller = threading.Thread(target=poll, daemon=True)
poller.start()
trace = {"source": a.source, "controller": controller, "phases": []}
for i, ((name, prompt, output), rate, goals) in enumerate(zip(phases, rates, slo)):
    start = time.monotonic() - t0
    run = run_bench(url, "shift", os.path.join(a.work, f"trace_{i}.json"), prompt, output,
                    ["--num-prompts", str(max(1, int(rate * a.phase_s))), "--request-rate", f"{rate:.4f}",
                     "--slo-ttft-ms", f"{goals[0]:.3f}", "--slo-tpot-ms", f"{goals[1]:.3f}"])
    # Per bucket: requests, missed, over the TTFT goal, over the TPOT goal,
    # and the misses' median gap to their second token (ms; the hand-off's
    # wait for a decode row), None without one.
    buckets, first_gaps = {}, {}
    for r in run["requests"]:
        k = int(r["scheduled_s"] / a.bucket_s)
        b = buckets.setdefault(k, [0, 0, 0, 0])
        b[0] += 1
        if not r["meets_slo"]:
            b[1] += 1
            b[2] += r["ttft_s"] is None or r["ttft_s"] * 1e3 > goals[0]
            b[3] += r["tpot_s"] is not None and r["tpot_s"] * 1e3 > goals[1]
            if r["itl_s"]:
                first_gaps.setdefault(k, []).append(r["itl_s"][0] * 1e3)
    for k, b in buckets.items():
        b.append(round(statistics.median(first_gaps[k]), 1) if k in first_gaps else None)
    s = run["summary"]
    trace["phases"].append({"name": name, "started_s": round(start, 3), "good": s["good_requests"],
                            "completed": s["completed"], "goodput": s["good_requests"] / s["duration_s"],
                            "misses": [[round(k * a.bucket_s, 3), *buckets[k]] for k in sorted(buckets)]})
done.set()
poller.join()
stop(proc)
trace["decisions"] = decisions

print(f"controller: {controller}")
for i, ph in enumerate(trace["phases"]):
    nxt = trace["phases"][i + 1]["started_s"] if i + 1 < len(trace["phases"]) else float("inf")
    print(f"\n{ph['name']}: bench started {ph['started_s']:.2f} s, {ph['good']} of {ph['completed']} met the goals")
    print("  decisions (s since the bench started, P, D, TTFT / TPOT pressure, prefill busy, prefill load):")
    for t, n, p, d, ttft, tpot, busy, load in decisions:
        if ph["started_s"] <= t < min(nxt, ph["started_s"] + 4):
            print(f"    {t - ph['started_s']:6.2f}  P{p}:D{d}  {ttft if ttft is not None else '-'} / "
                  f"{tpot if tpot is not None else '-'}  {busy if busy is not None else '-'}  "
                  f"{load if load is not None else '-'}")
    print("  arrivals by time (s since the first: requests/missed/over TTFT/over TPOT, misses' median wait "
          "for a second token in ms):")
    print("    " + "  ".join(f"{t:g}: {n}/{m}/{f}/{g}" + (f" {w:g}" if w is not None else "")
                             for t, n, m, f, g, w in ph["misses"] if t < 4))
if a.json:
    json.dump(trace, open(a.json, "w"), indent=1)
