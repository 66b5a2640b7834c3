#!/usr/bin/env python3
"""Several models in one cluster (tests/nodes/models.lua), real processes on
loopback: the head serves model alpha (colocated on a0) and model beta (P/D
on bp and bd0, with bd1 joining under load and then drained). Each request
goes to the model its "model" field names, and every answer equals that
model's own `cleave serve` process (text, logprobs, finish reason) though
both models see the same prompts; /v1/models lists both; a request without a
model goes to the head's (alpha); an unknown one is 404 model_not_found;
draining bd1 moves beta's requests to bd0 without a failure; the beta router
counts its own requests and decoders. Flags that name one model are refused.

usage: check_models.py CLEAVE VOCAB WORKDIR"""
import json
import signal
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "models.lua")
sys.path.insert(0, HERE)
from node_process import (NodeProcess, expect, failures, make_two_models, mono_answers, post_completion,  # noqa: E402
                          random_completions, run_clients, stats_of, stop_all, wait_until, start_two_model_head, expect_same_answers)

MODEL_A, MODEL_B, SETS = make_two_models(CLEAVE, VOCAB, WORK)
N = 24
# The same prompts for both models: their caches must stay apart.
A = random_completions(31, N, "alpha", (8, 40), (8, 24))
B = [dict(b, model="beta") for b in A]


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def node_cmd(*extra, timeout=60):
    return subprocess.run([CLEAVE, "node", "--topology", TOPOLOGY, *SETS, *extra], capture_output=True, text=True,
                          timeout=timeout)


try:
    want_a = mono_answers(CLEAVE, MODEL_A, A, os.path.join(WORK, "mono_a.err"))
    want_b = mono_answers(CLEAVE, MODEL_B, B, os.path.join(WORK, "mono_b.err"))
    expect("mono answered every request of both models",
           all("error" not in a for a in want_a + want_b) and len(want_a + want_b) == 2 * N, (want_a[:1], want_b[:1]))
    expect("the two models answer the same prompts differently", want_a != want_b)

    common = ["--topology", TOPOLOGY, *SETS, "-t", "1"]
    head, port, base = start_two_model_head([CLEAVE, "node", *common, "--name", "head", "--http-port", "0"],
                                            os.path.join(WORK, "head.err"))

    def worker(name):
        return NodeProcess([CLEAVE, "node", *common, "--name", name, "--set", f"head_port={port}",
                            "--join-timeout", "20", "--no-rejoin"], os.path.join(WORK, name + ".err"))

    def joined(*names):
        return wait_until(lambda: all(f"node {n} joined" in head.stderr() for n in names), 60)

    nodes = {n: worker(n) for n in ("a0", "bp", "bd0")}
    expect("a0, bp and bd0 joined", joined("a0", "bp", "bd0"), head.stderr()[-1500:])
    time.sleep(0.5)  # their stages attach after the join

    status, models = get(base + "/v1/models")
    expect("/v1/models lists alpha then beta",
           status == 200 and [c["id"] for c in models.get("data", [])] == ["alpha", "beta"], (status, models))
    bad = post_completion(base, dict(A[0], model="gamma"))
    expect("an unknown model is refused with 404", "error" in bad and "404" in bad["error"], bad)
    plain = dict(A[1])
    del plain["model"]
    expect("a request without a model goes to the head's model (alpha)", post_completion(base, plain) == want_a[1])

    rc = {}

    def scale(done):
        # beta's decoders 1 -> 2 -> 1 under load; alpha keeps its one node.
        wait_until(lambda: done[0] >= N // 3, 120)
        nodes["bd1"] = worker("bd1")
        joined("bd1")
        wait_until(lambda: done[0] >= N, 120)
        d = subprocess.run([CLEAVE, "node", "drain", "bd1", "--topology", TOPOLOGY, *SETS, "--set",
                            f"head_port={port}", "--timeout", "60"], capture_output=True, text=True, timeout=90)
        expect("`cleave node drain bd1` drains beta's second decoder",
               d.returncode == 0 and "node bd1 drained" in d.stdout, (d.returncode, d.stdout, d.stderr))
        rc["bd1"] = nodes["bd1"].wait(60)
    # Interleaved: alpha, beta, alpha, ...
    bodies = [x for pair in zip(A, B) for x in pair]
    answers = run_clients(base, bodies, 4, scale)
    got_a, got_b = answers[0::2], answers[1::2]
    head.proc.send_signal(signal.SIGTERM)
    head.wait(60)
    for n in ("a0", "bp", "bd0"):
        nodes[n].wait(30)
    stop_all()

    expect_same_answers("every alpha answer equals alpha's own server", got_a, want_a)
    expect_same_answers("every beta answer equals beta's own server", got_b, want_b)
    expect("bd1 exits 0 once drained", rc.get("bd1") == 0 and "drained by the head" in nodes["bd1"].stderr(),
           (rc.get("bd1"), nodes["bd1"].stderr()[-800:]))
    err = head.stderr()
    ra = stats_of(err, "router")
    rb = stats_of(err, f"model:{MODEL_B}/router")
    print(f"alpha router: {ra.get('finished')} finished; beta router: {rb.get('finished')} finished, "
          f"drained_stages {rb.get('drained_stages')}, migrated {rb.get('migrated')}")
    # alpha: the N interleaved ones and the one without a model.
    expect("each model's router served its own requests, none failed",
           ra.get("finished") == N + 1 and rb.get("finished") == N and ra.get("failures", 1) == 0 and
           rb.get("failures", 1) == 0, (ra, rb))
    expect("the drain happened on beta's router only", rb.get("drained_stages") == 1 and
           ra.get("drained_stages", 0) == 0, (ra, rb))
    a0 = stats_of(nodes["a0"].stderr(), "a0/colocated/0").get("requests", -1)
    expect("alpha's requests all ran on a0", a0 == N + 1, a0)

    # Flags that name one model, and a node whose -m disagrees with its script model.
    p = node_cmd("--name", "head", "--http-port", "0", "--alias", "x")
    expect("--alias on a head of several models is refused", p.returncode == 2 and "--alias" in p.stderr and
           "this cluster serves 2" in p.stderr, (p.returncode, p.stderr))
    p = node_cmd("--name", "a0", "-m", MODEL_B, "--set", "head_port=1")
    expect("-m that disagrees with the node's model is refused", p.returncode == 2 and
           "serves model" in p.stderr and "drop -m" in p.stderr, (p.returncode, p.stderr))
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all several-models node checks passed")
sys.exit(1 if failures else 0)
