#!/usr/bin/env python3
"""Vision encoders in a cluster of several models (tests/nodes/models_vision.lua),
real processes on loopback: the shapes VLM's dense and MoE language models,
each with a colocated node and a vision encoder node of its own, the
model's encoder named by node{}.mmproj. Chat requests with images (and text
ones) for both models, interleaved, answer exactly as each model's own
`cleave serve --mmproj` does (text, logprobs, finish reason); each model's
images are encoded by its own encoder node only (the encoder nodes' and
the routers' counters), and each model's router places its own requests.
The script checks that refuse what would mix encoders or leave a model's
encoder unnamed, and a node whose --mmproj disagrees with its model's
node{}.mmproj, fail with one line naming the node.

usage: check_models_vision.py CLEAVE SHAPES_DIR WORKDIR"""
import base64
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CLEAVE, SHAPES, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
TOPOLOGY = os.path.join(HERE, "models_vision.lua")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "models", "shapes"))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import shapes_data as D  # noqa: E402
from node_process import NodeProcess, expect, failures, post_chat, stats_of, stop_all, wait_until  # noqa: E402
from reference_clip import write_png  # noqa: E402

DENSE = os.path.join(SHAPES, "shapes-lm-f32.gguf")
MOE = os.path.join(SHAPES, "shapes-lm-moe-f32.gguf")
MMPROJ = os.path.join(SHAPES, "shapes-mmproj-f32.gguf")
NAME_D, NAME_M = "shapes-lm-f32", "shapes-lm-moe-f32"  # the served names: the files' stems
SETS = ["--set", f"dense={DENSE}", "--set", f"moe={MOE}", "--set", f"mmproj={MMPROJ}"]
os.makedirs(WORK, exist_ok=True)

# Images the training never saw (seed 9311), as data URLs.
rng = np.random.default_rng(9311)
IMAGES = []
for i in range(5):
    img, _ = D.make_sample(rng)
    path = os.path.join(WORK, f"img{i}.png")
    write_png(path, img)
    with open(path, "rb") as f:
        IMAGES.append("data:image/png;base64," + base64.b64encode(f.read()).decode())
QUESTIONS = ["describe", "how many shapes", "how many red shapes"]


def bodies_for(model):
    out = []
    for i, url in enumerate(IMAGES):
        q = QUESTIONS[i % len(QUESTIONS)]
        out.append({"model": model, "max_tokens": 12, "temperature": 0, "logprobs": True,
                    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                              {"type": "text", "text": q}]}]})
    # A text request and a sampled image request.
    out.append({"model": model, "max_tokens": 8, "temperature": 0, "logprobs": True,
                "messages": [{"role": "user", "content": "describe"}]})
    out.append({"model": model, "max_tokens": 10, "temperature": 0.9, "seed": 7, "logprobs": True,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGES[0]}},
                                                          {"type": "text", "text": "describe"}]}]})
    return out


def mono(lm, bodies, tag):
    p = NodeProcess([CLEAVE, "serve", "-m", lm, "--mmproj", MMPROJ, "--port", "0", "-t", "1"],
                    os.path.join(WORK, f"mono_{tag}.err"))
    m = p.wait_line(r"listening on (http://[0-9.]+:\d+)", 60)
    expect(f"mono serve of {tag} starts", m is not None, p.stderr()[-2000:])
    answers = [post_chat(m.group(1), b) for b in bodies] if m else []
    p.proc.send_signal(signal.SIGTERM)
    p.wait(30)
    stop_all()
    return answers


def topology_check(script, *extra):
    path = os.path.join(WORK, "bad.lua")
    with open(path, "w") as f:
        f.write(script)
    return subprocess.run([CLEAVE, "topology", "check", path, *extra], capture_output=True, text=True, timeout=60)


try:
    want_d = mono(DENSE, bodies_for(NAME_D), "dense")
    want_m = mono(MOE, bodies_for(NAME_M), "moe")
    print("dense answers:", [a.get("text") for a in want_d])
    print("MoE answers:", [a.get("text") for a in want_m])
    expect("mono answered every request of both models",
           all("error" not in a for a in want_d + want_m), (want_d[:1], want_m[:1]))
    expect("the two models answer differently somewhere", want_d != want_m)

    common = ["--topology", TOPOLOGY, *SETS, "-t", "1"]
    head = NodeProcess([CLEAVE, "node", *common, "--name", "head", "--http-port", "0"],
                       os.path.join(WORK, "head.err"))
    m = head.wait_line(r"listening on ([0-9.]+):(\d+)")
    expect("head prints its port", m is not None, head.stderr())
    port = m.group(2) if m else "1"
    url = head.wait_line(r"listening on (http://[0-9.]+:\d+) \(models ([^)]*)\)", 30)
    expect("head serves HTTP for both models", url is not None and url.group(2) == f"{NAME_D}, {NAME_M}",
           (url.group(0) if url else None, head.stderr()[-1500:]))
    base = url.group(1) if url else "http://127.0.0.1:1"
    nodes = {n: NodeProcess([CLEAVE, "node", *common, "--name", n, "--set", f"head_port={port}",
                             "--join-timeout", "20", "--no-rejoin"], os.path.join(WORK, n + ".err"))
             for n in ("d0", "de", "m0", "me")}
    expect("every node joined", wait_until(lambda: all(f"node {n} joined" in head.stderr() for n in nodes), 60),
           head.stderr()[-1500:])
    time.sleep(1.0)  # their stages and encoders attach after the join

    dense_b, moe_b = bodies_for(NAME_D), bodies_for(NAME_M)
    bodies = [x for pair in zip(dense_b, moe_b) for x in pair]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: post_chat(base, b), bodies))
    got_d, got_m = answers[0::2], answers[1::2]
    head.proc.send_signal(signal.SIGTERM)
    head.wait(60)
    for n in nodes:
        nodes[n].wait(30)
    stop_all()

    for name, got, want in (("dense", got_d, want_d), ("MoE", got_m, want_m)):
        differ = [i for i in range(len(want)) if got[i] != want[i]]
        expect(f"every {name} answer equals its own `cleave serve --mmproj`", not differ,
               [(i, got[i], want[i]) for i in differ[:2]])
    # Per model: 6 image requests (the sampled one repeats image 0, a cache hit), 5 distinct images.
    n_image_req, n_images = len(IMAGES) + 1, len(IMAGES)
    de = stats_of(nodes["de"].stderr(), "de/vision_encoder/0")
    me = stats_of(nodes["me"].stderr(), "me/vision_encoder/0")
    print(f"encoders: de {de}, me {me}")
    expect("each model's encoder node encoded that model's images, none failed",
           all(e.get("requests") == n_image_req and e.get("cache_misses") == n_images and e.get("failures", 1) == 0
               for e in (de, me)), (de, me))
    err = head.stderr()
    rd, rm = stats_of(err, "router"), stats_of(err, f"model:{MOE}/router")
    print(f"routers: dense {rd}, moe {rm}")
    n_req = len(dense_b)
    expect("each model's router placed its own requests and images, none failed",
           all(r.get("finished") == n_req and r.get("encodes") == n_image_req and r.get("failures", 1) == 0 and
               r.get("alive_vision_encoder") == 1 for r in (rd, rm)), (rd, rm))
    d0 = stats_of(nodes["d0"].stderr(), "d0/colocated/0").get("requests", -1)
    m0 = stats_of(nodes["m0"].stderr(), "m0/colocated/0").get("requests", -1)
    expect("each model's requests ran on its own node", d0 == n_req and m0 == n_req, (d0, m0))

    # Refusals: one encoder per model, a model's encoder named with several
    # models, --mmproj against the script.
    two = ('node { name = "h", head = true, model = "a.gguf", mmproj = "x.gguf", actors = { colocated = 1 } }\n'
           'node { name = "e1", model = "a.gguf", mmproj = "y.gguf", actors = { vision_encoder = 1 } }\n')
    p = topology_check(two)
    expect("two mmproj files for one model are refused naming the node",
           p.returncode != 0 and "node 'e1': mmproj 'y.gguf' differs from 'x.gguf'" in p.stderr, p.stderr)
    unnamed = ('node { name = "h", head = true, model = "a.gguf", actors = { colocated = 1 } }\n'
               'node { name = "b0", model = "b.gguf", actors = { colocated = 1, vision_encoder = 1 } }\n')
    p = topology_check(unnamed)
    expect("an encoder of several models' cluster without its model's mmproj is refused",
           p.returncode != 0 and "node 'b0' hosts vision_encoder actors" in p.stderr and "node{}.mmproj" in p.stderr,
           p.stderr)
    p = subprocess.run([CLEAVE, "node", *common, "--name", "me", "--mmproj", DENSE, "--set", "head_port=1"],
                       capture_output=True, text=True, timeout=60)
    expect("--mmproj that disagrees with the model's node{}.mmproj is refused",
           p.returncode == 2 and "--mmproj" in p.stderr and "drop --mmproj" in p.stderr, (p.returncode, p.stderr))
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all several-models vision checks passed")
sys.exit(1 if failures else 0)
