#!/usr/bin/env python3
"""Nodes the script does not declare join a running cluster
(tests/nodes/join.lua: a head with a secret, p0, d0): under HTTP load on 6
client threads, e1 (`cleave node --join HOST:PORT --name e1 --actors decode=1
--secret-file F`) and e2 (the same, secret from $CLEAVE_CLUSTER_SECRET) take
the head's script and --set values from the head, join and serve; e1 is
drained by `cleave node drain e1`, e2 by SIGTERM, both exit 0. Every answer
(text, per-token logprobs, finish reason) must equal the one `cleave serve`
process (mono) gives, and no request fails. Refused, naming why: a wrong
secret, the head's name, an undeclared node without --actors, a declared one
with --actors, a kind a joining node cannot host, --join with --topology,
--actors without --join, a head that is not there.

usage: check_join.py CLEAVE VOCAB WORKDIR"""
import os
import signal
import subprocess
import sys

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "join.lua")
sys.path.insert(0, HERE)
from node_process import (NodeProcess, expect, failures, make_gqa128, mono_answers, random_completions,  # noqa: E402
                          run_clients, stats_of, stop_all, wait_until)

MODEL = make_gqa128(CLEAVE, VOCAB, WORK)
N, THREADS = 72, 6
SECRET = "join-test-secret-41"
SECRET_FILE = os.path.join(WORK, "secret")
with open(SECRET_FILE, "w") as f:
    f.write(SECRET + "\n")
REQS = random_completions(29, N, "gqa128", (8, 40), (24, 64))


def env(**extra):
    e = {k: v for k, v in os.environ.items() if k not in ("CLEAVE_CLUSTER_SECRET", "CLEAVE_JOIN_TEST_SECRET")}
    e.update(extra)
    return e


def joiner(port, name, *flags, secret_env=None):
    """A `cleave node --join` command line and its environment."""
    cmd = [CLEAVE, "node", "--join", f"127.0.0.1:{port}", "--name", name, "-m", MODEL, "-t", "1",
           "--join-timeout", "20", "--no-rejoin", *flags]
    return cmd, env(**({"CLEAVE_CLUSTER_SECRET": secret_env} if secret_env else {}))


def refused(what, cmd, e, needle):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=e)
    expect(f"refused: {what}", r.returncode != 0 and needle in r.stderr, (r.returncode, r.stderr[-600:]))


try:
    want = mono_answers(CLEAVE, MODEL, REQS, os.path.join(WORK, "mono.err"))
    expect("mono answered every request", len(want) == N and all("error" not in a for a in want), want[:3])

    head = NodeProcess([CLEAVE, "node", "--topology", TOPOLOGY, "-m", MODEL, "-t", "1", "--name", "head",
                        "--http-port", "0"], os.path.join(WORK, "head.err"), env(CLEAVE_JOIN_TEST_SECRET=SECRET))
    m = head.wait_line(r"listening on ([0-9.]+):(\d+)")
    expect("head prints its port", m is not None, head.stderr())
    port = m.group(2) if m else "1"
    url = head.wait_line(r"listening on (http://[0-9.]+:\d+)", 30)
    expect("head serves HTTP", url is not None, head.stderr())
    nodes = {n: NodeProcess([CLEAVE, "node", "--topology", TOPOLOGY, "-m", MODEL, "-t", "1", "--name", n, "--set",
                             f"head_port={port}", "--join-timeout", "20", "--no-rejoin"],
                            os.path.join(WORK, n + ".err"), env(CLEAVE_JOIN_TEST_SECRET=SECRET))
             for n in ("p0", "d0")}
    expect("p0 and d0 joined", wait_until(lambda: all(f"node {n} joined" in head.stderr() for n in nodes), 60),
           head.stderr()[-1500:])

    # What is refused, each with one line naming why.
    refused("a wrong secret", *joiner(port, "x1", "--actors", "decode=1", secret_env="not-the-secret"),
            "wrong cluster secret")
    refused("the head's name", *joiner(port, "head", secret_env=SECRET), "'head' is the head")
    refused("an undeclared node without --actors", *joiner(port, "x2", secret_env=SECRET),
            "is not in the head's script")
    refused("a declared node with --actors", *joiner(port, "d0", "--actors", "decode=1", secret_env=SECRET),
            "the script declares 'd0'")
    refused("a kind a joining node cannot host", *joiner(port, "x3", "--actors", "kv_store=1", secret_env=SECRET),
            "cannot host 'kv_store'")
    refused("a bad count", *joiner(port, "x4", "--actors", "decode=0", secret_env=SECRET), "must be 1 to 4096")
    refused("--join with --topology", *joiner(port, "x5", "--actors", "decode=1", "--topology", TOPOLOGY),
            "does not go with --join")
    refused("--actors without --join", [CLEAVE, "node", "--topology", TOPOLOGY, "--name", "x6", "-m", MODEL,
                                        "--actors", "decode=1"], env(), "needs --join")
    refused("a head that is not there", [CLEAVE, "node", "--join", "127.0.0.1:1", "--name", "x7", "-m", MODEL,
                                         "--actors", "decode=1", "--join-timeout", "0.5"], env(),
            "cannot reach the head at 127.0.0.1:1")
    expect("the head logged the refused secret", "refused to send the topology: wrong cluster secret" in head.stderr(),
           head.stderr()[-800:])

    rc = {}

    def grow_and_shrink(done):
        wait_until(lambda: done[0] >= N // 6, 120)
        cmd1, env1 = joiner(port, "e1", "--actors", "decode=1", "--secret-file", SECRET_FILE)
        nodes["e1"] = NodeProcess(cmd1, os.path.join(WORK, "e1.err"), env1)
        cmd2, env2 = joiner(port, "e2", "--actors", "decode=1", secret_env=SECRET)
        nodes["e2"] = NodeProcess(cmd2, os.path.join(WORK, "e2.err"), env2)
        expect("e1 and e2 joined the running cluster",
               wait_until(lambda: all(f"node {n} joined" in head.stderr() for n in ("e1", "e2")), 60),
               head.stderr()[-1500:])
        wait_until(lambda: done[0] >= N // 2, 120)
        d = subprocess.run([CLEAVE, "node", "drain", "e1", "--topology", TOPOLOGY, "--set", f"head_port={port}",
                            "--timeout", "60"], capture_output=True, text=True, timeout=90,
                           env=env(CLEAVE_JOIN_TEST_SECRET=SECRET))
        expect("`cleave node drain e1` drains the joined node", d.returncode == 0 and "node e1 drained" in d.stdout,
               (d.returncode, d.stdout, d.stderr))
        rc["e1"] = nodes["e1"].wait(60)
        wait_until(lambda: done[0] >= 3 * N // 4, 120)
        nodes["e2"].proc.send_signal(signal.SIGTERM)
        rc["e2"] = nodes["e2"].wait(60)
    answers = run_clients(url.group(1), REQS, THREADS, grow_and_shrink)
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
    expect("no request failed, both joined decoders drained",
           r.get("failures", 1) == 0 and r.get("finished", 0) == N and r.get("drained_stages", 0) == 2, r)
    e1, e2 = nodes["e1"].stderr(), nodes["e2"].stderr()
    expect("e1 exits 0 once the head drained it", rc.get("e1") == 0 and "drained by the head" in e1,
           (rc.get("e1"), e1[-800:]))
    expect("e2 exits 0 after SIGTERM drained it", rc.get("e2") == 0 and "SIGTERM: drained" in e2,
           (rc.get("e2"), e2[-800:]))
    expect("e1 and e2 served hand-offs while they were up",
           stats_of(e1, "e1/decode/0").get("resumes", 0) > 0 and stats_of(e2, "e2/decode/0").get("resumes", 0) > 0,
           (stats_of(e1, "e1/decode/0").get("resumes"), stats_of(e2, "e2/decode/0").get("resumes")))
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all join checks passed")
sys.exit(1 if failures else 0)
