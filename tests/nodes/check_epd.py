#!/usr/bin/env python3
"""E/P/D across processes (examples/epd_3nodes.lua): an encoder node
(vision_encoder actor), the head (router, prefill, KV store) and a decode
node, real processes on loopback with ports 0. Image and text requests, half
greedy and half sampled (fixed seeds), give the one-process run's tokens and
logits (`cleave generate --requests`, mono; each token's `logits_hash`); each
image request's embeddings came from the encoder node (its stages name it) as
Cap'n Proto messages; kill -9 of the encoder node while it holds requests
(the router's encode_replacements > 0): those fail unavailable naming the
encoder, the rest keep the one-process tokens and logits, none hangs; kill -9
of one of two encoder nodes (tests/nodes/epd_cluster.lua) while it holds
requests: they are re-placed on the other and every request has the
one-process tokens and logits.

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
    """A `cleave node` process of epd_3nodes.lua (or another topology) with the test LM and mmproj."""

    def __init__(self, name, args, tag, topology=TOPOLOGY):
        super().__init__([CLEAVE, "node", "--topology", topology, "--name", name, "-m", LM,
                          "--mmproj", MMPROJ, "-t", "1", *args], os.path.join(WORK, f"{tag}{name}.err"))


def read_results(path):
    try:
        with open(path) as f:
            return {j["id"]: j for j in (json.loads(l) for l in f if l.strip())}
    except (OSError, ValueError):
        return {}


def cluster(tag, req_path, out_path, decoders, encoders=("encoder",), topology=TOPOLOGY):
    """Head first (it prints its port), then the encoder and decode nodes."""
    sets = ["--set", f"decoders={decoders}"]
    if topology != TOPOLOGY:  # the example has one encoder node and no such parameter
        sets += ["--set", f"encoders={len(encoders)}"]
    head = Node("prefill", ["--requests", req_path, "--out", out_path,
                            "--wait-stages", str(1 + len(encoders) + decoders), *sets], tag, topology)
    m = head.wait_line(r"cleave node head listening on ([0-9.]+):(\d+)")
    expect(tag + "head prints its port", m is not None, head.stderr())
    port = m.group(2) if m else "1"
    sets += ["--set", f"prefill_port={port}", "--join-timeout", "20"]
    encs = [Node(e, sets, tag, topology) for e in encoders]
    decode = Node("decode", sets, tag, topology)
    return head, encs, decode


def cluster_with_frozen_encoder(tag, out_path, encoders, topology=TOPOLOGY):
    """The head, then the decode node and every encoder but the first, then
    the first encoder (the victim): the head submits as soon as the victim
    has joined (it is the last stage), and the victim is frozen (SIGSTOP) the
    moment it has joined, so whatever the router sends it stays in flight,
    however fast it would encode. Killed (SIGKILL) once the head has
    submitted: well within the heartbeat timeout (500 ms) that would drop it
    anyway. Then waits for the head (a hang fails) and returns the results,
    the router's stats and the seconds from the kill to the head's exit."""
    label = tag.rstrip("_") + ": "
    sets = ["--set", "decoders=1"]
    if topology != TOPOLOGY:
        sets += ["--set", f"encoders={len(encoders)}"]
    head = Node("prefill", ["--requests", req_path, "--out", out_path,
                            "--wait-stages", str(2 + len(encoders)), *sets], tag, topology)
    m = head.wait_line(r"cleave node head listening on ([0-9.]+):(\d+)")
    expect(label + "head prints its port", m is not None, head.stderr())
    sets += ["--set", f"prefill_port={m.group(2) if m else '1'}", "--join-timeout", "20"]
    for name in ["decode", *encoders[1:]]:
        n = Node(name, sets, tag, topology)
        expect(f"{label}{name} joins", n.wait_line(r"joined", timeout=60) is not None, n.stderr())
    victim = Node(encoders[0], sets, tag, topology)
    joined = victim.wait_line(r"joined", timeout=60)
    victim.freeze()
    expect(f"{label}{encoders[0]} joins", joined is not None, victim.stderr())
    submitted = head.wait_line(r"submitted", timeout=5) is not None
    time.sleep(0.05)
    victim.proc.send_signal(signal.SIGKILL)
    t_kill = time.time()
    expect(f"{label}the head submitted while {encoders[0]} was frozen", submitted, head.stderr()[-2000:])
    rc = head.wait(120)
    t_done = time.time()
    herr = head.stderr()
    results = read_results(out_path)
    expect(f"{label}after kill -9 of {encoders[0]} the head finishes every request (no hang)",
           rc == 0 and len(results) == len(requests), f"rc={rc} {herr[-2000:]}")
    return results, stats_of(herr, "router"), t_done - t_kill


def stats_of(err, actor):
    m = re.search(r"stats " + re.escape(actor) + r" (.*)", err)
    return {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())} if m else {}


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
expect("one process answers every request, with a logits hash per token",
       p.returncode == 0 and len(mono) == len(requests) and
       all("error" not in r and len(r["logits_hash"]) == len(r["tokens"]) > 0 for r in mono.values()),
       p.stderr)

def same_as_mono(r):
    """Finished, with the one-process tokens and logits hash for every token."""
    m = mono.get(r.get("id"), {})
    return ("error" not in r and r.get("tokens") == m.get("tokens") and
            r.get("logits_hash") == m.get("logits_hash"))


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
    head, (encoder,), decode = cluster("epd_", req_path, out, 1)
    rc = head.wait(240)
    herr = head.stderr()
    results = read_results(out)
    expect("E/P/D head runs every request and exits 0", rc == 0 and len(results) == len(requests),
           f"rc={rc} results={len(results)} {herr}")
    wrong = [i for i, r in results.items() if not same_as_mono(r)]
    expect(f"E/P/D over 3 processes gives the one-process tokens and logits for {len(requests)} requests",
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

    # ---- kill -9 of the only encoder node: what it held fails, clearly --------------
    # (the same ids: a request's id keys its sampling). The encoder is frozen
    # from the moment it joins, so it surely holds requests when it dies (the
    # router counts them: encode_replacements).
    out = os.path.join(WORK, "kill.jsonl")
    results, router, done_s = cluster_with_frozen_encoder("kill_", out, ["encoder"])
    expect("work was in flight at the encoder when it died: the router re-placed what it held",
           router.get("encoder_downs") == 1 and router.get("encode_replacements", 0) > 0, router)
    same = sum(1 for r in requests if same_as_mono(results.get(r["id"], {"error": 1})))
    failed = [results[r["id"]]["error"] for r in requests if "error" in results.get(r["id"], {})]
    expect("every request has the one-process tokens and logits or fails unavailable naming the encoder; "
           "each re-placed one failed (no encoder left)",
           same + len(failed) == len(requests) and len(failed) >= router.get("encode_replacements", 0) and
           all("unavailable" in e and "vision_encoder" in e for e in failed), failed[:3])
    expect("text requests are unaffected",
           all("error" not in results.get(r["id"], {}) for r in requests if "images" not in r))
    print(f"     encoder killed: {router.get('encode_replacements')} requests at it, {same} identical, "
          f"{len(failed)} failed unavailable, head done {done_s:.2f} s after the kill")
    stop_all()

    # ---- kill -9 of one of two encoder nodes: its requests finish on the other ----
    out = os.path.join(WORK, "kill2.jsonl")
    results, router, done_s = cluster_with_frozen_encoder(
        "kill2_", out, ["e0", "e1"],
        topology=os.path.join(os.path.dirname(os.path.abspath(__file__)), "epd_cluster.lua"))
    moved = router.get("encode_replacements", 0)
    expect("kill one of two encoders: e0 held requests when it died and the router re-placed them",
           router.get("encoder_downs") == 1 and moved > 0 and
           router.get("encodes") == len(with_images) + moved, router)
    wrong = [i for i, r in results.items() if not same_as_mono(r)]
    expect("kill one of two encoders: every request finishes with the one-process tokens and logits "
           "(e1 lives)",
           not wrong and len(results) == len(requests),
           f"differ or failed: {[(i, results[i].get('error')) for i in wrong[:5]]}")
    def encoded_on(node):
        return sum(1 for r in with_images
                   if any(k.startswith(node + "/vision_encoder/") for k in results.get(r["id"], {}).get("stages", {})))
    on_e0, on_e1 = encoded_on("e0"), encoded_on("e1")
    expect("kill one of two encoders: e1 encoded the requests e0 held, e0 none of them",
           on_e0 + on_e1 == len(with_images) and on_e0 <= len(with_images) - moved and on_e1 >= moved,
           f"e0 {on_e0}, e1 {on_e1}, re-placed {moved}")
    print(f"     e0 killed: {moved} requests re-placed on e1 (e0 encoded {on_e0}, e1 {on_e1}), "
          f"head done {done_s:.2f} s after the kill")
finally:
    stop_all()

if failures:
    print(f"{len(failures)} checks failed: {failures}")
    sys.exit(1)
print("all E/P/D node checks passed")
