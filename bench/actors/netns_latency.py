#!/usr/bin/env python3
"""TTFT and TPOT of P/D across hosts (network namespaces, tests/netns/netns.py)
against loopback: the head (prefill, KV store, HTTP) and one decoder d0
(tests/netns/netns.lua), requests one at a time over HTTP with streaming
(TTFT: the first streamed token, which the prefill samples; hand-off: the
gap to the second, the decoder's first, which waits for the KV; TPOT: the
mean gap after it). The head
hands KV over through its store (--kv-via-store), so every byte between the
nodes (KV, tokens, heartbeats) crosses the one link.

  loopback         both processes in one namespace on 127.0.0.1
  veth             each on its own host (namespace), one bridge between them
  10G + 100 us     d0's link shaped to 10 Gbit/s each way (tc tbf on both
                   ends) and d0 behind a TCP relay (tests/netns/tcp_relay.py)
                   that holds every chunk 100 us each way

Limits measured in the same run, per config: the round trip of one byte
between the two hosts over the same path (the relay included), and TCP
throughput over it (256 MiB). Cells: median of --reps runs with the range;
each run's figure is the median over its requests.

Needs root (ip netns). usage: netns_latency.py CLEAVE VOCAB WORKDIR [--reps 3]
       [--requests 16] [--dim 256] [--layers 4] [--prompt 200] [--max-tokens 32] [--json FILE]"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "..", "tests")
sys.path.insert(0, os.path.join(TESTS, "netns"))
sys.path.insert(0, HERE)
import netns  # noqa: E402
from node_bench import median_range  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("work")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--requests", type=int, default=16)
ap.add_argument("--dim", type=int, default=256)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--prompt", type=int, default=200)
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--delay-us", type=int, default=100)
ap.add_argument("--rate", default="10gbit")
ap.add_argument("--json")
a = ap.parse_args()
why = netns.available()
if why:
    sys.exit("network namespaces unavailable: " + why)
os.makedirs(a.work, exist_ok=True)
TOPOLOGY = os.path.join(TESTS, "netns", "netns.lua")
RELAY = os.path.join(TESTS, "netns", "tcp_relay.py")
model = os.path.join(a.work, "latency.gguf")
subprocess.run([a.cleave, "make-model", "--out", model, "--vocab", a.vocab, "--dim", str(a.dim), "--layers",
                str(a.layers), "--heads", str(a.dim // 64), "--kv-heads", str(max(1, a.dim // 128)), "--ffn",
                str(a.dim * 3), "--ctx", "1024", "--type", "f16"], check=True, capture_output=True, timeout=300)
rng = random.Random(7)
BODIES = [{"model": "latency", "prompt": [1] + [rng.randrange(3, 32000) for _ in range(a.prompt - 1)],
           "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
          for _ in range(a.requests)]
HEAD_PORT, HTTP_PORT, RELAY_PORT, PROBE_PORT = 7411, 7412, 7500, 7600


def wait_for(path, needle, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and needle in open(path).read():
            return True
        time.sleep(0.05)
    return False


def probe(net, server_host, client_host, target, port):
    """Round trip of one byte (median of 200) and TCP throughput (256 MiB)
    from client_host to target:port, where server_host runs an echo / sink."""
    code = ("import socket,sys\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('0.0.0.0',{PROBE_PORT}));s.listen(4)\n"
            "print('ready',flush=True)\n"
            "c,_=s.accept();c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
            "while True:\n"
            "  d=c.recv(1)\n"
            "  if not d or d==b'q': break\n"
            "  c.sendall(d)\n"
            "c,_=s.accept()\n"
            "while c.recv(1<<20): pass\n"
            "c.sendall(b'k')\n")
    srv = subprocess.Popen(net.run(server_host, [sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True)
    srv.stdout.readline()
    client = ("import socket,time,statistics,json\n"
              f"a=('{target}',{port})\n"
              "c=socket.create_connection(a);c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
              "rt=[]\n"
              "for _ in range(200):\n"
              "  t=time.perf_counter();c.sendall(b'x');c.recv(1);rt.append(time.perf_counter()-t)\n"
              "c.sendall(b'q');c.close();time.sleep(0.1)\n"
              "c=socket.create_connection(a);buf=b'\\0'*(1<<20);t=time.perf_counter()\n"
              "for _ in range(256): c.sendall(buf)\n"
              "c.shutdown(socket.SHUT_WR);c.recv(1);dt=time.perf_counter()-t\n"
              "print(json.dumps({'rtt_us':statistics.median(rt)*1e6,'gbit_s':256*8*(1<<20)/dt/1e9}))\n")
    p = subprocess.run(net.run(client_host, [sys.executable, "-c", client]), capture_output=True, text=True,
                       timeout=300)
    srv.wait(timeout=30)
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_config(net, name, rep):
    """One run: start the nodes, the requests one at a time, stop. -> (ttfts, tpots)."""
    same_host = name == "loopback"
    relay = name != "loopback" and name != "veth"
    h_addr = "127.0.0.1" if same_host else net.addr("head")
    d_addr = "127.0.0.1" if same_host else net.addr("d0")
    d_host = "head" if same_host else "d0"
    common = ["--topology", TOPOLOGY, "-m", model, "-t", "1", "--set", f"d0_host={d_addr}"]
    procs = []
    tag = "".join(ch if ch.isalnum() else "_" for ch in name)
    err = lambda n: os.path.join(a.work, f"{tag}_{rep}_{n}.err")  # noqa: E731
    try:
        if relay:
            procs.append(subprocess.Popen(
                net.run("switch", [sys.executable, RELAY, netns.SUBNET + "254", str(RELAY_PORT), h_addr,
                                   str(HEAD_PORT), str(a.delay_us)]), stdout=subprocess.PIPE, text=True))
            procs[-1].stdout.readline()
        procs.append(subprocess.Popen(net.run("head", [
            a.cleave, "node", *common, "--name", "head", "--set", f"head_host={h_addr}", "--set",
            f"head_port={HEAD_PORT}", "--kv-via-store", "--http-port", str(HTTP_PORT), "--host", h_addr]),
            stdout=subprocess.DEVNULL, stderr=open(err("head"), "w")))
        target = (netns.SUBNET + "254", RELAY_PORT) if relay else (h_addr, HEAD_PORT)
        procs.append(subprocess.Popen(net.run(d_host, [
            a.cleave, "node", *common, "--name", "d0", "--set", f"head_host={target[0]}", "--set",
            f"head_port={target[1]}", "--join-timeout", "30", "--no-rejoin"]),
            stdout=subprocess.DEVNULL, stderr=open(err("d0"), "w")))
        if not wait_for(err("head"), "node d0 joined"):
            sys.exit(f"{name}: d0 did not join: {open(err('head')).read()[-1500:]}")
        time.sleep(0.5)
        # The client runs on the head's host: HTTP stays off the measured link.
        p = subprocess.run(net.run("head", [sys.executable, os.path.join(HERE, "netns_latency_client.py"),
                                            f"http://{h_addr}:{HTTP_PORT}"]),
                           input=json.dumps(BODIES), capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            sys.exit(f"{name}: client failed: {p.stderr[-1500:]}")
        return json.loads(p.stdout)
    finally:
        for q in reversed(procs):
            q.send_signal(signal.SIGKILL if q.args[-1] == str(a.delay_us) else signal.SIGINT)
        for q in procs:
            try:
                q.wait(timeout=20)
            except subprocess.TimeoutExpired:
                q.kill()


net = netns.Network(["head", "d0"])
try:
    rows = []
    for name in ("loopback", "veth", f"{a.rate.replace('gbit', ' Gbit/s')} + {a.delay_us} us"):
        if name not in ("loopback", "veth"):
            net.shape("d0", a.rate)
        ttft, handoff, tpot = [], [], []
        for rep in range(a.reps):
            r = run_config(net, name, rep)
            ttft.append(statistics.median(r["ttft"]) * 1e3)
            handoff.append(statistics.median(r["handoff"]) * 1e3)
            tpot.append(statistics.median(r["tpot"]) * 1e3)
        if name == "loopback":
            lim = probe(net, "head", "head", "127.0.0.1", PROBE_PORT)
        elif name == "veth":
            lim = probe(net, "head", "d0", net.addr("head"), PROBE_PORT)
        else:
            relay = subprocess.Popen(net.run("switch", [sys.executable, RELAY, netns.SUBNET + "254",
                                                        str(RELAY_PORT), net.addr("head"), str(PROBE_PORT),
                                                        str(a.delay_us)]), stdout=subprocess.PIPE, text=True)
            relay.stdout.readline()
            lim = probe(net, "head", "d0", netns.SUBNET + "254", RELAY_PORT)
            relay.kill()
            relay.wait()
        rows.append({"config": name, "ttft_ms": median_range(ttft), "handoff_ms": median_range(handoff),
                     "tpot_ms": median_range(tpot), **lim})
    for r in rows:
        print(f"{r['config']:>22}  TTFT {r['ttft_ms']['median']:7.2f} ms ({r['ttft_ms']['min']:.2f}-"
              f"{r['ttft_ms']['max']:.2f})  hand-off {r['handoff_ms']['median']:6.2f} ms ({r['handoff_ms']['min']:.2f}-"
              f"{r['handoff_ms']['max']:.2f})  TPOT {r['tpot_ms']['median']:6.3f} ms ({r['tpot_ms']['min']:.3f}-"
              f"{r['tpot_ms']['max']:.3f})  link RTT {r['rtt_us']:7.1f} us  TCP {r['gbit_s']:5.2f} Gbit/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
finally:
    net.close()
