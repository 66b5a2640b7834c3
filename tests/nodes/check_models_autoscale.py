#!/usr/bin/env python3
"""Each model of a cluster scales on its own (tests/nodes/models_autoscale.lua),
real processes on loopback: the cluster's autoscale block runs in each
model's router, over that model's stages only. Alpha's requests come first:
alpha's router brings its parked stages up (to 3) while beta's keeps its
floor of one and steps nowhere; then beta's requests bring beta's up while
alpha's router takes no step. Read live from the head's /metrics, where
each model's router is its own series (the second model's actors named
"model:PATH/...") and every worker's stages report too (a stopped worker
does not hold a scrape up). Every answer equals that model's own `cleave
serve`; each model's requests ran on its own node, spread over more than
one of its stages.

usage: check_models_autoscale.py CLEAVE VOCAB WORKDIR"""
import os
import re
import signal
import sys
import threading
import time
import urllib.request

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "models_autoscale.lua")
sys.path.insert(0, HERE)
from node_process import (NodeProcess, expect, failures, make_two_models, mono_answers, random_completions,  # noqa: E402
                          run_clients, stats_of, stop_all, wait_until, start_two_model_head, expect_same_answers)

MODEL_A, MODEL_B, SETS = make_two_models(CLEAVE, VOCAB, WORK)
N = 24
A = random_completions(57, N, "alpha", (8, 40), (16, 32))
B = [dict(b, model="beta") for b in random_completions(58, N, "beta", (8, 40), (16, 32))]
ROUTER_A, ROUTER_B = "router", f"model:{MODEL_B}/router"


def metrics(base):
    """cleave_actor_stat of every actor: {actor: {counter: value}}."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out = {}
    for m in re.finditer(r'^cleave_actor_stat\{actor="([^"]*)",name="([^"]*)"\} (\S+)$', text, re.M):
        out.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))
    return out, text


class Watch:
    """Polls /metrics beside a load: the most active entry stages each router showed."""

    def __init__(self, base):
        self.base, self.most, self.stop = base, {ROUTER_A: 0, ROUTER_B: 0}, threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            m, _ = metrics(self.base)
            for r in self.most:
                self.most[r] = max(self.most[r], m.get(r, {}).get("autoscale_active", 0))
            self.stop.wait(0.05)

    def done(self):
        self.stop.set()
        self.thread.join()
        return self.most


try:
    want_a = mono_answers(CLEAVE, MODEL_A, A, os.path.join(WORK, "mono_a.err"))
    want_b = mono_answers(CLEAVE, MODEL_B, B, os.path.join(WORK, "mono_b.err"))
    expect("mono answered every request of both models",
           all("error" not in a for a in want_a + want_b) and len(want_a + want_b) == 2 * N, (want_a[:1], want_b[:1]))

    common = ["--topology", TOPOLOGY, *SETS, "-t", "1"]
    head, port, base = start_two_model_head([CLEAVE, "node", *common, "--name", "head", "--http-port", "0", "--metrics"],
                                            os.path.join(WORK, "head.err"))
    nodes = {n: NodeProcess([CLEAVE, "node", *common, "--name", n, "--set", f"head_port={port}", "--join-timeout",
                             "20", "--no-rejoin"], os.path.join(WORK, n + ".err")) for n in ("a0", "b0")}
    expect("a0 and b0 joined", wait_until(lambda: all(f"node {n} joined" in head.stderr() for n in nodes), 60),
           head.stderr()[-1500:])

    def routers():
        m, _ = metrics(base)
        return m.get(ROUTER_A, {}), m.get(ROUTER_B, {})

    # Every stage attached, each router at its floor: one active, two parked.
    expect("each router starts with 1 of its 3 stages active", wait_until(
        lambda: all(r.get("autoscale_active") == 1 and r.get("autoscale_parked") == 2 for r in routers()), 30),
        routers())
    _, text = metrics(base)
    series = re.findall(r'^(cleave_actor_stat\{[^}]*\}) ', text, re.M)
    expect("/metrics names every actor's counter once (no two models' routers in one series)",
           len(series) == len(set(series)) and len(series) > 0, len(series) - len(set(series)))

    def load(bodies):
        """bodies posted 4 at a time, /metrics polled beside them: the
        answers, the most active entry stages each router showed, and the
        routers' counters after."""
        watch = Watch(base)
        got = run_clients(base, bodies, 4)
        most = watch.done()
        ra, rb = routers()
        print(f"most active: alpha {most[ROUTER_A]:.0f}, beta {most[ROUTER_B]:.0f}; "
              f"ups alpha {ra.get('autoscale_ups')}, beta {rb.get('autoscale_ups')}")
        return got, most, ra, rb

    # Alpha's load: alpha's router steps up to 3; beta's stays at 1.
    got_a, most, ra, rb = load(A)
    expect("alpha's load brought alpha's parked stages up (3 active)", most[ROUTER_A] == 3, (most, ra))
    expect("beta's router stayed at its floor and took no step while alpha was loaded",
           most[ROUTER_B] == 1 and rb.get("autoscale_ups") == 0 and rb.get("requests") == 0, (most, rb))
    alpha_ups = ra.get("autoscale_ups")

    # Beta's load: beta's router steps up; alpha's takes no step (its cooldown keeps it at 3).
    got_b, most, ra, rb = load(B)
    expect("beta's load brought beta's parked stages up (3 active)", most[ROUTER_B] == 3, (most, rb))
    expect("alpha's router took no step while beta was loaded",
           ra.get("autoscale_ups") == alpha_ups and ra.get("autoscale_downs") == 0 and ra.get("requests") == N,
           (alpha_ups, ra))

    # The head's /metrics holds every attached stage's counters, on any
    # node: each model's requests, per stage, as its node counted them.
    m, text = metrics(base)
    for node in ("a0", "b0"):
        per = [m.get(f"{node}/colocated/{i}", {}).get("requests", -1) for i in range(3)]
        expect(f"/metrics holds {node}'s three stages, {N} requests among them", sum(per) == N and min(per) >= 0,
               (per, sorted(m)))
    expect("/metrics maps the workers' steps to cleave_stage_steps_total",
           re.search(r'^cleave_stage_steps_total\{stage="b0/colocated/0"\} [1-9]', text, re.M) is not None)
    # A stopped worker: a scrape comes back (without its stages) instead of
    # waiting on them.
    nodes["b0"].freeze()
    t0 = time.time()
    m, _ = metrics(base)
    took = time.time() - t0
    nodes["b0"].thaw()
    print(f"a scrape with b0 stopped took {took:.2f} s")
    expect("a scrape with a stopped worker answers within 5 s, the other node's stages in it",
           took < 5 and "a0/colocated/0" in m and ROUTER_B in m, (took, sorted(m)))

    head.proc.send_signal(signal.SIGTERM)
    head.wait(60)
    for n in nodes.values():
        n.wait(30)
    stop_all()

    expect_same_answers("every alpha answer equals alpha's own server", got_a, want_a)
    expect_same_answers("every beta answer equals beta's own server", got_b, want_b)
    err = head.stderr()
    fa, fb = stats_of(err, ROUTER_A), stats_of(err, ROUTER_B)
    expect("each router finished its model's requests, none failed",
           fa.get("finished") == N and fb.get("finished") == N and fa.get("failures", 1) == 0 and
           fb.get("failures", 1) == 0, (fa, fb))
    for node, name in (("a0", "alpha"), ("b0", "beta")):
        per = [stats_of(nodes[node].stderr(), f"{node}/colocated/{i}").get("requests", 0) for i in range(3)]
        print(f"{name}'s requests per stage on {node}: {per}")
        expect(f"{name}'s requests all ran on {node}, on more than one stage",
               sum(per) == N and sum(1 for x in per if x > 0) >= 2, per)
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all per-model autoscale node checks passed")
sys.exit(1 if failures else 0)
