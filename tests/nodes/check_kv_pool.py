#!/usr/bin/env python3
"""The distributed KV pool across processes (tests/nodes/kv_pool.lua): a head
(router and the pool's directory store) and nodes A and C with a kv_store
each, real processes on loopback, a 4-layer GQA model. Every comparison is of
the tokens, text and per-step logits hashes against one
`cleave generate --requests` process (mono).

1. A computes: requests sharing a few long prefixes run on A alone; A's store
   keeps their blocks in its RocksDB directory.
2. A restarts as a store only (from that directory) and C joins: the same
   prompts run on C, whose store fetches the prefixes from A (counters on C's
   stage and store and on A's store) on A's KV data socket instead of
   computing them.
3. A serves corrupt blocks (a flipped byte in each): C's store catches every
   one, computes instead, the tokens do not change.
4. A is killed -9 while C runs prompts whose prefixes only A held: every
   request finishes with the mono bits, and the directory dropped A.

usage: check_kv_pool.py CLEAVE VOCAB WORKDIR"""
import json
import os
import shutil
import signal
import sys
import time

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "kv_pool.lua")
sys.path.insert(0, HERE)
from node_process import NodeProcess, expect, failures, make_model, mono_results, results, stats_of, stop_all  # noqa: E402,E501

os.makedirs(WORK, exist_ok=True)
MODEL = os.path.join(WORK, "gqa4.gguf")
make_model(CLEAVE, VOCAB, MODEL, "--dim", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
           "--ctx", "512")
A_DIR = os.path.join(WORK, "a_rocksdb")
shutil.rmtree(A_DIR, ignore_errors=True)


def write_requests(path, n, prefixes, prefix_len, first_id=0, salt=0):
    """n requests over `prefixes` shared prefixes of prefix_len tokens, each
    with a tail of its own; greedy and sampled."""
    with open(path, "w") as f:
        for i in range(n):
            k = i % prefixes
            prefix = [1] + [200 + (37 * k + 11 * j + salt) % 3000 for j in range(prefix_len)]
            tail = [400 + (13 * i + j) % 2000 for j in range(1 + i % 7)]
            f.write(json.dumps({"id": first_id + i, "prompt_ids": prefix + tail, "max_tokens": 6,
                                "temperature": 0 if i % 2 else 0.8, "seed": i}) + "\n")


def mono(req):
    return mono_results(CLEAVE, MODEL, req)


def cluster(tag, req, out, sets, workers, stages, extra=None, freeze=()):
    """The head runs req once `stages` stages joined; workers: names (A, C);
    those in `freeze` are stopped (SIGSTOP) once their store is in the pool."""
    common = ["--topology", TOPOLOGY, "-m", MODEL, "-t", "1", *sets]
    head = NodeProcess([CLEAVE, "node", *common, "--name", "head", "--requests", req, "--out", out,
                        "--wait-stages", str(stages)], os.path.join(WORK, tag + "head.err"))
    m = head.wait_line(r"listening on ([0-9.]+):(\d+)")
    expect(tag + "head prints its port", m is not None, head.stderr())
    port = m.group(2) if m else "1"
    procs = {}
    for i, name in enumerate(workers):
        procs[name] = NodeProcess([CLEAVE, "node", *common, "--name", name, "--set", f"head_port={port}",
                                   "--join-timeout", "20", "--no-rejoin", *(extra or {}).get(name, [])],
                                  os.path.join(WORK, tag + name + ".err"))
        # The next node starts once this one's store is in the pool, so the
        # requests (they start when the stages are there) find its blocks.
        deadline = time.time() + 30
        while head.stderr().count("joined the pool") < i + 1 and time.time() < deadline:
            time.sleep(0.05)
        expect(f"{tag}{name}'s store joined the pool", head.stderr().count("joined the pool") >= i + 1,
               head.stderr()[-1000:])
        if name in freeze:
            procs[name].freeze()
    return head, procs


def run(tag, req, sets, workers, stages, extra=None, during=None, freeze=()):
    out = os.path.join(WORK, tag + "out.jsonl")
    head, procs = cluster(tag, req, out, sets, workers, stages, extra, freeze)
    if during:
        during(head, procs)
    rc = head.wait(300)
    for w in procs.values():
        w.wait(30)
    stop_all()
    return rc, head.stderr(), {n: w.stderr() for n, w in procs.items()}, results(out)


try:
    # 1. A computes 24 requests over 4 prefixes of 96 tokens (6 blocks each).
    req1 = os.path.join(WORK, "prefixes.jsonl")
    write_requests(req1, 24, 4, 96)
    ref1 = mono(req1)
    rc, err, werr, got = run("compute_", req1, ["--set", "c=0", "--set", f"a_dir={A_DIR}"], ["A"], 1)
    expect("1. A alone gives mono's tokens, text and logits hashes", rc == 0 and got == ref1,
           f"rc={rc} {err[-1500:]}")
    a = stats_of(werr["A"], "kv_store")
    expect("1. A's store kept the prefixes' blocks", a.get("kv_blocks_stored", 0) >= 24, a)

    # 2. A restarts as a store from its directory; the prompts run on C.
    req2 = os.path.join(WORK, "again.jsonl")
    write_requests(req2, 24, 4, 96, first_id=100)
    ref2 = mono(req2)
    rc, err, werr, got = run("restart_", req2, ["--set", "a_stage=0", "--set", f"a_dir={A_DIR}"], ["A", "C"], 1)
    expect("2. C after A's restart gives mono's tokens, text and logits hashes", rc == 0 and got == ref2,
           f"rc={rc} {err[-1500:]}")
    c_stage = stats_of(werr["C"], "C/colocated/0")
    c_store = stats_of(werr["C"], "kv_store")
    a_store = stats_of(werr["A"], "kv_store")
    expect("2. C's stage got the prefixes from the pool, not computed (imported tokens)",
           c_stage.get("pool_blocks_got", 0) >= 4 * 6 and c_stage.get("imported_tokens", 0) >= 4 * 96, c_stage)
    expect("2. C's store fetched them from A's restarted store, every one verified",
           c_store.get("pool_blocks_fetched", 0) >= 4 * 6 and c_store.get("pool_blocks_corrupt", 1) == 0 and
           a_store.get("peer_blocks_served", 0) >= 4 * 6, (c_store, a_store))
    expect("2. the blocks came on A's KV data socket (offers read by C), not as CAF messages",
           a_store.get("peer_offers", 0) > 0 and c_store.get("pool_socket_reads", 0) == a_store.get("peer_offers")
           and a_store.get("peer_gets", 1) == 0, (c_store, a_store))

    # 3. A's blocks arrive corrupt: caught at C, computed instead.
    rc, err, werr, got = run("corrupt_", req2, ["--set", "a_stage=0", "--set", f"a_dir={A_DIR}"], ["A", "C"], 1,
                             extra={"A": ["--kv-fault-corrupt-served"]})
    expect("3. with A serving corrupt blocks C still gives mono's bits", rc == 0 and got == ref2,
           f"rc={rc} {err[-1500:]}")
    c_store = stats_of(werr["C"], "kv_store")
    c_stage = stats_of(werr["C"], "C/colocated/0")
    # (C may still import blocks its own store kept of what C computed.)
    expect("3. C's store caught the corrupt blocks and accepted none of A's",
           c_store.get("pool_blocks_corrupt", 0) > 0 and c_store.get("pool_blocks_fetched", 1) == 0 and
           c_store.get("pool_replicas", 1) == 0, (c_store, c_stage))

    # 4. A killed -9 while C runs: prefixes A held cost a recompute, nothing
    # fails. A is frozen from the moment its store is in the pool, so C's
    # first fetches from it are still waiting when it dies, however fast
    # the rest would run.
    def kill_a(head, procs):
        head.wait_line(r"submitted", timeout=60)
        time.sleep(0.05)
        procs["A"].proc.send_signal(signal.SIGKILL)
    rc, err, werr, got = run("kill_", req2, ["--set", "a_stage=0", "--set", f"a_dir={A_DIR}"], ["A", "C"], 1,
                             during=kill_a, freeze=("A",))
    expect("4. A killed -9 mid-run: every request has mono's bits", rc == 0 and got == ref2,
           f"rc={rc} {err[-1500:]}")
    h = stats_of(err, "kv_store")
    r = stats_of(err, "router")
    expect("4. the directory dropped A's store and no request failed",
           h.get("pool_members", 0) == 2 and r.get("failures", 1) == 0, (h, r))

    # 5. kv_aware placement over the pool, A (a stage over its restarted
    # store) and C (a fresh stage). With the default fetch_weight (0.05 a
    # block) the first request of a prefix lands on A, where its KV is, and
    # once A is loaded the next go to C and their KV moves there (fetched,
    # preloaded by the router); with fetch_weight 100 a fetch costs more than
    # any load here and every request stays on A.
    def placed(weight):
        rc, err, werr, got = run(f"place{weight}_", req2, ["--set", f"a_dir={A_DIR}",
                                                         "--set", f"fetch_weight={weight}"], ["A", "C"], 2)
        expect(f"5. kv_aware, fetch_weight {weight}: mono's tokens, text and logits hashes",
               rc == 0 and got == ref2, f"rc={rc} {err[-1500:]}")
        return (stats_of(werr["A"], "A/colocated/0"), stats_of(werr["C"], "C/colocated/0"),
                stats_of(werr["C"], "kv_store"), stats_of(err, "router"))
    a_st, c_st, c_store, r = placed(0.05)
    expect("5. fetch_weight 0.05: requests on A (its KV) and on C (KV fetched and preloaded there)",
           a_st.get("requests", 0) > 0 and c_st.get("requests", 0) > 0 and c_st.get("pool_blocks_got", 0) > 0 and
           r.get("preloads", 0) > 0 and c_store.get("preloads", 0) > 0 and c_store.get("pool_blocks_fetched", 0) > 0,
           (a_st.get("requests"), c_st.get("requests"), c_st.get("pool_blocks_got"), r.get("preloads"), c_store))
    a_st, c_st, c_store, r = placed(100)
    expect("5. fetch_weight 100: every request lands where its KV is (A), nothing fetched",
           a_st.get("requests", 0) == 24 and c_st.get("requests", 1) == 0 and c_store.get("pool_fetches", 1) == 0,
           (a_st.get("requests"), c_st.get("requests"), c_store))
finally:
    stop_all()

print("FAILED: " + ", ".join(failures) if failures else "all KV pool node checks passed")
sys.exit(1 if failures else 0)
