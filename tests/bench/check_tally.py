#!/usr/bin/env python3
"""bench/tally_batched.py: its counts on a table of made-up cases whose
answers are known, its refusal of a file that is not a batched result, and
the counts docs/PERFORMANCE.md quotes from the committed results.

usage: check_tally.py WORKDIR"""
import json
import os
import re
import subprocess
import sys

WORK = sys.argv[1]
os.makedirs(WORK, exist_ok=True)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TALLY = os.path.join(ROOT, "bench", "tally_batched.py")
failures = []


def expect(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else ": " + str(detail)[:1500]), flush=True)
    if not cond:
        failures.append(name)


def tally(*files):
    p = subprocess.run(["/usr/bin/python3", TALLY, *files], capture_output=True, text=True, timeout=60)
    counts = {}
    for label, pattern in [("cases", r"^(\d+) cases of"), ("roof", r">= 60 % of the roofline: (\d+)"),
                           ("speed", r">= 6x one stream: (\d+)"), ("speed_ceil", r"\((\d+) of them with a ceiling"),
                           ("both", r"both: (\d+)"), ("ceil", r"ceiling >= 6x \(.*\): (\d+)")]:
        m = re.search(pattern, p.stdout, re.M)
        counts[label] = int(m.group(1)) if m else None
    return p, counts


def run(kv, threads, batch, tok_s, roof_tok_s, wtype="f16", compute="exact"):
    return {"type": wtype, "kv_type": kv, "threads": threads, "block_size": 16, "batch": batch,
            "compute": compute, "decode_tok_s_median": tok_s, "roofline_tok_s": roof_tok_s}


# Four cases at batch 32, each beside its batch 1 (roofline 100 tok/s):
#   f32 t1: 650 of 1000 (65 %), 6.5x one stream, ceiling 10x -> both
#   f32 t2: 700 of 1000 (70 %), 5.0x (batch 1 at 140), ceiling 10x -> roofline only
#   f16 t1: 500 of 1000 (50 %), 6.25x (batch 1 at 80) -> 6x only
#   f16 t2: 620 of 580 (107 %), 6.2x, ceiling 5.8x -> both, ceiling under 6x
# and rows that must not count: q8_0 weights, int8 compute, batch 8, a batch
# 32 with no batch-1 row.
made_up = {"isa": "avx512", "limits": {}, "runs": [
    run("f32", 1, 1, 100, 100), run("f32", 1, 32, 650, 1000),
    run("f32", 2, 1, 140, 100), run("f32", 2, 32, 700, 1000),
    run("f16", 1, 1, 80, 100), run("f16", 1, 32, 500, 1000),
    run("f16", 2, 1, 100, 100), run("f16", 2, 32, 620, 580),
    run("f16", 2, 8, 610, 600),
    run("f32", 1, 1, 100, 100, wtype="q8_0"), run("f32", 1, 32, 900, 1000, wtype="q8_0"),
    run("f32", 1, 32, 900, 1000, compute="int8"),
    run("q8_0", 1, 32, 900, 1000),
]}
path = os.path.join(WORK, "made_up.json")
with open(path, "w") as f:
    json.dump(made_up, f)
p, c = tally(path)
expect("made-up table: exit 0", p.returncode == 0, p.stderr)
want = {"cases": 4, "roof": 3, "speed": 3, "speed_ceil": 2, "both": 2, "ceil": 3}
expect("made-up table: counts", c == want, f"got {c}, want {want}\n{p.stdout}")

bad = os.path.join(WORK, "not_batched.json")
with open(bad, "w") as f:
    json.dump({"limits": {}}, f)
p, _ = tally(bad)
expect("a file without runs is refused, named", p.returncode != 0 and "not_batched.json" in p.stderr,
       (p.returncode, p.stderr))

# The counts docs/PERFORMANCE.md ("The tally, by a command") quotes.
results = os.path.join(ROOT, "bench", "results")
files = [os.path.join(results, n) for n in (
    "batched_2026-12-07_zen5.json", "batched_2026-12-07b_zen5.json", "batched_2026-12-07c_zen5.json",
    "blocksize_2026-12-07_short.json", "batched_2026-12-07_head_run1.json", "batched_2026-12-07_head_run2.json",
    "batched_2026-12-07_head_run3.json", "batched_2026-12-07_head_run4.json")]
p, c = tally(*files)
want = {"cases": 54, "roof": 43, "speed": 21, "speed_ceil": 15, "both": 20, "ceil": 40}
expect("committed Zen 5 runs: the counts PERFORMANCE.md quotes", p.returncode == 0 and c == want,
       f"got {c}, want {want}\n{p.stderr}")

if failures:
    sys.exit(f"{len(failures)} check(s) failed: {', '.join(failures)}")
print("all checks passed")
