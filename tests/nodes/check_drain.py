#!/usr/bin/env python3
"""Elastic decoders across processes (tests/nodes/cluster.lua): an HTTP head
(router and KV store), a prefill node p0 and decode node d0 serve requests
that arrive on 6 client threads; under that load decoders d1 and d2 join the
running cluster (1 -> 3), then d1 is drained by `cleave node drain d1` and d2
by SIGTERM (3 -> 1): each takes nothing new, its in-flight requests move to
the other decoders with their tokens (KV from the store) and it exits 0.
Every answer (text, per-token logprobs, finish reason) must equal the one
`cleave serve` process (mono) gives, and no request fails. Draining the head
or the last decoder is refused, naming why.

usage: check_drain.py CLEAVE VOCAB WORKDIR"""
import os
import signal
import subprocess
import sys
import time

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "cluster.lua")
sys.path.insert(0, HERE)
from node_process import (NodeProcess, expect, failures, make_gqa128, mono_answers, random_completions,  # noqa: E402
                          run_clients, stats_of, stop_all, wait_until)

MODEL = make_gqa128(CLEAVE, VOCAB, WORK)
N, THREADS = 96, 6


REQS = random_completions(23, N, "gqa128", (8, 40), (24, 64))


def mono():
    return mono_answers(CLEAVE, MODEL, REQS, os.path.join(WORK, "mono.err"))


def drain(port, name):
    return subprocess.run([CLEAVE, "node", "drain", name, "--topology", TOPOLOGY, "--set", f"head_port={port}",
                           "--set", "decoders=3", "--timeout", "60"], capture_output=True, text=True, timeout=90)


try:
    want = mono()
    expect("mono answered every request", len(want) == N and all("error" not in a for a in want), want[:3])

    common = ["--topology", TOPOLOGY, "-m", MODEL, "-t", "1", "--set", "decoders=3"]
    head = NodeProcess([CLEAVE, "node", *common, "--name", "head", "--http-port", "0"],
                       os.path.join(WORK, "head.err"))
    m = head.wait_line(r"listening on ([0-9.]+):(\d+)")
    expect("head prints its port", m is not None, head.stderr())
    port = m.group(2) if m else "1"
    url = head.wait_line(r"listening on (http://[0-9.]+:\d+)", 30)
    expect("head serves HTTP", url is not None, head.stderr())

    def worker(name):
        return NodeProcess([CLEAVE, "node", *common, "--name", name, "--set", f"head_port={port}",
                            "--join-timeout", "20", "--no-rejoin"], os.path.join(WORK, name + ".err"))

    def wait_joined(names):
        deadline = time.time() + 60
        while not all(f"node {n} joined" in head.stderr() for n in names) and time.time() < deadline:
            time.sleep(0.05)
        expect(f"{', '.join(names)} joined", all(f"node {n} joined" in head.stderr() for n in names),
               head.stderr()[-1500:])

    nodes = {n: worker(n) for n in ("p0", "d0")}
    wait_joined(["p0", "d0"])
    time.sleep(0.5)  # their stages attach after the join
    rc = {}

    def scale(done):
        # 1 -> 3 decoders under load.
        wait_until(lambda: done[0] >= N // 6, 120)
        nodes["d1"] = worker("d1")
        nodes["d2"] = worker("d2")
        wait_joined(["d1", "d2"])
        # 3 -> 1: one drained from the command line, one by SIGTERM.
        wait_until(lambda: done[0] >= N // 2, 120)
        d = drain(port, "d1")
        expect("`cleave node drain d1` answers 0 with the requests it moved",
               d.returncode == 0 and "node d1 drained" in d.stdout, (d.returncode, d.stdout, d.stderr))
        rc["d1"] = nodes["d1"].wait(60)
        wait_until(lambda: done[0] >= 2 * N // 3, 120)
        nodes["d2"].proc.send_signal(signal.SIGTERM)
        rc["d2"] = nodes["d2"].wait(60)
    answers = run_clients(url.group(1), REQS, THREADS, scale)
    rc1, rc2 = rc.get("d1"), rc.get("d2")
    # What is refused: the head, and the last decoder.
    head_refused = drain(port, "head")
    last_refused = drain(port, "d0")
    head.proc.send_signal(signal.SIGTERM)
    head.wait(60)
    for n in ("p0", "d0"):
        nodes[n].wait(30)
    stop_all()

    differ = [i for i in range(N) if answers[i] != want[i]][:10]
    expect("every answer equals mono's (text, logprobs, finish reason)", not differ,
           [(i, answers[i], want[i]) for i in differ[:2]])
    r = stats_of(head.stderr(), "router")
    print(f"router: finished {r.get('finished')}, failures {r.get('failures')}, drained_stages "
          f"{r.get('drained_stages')}, migrated {r.get('migrated')}")
    expect("no request failed, both drained decoders counted, requests moved off them",
           r.get("failures", 1) == 0 and r.get("finished", 0) == N and r.get("drained_stages", 0) == 2 and
           r.get("migrated", 0) > 0, r)
    d1, d2 = nodes["d1"].stderr(), nodes["d2"].stderr()
    expect("d1 exits 0 once the head drained it", rc1 == 0 and "drained by the head" in d1, (rc1, d1[-800:]))
    expect("d2 exits 0 after SIGTERM drained it", rc2 == 0 and "SIGTERM: drained" in d2, (rc2, d2[-800:]))
    expect("d1 and d2 served requests while they were up",
           stats_of(d1, "d1/decode/0").get("resumes", 0) > 0 and stats_of(d2, "d2/decode/0").get("resumes", 0) > 0,
           (stats_of(d1, "d1/decode/0").get("resumes"), stats_of(d2, "d2/decode/0").get("resumes")))
    expect("draining the head is refused", head_refused.returncode == 1 and "is the head" in head_refused.stderr,
           (head_refused.returncode, head_refused.stderr))
    expect("draining the last decoder is refused",
           last_refused.returncode == 1 and "would leave no live decode actor" in last_refused.stderr,
           (last_refused.returncode, last_refused.stderr))
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all drain checks passed")
sys.exit(1 if failures else 0)
