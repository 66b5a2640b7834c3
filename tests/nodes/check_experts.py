#!/usr/bin/env python3
"""Attention/FFN disaggregation across processes (examples/experts_3nodes.lua):
the head "attn" (router, KV store, attention actors) and two expert nodes
"ex0" and "ex1", real processes on loopback. 120 mixed greedy and sampled
requests give the one-process run's tokens, text and per-step logits hashes
(`cleave generate --requests`, mono), with every expert row computed on the
expert nodes (none by the attention actor's fallback): half the experts on
each node, then every expert on both (replicas, with 2 micro-batches); then kill -9 of ex0 under
load with replicas: every request still finishes with the mono bits; then
SIGSTOP of an expert node under load, with replicas (the other takes over)
and without (the attention actor computes its experts itself).

usage: check_experts.py CLEAVE VOCAB WORKDIR"""
import json
import os
import re
import signal
import subprocess
import sys
import time

CLEAVE, VOCAB, WORK = sys.argv[1:4]
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TOPOLOGY = os.path.join(ROOT, "examples", "experts_3nodes.lua")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from node_process import NodeProcess, expect, failures, mono_results, results, stats_of, stop_all  # noqa: E402

os.makedirs(WORK, exist_ok=True)
MODEL = os.path.join(WORK, "moe.gguf")
p = subprocess.run([CLEAVE, "make-model", "--out", MODEL, "--vocab", VOCAB, "--dim", "64", "--layers", "3",
                    "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--experts", "8", "--experts-used", "2",
                    "--ctx", "256", "--router-skew", "4"], capture_output=True, text=True, timeout=120)
expect("make-model", p.returncode == 0, p.stderr)


def write_requests(path, n, max_tokens):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "prompt_ids": [1] + [300 + 7 * j + i for j in range(3 + i % 40)],
                                "max_tokens": max_tokens, "temperature": 0 if i % 2 else 0.9, "seed": i,
                                "repeat_penalty": 1.1 if i % 3 == 0 else 1.0}) + "\n")


def mono(req):
    return mono_results(CLEAVE, MODEL, req)


head_port = ["1"]  # the latest cluster's head port


def cluster(tag, req, out, sets, head_flags=()):
    head = NodeProcess([CLEAVE, "node", "--topology", TOPOLOGY, "--name", "attn", "-m", MODEL, "-t", "1",
                        "--requests", req, "--out", out, "--wait-stages", "3", *sets, *head_flags],
                       os.path.join(WORK, tag + "attn.err"))
    m = head.wait_line(r"listening on ([0-9.]+):(\d+)")
    expect(tag + "head prints its port", m is not None, head.stderr())
    port = m.group(2) if m else "1"
    head_port[0] = port
    workers = {}
    for name in ("ex0", "ex1"):
        workers[name] = NodeProcess([CLEAVE, "node", "--topology", TOPOLOGY, "--name", name, "-m", MODEL, "-t", "1",
                                     "--set", f"attn_port={port}", "--join-timeout", "20", *sets],
                                    os.path.join(WORK, tag + name + ".err"))
    return head, workers


try:
    req = os.path.join(WORK, "requests.jsonl")
    write_requests(req, 120, 8)
    ref = mono(req)
    # replicas_ with micro-batch ping-pong: 2 groups' layers in flight.
    # halves_ with hot-expert replication: the skewed router loads ex0 (experts
    # 0-3) most, so replicas go to ex1 across processes.
    for tag, sets, head_flags in (("halves_", [], ["--enable-eplb"]),
                                  ("replicas_", ["--set", "replicas=true"], ["--expert-micro-batches", "2"])):
        out = os.path.join(WORK, tag + "out.jsonl")
        head, workers = cluster(tag, req, out, sets, head_flags)
        rc = head.wait(300)
        err = head.stderr()
        got = results(out)
        expect(f"{tag}1 attention + 2 expert nodes: 120 requests give mono's tokens, text and logits hashes",
               rc == 0 and len(got) == 120 and got == ref, f"rc={rc} {err[-2000:]}")
        s = stats_of(err, "attn/colocated/0")
        expect(f"{tag}every expert row ran on the expert nodes",
               s.get("expert_rows", 0) > 0 and s.get("expert_fallback_rows", 1) == 0 and
               s.get("expert_hosts_alive") == 2 and s.get("expert_host_failures") == 0, s)
        expect(f"{tag}every batch went on the expert nodes' data sockets",
               s.get("expert_batches", 0) > 0 and s.get("expert_socket_batches") == s.get("expert_batches"), s)
        if tag == "halves_":
            # Counted once the expert actor (in its own process) said yes.
            expect("halves_--enable-eplb added replicas across processes", s.get("expert_replicas_added", 0) >= 1, s)
        stop_all()

    # kill -9 of an expert node under load, with replicas: the other takes over.
    # Long enough (160 tokens each) that the kill 0.1 s after the submit
    # lands mid-run on a fast machine too (48 tokens ran in 0.3 s on one).
    long_req = os.path.join(WORK, "long.jsonl")
    write_requests(long_req, 40, 160)
    long_ref = mono(long_req)
    out = os.path.join(WORK, "kill_out.jsonl")
    head, workers = cluster("kill_", long_req, out, ["--set", "replicas=true"])
    submitted = head.wait_line(r"submitted", timeout=60) is not None
    time.sleep(0.1)
    workers["ex0"].proc.send_signal(signal.SIGKILL)
    rc = head.wait(300)
    err = head.stderr()
    got = results(out)
    expect("kill -9 of ex0 under load: every request finishes with mono's bits",
           submitted and rc == 0 and len(got) == 40 and got == long_ref, f"rc={rc} {err[-2000:]}")
    s = stats_of(err, "attn/colocated/0")
    expect("kill -9 of ex0: the attention actor dropped it and ex1 took its rows",
           s.get("expert_host_failures", 0) >= 1 and s.get("expert_hosts_alive") == 1, s)
    stop_all()

    # SIGSTOP of an expert node under load: its connection stays open and it
    # never answers, so only the dispatch timeout can tell. With replicas
    # the other node takes its rows; without (halves), the attention actor
    # computes its experts from the model file. No request fails or hangs.
    for tag, sets, victim in (("stop_replicas_", ["--set", "replicas=true"], "ex0"), ("stop_halves_", [], "ex1")):
        out = os.path.join(WORK, tag + "out.jsonl")
        head, workers = cluster(tag, long_req, out, sets)
        submitted = head.wait_line(r"submitted", timeout=60) is not None
        time.sleep(0.1)
        workers[victim].freeze()
        t0 = time.monotonic()
        rc = head.wait(300)
        took = time.monotonic() - t0
        workers[victim].thaw()
        err = head.stderr()
        got = results(out)
        expect(f"{tag}SIGSTOP of {victim} under load: every request finishes with mono's bits",
               submitted and rc == 0 and len(got) == 40 and got == long_ref, f"rc={rc} {err[-2000:]}")
        s = stats_of(err, "attn/colocated/0")
        expect(f"{tag}SIGSTOP of {victim}: dropped after the dispatch timeout ({took:.1f} s to finish)",
               s.get("expert_host_failures", 0) >= 1 and s.get("expert_hosts_alive") == 1, s)
        if tag == "stop_halves_":
            expect("stop_halves_the attention actor computed the stopped node's experts",
                   s.get("expert_fallback_rows", 0) > 0, s)
        else:
            expect("stop_replicas_the replica took every row (no fallback)",
                   s.get("expert_fallback_rows", 1) == 0, s)
        stop_all()
    # An expert left without any host, until its node joins again: kill -9
    # of ex1 (halves: no replica), the attention actor computes its experts,
    # then ex1 starts again, attaches, and takes its experts' rows back.
    rejoin_req = os.path.join(WORK, "rejoin.jsonl")
    write_requests(rejoin_req, 40, 200)
    rejoin_ref = mono(rejoin_req)
    out = os.path.join(WORK, "rejoin_out.jsonl")
    head, workers = cluster("rejoin_", rejoin_req, out, [])
    submitted = head.wait_line(r"submitted", timeout=60) is not None
    time.sleep(0.1)
    workers["ex1"].proc.send_signal(signal.SIGKILL)
    workers["ex1"].proc.wait()
    again = NodeProcess([CLEAVE, "node", "--topology", TOPOLOGY, "--name", "ex1", "-m", MODEL, "-t", "1",
                         "--set", f"attn_port={head_port[0]}", "--join-timeout", "20", "--no-rejoin"],
                        os.path.join(WORK, "rejoin_ex1_again.err"))
    rc = head.wait(300)
    err = head.stderr()
    got = results(out)
    expect("rejoin: every request finishes with mono's bits", submitted and rc == 0 and got == rejoin_ref,
           f"rc={rc} {err[-2000:]}")
    s = stats_of(err, "attn/colocated/0")
    expect("rejoin: the attention actor computed ex1's experts while it was gone, then had 2 hosts again",
           s.get("expert_fallback_rows", 0) > 0 and s.get("expert_host_failures", 0) >= 1 and
           s.get("expert_hosts_alive") == 2, s)
    # The restarted ex1 prints its expert actor's counters when the head goes.
    deadline = time.time() + 20
    rows = None
    while time.time() < deadline and rows is None:
        m = re.search(r"stats ex1/expert/0 .*\brows=(\d+)", again.stderr())
        rows = int(m.group(1)) if m else None
        time.sleep(0.2)
    expect("rejoin: the restarted ex1 computed rows again", rows is not None and rows > 0, again.stderr()[-2000:])
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all expert node checks passed")
sys.exit(1 if failures else 0)
