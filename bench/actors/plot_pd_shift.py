#!/usr/bin/python3
"""Adaptive P:D against the fixed splits (bench/actors/pd_shift.py's --json)
as a plot: each phase's goodput per cluster, the median of the runs with
their range, beside the phase's offered rate.

usage: plot_pd_shift.py JSON PNG [--title TEXT]"""
import argparse
import json
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(data, png, title=""):
    phases = [p[0] for p in data["phases"]]
    names = list(data["results"])
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, name in enumerate(names):
        runs = data["results"][name]
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(phases))]
        med = [statistics.median(r["goodput"][i] for r in runs) for i in range(len(phases))]
        lo = [m - min(r["goodput"][i] for r in runs) for i, m in enumerate(med)]
        hi = [max(r["goodput"][i] for r in runs) - m for i, m in enumerate(med)]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=f"{name} ({len(runs)} runs)",
               hatch="//" if name.startswith("adaptive") else None, edgecolor="black", linewidth=0.5)
    for i, rate in enumerate(data["rates"]):
        ax.hlines(rate, i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1,
                  label="offered rate" if i == 0 else None)
    ax.set_xticks(range(len(phases)))
    ax.set_xticklabels([f"{p}\nTTFT {g[0]:.0f} ms, TPOT {g[1]:.1f} ms" for p, g in zip(phases, data["slo"])],
                       fontsize=8)
    ax.set_ylabel("goodput (requests/s within both goals)")
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    ax.set_ylim(0, max(data["rates"]) * 1.35)
    ax.set_title(title or "Adaptive P:D against fixed splits: goodput per phase (median, range)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("png")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    plot(json.load(open(a.json)), a.png, a.title)
    print("plot:", a.png)
