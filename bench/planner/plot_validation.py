#!/usr/bin/python3
"""The planner against real runs (bench/planner/validate_plan.py's --json)
as a plot: measured goodput per rate (median of the runs, their range)
beside the predictions, and each run's error against the issue's 20 %.

usage: plot_validation.py JSON PNG [--title TEXT]"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (key in each run, label, colour)
PREDICTIONS = [("own_run", "calibrated on the run itself", "tab:green"),
               ("ahead", "calibrated just ahead (seconds before)", "tab:orange"),
               ("calibrated", "calibrated in advance (minutes before)", "tab:blue"),
               ("raw", "raw profile", "tab:gray")]
ERRORS = ("own_run", "ahead", "calibrated")  # each run's error is drawn for these


def plot(data, png, title=""):
    rows = data["rows"]
    # Results from before the just-ahead calibration have no "ahead".
    predictions = [p for p in PREDICTIONS if all(p[0] in r["median_goodput"] for r in rows)]
    rates = [r["rate"] for r in rows]
    fig, (ax, err) = plt.subplots(1, 2, figsize=(11, 4.5))
    measured = [r["median_goodput"]["measured"] for r in rows]
    lo = [m - min(x["measured"]["goodput"] for x in r["runs"]) for m, r in zip(measured, rows)]
    hi = [max(x["measured"]["goodput"] for x in r["runs"]) - m for m, r in zip(measured, rows)]
    ax.errorbar(rates, measured, yerr=[lo, hi], color="black", marker="o", capsize=3, label="measured")
    for key, label, color in predictions:
        ax.plot(rates, [r["median_goodput"][key] for r in rows], marker=".", color=color, label=label)
    ax.plot(rates, rates, color="black", linestyle=":", linewidth=1, label="offered rate")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("goodput (requests/s within both goals)")
    ax.legend(fontsize=8)
    ax.set_title("goodput: median of the runs (measured: range)", fontsize=9)
    every = [100.0]
    shown = [p for p in predictions if p[0] in ERRORS]
    for k, (key, label, color) in enumerate(shown):
        xs, ys = [], []
        for r in rows:
            for x in r["runs"]:
                if x[key + "_error"] is not None:
                    xs.append(r["rate"] + (k - (len(shown) - 1) / 2) * 0.15)
                    ys.append(max(0.3, 100 * x[key + "_error"]))  # 0 shows at the axis' floor
        err.scatter(xs, ys, color=color, s=14, label=label)
        every += ys
    err.axhline(20, color="red", linestyle="--", linewidth=1, label="20 %")
    err.set_yscale("log")
    ticks = [0.3, 1, 2, 5, 10, 20, 50, 100, 200, 500]
    err.set_yticks([t for t in ticks if t <= max(every)])
    err.set_yticklabels([f"{t:g}" for t in ticks if t <= max(every)])
    err.set_xlabel("offered rate (requests/s)")
    err.set_ylabel("|predicted - measured| / measured goodput (%)")
    err.legend(fontsize=8)
    err.set_title("each run's error", fontsize=9)
    fig.suptitle(title or "cleave plan against measured runs", fontsize=10)
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
