#!/usr/bin/env python3
"""Several models, each with a KV pool of its own (tests/nodes/models_pool.lua),
real processes on loopback: alpha on a0 and a1, beta on b0 and b1, every
worker with a kv_store in its model's pool, round-robin placement. Both
models get the same prompts, which share two long prefixes, one request at
a time: the second request of a prefix lands on the other node of its model,
whose store fetches the prefix from its peer instead of computing it. Each
model's directory counts a pool of its own (3 stores, not 5). Every
answer equals that model's own `cleave serve` process; each model's stores
fetched blocks, and only from their own model's stores (what a model's
stores fetched equals what that model's stores served).

usage: check_models_pool.py CLEAVE VOCAB WORKDIR"""
import os
import signal
import sys
import time

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "models_pool.lua")
sys.path.insert(0, HERE)
from node_process import (NodeProcess, expect, failures, make_two_models, mono_answers, run_clients,  # noqa: E402
                          stats_of, stop_all, wait_until, start_two_model_head, expect_same_answers)

MODEL_A, MODEL_B, SETS = make_two_models(CLEAVE, VOCAB, WORK)
PREFIX_BLOCKS = 4  # 64 tokens, blocks of 16


def bodies(model):
    out = []
    for i in range(8):
        prefix = [1] + [300 + (41 * ((i // 2) % 2) + 13 * j) % 3000 for j in range(16 * PREFIX_BLOCKS - 1)]
        tail = [900 + (17 * i + j) % 1000 for j in range(3 + i)]
        body = {"model": model, "prompt": prefix + tail, "max_tokens": 5, "logprobs": 1, "ignore_eos": True}
        body.update(temperature=0.8, seed=i) if i % 2 else body.update(temperature=0)
        out.append(body)
    return out


A, B = bodies("alpha"), bodies("beta")
try:
    want_a = mono_answers(CLEAVE, MODEL_A, A, os.path.join(WORK, "mono_a.err"))
    want_b = mono_answers(CLEAVE, MODEL_B, B, os.path.join(WORK, "mono_b.err"))
    expect("mono answered every request of both models",
           all("error" not in a for a in want_a + want_b) and len(want_a + want_b) == 16, (want_a[:1], want_b[:1]))

    common = ["--topology", TOPOLOGY, *SETS, "-t", "1"]
    p = NodeProcess([CLEAVE, "topology", "check", TOPOLOGY, *SETS], os.path.join(WORK, "check.err"))
    expect("`cleave topology check` accepts a pool per model", p.wait(60) == 0, p.stderr()[-800:])
    head, port, base = start_two_model_head([CLEAVE, "node", *common, "--name", "head", "--http-port", "0"],
                                            os.path.join(WORK, "head.err"))
    names = ("a0", "a1", "b0", "b1")
    nodes = {}
    for i, n in enumerate(names):
        nodes[n] = NodeProcess([CLEAVE, "node", *common, "--name", n, "--set", f"head_port={port}",
                                "--join-timeout", "20", "--no-rejoin"], os.path.join(WORK, n + ".err"))
        ok = wait_until(lambda: head.stderr().count("joined the pool") >= i + 1, 30)
        expect(f"{n}'s store joined its model's pool", ok, head.stderr()[-1000:])
    expect("every node joined", wait_until(lambda: all(f"node {n} joined" in head.stderr() for n in names), 60),
           head.stderr()[-1500:])
    time.sleep(0.5)  # their stages attach after the join
    # One at a time, alpha and beta interleaved: round robin alternates each
    # model's two nodes, so a prefix's second request runs on the node that
    # did not compute it.
    answers = run_clients(base, [x for pair in zip(A, B) for x in pair], 1)
    got_a, got_b = answers[0::2], answers[1::2]
    head.proc.send_signal(signal.SIGTERM)
    head.wait(60)
    for n in names:
        nodes[n].wait(30)
    stop_all()

    expect_same_answers("every alpha answer equals alpha's own server", got_a, want_a)
    expect_same_answers("every beta answer equals beta's own server", got_b, want_b)
    # Each model's directory counts its own pool: the head's store of that
    # model and its two workers' (a shared pool would have counted to 5).
    joins = [l for l in head.stderr().splitlines() if "joined the pool" in l]
    expect("two pools of 3 stores each (the head's store per model and that model's two workers)",
           sum("(2 stores)" in l for l in joins) == 2 and sum("(3 stores)" in l for l in joins) == 2 and
           len(joins) == 4, joins)
    store = {n: stats_of(nodes[n].stderr(), "kv_store") for n in names}
    for model, pair in (("alpha", ("a0", "a1")), ("beta", ("b0", "b1"))):
        fetched = sum(store[n].get("pool_blocks_fetched", 0) for n in pair)
        served = sum(store[n].get("peer_blocks_served", 0) for n in pair)
        corrupt = sum(store[n].get("pool_blocks_corrupt", 0) for n in pair)
        print(f"{model}: stores fetched {fetched} blocks, served {served}")
        expect(f"{model}: its stores fetched prefix blocks from each other, none corrupt",
               fetched >= PREFIX_BLOCKS and corrupt == 0, {n: store[n] for n in pair})
        expect(f"{model}: what its stores fetched, its own stores served (the pools stay apart)",
               fetched == served, {n: store[n] for n in pair})
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all model pool checks passed")
sys.exit(1 if failures else 0)
