#!/usr/bin/env python3
"""Accuracy of a shapes VLM (models/shapes/) through `cleave generate`.

Draws N fresh images with models/shapes/shapes_data.py from a seed training
never used (training: 1234/1235, its evaluation: 777/778/4242; default
9001), writes them as PNGs, asks every task of each image (the caption for
`describe` and each counting question) greedily in one batched
`cleave generate --requests` run, and reports exact match of the answer
text. Exit status 1 when the accuracy is below --min-accuracy.

    /usr/bin/python3 tests/vision/check_shapes.py --cleave build/apps/cleave \\
        --lm models/shapes/shapes-lm-f32.gguf --mmproj models/shapes/shapes-mmproj-f32.gguf \\
        --images 200 --min-accuracy 0.95 --workdir /tmp/shapes-check [--topology pd]

Needs numpy only (no PIL): the PNG writer is tests/reference's.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "models", "shapes"))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import shapes_data as D  # noqa: E402
from reference_clip import write_png  # noqa: E402

USED_SEEDS = {1234, 1235, 777, 778, 4242}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cleave", required=True)
    ap.add_argument("--lm", required=True, help="language model GGUF")
    ap.add_argument("--mmproj", required=True, help="vision encoder GGUF")
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--seed", type=int, default=9001)
    ap.add_argument("--min-accuracy", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--tasks", choices=["all", "caption", "questions"], default="all")
    ap.add_argument("--topology", choices=["mono", "colocated", "pd"], default="mono",
                    help="pd with --vision-actors: E/P/D in one process")
    ap.add_argument("--vision-actors", type=int, default=1)
    a = ap.parse_args()
    if a.seed in USED_SEEDS:
        sys.exit(f"seed {a.seed} was used in training or its evaluation; pick another")
    os.makedirs(a.workdir, exist_ok=True)

    rng = np.random.default_rng(a.seed)
    requests, expected = [], []
    for i in range(a.images):
        img, objects = D.make_sample(rng)
        png = os.path.join(a.workdir, f"shape{i:04d}.png")
        write_png(png, img)
        tasks = D.tasks(objects)
        if a.tasks == "caption":
            tasks = tasks[:1]
        elif a.tasks == "questions":
            tasks = tasks[1:]
        for prompt, answer in tasks:
            rid = len(requests)
            # Answers are at most 16 words; EOS ends them.
            requests.append({"id": rid, "prompt": prompt, "images": [png], "max_tokens": 24,
                             "temperature": 0})
            expected.append((i, prompt, answer))
    req_path = os.path.join(a.workdir, "requests.jsonl")
    out_path = os.path.join(a.workdir, "results.jsonl")
    with open(req_path, "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")

    cmd = [a.cleave, "generate", "-m", a.lm, "--mmproj", a.mmproj, "--requests", req_path,
           "--out", out_path]
    if a.threads:
        cmd += ["-t", str(a.threads)]
    if a.topology != "mono":
        cmd += ["--topology", a.topology, "--vision-actors", str(a.vision_actors)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"cleave failed ({p.returncode}): {p.stderr.strip()}")
    results = {}
    with open(out_path) as f:
        for line in f:
            j = json.loads(line)
            results[j["id"]] = j

    right = {"caption": [0, 0], "questions": [0, 0]}
    wrong_examples = []
    for rid, (i, prompt, answer) in enumerate(expected):
        j = results.get(rid, {})
        got = j.get("text", "").strip() if "error" not in j else "<error: %s>" % j["error"]
        kind = "caption" if prompt == "describe" else "questions"
        right[kind][1] += 1
        if got == answer:
            right[kind][0] += 1
        elif len(wrong_examples) < 8:
            wrong_examples.append(f"  image {i} {prompt!r}: want {answer!r}, got {got!r}")
    total = sum(r[0] for r in right.values()), sum(r[1] for r in right.values())
    acc = total[0] / total[1]
    print(f"shapes exact match: {total[0]}/{total[1]} = {100 * acc:.2f} % "
          f"({a.images} images, seed {a.seed}, {wall:.1f} s)")
    for kind, (ok, n) in right.items():
        if n:
            print(f"  {kind:9s} {ok}/{n} = {100 * ok / n:.2f} %")
    print("  cleave: " + p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "")
    if wrong_examples:
        print("some misses:\n" + "\n".join(wrong_examples))
    if acc < a.min_accuracy:
        print(f"FAIL: accuracy {100 * acc:.2f} % is below {100 * a.min_accuracy:.2f} %")
        sys.exit(1)


if __name__ == "__main__":
    main()
