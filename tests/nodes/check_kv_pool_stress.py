#!/usr/bin/env python3
"""The KV pool under churn (tests/nodes/kv_pool.lua with nodes A, B, C): an
HTTP head (round robin, the pool's directory store) and three nodes, each a
colocated stage with a kv_store whose memory tiers hold only a few blocks, so
blocks come and go while requests that share 12 long prefixes arrive over
time on 6 client threads (fixed seeds: which prefix, the gaps, the tails).
Every answer (text, per-token logprobs, finish reason) must equal the one
`cleave serve` process (mono) gives the same request.

1. The index follows the stores: blocks are fetched from other nodes and
   dropped by their LRU, no fetched block is corrupt, and at the end the
   index names no more distinct blocks than the stores hold.
2. A stale index (--kv-fault-stale-index on every node: a store never tells
   the index what it dropped): readers ask holders for blocks they no longer
   have, get short answers and compute the rest; the answers do not change.
3. kv_preload = false: the router preloads nothing, the answers do not change.
4. Two requests one after the other that end at their first token, on two
   nodes: the second imports the first one's prompt blocks.
5. kv_replicate_reads 1 keeps the fetched blocks on the reader's node, 2^20
   keeps none (no preloads, which always keep).

usage: check_kv_pool_stress.py CLEAVE VOCAB WORKDIR"""
import os
import random
import re
import signal
import sys
import threading
import time

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "kv_pool.lua")
sys.path.insert(0, HERE)
from node_process import NodeProcess, expect, failures, make_model, stats_of, stop_all, mono_answers, post_completion  # noqa: E402,E501

os.makedirs(WORK, exist_ok=True)
MODEL = os.path.join(WORK, "gqa4.gguf")
make_model(CLEAVE, VOCAB, MODEL, "--dim", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
           "--ctx", "512")

PREFIXES, PREFIX_LEN, N, THREADS = 12, 64, 96, 6
WORKERS = ["A", "B", "C"]
# Each worker store's two memory tiers: 80 KiB each, 5 blocks of this
# model (16 tokens x 4 layers x 2 kv heads x 16 dims x K and V in F32 = 16 KiB
# and its header), far fewer than the 12 x 4 prefix blocks.
TIER = 80 * 1024


def requests():
    rng = random.Random(16)
    out = []
    for i in range(N):
        k = rng.randrange(PREFIXES)
        prefix = [1] + [200 + (37 * k + 11 * j) % 3000 for j in range(PREFIX_LEN)]
        tail = [400 + rng.randrange(2000) for _ in range(rng.randrange(1, 10))]
        body = {"model": "gqa4", "prompt": prefix + tail, "max_tokens": rng.randrange(3, 8), "logprobs": 1}
        if i % 2:
            body.update(temperature=0.8, seed=i)
        else:
            body.update(temperature=0)
        out.append(body)
    return out


REQS = requests()
# Two requests one after the other over a prefix no other request has, each
# ending at its first token: round robin puts them on two nodes.
FIRST_TOKEN = [{"model": "gqa4", "prompt": [1] + [3100 + j for j in range(PREFIX_LEN)] + [tail], "max_tokens": 1,
                "temperature": 0, "logprobs": 1} for tail in (501, 502)]
GAPS = [random.Random(17 + t).uniform(0.0, 0.03) for t in range(N)]


def post(base, body):
    return post_completion(base, body)


def send_all(base):
    """Every request, THREADS at a time, each thread sleeping its fixed gap
    before its next one; answers by request index."""
    answers = [None] * N
    nxt = [0]
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= N:
                return
            time.sleep(GAPS[i])
            answers[i] = post(base, REQS[i])
    ts = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return answers


def mono():
    return mono_answers(CLEAVE, MODEL, REQS + FIRST_TOKEN, os.path.join(WORK, "mono.err"))


def cluster(tag, sets=(), extra=(), send=None):
    """The answers (of send(url), default send_all), the head's stderr and
    each worker's stderr."""
    common = ["--topology", TOPOLOGY, "-m", MODEL, "-t", "1", "--set", "b=1", "--set", f"tier={TIER}", *sets]
    head = NodeProcess([CLEAVE, "node", *common, "--name", "head", "--http-port", "0"],
                       os.path.join(WORK, tag + "head.err"))
    m = head.wait_line(r"listening on ([0-9.]+):(\d+)")
    expect(tag + "head prints its port", m is not None, head.stderr())
    port = m.group(2) if m else "1"
    url = head.wait_line(r"listening on (http://[0-9.]+:\d+)", 30)
    expect(tag + "head serves HTTP", url is not None, head.stderr())
    workers = {}
    for i, name in enumerate(WORKERS):
        workers[name] = NodeProcess([CLEAVE, "node", *common, "--name", name, "--set", f"head_port={port}",
                                     "--join-timeout", "20", "--no-rejoin", *extra],
                                    os.path.join(WORK, tag + name + ".err"))
    deadline = time.time() + 60
    def joined():
        err = head.stderr()
        return min(err.count("joined the pool"), len(re.findall(r"node \w+ joined$", err, re.M)))
    while joined() < len(WORKERS) and time.time() < deadline:
        time.sleep(0.05)
    expect(tag + "every worker and its store joined", joined() >= len(WORKERS), head.stderr()[-1500:])
    answers = (send or send_all)(url.group(1)) if url else []
    head.proc.send_signal(signal.SIGTERM)
    rc = head.wait(60)
    for w in workers.values():
        w.wait(30)
    stop_all()
    return rc, answers, head.stderr(), {n: w.stderr() for n, w in workers.items()}


def totals(werr, key):
    return sum(stats_of(e, "kv_store").get(key, 0) for e in werr.values())


def differ(got, want):
    return [i for i in range(N) if i >= len(got) or got[i] != want[i]][:10]


try:
    want = mono()
    expect("mono answered every request", len(want) == N + 2 and all("error" not in a for a in want), want[:3])

    # 1. The index follows the stores.
    rc, got, err, werr = cluster("fresh_")
    expect("1. every answer equals mono's (text, logprobs, finish reason)", got == want[:N], differ(got, want))
    head_store = stats_of(err, "kv_store")
    stages = [stats_of(e, f"{n}/colocated/0") for n, e in werr.items()]
    expect("1. blocks were fetched from other nodes, none corrupt, and dropped by the tiers' LRU",
           totals(werr, "pool_blocks_fetched") > 0 and totals(werr, "pool_blocks_corrupt") == 0 and
           totals(werr, "store_drops") > 0 and sum(s.get("pool_blocks_got", 0) for s in stages) > 0,
           {n: stats_of(e, "kv_store") for n, e in werr.items()})
    held = totals(werr, "kv_blocks_held") + head_store.get("kv_blocks_held", 0)
    expect("1. the index names no more distinct blocks than the stores hold",
           0 < head_store.get("pool_index_blocks", 0) <= held, (head_store, held))
    expect("1. every stage served requests", all(s.get("requests", 0) > 0 for s in stages), stages)

    # 2. A stale index: short answers, the rest computed, the same answers.
    rc, got, err, werr = cluster("stale_", extra=["--kv-fault-stale-index"])
    expect("2. stale index: every answer equals mono's", got == want[:N], differ(got, want))
    head_store = stats_of(err, "kv_store")
    held = totals(werr, "kv_blocks_held") + head_store.get("kv_blocks_held", 0)
    expect("2. the index names blocks no store holds, readers got short answers, none corrupt",
           head_store.get("pool_index_blocks", 0) > held and totals(werr, "pool_short_answers") > 0 and
           totals(werr, "pool_blocks_corrupt") == 0, (head_store, held, totals(werr, "pool_short_answers")))

    # 3. No preloads.
    rc, got, err, werr = cluster("nopreload_", sets=["--set", "preload=0"])
    expect("3. kv_preload = false: every answer equals mono's", got == want[:N], differ(got, want))
    r = stats_of(err, "router")
    expect("3. kv_preload = false: the router preloaded nothing, the stores fetched on demand",
           r.get("preloads", 1) == 0 and totals(werr, "preloads") == 0 and totals(werr, "pool_blocks_fetched") > 0,
           (r, totals(werr, "preloads")))

    # 4. A prompt whose request ends at its first token is in the pool too
    # (the stage saves a finishing request's blocks before its sequence
    # closes): the second request, on another node, imports the 4 blocks.
    def one_by_one(base):
        out = []
        for body in FIRST_TOKEN:
            out.append(post(base, body))
            time.sleep(0.3)  # the index hears of the blocks from the store, not with the answer
        return out
    rc, got, err, werr = cluster("first_token_", send=one_by_one)
    expect("4. first-token requests: both answers equal mono's", got == want[N:], (got, want[N:]))
    stages = [stats_of(e, f"{n}/colocated/0") for n, e in werr.items()]
    expect("4. the second request imported the first one's 4 prompt blocks from the other node",
           sum(s.get("pool_blocks_got", 0) for s in stages) == 4 and
           sorted(s.get("requests", 0) for s in stages) == [0, 1, 1], stages)

    # 5. kv_replicate_reads: without preloads, a block fetched that many
    # times for a node's stages is kept there (1: at once; 2^20: never).
    for reads, kept in ((1, 4), (1 << 20, 0)):
        rc, got, err, werr = cluster(f"replicate{reads}_", sets=["--set", "preload=0", "--set", f"replicate={reads}"],
                                     send=one_by_one)
        expect(f"5. kv_replicate_reads {reads}: both answers equal mono's", got == want[N:], (got, want[N:]))
        expect(f"5. kv_replicate_reads {reads}: the reader's store fetched 4 blocks and kept {kept}",
               totals(werr, "pool_blocks_fetched") == 4 and totals(werr, "pool_replicas") == kept,
               {n: stats_of(e, "kv_store") for n, e in werr.items()})
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all KV pool stress checks passed")
sys.exit(1 if failures else 0)
