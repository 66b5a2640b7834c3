#!/usr/bin/env python3
"""cleave_bench --attention as a user runs it: the section's cases and its
limits land in the JSON with the bytes the documented formula gives, and
the flags that belong to it are refused elsewhere with a one-line error.
And --matmul: every case's widened panels give the direct path's bits
(13 rows: no widening; 60: widened for F16 and Q8_0 alike), and the flags
that do not apply to it are refused. And --ab: the engine against a
variant without one change, a row per model and thread count."""
import json
import os
import sys

from cli_checks import Checks

BENCH, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
checks = Checks(BENCH, timeout=300)
run, expect = checks.run, checks.expect


out = os.path.join(WORK, "attention.json")
rc, so, se = run("--attention", "--rows", "1,3", "--context", "17,40", "--runs", "2", "--threads",
                 "1", "--kv-types", "f32,q8_0", "--json", out)
expect("attention section runs", rc == 0, f"rc={rc} stderr={se!r}")
if rc == 0:
    res = json.load(open(out))
    runs = res["runs"]
    expect("a case per type, context and row count", len(runs) == 2 * 2 * 2, str(len(runs)))
    row_bytes = {"F32": 64 * 4, "Q8_0": 2 * 34}
    for r in runs:
        # rows x context x 12 layers x 4 kv heads x (K and V) x row bytes
        want = r["rows"] * r["context"] * 12 * 4 * 2 * row_bytes[r["kv_type"]]
        expect(f"{r['kv_type']} rows {r['rows']} context {r['context']}: KV bytes",
               r["kv_bytes"] == want, f"{r['kv_bytes']} != {want}")
        expect(f"{r['kv_type']} rows {r['rows']} context {r['context']}: timed runs",
               len(r["ms"]) == 2 and all(m > 0 for m in r["ms"]), str(r["ms"]))
        expect(f"{r['kv_type']} rows {r['rows']} context {r['context']}: limits beside it",
               r["read_gb_s"] > 0 and r["runs_gb_s"] > 0, str(r))
    lim = res["limits"][0]
    expect("limits name each type's run read", "runs_gb_s_F32" in lim and "runs_gb_s_Q8_0" in lim,
           str(lim))


def expect_error(name, args, needle):  # a usage error: exit 2
    checks.expect_error(name, args, 2, needle)


# --isa: the AVX2 kernels where this CPU has AVX-512 too (a CPU without AVX2
# runs none of these sections); one the CPU lacks is refused.
out = os.path.join(WORK, "attention_avx2.json")
rc, so, se = run("--attention", "--rows", "2", "--context", "40", "--runs", "1", "--threads", "1",
                 "--kv-types", "q8_0", "--isa", "avx2", "--json", out)
expect("--isa avx2 runs the AVX2 kernels and says so", rc == 0 and "avx2 kernels" in so and
       json.load(open(out))["isa"] == "avx2", f"rc={rc} stdout={so!r} stderr={se!r}")
flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
avx512 = all(f in flags for f in ("avx512f", "avx512dq", "avx512bw", "avx512vl"))  # cleave's detect_isa
if avx512:
    rc, so, se = run("--attention", "--rows", "2", "--context", "40", "--runs", "1", "--threads", "1",
                     "--kv-types", "f16", "--isa", "avx512")
    expect("--isa avx512 runs on this AVX-512 CPU", rc == 0 and "avx512 kernels" in so, f"rc={rc} {se!r}")
else:
    expect_error("--isa avx512 on a CPU without it is refused", ["--attention", "--isa", "avx512"],
                 "this CPU has avx2 at most")
# --block-size: a case per size, the KV bytes the same (the context, not the
# blocks, sets them), each size's run limit in the JSON; sizes outside
# vLLM's choices and the flag outside --batched / --attention refused.
out = os.path.join(WORK, "attention_blocks.json")
rc, so, se = run("--attention", "--rows", "2", "--context", "40", "--runs", "1", "--threads", "1",
                 "--kv-types", "f16", "--block-size", "16,64", "--json", out)
expect("--block-size 16,64 runs a case per size", rc == 0, f"rc={rc} stderr={se!r}")
if rc == 0:
    res = json.load(open(out))
    sizes = [r["block_size"] for r in res["runs"]]
    expect("a case per block size, with equal KV bytes", sizes == [16, 64] and
           res["runs"][0]["kv_bytes"] == res["runs"][1]["kv_bytes"] == 2 * 40 * 12 * 4 * 2 * 128, str(res["runs"]))
    lim = res["limits"][0]
    expect("each block size's run limit", "runs_gb_s_F16" in lim and "runs_gb_s_F16_block64" in lim, str(lim))
    expect("the header names the sizes", "blocks of 16, 64 positions" in so, so)
expect_error("--block-size takes vLLM's choices", ["--attention", "--block-size", "24"],
             "--block-size takes 8, 16, 32, 64 or 128, not 24")
expect_error("--block-size without --batched or --attention is refused", ["--matmul", "--block-size", "64"],
             "--block-size needs --batched or --attention")
expect_error("--isa names avx2 or avx512", ["--attention", "--isa", "sse2"], "--isa takes avx2 or avx512")
expect_error("--isa without --attention is refused", ["--matmul", "--isa", "avx2"], "--isa needs --attention")
expect_error("--rows without --attention or --matmul is refused", ["--rows", "4"], "--rows needs")
expect_error("--context without --attention is refused", ["--context", "40"], "--context needs --attention")
out = os.path.join(WORK, "matmul.json")
rc, so, se = run("--matmul", "--rows", "13,60", "--runs", "2", "--json", out)
expect("matmul section runs, the widened bits equal the direct ones (exit 0)", rc == 0,
       f"rc={rc} stderr={se!r}")
if rc == 0:
    res = json.load(open(out))
    cases = res["matmul"]
    expect("a case per type, shape and row count", len(cases) == 2 * 4 * 2, str(len(cases)))
    expect("every case has the same bits both ways and a speed for each",
           all(c["same_bits"] and c["direct_gflops"] > 0 and c["widened_gflops"] > 0 for c in cases),
           str(cases))
    expect("the FMA peak beside them, before and after", len(res["fma_peak_gflops"]) == 2 and
           min(res["fma_peak_gflops"]) > 0, str(res["fma_peak_gflops"]))
expect_error("--matmul takes no --threads (it runs one)", ["--matmul", "--threads", "2"],
             "--threads does not apply to --matmul")
expect_error("--matmul takes f16 and q8_0 only", ["--matmul", "--types", "f32"], "takes f16 and q8_0")
expect_error("two sections at once are refused", ["--attention", "--batched"], "pick one")
expect_error("a flag of another section is refused with --attention",
             ["--attention", "--batches", "1,8"], "--batches does not apply to --attention")


# --ab groups / rows: one A/B row per model and thread count, the pairs
# counted, the two engines' logits equal (the section fails otherwise), its
# foreign flags refused. rows: a 100-token prompt splits its rows on 2
# threads (48 a thread and up), so both splits meet in every pair.
for what in ("groups", "rows"):
    out = os.path.join(WORK, f"ab_{what}.json")
    rc, so, se = run("--ab", what, "--quick", "--runs", "3", "--decode", "2", "--prompt", "100",
                     "--workdir", os.path.join(WORK, "models"), "--json", out)
    expect(f"--ab {what} runs (the two engines' logits equal)", rc == 0, f"rc={rc} stderr={se!r}")
    if rc != 0:
        continue
    res = json.load(open(out))
    runs = res["runs"]
    expect(f"--ab {what}: a row per thread count of the 15M F16 model",
           res["ab"] == what and
           [(r["model"], r["type"], r["threads"]) for r in runs] == [("15M", "f16", 1), ("15M", "f16", 2)],
           str(runs))
    for r in runs:
        for part in ("prefill", "decode_steps"):
            p = r[part]
            expect(f"--ab {what} t={r['threads']} {part}: 2 pairs after the warm-up, both sides timed",
                   p["pairs"] == 2 and p["default_ms"] > 0 and p["variant_ms"] > 0 and
                   p["speedup_q1"] <= p["speedup_median"] <= p["speedup_q3"], str(p))
expect_error("--ab takes no --compute", ["--ab", "groups", "--compute", "int8"],
             "--compute does not apply to --ab")
expect_error("--ab is a section of its own", ["--ab", "rows", "--matmul"], "pick one")
expect_error("--ab names a known change", ["--ab", "threads"], "--ab takes groups or rows, not 'threads'")

checks.finish("bench")
