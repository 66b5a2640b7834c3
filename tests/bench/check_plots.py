#!/usr/bin/env python3
"""The benchmark plots that docs/PERFORMANCE.md shows, drawn from small
results of the benches' --json shape: bench/actors/plot_pd_shift.py and
bench/planner/plot_validation.py each write a PNG (the file's signature,
its size as a drawn figure has), and a result without a field they read
fails with the field named, not with a blank plot.

usage: check_plots.py WORKDIR"""
import json
import os
import subprocess
import sys

WORK = sys.argv[1]
os.makedirs(WORK, exist_ok=True)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
failures = []


def expect(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else ": " + str(detail)[:1500]), flush=True)
    if not cond:
        failures.append(name)


def draw(script, data, tag):
    src, png = os.path.join(WORK, tag + ".json"), os.path.join(WORK, tag + ".png")
    with open(src, "w") as f:
        json.dump(data, f)
    if os.path.exists(png):
        os.remove(png)
    p = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, script), src, png], capture_output=True, text=True,
                       timeout=120)
    head = open(png, "rb").read(8) if os.path.exists(png) else b""
    return p, png, head


def is_png(p, png, head):
    return p.returncode == 0 and head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 20000


phases = [["prompt-heavy", 480, 8], ["decode-heavy", 24, 96], ["prompt-heavy again", 480, 8]]
shift = {"phases": phases, "rates": [38.0, 46.2, 38.0], "slo": [[129.6, 6.57], [13.1, 3.41], [129.6, 6.57]],
         "results": {"fixed P1:D2": [{"goodput": [0.4, 45.6, 0.1]}, {"goodput": [0.3, 44.9, 0.3]}],
                     "fixed P2:D1": [{"goodput": [22.9, 11.0, 24.4]}, {"goodput": [3.2, 0.5, 20.3]}],
                     "adaptive from P2:D1": [{"goodput": [30.4, 43.5, 5.9]}, {"goodput": [20.5, 43.1, 22.5]}]}}
r = draw("bench/actors/plot_pd_shift.py", shift, "shift")
expect("plot_pd_shift.py draws goodput per phase and cluster", is_png(*r), r[0].stderr)
broken = dict(shift, results={"fixed P1:D2": [{"goodput": [0.4, 45.6]}]})
r = draw("bench/actors/plot_pd_shift.py", broken, "shift_broken")
expect("plot_pd_shift.py: a run with a phase missing fails", r[0].returncode != 0 and "IndexError" in r[0].stderr,
       r[0].stderr)


def run(rate, measured, factor):
    g = {k: {"goodput": v} for k, v in (("measured", measured), ("own_run", measured * 1.03),
                                         ("calibrated", rate * factor), ("raw", rate * 0.95))}
    return dict(g, own_run_error=0.03, calibrated_error=abs(rate * factor - measured) / measured)


rows = []
for rate, ms in ((2, [2.03, 2.04, 2.18]), (4, [2.69, 3.24, 4.26]), (6, [5.17, 3.34, 4.48])):
    runs = [run(rate, m, 0.9) for m in ms]
    med = {k: sorted(x[k]["goodput"] for x in runs)[1] for k in ("measured", "own_run", "calibrated", "raw")}
    rows.append({"rate": rate, "runs": runs, "median_goodput": med})
r = draw("bench/planner/plot_validation.py", {"rows": rows}, "planner")
expect("plot_validation.py draws goodput and each run's error", is_png(*r), r[0].stderr)
r = draw("bench/planner/plot_validation.py", {"rows": [{"rate": 2, "runs": rows[0]["runs"]}]}, "planner_broken")
expect("plot_validation.py: a row without its medians fails naming the field",
       r[0].returncode != 0 and "median_goodput" in r[0].stderr, r[0].stderr)

print(f"{len(failures)} failed" if failures else "all plot checks passed")
sys.exit(1 if failures else 0)
