#!/usr/bin/env python3
"""Count how often the batched-decode targets held over saved runs.

Reads the JSON files `cleave_bench --batched --json F` writes and, for each
case (weights, KV type, threads, block size) of the chosen batch, prints:
the batch's throughput as a % of its roofline, its throughput over batch
1's of the same case ("x b=1"), the same ratio of the two rooflines
("ceil": what the machine allows when batch 1 runs at its roofline), and
batch 1's % of its own roofline. The totals count the cases that held
each target (issue 18: >= 60 % of the roofline and >= 6x one stream at 32
streams) and how many of the 6x cases had a ceiling of 6x or more.

  /usr/bin/python3 bench/tally_batched.py bench/results/batched_*.json
"""
import argparse
import json
import sys


def cases(path, weights, batch):
    with open(path) as f:
        runs = json.load(f)["runs"]
    exact = [r for r in runs if r.get("compute", "exact") == "exact" and r["type"] == weights]

    def key(r):
        return (r["kv_type"], r["threads"], r.get("block_size", 16))

    one = {key(r): r for r in exact if r["batch"] == 1}
    for r in exact:
        if r["batch"] != batch or key(r) not in one:
            continue
        b1 = one[key(r)]
        yield {
            "kv": r["kv_type"],
            "threads": r["threads"],
            "block": r.get("block_size", 16),
            "pct": r["decode_tok_s_median"] / r["roofline_tok_s"],
            "speedup": r["decode_tok_s_median"] / b1["decode_tok_s_median"],
            "ceiling": r["roofline_tok_s"] / b1["roofline_tok_s"],
            "b1_pct": b1["decode_tok_s_median"] / b1["roofline_tok_s"],
        }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="files written by cleave_bench --batched --json")
    ap.add_argument("--weights", default="f16", help="weight type to count (default f16)")
    ap.add_argument("--batch", type=int, default=32, help="batch to count (default 32)")
    ap.add_argument("--roofline", type=float, default=0.60, help="target share of the roofline")
    ap.add_argument("--speedup", type=float, default=6.0, help="target x one stream")
    args = ap.parse_args()

    total = held_roof = held_speed = held_both = ceil_ok = speed_with_ceil = 0
    print(f"{'file':44} {'kv':5} {'t':>2} {'block':>5} | {'% roof':>6} {'x b=1':>6} {'ceil':>6} {'b1 %':>5}")
    for path in args.json:
        try:
            rows = list(cases(path, args.weights, args.batch))
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"tally_batched: {path}: not a cleave_bench --batched JSON ({e})")
        for c in rows:
            roof = c["pct"] >= args.roofline
            speed = c["speedup"] >= args.speedup
            total += 1
            held_roof += roof
            held_speed += speed
            held_both += roof and speed
            ceil_ok += c["ceiling"] >= args.speedup
            speed_with_ceil += speed and c["ceiling"] >= args.speedup
            mark = " both" if roof and speed else (" roof" if roof else "")
            print(f"{path.split('/')[-1][:44]:44} {c['kv']:5} {c['threads']:>2} {c['block']:>5} | "
                  f"{100 * c['pct']:5.1f}% {c['speedup']:5.2f}x {c['ceiling']:5.2f}x {100 * c['b1_pct']:4.0f}%{mark}")
    if total == 0:
        sys.exit(f"tally_batched: no {args.weights} cases at batch {args.batch} with a batch-1 row")
    print(f"\n{total} cases of {args.weights} weights at batch {args.batch}:")
    print(f"  >= {100 * args.roofline:.0f} % of the roofline: {held_roof}")
    print(f"  >= {args.speedup:g}x one stream: {held_speed} ({speed_with_ceil} of them with a ceiling >= {args.speedup:g}x)")
    print(f"  both: {held_both}")
    print(f"  ceiling >= {args.speedup:g}x (6x possible with batch 1 at its roofline): {ceil_ok}")


if __name__ == "__main__":
    main()
