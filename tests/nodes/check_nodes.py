#!/usr/bin/env python3
"""`cleave node` with real processes on loopback (ports 0): the head (router +
KV store) and prefill / decode worker nodes joined over CAF's middleman.
Every comparison with mono (`cleave generate --requests`, one process) is of
tokens and of the hash of each token's logits row (`logits_hash`), over 100
requests, half greedy and half sampled (temperature 0.9, fixed seeds).

  pd across 3 processes gives mono's tokens and logits for 100 requests,
  with KV on the data socket (--kv-transport socket); the examples' P/D
  runs take it through shared memory (the default between processes on
  one host), and a prefill whose every stream is corrupt falls back from
  shared memory to the socket to the store with the same answers;
  a worker with the wrong (or no) cluster secret is refused and the head logs it;
  kill -9 of a decode node while requests run: every request finishes with
  mono's tokens and logits (re-placed on the other decoder), no failure
  allowed; the head's detection time is printed;
  kill -9 of the prefill node while it streams KV: streams were cut (d0's
  kv_transfers_failed > 0) and each ended on the router's news that p0's
  stage is gone (not at its timeout), the store served the blocks (d0's kv_blocks_got
  = the store's kv_blocks_served > 0) and every request it handed off
  finishes with mono's tokens and logits; the rest fail unavailable (no
  prefill left);
  SIGSTOP of a decode node: the head's heartbeat timeout drops it and its
  requests finish on the other decoder with mono's tokens and logits
  (detection time printed).

usage: check_nodes.py CLEAVE VOCAB WORKDIR"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

from node_process import NodeProcess, expect, failures, procs, stop_all

CLEAVE, VOCAB, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
TOPOLOGY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster.lua")
os.makedirs(WORK, exist_ok=True)


class Node(NodeProcess):
    """A `cleave node` process of cluster.lua (or another topology)."""

    def __init__(self, name, args, env_secret=None, tag="", topology=TOPOLOGY):
        env = dict(os.environ)
        env.pop("CLEAVE_CLUSTER_SECRET", None)
        if env_secret is not None:
            env["CLEAVE_CLUSTER_SECRET"] = env_secret
        super().__init__([CLEAVE, "node", "--topology", topology, "--name", name, "-m", MODEL, *args],
                         os.path.join(WORK, f"{tag}{name}.err"), env)


def start_head(args, secret=None, tag=""):
    head = Node("head", args, secret, tag)
    m = head.wait_line(r"cleave node head listening on ([0-9.]+):(\d+)")
    if not m:
        return head, None
    return head, int(m.group(2))


def worker(name, port, secret=None, tag="", sets=(), extra=()):
    args = ["--set", f"head_port={port}", "--set", "prefills=1", "--set", "decoders=2",
            "--join-timeout", "20", "--no-rejoin", *extra]
    for s in sets:
        args += ["--set", s]
    return Node(name, args, secret, tag)


# ---- model, requests and mono's answers ---------------------------------------
MODEL = os.path.join(WORK, "nodes.gguf")
p = subprocess.run([CLEAVE, "make-model", "--out", MODEL, "--vocab", VOCAB, "--dim", "64", "--layers",
                    "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--ctx", "128", "--type",
                    "f16"], capture_output=True, text=True, timeout=120)
if p.returncode != 0:
    print("FAIL make-model: " + p.stderr)
    sys.exit(1)

rng = random.Random(5)
shared = [1] + [rng.randrange(3, 32000) for _ in range(20)]  # a prefix several prompts share
requests = []
for i in range(100):
    if i % 4 == 0:
        prompt = shared + [rng.randrange(3, 32000) for _ in range(rng.randrange(1, 12))]
    else:
        prompt = [1] + [rng.randrange(3, 32000) for _ in range(rng.randrange(1, 45))]
    r = {"id": 1000 + i, "prompt_ids": prompt, "max_tokens": rng.randrange(8, 33), "ignore_eos": True}
    if i % 2:  # sampled, with a fixed seed (mono must draw the same tokens from the same logits)
        r.update(temperature=0.9, seed=77 + i, top_k=40, top_p=0.95)
    else:
        r["temperature"] = 0
    requests.append(r)
req_path = os.path.join(WORK, "requests.jsonl")
with open(req_path, "w") as f:
    for r in requests:
        f.write(json.dumps(r) + "\n")

# Mono: one process (`cleave generate --requests`), each result's tokens and
# the hash of each token's logits row (`logits_hash`), compared with every
# cluster's results below: the same logits, not only the same tokens.
mono_path = os.path.join(WORK, "mono.jsonl")
p = subprocess.run([CLEAVE, "generate", "-m", MODEL, "--requests", req_path, "--out", mono_path, "-t", "1"],
                   capture_output=True, text=True, timeout=300)
mono = {}
if p.returncode == 0:
    with open(mono_path) as f:
        for line in f:
            j = json.loads(line)
            if "error" not in j and len(j["logits_hash"]) == len(j["tokens"]) > 0:
                mono[j["id"]] = (j["tokens"], j["logits_hash"])


def same_as_mono(r):
    """Finished, with mono's tokens and mono's logits hash for every token."""
    return "error" not in r and (r.get("tokens"), r.get("logits_hash")) == mono.get(r["id"])


expect("mono answers every request, with a logits hash per token",
       len(mono) == len(requests) and p.returncode == 0, p.stderr)


def read_results(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except (OSError, ValueError):
        return []


def stats_of(head_err, actor):
    m = re.search(r"stats " + re.escape(actor) + r" (.*)", head_err)
    return dict(kv.split("=") for kv in m.group(1).split()) if m else {}


def socket_inodes(pid):
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def v4(endpoint):
    """An IPv4-mapped IPv6 endpoint of /proc/net/tcp6 in /proc/net/tcp's form."""
    addr, port = endpoint.split(":")
    if len(addr) == 32 and addr.startswith("0000000000000000FFFF0000"):
        addr = addr[24:]
    return addr + ":" + port


def tcp_endpoints():
    """inode -> (local, remote) of established TCP sockets (IPv4 and IPv6)."""
    out = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "01":  # ESTABLISHED
                        out[parts[9]] = (v4(parts[1]), v4(parts[2]))
        except OSError:
            pass
    return out


class LinkWatch:
    """Samples whether processes a and b hold the two ends of one TCP connection."""

    def __init__(self, a, b):
        self.seen = False
        self.stop = False
        threading.Thread(target=self._run, args=(a, b), daemon=True).start()

    def _run(self, a, b):
        while not self.stop and not self.seen:
            ends = tcp_endpoints()
            ea = {ends[i] for i in socket_inodes(a.proc.pid) if i in ends}
            eb = {ends[i] for i in socket_inodes(b.proc.pid) if i in ends}
            self.seen = any((r, l) in eb for (l, r) in ea)
            time.sleep(0.02)


def one_line_error(name, args, code, *needles):
    p = subprocess.run([CLEAVE, "node", "--topology", TOPOLOGY, "-m", MODEL, *args], capture_output=True,
                       text=True, timeout=60)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    expect(name, p.returncode == code and len(lines) == 1 and all(n in p.stderr for n in needles),
           f"rc={p.returncode} stderr={p.stderr!r}")


try:
    # ---- bad input: exit 1 (2 for usage), one line naming the problem ------------
    one_line_error("unknown node name", ["--name", "zz"], 1, "'zz'", "head, p0, d0")
    one_line_error("a worker without the head's port", ["--name", "d0"], 1, "port 0", "head_port")
    one_line_error("an unreachable head within the join timeout",
                   ["--name", "d0", "--set", "head_port=1", "--join-timeout", "0.3"], 1, "127.0.0.1:1", "0.3 s")
    one_line_error("--requests without --out", ["--name", "head", "--requests", req_path], 2, "--out")
    bad_req = os.path.join(WORK, "bad.jsonl")
    with open(bad_req, "w") as f:
        f.write('{"id": 1, "prompt_ids": [1, 2]}\n{"id": 1, "prompt_ids": [1, 3]}\n')
    one_line_error("a duplicate request id", ["--name", "head", "--requests", bad_req, "--out", bad_req + ".out"],
                   1, "bad.jsonl:2", "appears twice")
    with open(bad_req, "w") as f:
        f.write('{"id": 1, "prompt_ids": [1, 2]}\n{"id": 2, "prompt_ids": [1, 3\n')
    one_line_error("a malformed request line", ["--name", "head", "--requests", bad_req, "--out", bad_req + ".out"],
                   1, "bad.jsonl:2")

    # ---- (a) head + prefill node + decode node give mono's tokens and logits -----
    out = os.path.join(WORK, "pd.jsonl")
    head, port = start_head(["--requests", req_path, "--out", out, "--wait-stages", "2",
                             "--set", "prefills=1", "--set", "decoders=1"], tag="pd_")
    expect("head prints its port", port is not None and port > 0, head.stderr())
    # The data socket (shared memory, the default on one host, is the
    # examples' below).
    p0 = worker("p0", port, tag="pd_", sets=["decoders=1"], extra=["--kv-transport", "socket"])
    d0 = worker("d0", port, tag="pd_", sets=["decoders=1"], extra=["--kv-transport", "socket"])
    link = LinkWatch(p0, d0)
    rc = head.wait(180)
    herr = head.stderr()
    results = read_results(out)
    expect("pd head runs every request and exits 0", rc == 0 and len(results) == 100,
           f"rc={rc} results={len(results)} {herr}")
    wrong = [r["id"] for r in results if not same_as_mono(r)]
    expect("pd over 3 processes gives mono's tokens and logits for 100 requests",
           not wrong and len(results) == 100,
           f"differ: {wrong[:10]}")
    def stage_tokens(r, node):
        return sum(s["tokens"] for k, s in r.get("stages", {}).items() if k.startswith(node + "/"))
    expect("each result names its stages: the first token from p0, the rest from d0, with step times",
           all(stage_tokens(r, "p0") == 1 and stage_tokens(r, "d0") == len(r["tokens"]) - 1 and
               all(s["ms"] > 0 for s in r["stages"].values()) for r in results if r.get("tokens")),
           str(results[0] if results else None))
    kv = stats_of(herr, "kv_store")
    router = stats_of(herr, "router")
    expect("every hand-off named the prefill's KV sender and the head's store got a copy",
           int(router.get("direct_handoffs", -1)) == int(router.get("handoffs", 0)) == 100 and
           int(kv.get("kv_blocks_stored", 0)) > 0, herr)
    for w in (p0, d0):
        w.wait(10)
    ps = stats_of(p0.stderr(), "p0/prefill/0")
    ds = stats_of(d0.stderr(), "d0/decode/0")
    sent = int(ps.get("kv_blocks_sent", 0))
    expect("KV went worker to worker: p0 streamed every block d0 received, the store served none",
           sent > 0 and int(ds.get("kv_blocks_received", -1)) == sent and
           int(ds.get("kv_transfers_received", 0)) == 100 and int(ds.get("kv_transfers_failed", 1)) == 0
           and int(ds.get("kv_blocks_got", 1)) == 0 and int(kv.get("kv_blocks_served", 1)) == 0
           and int(ds.get("kv_shared_received", 1)) == 0 and int(ps.get("kv_shared_sent", 1)) == 0,
           f"p0 {ps} d0 {ds} " + " | ".join(l for l in d0.stderr().splitlines() if "KV stream" in l))
    link.stop = True
    # The KV data socket (actors/kv_socket.h). CAF's own messages between the
    # two workers (offers, hand-offs) go through the head: no middleman
    # connection between workers was seen (probed: p0's middleman port never
    # had one).
    expect("p0 and d0 had a TCP connection of their own (the KV data socket)", link.seen)
    print(f"     p0 -> d0: {sent} blocks in {ps.get('kv_chunks_sent')} chunks, "
          f"{int(ps.get('kv_bytes_sent', 0)) / 2**20:.1f} MiB; {ds.get('kv_blocks_skipped')} blocks skipped "
          f"(cached on d0)")
    expect("the head logs both joins", "node p0 joined" in herr and "node d0 joined" in herr, herr)
    expect("an open cluster says so", "open cluster" in herr, herr)
    expect("workers exit 1 naming the lost head once the head is gone",
           p0.proc.returncode == 1 and "lost the head" in p0.stderr(), p0.stderr())
    stop_all()

    # ---- (a2) the examples: P and D on 2 processes, 1 P + 2 D on 3 -------------------
    EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
    for script, head_name, workers, decoders in (("pd_2nodes.lua", "prefill", ["decode"], ["decode"]),
                                                 ("p1_d2.lua", "p0", ["d0", "d1"], ["d0", "d1"])):
        topo = os.path.join(EXAMPLES, script)
        tag = script.split(".")[0] + "_"
        out = os.path.join(WORK, tag + "out.jsonl")
        head = Node(head_name, ["--requests", req_path, "--out", out, "--wait-stages", str(1 + len(workers))],
                    tag=tag, topology=topo)
        m = head.wait_line(r"cleave node head listening on ([0-9.]+):(\d+)")
        expect(f"{script}: head listens", m is not None, head.stderr())
        if not m:
            stop_all()
            continue
        ws = [Node(w, ["--set", f"{head_name}_port={m.group(2)}", "--join-timeout", "20"], tag=tag,
                   topology=topo) for w in workers]
        rc = head.wait(180)
        herr = head.stderr()
        results = read_results(out)
        wrong = [r["id"] for r in results if not same_as_mono(r)]
        expect(f"{script}: {1 + len(workers)} processes give mono's tokens and logits for 100 requests",
               rc == 0 and len(results) == 100 and not wrong, f"rc={rc} differ: {wrong[:10]} {herr[-2000:]}")
        expect(f"{script}: the first token comes from {head_name}, the rest from " + " or ".join(decoders),
               all(stage_tokens(r, head_name) == 1 and
                   sum(stage_tokens(r, d) for d in decoders) == len(r["tokens"]) - 1
                   for r in results if r.get("tokens")), str(results[0] if results else None))
        for w in ws:
            w.wait(10)
        dstats = [stats_of(w.stderr(), f"{w_name}/decode/{i}") for w, w_name in zip(ws, workers)
                  for i in range(1)]
        router = stats_of(herr, "router")
        received = sum(int(s.get("kv_blocks_received", 0)) for s in dstats)
        expect(f"{script}: every decoder took work and got its KV streamed from {head_name}",
               all(int(s.get("resumes", 0)) > 0 and int(s.get("kv_transfers_failed", 1)) == 0 for s in dstats)
               and received > 0 and int(router.get("direct_handoffs", -1)) == 100, f"{dstats} {router}")
        expect(f"{script}: every stream went through shared memory (one host), none fell back to the socket",
               all(int(s.get("kv_shared_received", -1)) == int(s.get("kv_transfers_received", -2)) > 0 and
                   int(s.get("kv_shared_fallbacks", 1)) == 0 for s in dstats), dstats)
        stop_all()

    # ---- (a3) every stream corrupt: shared memory -> socket -> store, same answers ----
    out = os.path.join(WORK, "corrupt.jsonl")
    few = os.path.join(WORK, "few.jsonl")
    with open(few, "w") as f:
        for r in requests[:12]:
            f.write(json.dumps(r) + "\n")
    head, port = start_head(["--requests", few, "--out", out, "--wait-stages", "2",
                             "--set", "prefills=1", "--set", "decoders=1"], tag="corrupt_")
    expect("corrupt: head listens", port is not None, head.stderr())
    p0 = worker("p0", port, tag="corrupt_", sets=["decoders=1"], extra=["--kv-fault-corrupt-chunk", "0"])
    d0 = worker("d0", port, tag="corrupt_", sets=["decoders=1"])
    rc = head.wait(180)
    results = read_results(out)
    wrong = [r["id"] for r in results if not same_as_mono(r)]
    for w in (p0, d0):
        w.wait(10)
    ds = stats_of(d0.stderr(), "d0/decode/0")
    expect("corrupt: every request still gives mono's tokens and logits",
           rc == 0 and len(results) == 12 and not wrong, f"rc={rc} differ: {wrong} {head.stderr()[-1500:]}")
    # A stream whose blocks all fit one held prefix sends nothing; the rest
    # failed twice each (shared memory, then the socket) and were read from the store.
    failed = int(ds.get("kv_transfers_failed", -1))
    expect("corrupt: each stream with blocks failed in shared memory, then on the socket, then read the store",
           failed > 0 and int(ds.get("kv_shared_fallbacks", -1)) == failed and
           int(ds.get("kv_shared_received", 1)) == 0 and int(ds.get("kv_chunks_rejected", -1)) >= 2 * failed and
           int(ds.get("kv_blocks_got", 0)) > 0, ds)
    stop_all()

    # ---- (b) cluster secret ------------------------------------------------------
    head, port = start_head(["--set", "decoders=2"], secret="s3cret-A", tag="sec_")
    expect("secret head listens", port is not None, head.stderr())
    bad = worker("d0", port, secret="s3cret-B", tag="sec_")
    rc = bad.wait(30)
    bad_err = [l for l in bad.stderr().splitlines() if l.strip()]
    expect("a wrong secret is refused: exit 1 with one line naming the reason",
           rc == 1 and len(bad_err) == 1 and "wrong cluster secret" in bad_err[0], f"rc={rc} {bad_err}")
    none = worker("d1", port, secret=None, tag="sec_")
    rc = none.wait(30)
    expect("no secret against a secret head is refused", rc == 1 and "wrong cluster secret" in none.stderr(),
           f"rc={rc} {none.stderr()}")
    time.sleep(0.2)
    herr = head.stderr()
    expect("the head logs the refusal", "refused node d0: wrong cluster secret" in herr and
           "refused node d1: wrong cluster secret" in herr, herr)
    good = worker("p0", port, secret="s3cret-A", tag="sec_")
    expect("the right secret joins", good.wait_line(r"cleave node p0 joined .* with 1 stages") is not None,
           good.stderr())
    head.proc.send_signal(signal.SIGTERM)
    expect("the head exits 0 on SIGTERM", head.wait(20) == 0, head.stderr())
    rc = good.wait(20)
    expect("its worker then exits 1 (lost the head)", rc == 1, f"rc={rc} {good.stderr()}")
    stop_all()

    # ---- (c) kill -9 of a decode node while requests run -------------------------
    out = os.path.join(WORK, "kill.jsonl")
    head, port = start_head(["--requests", req_path, "--out", out, "--wait-stages", "3", "--set",
                             "decoders=2"], tag="kill_")
    expect("kill: head listens", port is not None, head.stderr())
    p0 = worker("p0", port, tag="kill_", sets=["decoders=2"])
    # Four sequences at a time: the decoders hold running and queued work when d0 dies.
    d0 = worker("d0", port, tag="kill_", sets=["decoders=2"], extra=["--max-seqs", "4"])
    d1 = worker("d1", port, tag="kill_", sets=["decoders=2"], extra=["--max-seqs", "4"])
    submitted = head.wait_line(r"submitted (\d+) requests", timeout=60)
    t_submitted = time.time()
    # d0 decodes for a while (requests die mid-generation), then, frozen for
    # less than the heartbeat timeout, still takes its share of the
    # hand-offs: it surely holds requests when it dies.
    time.sleep(0.1)
    d0.freeze()
    time.sleep(0.2)
    t_kill = time.time()
    d0.proc.kill()
    rc = head.wait(120)  # a hang fails here, not forever
    t_done = time.time()
    herr = head.stderr()
    results = read_results(out)
    expect("kill: every request ends (none hangs), head exits 0",
           submitted is not None and rc == 0 and len(results) == 100, f"rc={rc} {herr}")
    finished = [r for r in results if "error" not in r]
    failed = [r for r in results if "error" in r]
    wrong = [r["id"] for r in results if not same_as_mono(r)]
    expect("kill: every request finishes with mono's tokens and logits (d1 lives: no failure allowed)",
           not wrong and len(results) == 100,
           f"{len(failed)} failed {[(r['id'], r['error']) for r in failed[:5]]}, differ: {wrong[:10]}")
    m = re.search(r"node d0 lost its decode stage \((.*)\) at ([0-9.]+)", herr)
    expect("kill: the head detects the lost node", m is not None, herr)
    router = stats_of(herr, "router")
    expect("kill: the router re-placed the dead node's requests",
           int(router.get("stage_downs", 0)) == 1 and int(router.get("replacements", 0)) > 0, router)
    moved = sum(1 for r in results if stage_tokens(r, "d0") > 0 and stage_tokens(r, "d1") > 0)
    if m:
        print(f"     detection {1e3 * (float(m.group(2)) - t_kill):.1f} ms after kill -9 ({m.group(1)}); "
              f"{len(finished)} finished, {len(failed)} failed, "
              f"{router.get('replacements')} re-placed ({moved} decoded partly on d0, then on d1); "
              f"head exited {t_done - t_submitted:.2f} s after submit")
    stop_all()

    # ---- (c2) kill -9 of the prefill node while it streams KV to the decoder ------
    out = os.path.join(WORK, "killp.jsonl")
    # Streams surely in flight when p0 dies, whatever the machine's speed:
    # d0 joins and is frozen before p0 exists, so the head (waiting for two
    # stages) submits only once p0 joins, and every hand-off p0 makes waits
    # in frozen d0's socket; then p0 is frozen and d0 resumed, so every
    # stream d0 starts waits on a frozen sender; then p0 is killed. The
    # connection timeout (heartbeats) is raised past the freezes.
    slow = ["--set", "connection_timeout_s=4"]
    head, port = start_head(["--requests", req_path, "--out", out, "--wait-stages", "2", *slow], tag="killp_")
    expect("kill prefill: head listens", port is not None, head.stderr())
    d0 = worker("d0", port, tag="killp_", sets=["decoders=1", "connection_timeout_s=4"],
                extra=["--max-seqs", "1", "--kv-chunk-bytes", "4096", "--kv-window", "2"])
    d0_joined = d0.wait_line(r"cleave node d0 joined", timeout=60)
    d0.freeze()
    p0 = worker("p0", port, tag="killp_", sets=["decoders=1", "connection_timeout_s=4"],
                extra=["--kv-chunk-bytes", "4096"])
    submitted = head.wait_line(r"submitted (\d+) requests", timeout=60)
    expect("kill prefill: d0 joined, then the head submitted once p0 joined",
           d0_joined is not None and submitted is not None, head.stderr()[-2000:])
    time.sleep(0.5)  # p0 prefills and hands off to frozen d0
    p0.freeze()
    d0.thaw()
    time.sleep(0.3)
    t_kill = time.time()
    p0.proc.kill()
    rc = head.wait(120)
    t_done = time.time()
    herr = head.stderr()
    results = read_results(out)
    expect("kill prefill: every request ends (none hangs), head exits 0",
           submitted is not None and rc == 0 and len(results) == 100, f"rc={rc} {herr[-2000:]}")
    finished = [r for r in results if "error" not in r]
    failed = [r for r in results if "error" in r]
    handed = [r for r in results if stage_tokens(r, "p0") == 1]
    router = stats_of(herr, "router")
    kv = stats_of(herr, "kv_store")
    d0.wait(10)
    ds = stats_of(d0.stderr(), "d0/decode/0")
    cut = int(ds.get("kv_transfers_failed", 0))
    # A request whose first token reached the head but whose hand-off died
    # with p0 is re-placed on d0 with that token (the rest of the re-placed
    # had no token: they fail, no prefill left), so d0 resumed the hand-offs
    # plus those.
    replaced_with_token = int(router.get("replacements", -1)) - len(failed)
    expect("kill prefill: p0 handed requests off before it died, and d0 resumed each (and each "
           "re-placed request that had its first token)",
           handed and int(router.get("handoffs", -1)) > 0 and replaced_with_token >= 0 and
           len(handed) == int(router.get("handoffs", -1)) + replaced_with_token ==
           int(ds.get("resumes", -1)),
           f"{len(handed)} results from p0, router {router}, d0 {ds}")
    expect("kill prefill: streams were cut (d0 counts failed KV transfers)", cut > 0, ds)
    # d0's pulls to frozen p0 were still in their handshake, so CAF tells d0
    # nothing when p0 dies: the router, which lost p0's stage, does. Without
    # that each would end at its pull's 10 s timeout ("timed_out").
    ended = [l for l in d0.stderr().splitlines() if "KV stream of request" in l and "failed" in l]
    expect("kill prefill: every cut stream ended on the news of p0's death, none by timeout",
           len(ended) == cut and all("the KV sender's stage is gone" in l or "the KV sender went down" in l
                                     for l in ended), ended[:3])
    got, served = int(ds.get("kv_blocks_got", 0)), int(kv.get("kv_blocks_served", 0))
    expect("kill prefill: the store served the cut streams' blocks (d0 got every block it served)",
           got > 0 and served == got, f"d0 kv_blocks_got={got}, store kv_blocks_served={served}")
    wrong = [r["id"] for r in handed if not same_as_mono(r)]
    expect("kill prefill: every request p0 handed off, cut streams included, finishes with mono's "
           "tokens and logits",
           not wrong and len(handed) >= cut, f"differ or failed: {wrong[:10]}")
    unclear = [r for r in failed if "unavailable: no live prefill" not in r["error"]]
    expect("kill prefill: the requests p0 had not handed off fail unavailable (no prefill left)",
           not unclear and len(finished) == len(handed), unclear[:3])
    print(f"     {len(finished)} finished, {len(failed)} failed (no prefill left); d0: "
          f"{ds.get('kv_transfers_received')} streams in, {cut} cut, {got} blocks from the store; "
          f"head done {t_done - t_kill:.2f} s after the kill")
    stop_all()

    # ---- (d) SIGSTOP of a decode node: heartbeats drop it, its work ends elsewhere ----
    out = os.path.join(WORK, "stop.jsonl")
    head, port = start_head(["--requests", req_path, "--out", out, "--wait-stages", "3", "--set",
                             "decoders=2"], tag="stop_")
    expect("stop: head listens", port is not None, head.stderr())
    p0 = worker("p0", port, tag="stop_", sets=["decoders=2"])
    d0 = worker("d0", port, tag="stop_", sets=["decoders=2"], extra=["--max-seqs", "1"])
    d1 = worker("d1", port, tag="stop_", sets=["decoders=2"], extra=["--max-seqs", "1"])
    submitted = head.wait_line(r"submitted (\d+) requests", timeout=60)
    t_stop = time.time()
    d0.freeze()
    rc = head.wait(120)
    herr = head.stderr()
    d0.thaw()
    results = read_results(out)
    expect("stop: every request ends (none hangs), head exits 0",
           submitted is not None and rc == 0 and len(results) == 100, f"rc={rc} {herr}")
    finished = [r for r in results if "error" not in r]
    failed = [r for r in results if "error" in r]
    wrong = [r["id"] for r in results if not same_as_mono(r)]
    expect("stop: every request finishes with mono's tokens and logits (d1 lives: no failure allowed)",
           not wrong and len(results) == 100,
           f"{len(failed)} failed {[(r['id'], r['error']) for r in failed[:5]]}, differ: {wrong[:10]}")
    m = re.search(r"node d0 lost its decode stage \((.*)\) at ([0-9.]+)", herr)
    router = stats_of(herr, "router")
    expect("stop: the head drops the frozen node (heartbeat timeout) and re-places its requests",
           m is not None and int(router.get("stage_downs", 0)) == 1 and
           int(router.get("replacements", 0)) > 0, herr)
    if m:
        print(f"     detection {1e3 * (float(m.group(2)) - t_stop):.1f} ms after SIGSTOP ({m.group(1)}); "
              f"{len(finished)} finished, {len(failed)} failed, {router.get('replacements')} re-placed")
finally:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
    stop_all()

print(f"{len(failures)} failures" if failures else "all node checks passed")
sys.exit(1 if failures else 0)
