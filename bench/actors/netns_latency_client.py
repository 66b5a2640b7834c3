"""The client of netns_latency.py, run on the head's host: reads the request
bodies (JSON) on stdin, posts them one at a time to BASE with streaming and
prints {"ttft": [...], "handoff": [...], "tpot": [...]} in seconds: the
first token, the gap to the second (the decoder's first, after the
hand-off), and the mean gap after it.

usage: netns_latency_client.py BASE < bodies.json"""
import json
import sys
import time
import urllib.request


def stream_times(base, body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"text"' in line:
                stamps.append(time.perf_counter())
    if len(stamps) < 3:
        raise RuntimeError(f"{len(stamps)} streamed chunks")
    # The second token is the decoder's first: it waits for the hand-off.
    return stamps[0] - t0, stamps[1] - stamps[0], (stamps[-1] - stamps[1]) / (len(stamps) - 2)


out = {"ttft": [], "handoff": [], "tpot": []}
for body in json.load(sys.stdin):
    t, h, p = stream_times(sys.argv[1], body)
    out["ttft"].append(t)
    out["handoff"].append(h)
    out["tpot"].append(p)
print(json.dumps(out))
