#!/usr/bin/env python3
"""E/P/D across processes (examples/epd_3nodes.lua): an encoder node
(vision_encoder actor), the head (router, prefill, KV store) and a decode
node, real processes on loopback with ports 0. Image and text requests give
the one-process run's tokens (`cleave generate --requests`, mono); each image
request's embeddings came from the encoder node (its stages name it) as
Cap'n Proto messages; kill -9 of the encoder node: image requests still
queued fail with a clear error, none hangs.

usage: check_epd.py CLEAVE CLIP_DUMP VOCAB WORKDIR"""
import json
import os
import re
import signal
import subprocess
import sys
import time

CLEAVE, CLIP_DUMP, VOCAB, WORK = sys.argv[1:5]
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TOPOLOGY = os.path.join(ROOT, "examples", "epd_3nodes.lua")
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import numpy as np  # noqa: E402
from reference_clip import write_png  # noqa: E402
from node_process import NodeProcess, expect, failures, stop_all  # noqa: E402

os.makedirs(WORK, exist_ok=True)


class Node(NodeProcess):
    """A `cleave node` process of epd_3nodes.lua with the test LM and mmproj."""

    def __init__(self, name, args, tag):
        super().__init__([CLEAVE, "node", "--topology", TOPOLOGY, "--name", name, "-m", LM,
                          "--mmproj", MMPROJ, "-t", "1", *args], os.path.join(WORK, f"{tag}{name}.err"))


def read_results(path):
    try:
        with open(path) as f:
            return {j["id"]: j for j in (json.loads(l) for l in f if l.strip())}
    except (OSError, ValueError):
        return {}


def cluster(tag, req_path, out_path, decoders):
    """Head first (it prints its port), then the encoder and decode nodes."""
    head = Node("prefill", ["--requests", req_path, "--out", out_path,
                            "--wait-stages", str(2 + decoders), "--set", f"decoders={decoders}"], tag)
    m = head.wait_line(r"cleave node head listening on ([0-9.]+):(\d+)")
    expect(tag + "head prints its port", m is not None, head.stderr())
    port = m.group(2) if m else "1"
    sets = ["--set", f"prefill_port={port}", "--set", f"decoders={decoders}", "--join-timeout", "20"]
    encoder = Node("encoder", sets, tag)
    decode = Node("decode", sets, tag)
    return head, encoder, decode


# ---- models, images, requests and the one-process answers ---------------------
LM = os.path.join(WORK, "lm.gguf")
MMPROJ = os.path.join(WORK, "mmproj.gguf")
p = subprocess.run([CLEAVE, "make-model", "--out", LM, "--vocab", VOCAB, "--dim", "64", "--layers", "2",
                    "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--ctx", "256", "--type", "f32"],
                   capture_output=True, text=True, timeout=120)
expect("make-model", p.returncode == 0, p.stderr)
p = subprocess.run([CLIP_DUMP, "make", MMPROJ, "f32", "5", "proj=64"], capture_output=True, text=True)
expect("clip_dump writes the mmproj", p.returncode == 0, p.stderr)

rng = np.random.default_rng(11)
pngs = []
for k in range(6):  # 32x32 and other sizes: the encoder resizes
    h, w = (32, 32) if k % 2 == 0 else (24 + 4 * k, 40 - 2 * k)
    path = os.path.join(WORK, f"img{k}.png")
    write_png(path, rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
    pngs.append(path)
words = ["what", "shape", "is", "red", "how", "many", "circles", "left", "blue", "describe"]
requests = []
for i in range(48):
    text = " ".join(words[(i * 3 + k) % len(words)] for k in range(2 + i % 5))
    r = {"id": 100 + i, "max_tokens": 4 + i % 9, "ignore_eos": True,
         "temperature": 0.0 if i % 2 == 0 else 0.8, "seed": 7 + i, "top_k": 20}
    if i % 4 == 3:
        r["prompt"] = text  # text only
    else:
        r["prompt"] = ("<image> " + text) if i % 3 else text  # else: the image goes first
        r["images"] = [pngs[i % len(pngs)]]  # images repeat: the encoder's cache serves them
    requests.append(r)
req_path = os.path.join(WORK, "requests.jsonl")
with open(req_path, "w") as f:
    for r in requests:
        f.write(json.dumps(r) + "\n")

ref_path = os.path.join(WORK, "mono.jsonl")
p = subprocess.run([CLEAVE, "generate", "-m", LM, "--mmproj", MMPROJ, "--requests", req_path, "--out",
                    ref_path, "-t", "1"], capture_output=True, text=True, timeout=300)
mono = read_results(ref_path)
expect("one process answers every request", p.returncode == 0 and len(mono) == len(requests) and
       all("error" not in r for r in mono.values()), p.stderr)

def one_line_error(name, args, *needles):
    p = subprocess.run([CLEAVE, "node", "--topology", TOPOLOGY, "-m", LM, *args], capture_output=True,
                       text=True, timeout=60)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    expect(name, p.returncode == 1 and len(lines) == 1 and all(n in p.stderr for n in needles),
           f"rc={p.returncode} stderr={p.stderr!r}")


try:
    # ---- bad input: one line naming the problem ---------------------------------
    one_line_error("an encoder node without --mmproj",
                   ["--name", "encoder", "--set", "prefill_port=1"], "vision_encoder", "--mmproj")
    one_line_error("image requests on a head without --mmproj",
                   ["--name", "prefill", "--requests", req_path, "--out", req_path + ".out"],
                   "requests.jsonl:1", "\"images\" need a vision encoder (--mmproj)")

    # ---- E/P/D on 3 processes gives the one-process tokens ----------------------
    out = os.path.join(WORK, "epd.jsonl")
    head, encoder, decode = cluster("epd_", req_path, out, 1)
    rc = head.wait(240)
    herr = head.stderr()
    results = read_results(out)
    expect("E/P/D head runs every request and exits 0", rc == 0 and len(results) == len(requests),
           f"rc={rc} results={len(results)} {herr}")
    wrong = [i for i, r in results.items() if "error" in r or r.get("tokens") != mono.get(i, {}).get("tokens")]
    expect(f"E/P/D over 3 processes gives the one-process tokens for {len(requests)} requests",
           not wrong and len(results) == len(requests), f"differ: {wrong[:10]}")
    with_images = [r for r in requests if "images" in r]
    expect("each image request was encoded on the encoder node, prefilled on the head, decoded on "
           "the decode node",
           all(any(k.startswith("encoder/vision_encoder/") for k in results.get(r["id"], {}).get("stages", {}))
               and any(k.startswith("prefill/prefill/") for k in results[r["id"]]["stages"])
               and any(k.startswith("decode/decode/") for k in results[r["id"]]["stages"])
               for r in with_images),
           [results.get(r["id"], {}).get("stages") for r in with_images[:2]])
    expect("text requests skip the encoder",
           not any(k.startswith("encoder/") for r in requests if "images" not in r
                   for k in results.get(r["id"], {}).get("stages", {})))
    m = re.search(r"stats router .*\bencodes=(\d+)", herr)
    expect("the router sent each image request to the encoder once",
           m is not None and int(m.group(1)) == len(with_images), herr[-2000:])
    for n in (encoder, decode):
        n.proc.send_signal(signal.SIGTERM)
        expect("worker exits after SIGTERM", n.wait(15) is not None)
    stop_all()

    # ---- kill -9 of the encoder node: no hang, clear errors or the same tokens ---
    # (the same ids: a request's id keys its sampling)
    slow, slow_path = requests, req_path
    out = os.path.join(WORK, "kill.jsonl")
    head, encoder, decode = cluster("kill_", slow_path, out, 1)
    head.wait_line(r"submitted", timeout=60)
    encoder.proc.send_signal(signal.SIGKILL)
    t_kill = time.time()
    rc = head.wait(120)
    results = read_results(out)
    expect("after kill -9 of the encoder node the head finishes every request (no hang)",
           rc == 0 and len(results) == len(slow), f"rc={rc} {head.stderr()[-2000:]}")
    same = sum(1 for r in slow if "error" not in results.get(r["id"], {"error": 1}) and
               results[r["id"]]["tokens"] == mono[r["id"]]["tokens"])
    failed = [results[r["id"]]["error"] for r in slow if "error" in results.get(r["id"], {})]
    expect("every request has the one-process tokens or fails unavailable naming the encoder",
           same + len(failed) == len(slow) and
           all("unavailable" in e and "vision_encoder" in e for e in failed), failed[:3])
    expect("text requests are unaffected",
           all("error" not in results.get(r["id"], {}) for r in slow if "images" not in r))
    print(f"     encoder killed: {same} identical, {len(failed)} failed unavailable, "
          f"head done {time.time() - t_kill:.2f} s after the kill")
finally:
    stop_all()

if failures:
    print(f"{len(failures)} checks failed: {failures}")
    sys.exit(1)
print("all E/P/D node checks passed")
