#!/usr/bin/python3
"""Serving benchmark against an OpenAI-compatible server, in the spirit of
`vllm bench serve`: streamed /v1/completions requests from a synthetic
ShareGPT-like dataset, Poisson arrivals (or a fixed concurrency), and per
request TTFT, ITL, TPOT and E2E latency; p50/p90/p99 and means, request and
token throughput, goodput and SLO attainment at --slo-ttft-ms/--slo-tpot-ms
(DistServe: requests per second that meet every SLO given).

Needs Debian's python3-aiohttp (run it with /usr/bin/python3). See
bench/serve/README.md for the dataset's length distributions, the
definitions and the JSON layout.

  serve_bench.py --base-url http://127.0.0.1:8080 --model m --num-prompts 200 \\
      --request-rate 4 --slo-ttft-ms 500 --slo-tpot-ms 50 --json out.json
  serve_bench.py ... --sweep-rates 1,2,4,8,inf --label pd --json pd_sweep.json
"""
import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

# ---- the synthetic dataset ----

# Lognormal lengths with the means vLLM's paper reports for ShareGPT (Llama
# tokenizer: about 161 prompt and 338 output tokens; Kwon et al., SOSP '23,
# fig. 11). The sigmas are this tool's assumption (a long right tail as in
# ShareGPT), not a fit: median = mean * exp(-sigma^2 / 2), so ~98 prompt and
# ~225 output tokens with the defaults.
SHAREGPT_INPUT_MEAN = 161.0
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_MEAN = 338.0
SHAREGPT_OUTPUT_SIGMA = 0.9
MIN_INPUT_LEN = 4
MIN_OUTPUT_LEN = 1

WORDS = ("the of and to in is that for it as with was on be by this are at from or an which "
         "have not but all were when we there can more one their if has will about so what "
         "out up into than them some time could these two may then do first any my now such "
         "like our over man me even most made after also did many before must through").split()


@dataclass
class Prompt:
    prompt: object  # list of token ids, or text
    prompt_len: int  # token ids; for text, words (about one token each)
    output_len: int  # max_tokens (ignore_eos: the exact output length)


def lognormal_lengths(rng, n, mean, sigma, scale, lo, hi):
    mu = math.log(mean) - sigma * sigma / 2.0
    out = []
    for _ in range(n):
        v = int(round(rng.lognormvariate(mu, sigma) * scale))
        out.append(max(lo, min(hi, v)))
    return out


def synthetic_dataset(args):
    """num_prompts prompts, the same for a given --seed whatever the rate."""
    rng = random.Random(args.seed)
    n = args.num_prompts
    max_in = args.max_input_len
    max_out = args.max_output_len
    if args.max_model_len:
        max_in = min(max_in, args.max_model_len - MIN_OUTPUT_LEN)
    ins = lognormal_lengths(rng, n, args.input_mean, args.input_sigma, args.input_scale,
                            MIN_INPUT_LEN, max_in)
    outs = lognormal_lengths(rng, n, args.output_mean, args.output_sigma, args.output_scale,
                             MIN_OUTPUT_LEN, max_out)
    lo, hi = args.vocab_range
    shared = [[rng.randrange(lo, hi) for _ in range(args.shared_prefix_len)]]
    # More groups draw after the first, so --prefix-groups 1 keeps the
    # datasets of runs from before the flag.
    shared += [[rng.randrange(lo, hi) for _ in range(args.shared_prefix_len)] for _ in range(args.prefix_groups - 1)]
    prompts = []
    for i in range(n):
        group = shared[rng.randrange(len(shared))] if len(shared) > 1 else shared[0]
        n_in, n_out = ins[i], outs[i]
        if args.max_model_len and n_in + n_out > args.max_model_len:
            n_out = max(MIN_OUTPUT_LEN, args.max_model_len - n_in)
        if args.prompt_format == "text":
            words = [WORDS[rng.randrange(len(WORDS))] for _ in range(n_in)]
            prompts.append(Prompt(" ".join(words), n_in, n_out))
        else:
            head = group[:n_in]
            ids = head + [rng.randrange(lo, hi) for _ in range(n_in - len(head))]
            prompts.append(Prompt(ids, n_in, n_out))
    return prompts


def arrival_times(n, rate, seed):
    """Seconds after the start at which each request is sent: a Poisson
    process of `rate` per second (exponential gaps), or all at 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed * 1000003 + 17)  # apart from the dataset's stream
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def ramp_arrival_times(n, r0, r1, seconds, seed):
    """A Poisson process whose rate rises linearly from r0 to r1 per second
    over `seconds`, then stays at r1 (time rescaling: the k-th arrival is
    where the integrated rate reaches the k-th sum of unit exponentials)."""
    rng = random.Random(seed * 1000003 + 17)
    k = (r1 - r0) / (2 * seconds)  # integrated rate: r0 t + k t^2 up to `seconds`
    at_end = r0 * seconds + k * seconds * seconds
    e, out = 0.0, []
    for _ in range(n):
        out.append(ramp_inverse(e, r0, r1, k, seconds, at_end))
        e += rng.expovariate(1.0)
    return out


def ramp_inverse(e, r0, r1, k, seconds, at_end):
    if e >= at_end:
        return seconds + (e - at_end) / r1
    if abs(k) < 1e-15:
        return e / r0
    return (-r0 + math.sqrt(r0 * r0 + 4 * k * e)) / (2 * k)


# ---- statistics ----

def percentile(values, p):
    """numpy's default (linear interpolation between closest ranks)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def describe(values, percentiles):
    if not values:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None,
                **{f"p{fmt_p(p)}": None for p in percentiles}}
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    d = {"n": len(values), "mean": mean, "std": math.sqrt(var), "min": min(values),
         "max": max(values)}
    for p in percentiles:
        d[f"p{fmt_p(p)}"] = percentile(values, p)
    return d


def fmt_p(p):
    return str(int(p)) if float(p).is_integer() else str(p).replace(".", "_")


# ---- one request ----

@dataclass
class Record:
    index: int
    prompt_len: int
    expected_output_len: int
    scheduled_s: float = 0.0  # arrival time (after the start)
    start_s: float = 0.0      # when it was sent (later under --max-concurrency)
    success: bool = False
    error: str = ""
    http_status: int = 0
    ttft_s: float = None
    e2e_s: float = None
    tpot_s: float = None
    itl_s: list = field(default_factory=list)
    output_tokens: int = 0    # usage.completion_tokens when reported, else token chunks
    token_chunks: int = 0
    usage_prompt_tokens: int = None
    finish_reason: str = None
    meets_slo: bool = False


def is_token_chunk(obj):
    """A chunk that carries a token: a choice with text, or a choice that has
    not finished (a token whose text is not printable yet)."""
    choices = obj.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    return bool(c.get("text")) or c.get("finish_reason") is None


async def run_request(session, args, rec, prompt, t0):
    payload = {
        "model": args.model,
        "prompt": prompt.prompt,
        "max_tokens": prompt.output_len,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + args.endpoint
    start = time.perf_counter()
    rec.start_s = start - t0
    last = None
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                body = (await resp.text())[:500]
                rec.error = f"HTTP {resp.status}: {body}"
                return
            usage_tokens = None
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line or line.startswith(":") or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    rec.error = f"bad SSE data: {data[:200]}"
                    return
                if "error" in obj:
                    rec.error = "error event: " + json.dumps(obj["error"])[:500]
                    return
                now = time.perf_counter()
                if is_token_chunk(obj):
                    rec.token_chunks += 1
                    if last is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                for c in obj.get("choices") or []:
                    if c.get("finish_reason"):
                        rec.finish_reason = c["finish_reason"]
                usage = obj.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    rec.usage_prompt_tokens = usage.get("prompt_tokens", rec.usage_prompt_tokens)
            end = time.perf_counter()
            if rec.ttft_s is None:
                rec.error = "stream ended without a token"
                return
            rec.e2e_s = end - start
            rec.output_tokens = usage_tokens if usage_tokens is not None else rec.token_chunks
            rec.tpot_s = ((rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
                          if rec.output_tokens > 1 else 0.0)
            rec.success = True
    except asyncio.TimeoutError:
        rec.error = f"timeout after {args.request_timeout} s"
    except aiohttp.ClientError as e:
        rec.error = f"{type(e).__name__}: {e}"


# ---- one run at one rate ----

def summarize(records, duration, args):
    ok = [r for r in records if r.success]
    pct = args.percentiles
    ms = lambda xs: [x * 1000.0 for x in xs]  # noqa: E731
    ttft = ms([r.ttft_s for r in ok])
    tpot = ms([r.tpot_s for r in ok if r.output_tokens > 1])
    itl = ms([g for r in ok for g in r.itl_s])
    e2e = ms([r.e2e_s for r in ok])
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    slo_given = args.slo_ttft_ms is not None or args.slo_tpot_ms is not None
    good = sum(1 for r in records if r.meets_slo)
    errors = {}
    for r in records:
        if not r.success:
            kind = f"http_{r.http_status}" if r.http_status not in (0, 200) else r.error.split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_len_mismatch": sum(1 for r in ok if r.output_tokens != r.expected_output_len),
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
        "ttft_ms": describe(ttft, pct),
        "tpot_ms": describe(tpot, pct),
        "itl_ms": describe(itl, pct),
        "e2e_ms": describe(e2e, pct),
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "good_requests": good if slo_given else None,
        "goodput": (good / duration if duration > 0 else None) if slo_given else None,
        "slo_attainment": (good / len(records) if records else None) if slo_given else None,
    }


def meets_slo(rec, args):
    if not rec.success:
        return False
    if args.slo_ttft_ms is not None and rec.ttft_s * 1000.0 > args.slo_ttft_ms:
        return False
    if args.slo_tpot_ms is not None and rec.tpot_s * 1000.0 > args.slo_tpot_ms:
        return False
    return True


async def run_rate(args, prompts, rate):
    times = (ramp_arrival_times(len(prompts), *args.ramp, args.seed) if args.ramp
             else arrival_times(len(prompts), rate, args.seed))
    records = [Record(i, p.prompt_len, p.output_len) for i, p in enumerate(prompts)]
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    in_flight = peak = 0
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     read_bufsize=1 << 22) as session:
        for i in range(min(args.warmup, len(prompts))):  # not measured
            await run_request(session, args, Record(-1, 0, 0), prompts[i], time.perf_counter())
        t0 = time.perf_counter()

        async def one(i):
            nonlocal in_flight, peak
            delay = t0 + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            records[i].scheduled_s = times[i]
            if sem:
                await sem.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await run_request(session, args, records[i], prompts[i], t0)
            finally:
                in_flight -= 1
                if sem:
                    sem.release()

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - t0
    for r in records:
        r.meets_slo = meets_slo(r, args)
    summary = summarize(records, duration, args)
    summary["request_rate"] = (f"ramp {args.ramp[0]:g}->{args.ramp[1]:g} over {args.ramp[2]:g} s" if args.ramp
                               else "inf" if math.isinf(rate) else rate)
    summary["max_concurrency"] = args.max_concurrency
    summary["peak_in_flight"] = peak
    return {"request_rate": rate if not math.isinf(rate) else "inf",
            "summary": summary,
            "requests": [asdict(r) for r in records]}


def print_summary(s):
    def f(v, nd=2):
        return "-" if v is None else f"{v:.{nd}f}"
    conc = f", max concurrency {s['max_concurrency']}" if s["max_concurrency"] else ""
    print(f"==== request rate {s['request_rate']}{conc} ====")
    print(f"  requests: {s['completed']} completed, {s['failed']} failed {s['errors'] or ''}")
    print(f"  duration {f(s['duration_s'])} s, request throughput {f(s['request_throughput'])} req/s, "
          f"output {f(s['output_throughput'], 1)} tok/s, total {f(s['total_token_throughput'], 1)} tok/s")
    if s["output_len_mismatch"]:
        print(f"  WARNING: {s['output_len_mismatch']} requests did not give max_tokens tokens "
              "(does the server honour ignore_eos?)")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        d = s[key]
        ps = " ".join(f"{k}={f(v)}" for k, v in d.items() if k.startswith("p"))
        print(f"  {name:5s} ms: mean={f(d['mean'])} {ps} (n={d['n']})")
    if s["goodput"] is not None:
        slos = [f"{name} <= {s[key]:g} ms" for key, name in (("slo_ttft_ms", "TTFT"), ("slo_tpot_ms", "TPOT"))
                if s[key] is not None]
        print(f"  goodput {f(s['goodput'])} req/s at {', '.join(slos)}; SLO attainment "
              f"{f(100 * s['slo_attainment'], 1)} % ({s['good_requests']} of {s['num_requests']})")


async def wait_ready(args):
    url = args.base_url.rstrip("/") + "/v1/models"
    deadline = time.monotonic() + args.wait_ready
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return True
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.5)


def parse_rate(s):
    s = s.strip().lower()
    r = math.inf if s in ("inf", "infinity") else float(s)
    if not r > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 or inf: {s}")
    return r


def parse_ramp(s):
    try:
        r0, r1, t = (float(x) for x in s.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ramp wants FROM:TO:SECONDS (rates per second): {s}")
    if not (r0 >= 0 and r1 > 0 and t > 0 and math.isfinite(r0 + r1 + t)):
        raise argparse.ArgumentTypeError(f"--ramp wants FROM >= 0, TO > 0 and SECONDS > 0: {s}")
    return (r0, r1, t)


def parse_range(s):
    lo, hi = (int(x) for x in s.replace(":", ",").split(","))
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"--vocab-range wants LO,HI with 0 <= LO < HI: {s}")
    return (lo, hi)


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default="cleave")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--request-rate", type=parse_rate, default=math.inf,
                    help="requests per second, Poisson arrivals; inf: all at once (default)")
    ap.add_argument("--ramp", type=parse_ramp, default=None,
                    help="FROM:TO:SECONDS: a Poisson rate rising linearly from FROM to TO req/s over SECONDS, "
                         "then staying at TO (instead of --request-rate / --sweep-rates)")
    ap.add_argument("--sweep-rates", default=None,
                    help="comma-separated rates run in sequence (e.g. 1,2,4,8,inf); one JSON with all")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="at most C requests in flight (with rate inf: fixed-concurrency mode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=0, help="requests sent one by one first, not measured")
    ap.add_argument("--prompt-format", choices=("tokens", "text"), default="tokens")
    ap.add_argument("--vocab-range", type=parse_range, default=(100, 30000),
                    help="prompt token ids are drawn uniformly from [LO, HI) (default 100,30000)")
    ap.add_argument("--shared-prefix-len", type=int, default=0,
                    help="the first N prompt tokens are the same in every prompt (prefix cache)")
    ap.add_argument("--prefix-groups", type=int, default=1,
                    help="K distinct shared prefixes, each prompt starting with one drawn at random "
                         "(SGLang's generated-shared-prefix; needs --shared-prefix-len)")
    ap.add_argument("--input-mean", type=float, default=SHAREGPT_INPUT_MEAN)
    ap.add_argument("--input-sigma", type=float, default=SHAREGPT_INPUT_SIGMA)
    ap.add_argument("--output-mean", type=float, default=SHAREGPT_OUTPUT_MEAN)
    ap.add_argument("--output-sigma", type=float, default=SHAREGPT_OUTPUT_SIGMA)
    ap.add_argument("--input-scale", type=float, default=1.0, help="multiplies sampled prompt lengths")
    ap.add_argument("--output-scale", type=float, default=1.0, help="multiplies sampled output lengths")
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="context size: output lengths are cut so prompt + output fits")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--percentiles", default="50,90,99")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--wait-ready", type=float, default=0.0,
                    help="seconds to wait for GET /v1/models to answer 200 first")
    ap.add_argument("--label", default=None, help="the topology's name, stored in the JSON for plots")
    ap.add_argument("--json", default=None, help="write config, per-request records and summaries")
    return ap


async def main_async(args):
    if args.wait_ready > 0 and not await wait_ready(args):
        print(f"server at {args.base_url} not ready after {args.wait_ready} s", file=sys.stderr)
        return 2
    if args.ramp and (args.sweep_rates or not math.isinf(args.request_rate)):
        print("--ramp replaces --request-rate and --sweep-rates: give one of them", file=sys.stderr)
        return 2
    prompts = synthetic_dataset(args)
    rates = ([parse_rate(r) for r in args.sweep_rates.split(",") if r.strip()]
             if args.sweep_rates else [args.request_rate])
    runs = []
    for rate in rates:
        run = await run_rate(args, prompts, rate)
        print_summary(run["summary"])
        runs.append(run)
    if args.json:
        config = {k: v for k, v in vars(args).items()}
        config["request_rate"] = None if args.sweep_rates else (
            "inf" if math.isinf(args.request_rate) else args.request_rate)
        config["dataset"] = {
            "kind": "synthetic ShareGPT-like (lognormal lengths)",
            "input": {"mean": args.input_mean, "sigma": args.input_sigma, "scale": args.input_scale,
                      "clip": [MIN_INPUT_LEN, args.max_input_len]},
            "output": {"mean": args.output_mean, "sigma": args.output_sigma,
                       "scale": args.output_scale, "clip": [MIN_OUTPUT_LEN, args.max_output_len]},
            "prompt_lens": [p.prompt_len for p in prompts],
            "output_lens": [p.output_len for p in prompts],
        }
        doc = {"tool": "cleave serve_bench", "label": args.label, "created": time.time(),
               "config": config, "runs": runs}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1, allow_nan=False)
            fh.write("\n")
    total = sum(r["summary"]["num_requests"] for r in runs)
    failed = sum(r["summary"]["failed"] for r in runs)
    return 1 if total and failed == total else 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    if args.num_prompts < 1:
        print("--num-prompts must be >= 1", file=sys.stderr)
        return 2
    if args.prefix_groups < 1:
        print("--prefix-groups must be >= 1", file=sys.stderr)
        return 2
    if args.prefix_groups > 1 and args.shared_prefix_len < 1:
        print("--prefix-groups needs --shared-prefix-len", file=sys.stderr)
        return 2
    if args.prefix_groups > 1 and args.prompt_format == "text":
        print("--prefix-groups needs --prompt-format tokens", file=sys.stderr)
        return 2
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("--max-concurrency must be >= 1", file=sys.stderr)
        return 2
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
