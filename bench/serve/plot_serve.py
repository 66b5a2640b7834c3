#!/usr/bin/python3
"""Plots serve_bench.py sweeps: one line per topology (one JSON file each).

  plot_serve.py mono.json pd.json --out-dir plots [--labels mono,pd] [--logy]

Writes into --out-dir:
  ttft.png            TTFT p50 (solid) and p99 (dashed) vs request rate
  tpot.png            TPOT p50 (solid) and p99 (dashed) vs request rate
  goodput.png         goodput (requests/s meeting the SLOs) vs request rate
  slo_attainment.png  SLO attainment (%) vs request rate, with the 90 % line
  throughput.png      output tokens/s vs request rate

A rate of inf (all requests at once) is drawn right of the largest finite
rate, at a tick labelled "inf". The label of a file is --labels' entry, else
the JSON's "label" (serve_bench.py --label), else the file name.
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path, label):
    with open(path) as fh:
        doc = json.load(fh)
    if "runs" not in doc:
        raise SystemExit(f"{path}: not a serve_bench.py JSON (no 'runs')")
    name = label or doc.get("label") or os.path.splitext(os.path.basename(path))[0]
    points = []
    for run in doc["runs"]:
        rate = run["request_rate"]
        rate = math.inf if rate in ("inf", None) else float(rate)
        points.append((rate, run["summary"]))
    points.sort(key=lambda p: p[0])
    return name, points


def x_positions(series, logx):
    finite = [r for _, pts in series for r, _ in pts if not math.isinf(r)]
    top = max(finite) if finite else 1.0
    inf_x = top * (2.0 if logx else 1.5) if finite else 1.0
    has_inf = any(math.isinf(r) for _, pts in series for r, _ in pts)
    return (lambda r: inf_x if math.isinf(r) else r), (inf_x if has_inf else None)


def get(summary, key, stat):
    d = summary.get(key) or {}
    return d.get(stat)


def finish(ax, path, title, ylabel, inf_x, xrates, logx=False, logy=False):
    ax.set_title(title)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log")
    # Ticks at the rates swept (and "inf").
    ticks = sorted(set(xrates))
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels(["inf" if inf_x is not None and t == inf_x else f"{t:g}" for t in ticks])
        ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data (no SLO given?)", transform=ax.transAxes, ha="center")
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)


def line(ax, xs, ys, **kw):
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", **kw)
    return bool(pts)


def main(argv=None):
    ap = argparse.ArgumentParser(description="plots serve_bench.py sweeps")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--labels", default=None, help="comma-separated, one per file")
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--logy", action="store_true", help="log scale for the latency plots")
    ap.add_argument("--logx", action="store_true", help="log scale for the request rate")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [None] * len(args.files)
    if len(labels) != len(args.files):
        print("--labels needs one label per file", file=sys.stderr)
        return 2
    series = [load(f, lab) for f, lab in zip(args.files, labels)]
    os.makedirs(args.out_dir, exist_ok=True)
    xpos, inf_x = x_positions(series, args.logx)
    xrates = [xpos(r) for _, pts in series for r, _ in pts]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []

    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (label, pts) in enumerate(series):
            xs = [xpos(r) for r, _ in pts]
            c = colors[i % len(colors)]
            line(ax, xs, [get(s, key, "p50") for _, s in pts], color=c, label=f"{label} p50")
            line(ax, xs, [get(s, key, "p99") for _, s in pts], color=c, linestyle="--",
                 label=f"{label} p99")
        path = os.path.join(args.out_dir, f"{name.lower()}.png")
        finish(ax, path, f"{name} vs request rate", f"{name} (ms)", inf_x, xrates, args.logx, args.logy)
        written.append(path)

    slo = next((s for _, pts in series for _, s in pts
                if s.get("slo_ttft_ms") is not None or s.get("slo_tpot_ms") is not None), None)
    slo_text = ""
    if slo:
        parts = []
        if slo.get("slo_ttft_ms") is not None:
            parts.append(f"TTFT <= {slo['slo_ttft_ms']:g} ms")
        if slo.get("slo_tpot_ms") is not None:
            parts.append(f"TPOT <= {slo['slo_tpot_ms']:g} ms")
        slo_text = " (" + ", ".join(parts) + ")"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, pts) in enumerate(series):
        line(ax, [xpos(r) for r, _ in pts], [s.get("goodput") for _, s in pts],
             color=colors[i % len(colors)], label=label)
    path = os.path.join(args.out_dir, "goodput.png")
    finish(ax, path, "goodput vs request rate" + slo_text, "goodput (requests/s)", inf_x, xrates, args.logx)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, pts) in enumerate(series):
        att = [None if s.get("slo_attainment") is None else 100.0 * s["slo_attainment"]
               for _, s in pts]
        line(ax, [xpos(r) for r, _ in pts], att, color=colors[i % len(colors)], label=label)
    ax.axhline(90.0, color="gray", linestyle=":", label="90 %")
    ax.set_ylim(0, 105)
    path = os.path.join(args.out_dir, "slo_attainment.png")
    finish(ax, path, "SLO attainment vs request rate" + slo_text, "SLO attainment (%)", inf_x, xrates, args.logx)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, pts) in enumerate(series):
        line(ax, [xpos(r) for r, _ in pts], [s.get("output_throughput") for _, s in pts],
             color=colors[i % len(colors)], label=label)
    path = os.path.join(args.out_dir, "throughput.png")
    finish(ax, path, "output throughput vs request rate", "output tokens/s", inf_x, xrates, args.logx)
    written.append(path)

    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
