#!/usr/bin/env python3
"""Many streams against real servers, with aiohttp clients on loopback.

1. 1,000 concurrent streaming clients on one `cleave serve`: every stream
   ends with [DONE] and the single-request text; /health stays responsive
   while they run; the server's RSS stays bounded.
2. A client that goes away mid-stream: its request is cancelled (the
   router's and the metric's cancelled counters go up) and its KV freed.
3. A cluster (head with --http-port, one prefill node, two decode nodes),
   200 streams, kill -9 of a decode node while they run: every stream
   either completes with the single-process text or ends with an error
   event then [DONE]; none hangs. Then the last decoder is killed under 20
   streams: those cut short end with an error event, then [DONE].

  check_streams.py CLEAVE LM CLUSTER_LUA WORKDIR [RSS_BOUND_MIB]

RSS_BOUND_MIB (default 256) bounds the server's RSS growth under the 1,000
streams; sanitizer builds pass a larger one (ASan's shadow memory and
quarantine are not the server's).
"""
import asyncio
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nodes"))
from node_process import NodeProcess, expect, failures, stop_all  # noqa: E402

PROMPTS = ["describe", "how many shapes", "how many red shapes", "how many circles"]


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def body(i, max_tokens, stream=True):
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


PROGRESS = {"chunks": 0}


async def stream_one(session, url, b, timeout, spans=None):
    """(text, saw_done, error event or None, first-token time). spans gets
    (headers received, stream ended) of the response."""
    text, done, error, first = "", False, None, None
    async with session.post(url + "/v1/completions", json=b, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        opened = time.monotonic()
        if r.status != 200:
            return text, done, {"status": r.status, "body": await r.text()}, first
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"]
                continue
            if first is None:
                first = time.monotonic()
            PROGRESS["chunks"] += 1
            text += obj["choices"][0]["text"]
    if spans is not None:
        spans.append((opened, time.monotonic()))
    return text, done, error, first


async def reference_texts(url, n_prompts, max_tokens):
    async with aiohttp.ClientSession() as s:
        out = []
        for i in range(n_prompts):
            async with s.post(url + "/v1/completions", json=body(i, max_tokens, stream=False)) as r:
                out.append((await r.json())["choices"][0]["text"])
        return out


def start_serve(cleave, lm, workdir, name, extra):
    p = NodeProcess([cleave, "serve", "-m", lm, "--port", "0", "-t", "1", "--metrics", *extra],
                    os.path.join(workdir, name + ".err"))
    m = p.wait_line(r"listening on (http://[0-9.]+:\d+)", 60)
    if not m:
        raise SystemExit(f"{name} did not start: " + open(p.err_path).read()[-3000:])
    return p, m.group(1)


async def metric(session, url, name):
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def thousand_streams(cleave, lm, workdir, rss_bound):
    n, max_tokens = 1000, 100
    p, url = start_serve(cleave, lm, workdir, "serve1000", ["--parallel", "64", "--max-pending", "2048"])
    want = await reference_texts(url, len(PROMPTS), max_tokens)
    rss0 = rss_mib(p.proc.pid)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.monotonic()
        spans = []
        tasks = [asyncio.create_task(stream_one(s, url, body(i, max_tokens), 300, spans)) for i in range(n)]
        health, peak = [], rss0
        while not all(t.done() for t in tasks):
            h0 = time.monotonic()
            async with s.get(url + "/health") as r:
                await r.read()
                ok = r.status == 200
            health.append((time.monotonic() - h0, ok))
            peak = max(peak, rss_mib(p.proc.pid))
            await asyncio.sleep(0.1)
        results = [t.result() for t in tasks]
        wall = time.monotonic() - t0
    good = sum(1 for i, (text, done, err, _) in enumerate(results)
               if done and err is None and text == want[i % len(PROMPTS)])
    expect(f"1000 streams: all {n} end with [DONE] and the single-request text", good == n,
           f"{good} of {n}; first bad: " + str(next((r for i, r in enumerate(results)
                                                     if not (r[1] and r[2] is None and r[0] == want[i % 4])), None)))
    # How many responses were open at once (status line in, [DONE] not yet).
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    open_now = overlap = 0
    for _, d in edges:
        open_now += d
        overlap = max(overlap, open_now)
    expect("1000 streams: at least 950 responses open at the same time", overlap >= 950, overlap)
    worst = max(h[0] for h in health) if health else 0
    expect("1000 streams: /health answered 200 within 1 s throughout",
           all(ok for _, ok in health) and worst < 1.0, f"worst {worst:.3f} s over {len(health)} probes")
    expect(f"1000 streams: server RSS growth under {rss_bound} MiB", peak - rss0 < rss_bound,
           f"RSS {rss0:.0f} -> peak {peak:.0f} MiB")
    print(f"1000 streams: {wall:.1f} s wall, RSS {rss0:.0f} -> peak {peak:.0f} MiB, "
          f"worst /health {worst * 1e3:.0f} ms over {len(health)} probes, {overlap} open at once", flush=True)

    # A client that disconnects mid-stream cancels its request.
    async with aiohttp.ClientSession() as s:
        before = await metric(s, url, "cleave_requests_cancelled_total")
        async with s.post(url + "/v1/completions", json=body(0, 100)) as r:
            async for raw in r.content:
                if raw.startswith(b"data: {"):
                    break  # one token arrived; go away
        cancelled, used = before, 1.0
        for _ in range(100):
            await asyncio.sleep(0.05)
            cancelled = await metric(s, url, "cleave_requests_cancelled_total")
            used = await metric(s, url, "cleave_kv_cache_usage_perc")
            if cancelled > before and used == 0:
                break
        expect("disconnect: the request is cancelled (cleave_requests_cancelled_total + 1)",
               cancelled == before + 1, f"{before} -> {cancelled}")
        expect("disconnect: its KV is freed (cleave_kv_cache_usage_perc back to 0)", used == 0, used)
    p.proc.send_signal(signal.SIGTERM)
    p.proc.wait(20)
    return want


async def failover(cleave, lm, script, workdir, max_tokens):
    want = None
    ref, url = start_serve(cleave, lm, workdir, "reference", [])
    want = await reference_texts(url, len(PROMPTS), max_tokens)
    ref.proc.send_signal(signal.SIGTERM)
    ref.proc.wait(20)

    # Killed nodes are seen at once (their sockets close); the connection
    # timeout only drops frozen ones, and at the default 0.5 s a survivor
    # busy taking over the killed decoder's streams on a loaded 2-core CI
    # machine was once dropped too (its link to the head timed out 0.7 s
    # after the kill), which is not what this test is about.
    common = ["-m", lm, "-t", "1", "--topology", script, "--set", "prefills=1", "--set", "decoders=2",
              "--set", "connection_timeout_s=2"]
    head = NodeProcess([cleave, "node", "--name", "head", *common, "--http-port", "0"],
                       os.path.join(workdir, "head.err"))
    m = head.wait_line(r"head listening on [0-9.]+:(\d+)", 30)
    expect("cluster: the head listens", m is not None, open(head.err_path).read()[-2000:])
    if not m:
        return
    port = m.group(1)
    http = head.wait_line(r"listening on (http://[0-9.]+:\d+)", 30).group(1)
    workers = {}
    for name in ["p0", "d0", "d1"]:
        w = NodeProcess([cleave, "node", "--name", name, *common, "--set", f"head_port={port}"],
                        os.path.join(workdir, name + ".err"))
        expect(f"cluster: {name} joins", w.wait_line(r"joined", 30) is not None, open(w.err_path).read()[-2000:])
        workers[name] = w
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        # Wait until both decoders are attached (a request placed on each).
        deadline = time.time() + 30
        while time.time() < deadline:
            async with s.get(http + "/metrics") as r:
                text = await r.text()
            if re.search(r'cleave_actor_stat\{actor="router",name="alive_decode"\} 2', text):
                break
            await asyncio.sleep(0.1)
        n = 200
        tasks = [asyncio.create_task(stream_one(s, http, body(i, max_tokens), 120)) for i in range(n)]
        # Kill a decoder once streams are in full swing.
        PROGRESS["chunks"] = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and PROGRESS["chunks"] < n * 3:
            await asyncio.sleep(0.005)
        done_before = sum(1 for t in tasks if t.done())
        workers["d1"].proc.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 180)
        wall = time.monotonic() - t_kill
    hangs = sum(1 for r in results if isinstance(r, BaseException))
    same = sum(1 for i, r in enumerate(results) if not isinstance(r, BaseException)
               and r[1] and r[2] is None and r[0] == want[i % len(PROMPTS)])
    errored = sum(1 for r in results if not isinstance(r, BaseException) and r[1] and r[2] is not None)
    expect("failover: some streams were still running at the kill", done_before < n, done_before)
    expect("failover: no stream hangs or breaks without [DONE]", hangs == 0,
           next((r for r in results if isinstance(r, BaseException)), None))
    expect("failover: every stream completes with the single-process text or ends with an error event",
           same + errored == n, f"{same} same, {errored} errors, {n - same - errored} other")
    print(f"failover: {done_before} done at the kill, then {same} same text, {errored} error events, "
          f"{hangs} hung, all ended {wall:.1f} s after the kill", flush=True)

    # The last decoder killed under 20 streams: the streams that had begun
    # end with an error event, then [DONE] (the error comes after the status
    # line); none hangs.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        n = 20
        PROGRESS["chunks"] = 0
        tasks = [asyncio.create_task(stream_one(s, http, body(i, max_tokens), 120)) for i in range(n)]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and PROGRESS["chunks"] < n * 2:
            await asyncio.sleep(0.005)
        workers["d0"].proc.send_signal(signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
    broken = [r for r in results if isinstance(r, BaseException) or not r[1]]
    errors = [r[2] for r in results if not isinstance(r, BaseException) and r[2] is not None]
    expect("no decoder left: every stream ends with [DONE]", not broken, broken[:1])
    expect("no decoder left: the streams cut short end with an OpenAI error event",
           len(errors) > 0 and all(isinstance(e, dict) and e.get("message") and e.get("type") for e in errors),
           errors[:2])
    print(f"no decoder left: {len(errors)} of {n} streams ended with an error event, e.g. "
          f"{errors[0] if errors else None}", flush=True)


def main():
    cleave, lm, script, workdir = sys.argv[1:5]
    rss_bound = float(sys.argv[5]) if len(sys.argv) > 5 else 256
    os.makedirs(workdir, exist_ok=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    try:
        asyncio.run(thousand_streams(cleave, lm, workdir, rss_bound))
        asyncio.run(failover(cleave, lm, script, workdir, 120))
    finally:
        stop_all()
    if failures:
        print("FAILED: " + ", ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
