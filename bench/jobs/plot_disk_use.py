#!/usr/bin/python3
"""The long run's disk use (bench/jobs/long_run.py's CSV) as a plot.

usage: plot_disk_use.py CSV PNG --kv-disk-mib N --title TEXT [--restarts JSON]"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("png")
ap.add_argument("--kv-disk-mib", type=float, required=True)
ap.add_argument("--title", default="")
ap.add_argument("--restarts", default="", help="JSON list of restart times (s)")
a = ap.parse_args()
rows = [list(map(float, l.split(","))) for l in open(a.csv).read().splitlines()[1:] if l]
t = [r[0] for r in rows]
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot(t, [r[1] / 2**20 for r in rows], label="KV store (RocksDB)")
ax.plot(t, [r[2] / 2**20 for r in rows], label="journal (RocksDB)")
ax.plot(t, [r[3] / 2**20 for r in rows], label="output file")
ax.axhline(a.kv_disk_mib, color="grey", linestyle=":", label=f"--kv-disk-mib {a.kv_disk_mib:.0f}")
if a.restarts:
    for r in json.load(open(a.restarts)):
        ax.axvline(r, color="red", alpha=0.25)
ax.set_xlabel("seconds" + (" (red: kill -9 and restart)" if a.restarts else ""))
ax.set_ylabel("MiB on disk")
ax2 = ax.twinx()
ax2.plot(t, [r[4] for r in rows], color="black", alpha=0.4)
ax2.set_ylabel("lines done (grey)")
ax.legend(loc="upper left", fontsize=8)
ax.set_title(a.title, fontsize=10)
fig.tight_layout()
fig.savefig(a.png, dpi=100)
