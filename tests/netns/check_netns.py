#!/usr/bin/env python3
"""Nodes on hosts of their own (Linux network namespaces made here: a veth
per host to a bridge, tests/netns/netns.py), P/D over tests/netns/netns.lua:
the head (prefill, KV store, HTTP) and decoders d0 and d1. Requests arrive
over HTTP on 4 client threads; every answer (text, per-token logprobs,
finish reason) must equal the one `cleave serve` process's (mono).

1. Partition: d0's link is cut under load. The head's heartbeat drops d0,
   its requests finish on d1 with mono's answers, none fails; the link
   heals and d0 (which restarts itself to rejoin) joins again and serves.
2. A relay between d1 and the head (tests/netns/tcp_relay.py) carries all
   of d1's traffic, KV included (the head hands KV over through its store:
   --kv-via-store): d1 got its KV through it; the relay stalls under load
   (the heartbeat drops d1, its requests finish on d0), then resets every
   connection once d1 is back: each time every answer is mono's, no
   request hangs or fails.
3. The relay half-opens d1's connection under load (d1 is reset, the head
   hears nothing and holds the connection until its 4 s timeout): d1 starts
   again at once and joins as a new node while the head still holds the old
   run's connection (a new run is a new process, so CAF never takes it for
   the old one); the old run's requests finish elsewhere, none fails.

Exits 77 (skipped) where namespaces cannot be made (not root, no ip netns).
Every namespace and link goes when it ends, failed or not.

usage: check_netns.py CLEAVE VOCAB WORKDIR"""
import os
import signal
import sys
import time

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "netns.lua")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "nodes"))
import netns  # noqa: E402
from node_process import (NodeProcess, expect, failures, make_gqa128, mono_answers, random_completions,  # noqa: E402
                          run_clients, stats_of, stop_all, wait_until)

why = netns.available()
if why:
    print("SKIP: network namespaces unavailable: " + why)
    sys.exit(77)
MODEL = make_gqa128(CLEAVE, VOCAB, WORK)
N, THREADS = 48, 4
HEAD_PORT, HTTP_PORT, RELAY_PORT = 7411, 7412, 7500


REQS = random_completions(31, N, "gqa128", (20, 60), (24, 48))


def load(base, during):
    return run_clients(base, REQS, THREADS, during)


def same(tag, got, want):
    differ = [i for i in range(N) if got[i] != want[i]][:5]
    expect(f"{tag}: every answer equals mono's (text, logprobs, finish reason)", not differ,
           [(i, got[i], want[i]) for i in differ[:2]])


net = None
try:
    want = mono_answers(CLEAVE, MODEL, REQS, os.path.join(WORK, "mono.err"))
    expect("mono answered every request", len(want) == N and all("error" not in a for a in want), want[:2])
    net = netns.Network(["head", "d0", "d1"])
    me = net.attach_root()
    H = net.addr("head")
    sets = ["--set", f"d0_host={net.addr('d0')}", "--set", f"d1_host={net.addr('d1')}"]
    base = f"http://{H}:{HTTP_PORT}"

    def node(tag, host, name, head_host, head_port, extra=(), more_sets=()):
        cmd = [CLEAVE, "node", "--topology", TOPOLOGY, "--name", name, "-m", MODEL, "-t", "1", *sets, *more_sets,
               "--set", f"head_host={head_host}", "--set", f"head_port={head_port}", *extra]
        return NodeProcess(net.run(host, cmd), os.path.join(WORK, f"{tag}{name}.err"))

    def start(tag, head_extra=(), d1_head=(None, None), more_sets=()):
        head = node(tag, "head", "head", H, HEAD_PORT, ["--http-port", str(HTTP_PORT), "--host", H, *head_extra],
                    more_sets)
        expect(f"{tag}head listens", head.wait_line(r"listening on http://") is not None, head.stderr()[-1500:])
        d0 = node(tag, "d0", "d0", H, HEAD_PORT, ["--join-timeout", "30"], more_sets)
        d1 = node(tag, "d1", "d1", d1_head[0] or H, d1_head[1] or HEAD_PORT, ["--join-timeout", "30"], more_sets)
        expect(f"{tag}d0 and d1 joined", wait_until(lambda: head.stderr().count(" joined\n") >= 2 and
                                                   "node d0 joined" in head.stderr() and
                                                   "node d1 joined" in head.stderr()), head.stderr()[-1500:])
        time.sleep(0.5)  # their stages attach after the join
        return head, d0, d1

    def stop(head):
        head.proc.send_signal(signal.SIGTERM)
        head.wait(60)
        err = head.stderr()
        stop_all()
        return stats_of(err, "router")

    # 1. Partition of d0, then heal.
    head, d0, d1 = start("cut_")

    def cut_d0(done):
        wait_until(lambda: done[0] >= N // 4, 120)
        t0 = time.time()
        net.cut("d0")
        expect("1. the head notices the cut link by heartbeat",
               wait_until(lambda: "lost its decode stage" in head.stderr(), 30), head.stderr()[-1000:])
        print(f"     d0 dropped {time.time() - t0:.2f} s after its link was cut")
    got = load(base, cut_d0)
    same("1. d0 cut under load", got, want)
    net.heal("d0")
    expect("1. healed, d0 joins again", wait_until(lambda: head.stderr().count("node d0 joined") >= 2, 60),
           d0.stderr()[-1500:])
    time.sleep(0.5)
    again = load(base, lambda done: None)
    same("1. after d0 rejoined", again, want)
    r = stop(head)
    expect("1. no request failed, d0's stage went down once and came back (2 decoders at the end)",
           r.get("failures", 1) == 0 and r.get("stage_downs", 0) >= 1 and r.get("alive_decode", 0) == 2, r)

    # 2. d1 behind a relay; KV through the head's store (over the relay).
    relay = NodeProcess(net.run("switch", [sys.executable, os.path.join(HERE, "tcp_relay.py"), "10.77.0.254",
                                           str(RELAY_PORT), H, str(HEAD_PORT), "0"]),
                        os.path.join(WORK, "relay.err"))
    expect("2. the relay listens", relay.wait_line(r"relay listening") is not None, relay.stderr())
    head, d0, d1 = start("relay_", ["--kv-via-store"], ("10.77.0.254", RELAY_PORT))

    def stall(done):
        wait_until(lambda: done[0] >= N // 4, 120)
        relay.proc.send_signal(signal.SIGUSR1)
        expect("2. a stalled relay: the head drops d1 by heartbeat",
               wait_until(lambda: "lost its decode stage" in head.stderr(), 30), head.stderr()[-1000:])
        relay.proc.send_signal(signal.SIGUSR1)
    got = load(base, stall)
    same("2. relay stalled under load", got, want)
    expect("2. d1 got KV blocks from the store through the relay",
           stats_of(d1.stderr(), "d1/decode/0").get("kv_blocks_got", 0) > 0, stats_of(d1.stderr(), "d1/decode/0"))
    expect("2. d1 joins again through the relay", wait_until(lambda: head.stderr().count("node d1 joined") >= 2, 60),
           d1.stderr()[-1500:])
    time.sleep(0.5)

    def reset(done):
        wait_until(lambda: done[0] >= N // 4, 120)
        relay.proc.send_signal(signal.SIGUSR2)
    got = load(base, reset)
    same("2. relay reset every connection under load", got, want)
    r = stop(head)
    expect("2. no request failed; d1 dropped by the stall and by the reset",
           r.get("failures", 1) == 0 and r.get("stage_downs", 0) >= 2, r)

    # 3. d1's connection half-open: the head holds it for its 4 s timeout.
    relay = NodeProcess(net.run("switch", [sys.executable, os.path.join(HERE, "tcp_relay.py"), "10.77.0.254",
                                           str(RELAY_PORT), H, str(HEAD_PORT), "0"]),
                        os.path.join(WORK, "relay_half.err"))
    expect("3. the relay listens", relay.wait_line(r"relay listening") is not None, relay.stderr())
    head, d0, d1 = start("half_", ["--kv-via-store"], ("10.77.0.254", RELAY_PORT),
                         ["--set", "connection_timeout=4"])

    def half_open(done):
        wait_until(lambda: done[0] >= N // 4, 120)
        relay.proc.send_signal(signal.SIGHUP)
        t0 = time.time()
        rejoined = wait_until(lambda: head.stderr().count("node d1 joined") >= 2, 30)
        took = time.time() - t0
        expect("3. half-open: d1 starts again and joins while the head still holds its old run",
               rejoined and "lost its decode stage" not in head.stderr(), head.stderr()[-1500:])
        print(f"     d1's new run joined {took:.2f} s after the half-open (the head's timeout: 4 s)")
        expect("3. the head drops d1's old run by heartbeat",
               wait_until(lambda: "lost its decode stage" in head.stderr(), 30), head.stderr()[-1500:])
    got = load(base, half_open)
    same("3. half-open under load", got, want)
    r = stop(head)
    expect("3. no request failed; d1's old run dropped once, d0 and d1's new run serve at the end",
           r.get("failures", 1) == 0 and r.get("stage_downs", 0) == 1 and r.get("alive_decode", 0) == 2, r)
finally:
    stop_all()
    if net:
        net.close()

print("FAILED: " + ", ".join(failures) if failures else "all network namespace checks passed")
sys.exit(1 if failures else 0)
