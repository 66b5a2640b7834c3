#!/usr/bin/python3
"""bench/serve/serve_bench.py against a fake OpenAI streaming server (aiohttp,
in a thread) that emits tokens at known delays (TTFT 50 ms, 10 ms between
tokens): the measured TTFT / TPOT / ITL / E2E match, output lengths are
exact, goodput counts only requests that meet every SLO (a slow first token,
slow tokens, an HTTP 500 and an in-stream error event are left out), errors
are counted, sweeps write one JSON with every rate, and plot_serve.py draws
them. Also the arrival process, percentiles and the synthetic dataset.

usage: serve_bench_selftest.py [WORKDIR]     (exit 0: all passed)
"""
import asyncio
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from aiohttp import web

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH_DIR = os.path.join(HERE, "..", "..", "bench", "serve")
BENCH = os.path.join(BENCH_DIR, "serve_bench.py")
PLOT = os.path.join(BENCH_DIR, "plot_serve.py")

TTFT_S = 0.050
ITL_S = 0.010

failures = []


def check(cond, what):
    if cond:
        print(f"  ok    {what}")
    else:
        print(f"  FAIL  {what}")
        failures.append(what)


def load_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeServer:
    """POST /v1/completions, stream=true. behave(i, payload) gives the i-th
    request (in arrival order) a dict that may override ttft, itl, status
    (non-200: an error body instead of a stream) and error_after (an error
    event after that many tokens)."""

    def __init__(self, behave=None):
        self.behave = behave or (lambda i, p: {})
        self.payloads = []
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        fut.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(self, request):
        payload = await request.json()
        with self.lock:
            i = len(self.payloads)
            self.payloads.append(payload)
        b = {"ttft": TTFT_S, "itl": ITL_S, "status": 200, "error_after": None}
        b.update(self.behave(i, payload))
        if b["status"] != 200:
            return web.json_response({"error": {"message": "fake failure", "type": "server_error"}},
                                     status=b["status"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(b": keep-alive\n\n")  # a comment: not a token
        n = int(payload["max_tokens"])

        def chunk(obj):
            return ("data: " + json.dumps(obj) + "\n\n").encode()

        start = time.perf_counter()
        for k in range(n):
            # Sleep to an absolute schedule so the delays do not add up.
            due = start + b["ttft"] + k * b["itl"]
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if b["error_after"] is not None and k == b["error_after"]:
                await resp.write(chunk({"error": {"message": "engine failed", "type": "server_error"}}))
                await resp.write(b"data: [DONE]\n\n")
                return resp
            await resp.write(chunk({"id": f"cmpl-{i}", "object": "text_completion", "model": "fake",
                                    "choices": [{"index": 0, "text": f" t{k}", "logprobs": None,
                                                 "finish_reason": None}]}))
        await resp.write(chunk({"id": f"cmpl-{i}", "object": "text_completion", "model": "fake",
                                "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
        prompt = payload["prompt"]
        await resp.write(chunk({"id": f"cmpl-{i}", "object": "text_completion", "model": "fake",
                                "choices": [], "usage": {
                                    "prompt_tokens": len(prompt) if isinstance(prompt, list) else 0,
                                    "completion_tokens": n, "total_tokens": n}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


def run_bench(args, work, name):
    out = os.path.join(work, name + ".json")
    cmd = [sys.executable, BENCH, *args, "--json", out]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print("    $ " + " ".join(cmd[1:]))
    for ln in p.stdout.splitlines():
        print("    | " + ln)
    if p.stderr.strip():
        print("    stderr: " + p.stderr.strip()[-2000:])
    doc = None
    if os.path.exists(out):
        with open(out) as fh:
            doc = json.load(fh)
    return p.returncode, doc, out


def test_units(sb):
    print("== units: arrivals, percentiles, dataset")
    t = sb.arrival_times(20000, 50.0, 7)
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean_gap = sum(gaps) / len(gaps)
    check(abs(mean_gap - 0.02) < 0.02 * 0.03, f"Poisson at 50/s: mean gap {mean_gap * 1000:.3f} ms ~ 20 ms")
    cv = math.sqrt(sum((g - mean_gap) ** 2 for g in gaps) / len(gaps)) / mean_gap
    check(abs(cv - 1.0) < 0.05, f"exponential gaps: coefficient of variation {cv:.3f} ~ 1")
    check(t[0] == 0.0 and t == sb.arrival_times(20000, 50.0, 7), "arrivals start at 0, same for the same seed")
    check(t != sb.arrival_times(20000, 50.0, 8), "another seed, other arrivals")
    check(sb.arrival_times(5, math.inf, 0) == [0.0] * 5, "rate inf: all at once")
    # A ramp 10 -> 90 /s over 100 s, then 90 /s: the count in each 20 s window
    # is the integrated rate there (Poisson: within 4 standard deviations).
    r = sb.ramp_arrival_times(20000, 10.0, 90.0, 100.0, 7)
    check(r[0] == 0.0 and all(b >= a for a, b in zip(r, r[1:])), "ramp arrivals start at 0, in order")
    for lo in range(0, 100, 20):
        expect = 10 * 20 + 0.4 * ((lo + 20) ** 2 - lo ** 2)  # r0 t + (r1 - r0) t^2 / (2 T)
        got = sum(1 for x in r if lo <= x < lo + 20)
        check(abs(got - expect) < 4 * math.sqrt(expect), f"ramp window {lo}-{lo + 20} s: {got} ~ {expect:.0f}")
    after = [x for x in r if 100 <= x < 120]
    check(abs(len(after) - 1800) < 4 * math.sqrt(1800), f"after the ramp 90/s: {len(after)} in 20 s ~ 1800")
    flat = sb.ramp_arrival_times(20000, 50.0, 50.0, 10.0, 7)
    check(abs(len([x for x in flat if x < 100]) - 5000) < 4 * math.sqrt(5000), "a flat ramp is Poisson at its rate")
    ap0 = sb.build_parser()
    for bad in ("5:1", "a:b:c", "1:0:10", "1:2:0", "-1:2:3"):
        try:
            ap0.parse_args(["--ramp", bad])
            check(False, f"--ramp {bad} refused")
        except SystemExit:
            pass
    check(sb.percentile([1, 2, 3, 4], 50) == 2.5 and abs(sb.percentile([1, 2, 3, 4], 90) - 3.7) < 1e-12
          and sb.percentile([5], 99) == 5 and sb.percentile([], 50) is None,
          "percentiles interpolate as numpy's default")

    ap = sb.build_parser()
    a = ap.parse_args(["--num-prompts", "2000", "--seed", "3"])
    ds = sb.synthetic_dataset(a)
    ins = sorted(p.prompt_len for p in ds)
    outs = sorted(p.output_len for p in ds)
    med_in, med_out = ins[len(ins) // 2], outs[len(outs) // 2]
    exp_in = 161 * math.exp(-0.5)
    exp_out = 338 * math.exp(-0.81 / 2)
    check(abs(med_in - exp_in) < 0.1 * exp_in, f"input median {med_in} ~ {exp_in:.0f} (ShareGPT-like)")
    check(abs(med_out - exp_out) < 0.1 * exp_out, f"output median {med_out} ~ {exp_out:.0f}")
    check(ins[0] >= 4 and ins[-1] <= 1024 and outs[0] >= 1 and outs[-1] <= 1024, "lengths clipped")
    check(all(len(p.prompt) == p.prompt_len and all(100 <= t < 30000 for t in p.prompt) for p in ds),
          "prompts are token ids in --vocab-range")
    check([p.prompt for p in ds] == [p.prompt for p in sb.synthetic_dataset(a)], "same seed, same prompts")
    a = ap.parse_args(["--num-prompts", "500", "--max-model-len", "256", "--input-scale", "2",
                       "--shared-prefix-len", "8", "--vocab-range", "5,50"])
    ds = sb.synthetic_dataset(a)
    check(all(p.prompt_len + p.output_len <= 256 or p.output_len == 1 for p in ds)
          and all(p.prompt_len <= 255 for p in ds), "--max-model-len: prompt + output fit")
    check(all(p.prompt[:8] == ds[0].prompt[:8] for p in ds if p.prompt_len >= 8)
          and all(5 <= t < 50 for p in ds for t in p.prompt), "shared prefix, vocab range 5,50")
    a = ap.parse_args(["--num-prompts", "400", "--shared-prefix-len", "16", "--prefix-groups", "5",
                       "--input-mean", "40", "--input-sigma", "0"])
    ds = sb.synthetic_dataset(a)
    heads = {tuple(p.prompt[:16]) for p in ds}
    check(len(heads) == 5 and all(len(p.prompt) == 40 for p in ds) and
          min(sum(tuple(p.prompt[:16]) == h for p in ds) for h in heads) > 40 and
          len({tuple(p.prompt[16:]) for p in ds}) == 400, "--prefix-groups 5: five prefixes, each drawn, own tails")
    a1 = ap.parse_args(["--num-prompts", "50", "--shared-prefix-len", "8"])
    a2 = ap.parse_args(["--num-prompts", "50", "--shared-prefix-len", "8", "--prefix-groups", "1"])
    check([p.prompt for p in sb.synthetic_dataset(a1)] == [p.prompt for p in sb.synthetic_dataset(a2)],
          "--prefix-groups 1 is the one shared prefix of before")
    for bad in (["--prefix-groups", "0"], ["--prefix-groups", "3"],
                ["--prefix-groups", "3", "--shared-prefix-len", "4", "--prompt-format", "text"]):
        check(sb.main(bad) == 2, "refused: " + " ".join(bad))
    a = ap.parse_args(["--num-prompts", "3", "--prompt-format", "text", "--input-mean", "10",
                       "--input-sigma", "0"])
    ds = sb.synthetic_dataset(a)
    check(all(isinstance(p.prompt, str) and len(p.prompt.split()) == 10 for p in ds), "text prompts")


def test_timing(work):
    print(f"== timing: fake server, TTFT {TTFT_S * 1000:.0f} ms, {ITL_S * 1000:.0f} ms between tokens")
    srv = FakeServer()
    try:
        rc, doc, _ = run_bench(["--base-url", srv.url, "--model", "fake", "--num-prompts", "24",
                                "--max-concurrency", "4", "--seed", "1", "--input-mean", "16",
                                "--max-input-len", "64", "--output-mean", "8", "--output-sigma", "0.5",
                                "--max-output-len", "16", "--vocab-range", "10,1000",
                                "--wait-ready", "10"], work, "timing")
    finally:
        srv.close()
    check(rc == 0 and doc is not None, "exit 0 and a JSON")
    if doc is None:
        return
    run = doc["runs"][0]
    s, recs = run["summary"], run["requests"]
    check(s["completed"] == 24 and s["failed"] == 0, "24 requests completed")
    check(s["output_len_mismatch"] == 0 and all(r["output_tokens"] == r["expected_output_len"] for r in recs),
          "output lengths exact (max_tokens, ignore_eos)")
    pl = srv.payloads
    check(len(pl) == 24 and all(p["stream"] is True and p["ignore_eos"] is True and p["temperature"] == 0
                                and isinstance(p["prompt"], list)
                                and all(10 <= t < 1000 for t in p["prompt"]) for p in pl),
          "requests: stream, ignore_eos, temperature 0, token id prompts in range")
    check(sorted(p["max_tokens"] for p in pl) == sorted(r["expected_output_len"] for r in recs),
          "max_tokens = the sampled output lengths")
    check(s["peak_in_flight"] <= 4, f"max concurrency 4 held (peak {s['peak_in_flight']})")
    ttft, tpot, itl = s["ttft_ms"], s["tpot_ms"], s["itl_ms"]
    # Bounds leave room for a loaded machine; the fake's delays are exact.
    check(49 <= ttft["mean"] <= 90 and ttft["p99"] <= 150,
          f"TTFT mean {ttft['mean']:.1f} ms (50 expected), p99 {ttft['p99']:.1f}")
    check(9.5 <= tpot["mean"] <= 15, f"TPOT mean {tpot['mean']:.2f} ms (10 expected)")
    check(7 <= itl["p50"] <= 15, f"ITL p50 {itl['p50']:.2f} ms (10 expected)")
    e2e_ok = all(abs(r["e2e_s"] - (TTFT_S + (r["output_tokens"] - 1) * ITL_S)) < 0.060 for r in recs)
    check(e2e_ok, "each E2E = TTFT + (n - 1) x ITL within 60 ms")
    check(all(len(r["itl_s"]) == r["output_tokens"] - 1 for r in recs), "one ITL per token after the first")
    check(all(abs(r["tpot_s"] - (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)) < 1e-12
              for r in recs if r["output_tokens"] > 1), "TPOT = (E2E - TTFT) / (n - 1)")
    out_tok = sum(r["output_tokens"] for r in recs)
    check(s["total_output_tokens"] == out_tok
          and abs(s["output_throughput"] - out_tok / s["duration_s"]) < 1e-6
          and abs(s["request_throughput"] - 24 / s["duration_s"]) < 1e-6, "throughputs")
    check(s["goodput"] is None and s["slo_attainment"] is None, "no SLO given: no goodput")


def test_goodput(work):
    print("== goodput: slow first token, slow tokens, HTTP 500 and an error event are not good")

    def behave(i, payload):
        if i == 4:
            return {"status": 500}
        if i == 10:
            return {"error_after": 2}
        if i % 6 == 1:
            return {"ttft": 0.250}  # over the 150 ms TTFT SLO
        if i % 6 == 3:
            return {"itl": 0.030}  # TPOT 30 ms, over the 20 ms SLO
        return {}

    srv = FakeServer(behave)
    try:
        rc, doc, _ = run_bench(["--base-url", srv.url, "--num-prompts", "18", "--max-concurrency", "3",
                                "--input-mean", "8", "--input-sigma", "0", "--output-mean", "6",
                                "--output-sigma", "0", "--slo-ttft-ms", "150", "--slo-tpot-ms", "20"],
                               work, "goodput")
    finally:
        srv.close()
    check(rc == 0 and doc is not None, "exit 0 (not every request failed) and a JSON")
    if doc is None:
        return
    s, recs = doc["runs"][0]["summary"], doc["runs"][0]["requests"]
    slow_ttft = [i for i in range(18) if i not in (4, 10) and i % 6 == 1]
    slow_tpot = [i for i in range(18) if i not in (4, 10) and i % 6 == 3]
    good = 18 - 2 - len(slow_ttft) - len(slow_tpot)
    check(s["failed"] == 2 and s["errors"] == {"http_500": 1, "error event": 1},
          f"errors counted by kind: {s['errors']}")
    check(s["good_requests"] == good, f"good requests {s['good_requests']} == {good}")
    check(abs(s["slo_attainment"] - good / 18) < 1e-9, f"SLO attainment {s['slo_attainment']:.3f} == {good}/18")
    check(abs(s["goodput"] - good / s["duration_s"]) < 1e-9, "goodput = good requests / duration")
    over = [r for r in recs if r["success"] and r["ttft_s"] > 0.150]
    check(len(over) == len(slow_ttft) and not any(r["meets_slo"] for r in over),
          "requests over the TTFT SLO are measured so and not counted")
    over = [r for r in recs if r["success"] and r["tpot_s"] > 0.020]
    check(len(over) == len(slow_tpot) and all(0.028 <= r["tpot_s"] <= 0.040 for r in over)
          and not any(r["meets_slo"] for r in over), "requests over the TPOT SLO are measured so and not counted")
    check(not any(r["meets_slo"] for r in recs if not r["success"]), "failed requests never meet the SLO")
    check(s["completed"] == 16 and s["ttft_ms"]["n"] == 16, "latency statistics over successful requests only")


def test_sweep_and_plot(work):
    print("== sweep (Poisson 40/s, inf) and plots")
    srv = FakeServer()
    try:
        rc, doc, path = run_bench(["--base-url", srv.url, "--num-prompts", "10", "--sweep-rates", "40,inf",
                                   "--input-mean", "8", "--output-mean", "4", "--output-sigma", "0",
                                   "--slo-ttft-ms", "200", "--slo-tpot-ms", "50", "--label", "fake-a"],
                                  work, "sweep")
    finally:
        srv.close()
    check(rc == 0 and doc is not None, "exit 0 and a JSON")
    if doc is None:
        return
    check(doc["label"] == "fake-a" and [r["request_rate"] for r in doc["runs"]] == [40.0, "inf"],
          "one JSON, both rates, the label")
    poisson = doc["runs"][0]
    last = max(r["scheduled_s"] for r in poisson["requests"])
    check(last > 0 and poisson["summary"]["duration_s"] >= last
          and all(r["start_s"] >= r["scheduled_s"] - 1e-6 for r in poisson["requests"]),
          f"Poisson arrivals spread over {last * 1000:.0f} ms, none sent early")
    check(all(r["scheduled_s"] == 0 for r in doc["runs"][1]["requests"]), "rate inf: all at once")
    check(all(r["summary"]["slo_attainment"] == 1.0 for r in doc["runs"]), "every request within the SLOs")
    # A second topology: the same file under another label.
    out_dir = os.path.join(work, "plots")
    p = subprocess.run([sys.executable, PLOT, path, path, "--labels", "a,b", "--out-dir", out_dir],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        print("    " + p.stderr[-2000:])
    names = ["ttft.png", "tpot.png", "goodput.png", "slo_attainment.png", "throughput.png"]
    check(p.returncode == 0 and all(os.path.getsize(os.path.join(out_dir, n)) > 1000 for n in names),
          "plot_serve.py wrote " + ", ".join(names))
    with open(os.path.join(out_dir, "ttft.png"), "rb") as fh:
        check(fh.read(8) == b"\x89PNG\r\n\x1a\n", "PNG files")


def test_unreachable(work):
    print("== no server: every request an error, exit 1")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    rc, doc, _ = run_bench(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "3",
                            "--slo-ttft-ms", "100"], work, "unreachable")
    check(rc == 1 and doc is not None and doc["runs"][0]["summary"]["failed"] == 3
          and doc["runs"][0]["summary"]["good_requests"] == 0, "3 errors, no goodput, exit 1")


def main():
    work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="serve_bench_selftest_")
    os.makedirs(work, exist_ok=True)
    sb = load_bench()
    test_units(sb)
    test_timing(work)
    test_goodput(work)
    test_sweep_and_plot(work)
    test_unreachable(work)
    if failures:
        print(f"{len(failures)} FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
