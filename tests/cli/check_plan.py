#!/usr/bin/env python3
"""`cleave plan` as a user meets it: a profile measured on this machine and
read back, traces, calibration from a server's step counters (one load, a
baseline, the steps' spread, two loads and their slowdown), and each
refusal as one line naming the flag or field."""
import json
import os
import sys

from cli_checks import Checks

CLEAVE, VOCAB, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(WORK, exist_ok=True)
checks = Checks(CLEAVE)
run, expect, expect_error = checks.run, checks.expect, checks.expect_error

model = checks.small_model(VOCAB, os.path.join(WORK, "plan.gguf"))

# cleave plan: a profile from this machine (the small model), the front read
# back from a saved profile, and its refusals.
prof = os.path.join(WORK, "cli-profile.json")
rc, out, err = run("plan", "-m", model, "--save-profile", prof, "--rate", "4", "--prompt-tokens", "16",
                   "--output-tokens", "8", "--max-stages", "3", "--requests", "200", "--slo-ttft-ms", "1000")
front = [l.split() for l in out.splitlines() if l.split()[:1] and l.split()[0].isdigit() and len(l.split()) == 11]
expect("plan -m: profiles, simulates the 3 splits of 3 stages and prints a front",
       rc == 0 and "3 splits simulated" in out and len(front) >= 1 and os.path.exists(prof), out + err)
rc, out2, err = run("plan", "--profile", prof, "--rate", "4", "--prompt-tokens", "16", "--output-tokens", "8",
                    "--max-stages", "3", "--requests", "200", "--slo-ttft-ms", "1000")
expect("plan --profile: the saved profile gives the same front", rc == 0 and out2.split("\n", 1)[1] == out.split("\n", 1)[1],
       out2 + err)
expect_error("plan: a profile or a model is needed", ["plan", "--rate", "4"], 2, "--profile")


def front_rows(text):
    return [l.split() for l in text.splitlines() if l.split()[:1] and l.split()[0].isdigit() and len(l.split()) == 11]


# --top keeps the head of the front (goodput, then cost); the header still
# counts the whole front.
# A load that saturates small splits, so that the front has many rows.
args8 = ["plan", "--profile", prof, "--rate", "1500", "--prompt-tokens", "16:64", "--output-tokens", "4:32",
         "--max-stages", "8", "--requests", "600", "--slo-ttft-ms", "3", "--slo-tpot-ms", "1"]
rc, full, err = run(*args8)
rc2, top, err2 = run(*args8, "--top", "2")
whole = front_rows(full)
expect("plan --top 2: the two rows of highest goodput, the front's size still said",
       rc == 0 and rc2 == 0 and len(whole) > 4 and front_rows(top) == whole[:2] and
       f"{len(whole)} rows, the 2 of highest goodput shown (--top)" in top and
       all(float(whole[i][3]) >= float(whole[i + 1][3]) for i in range(len(whole) - 1)), full + top + err + err2)
rc, top0, err = run(*args8, "--top", "0")
expect("plan --top 0: the whole front", rc == 0 and front_rows(top0) == whole and "shown" not in top0, top0 + err)
expect_error("plan: --top below 0 is refused", [*args8, "--top", "-1"], 2, "--top")
rc, out3, err = run("plan", "-m", model, "--profile-topology", "mono", "--rate", "4", "--prompt-tokens", "16",
                    "--output-tokens", "8", "--max-stages", "2", "--requests", "50")
expect("plan -m --profile-topology mono: profiles the bare engine", rc == 0 and "1 split simulated" in out3, out3 + err)
expect_error("plan: --profile-topology takes pd or mono", ["plan", "-m", model, "--profile-topology", "colocated",
                                                           "--rate", "4"], 2, "--profile-topology")
expect_error("plan: --profile-topology needs -m", ["plan", "--profile", prof, "--profile-topology", "mono",
                                                   "--rate", "4"], 2, "--profile-topology")
expect_error("plan: a bad length range is refused", ["plan", "--profile", prof, "--rate", "4", "--prompt-tokens", "9:3"],
             2, "--prompt-tokens", "LO:HI")
bad_prof = os.path.join(WORK, "cli-bad-profile.json")
with open(bad_prof, "w") as f:
    f.write('{"prefill_ms_per_token": 0.1, "decode_ms": 1, "speed": 2}')
expect_error("plan: an unknown profile field is refused by name", ["plan", "--profile", bad_prof, "--rate", "4"], 1,
             "unknown field 'speed'")
# A recorded trace instead of Poisson arrivals, and calibration from a
# served run's metrics (Prometheus text as a P/D server's /metrics writes it).
trace = os.path.join(WORK, "cli-trace.jsonl")
with open(trace, "w") as f:
    for i in range(40):
        f.write(json.dumps({"arrival_s": i * 0.25, "prompt_tokens": 16, "output_tokens": 8}) + "\n")
rc, out, err = run("plan", "--profile", prof, "--trace", trace, "--max-stages", "2")
expect("plan --trace: simulates the trace at its own rate", rc == 0 and "40 requests at 4 requests/s" in out, out + err)
for flag, value in (("--rate", "4"), ("--requests", "10"), ("--prompt-tokens", "16"), ("--seed", "3")):
    expect_error(f"plan: {flag} with --trace is refused", ["plan", "--profile", prof, "--trace", trace, flag, value],
                 2, flag, "does not go with --trace")
expect_error("plan: --rate or --trace is needed", ["plan", "--profile", prof], 2, "--rate")
with open(os.path.join(WORK, "cli-bad-trace.jsonl"), "w") as f:
    f.write('{"arrival_s": 0, "prompt_tokens": 16, "output_tokens": 8}\n{"arrival_s": "soon"}\n')
expect_error("plan: a bad trace line is refused by line and field",
             ["plan", "--profile", prof, "--trace", os.path.join(WORK, "cli-bad-trace.jsonl")], 1, "line 2",
             "arrival_s")
profile_fit = json.load(open(prof))
metrics = os.path.join(WORK, "cli-metrics.txt")
with open(metrics, "w") as f:  # steps exactly twice the profile's (prefill) and 1.5 times (decode)
    pre = 100 * (profile_fit["prefill_ms"] + 16 * profile_fit["prefill_ms_per_token"]) * 2
    dec = 1000 * (profile_fit["decode_ms"] + 4 * profile_fit["decode_ms_per_row"]) * 1.5
    f.write(f'cleave_actor_stat{{actor="prefill/0",name="steps"}} 100\n'
            f'cleave_actor_stat{{actor="prefill/0",name="step_us"}} {int(round(pre * 1e3))}\n'
            f'cleave_actor_stat{{actor="prefill/0",name="prefill_tokens"}} 1600\n'
            f'cleave_actor_stat{{actor="decode/0",name="steps"}} 1000\n'
            f'cleave_actor_stat{{actor="decode/0",name="step_us"}} {int(round(dec * 1e3))}\n'
            f'cleave_actor_stat{{actor="decode/0",name="decode_rows"}} 4000\n')
cal = os.path.join(WORK, "cli-calibrated.json")
rc, out, err = run("plan", "--profile", prof, "--calibrate-metrics", metrics, "--save-profile", cal, "--trace", trace,
                   "--max-stages", "2")
saved = json.load(open(cal)) if os.path.exists(cal) else {}
expect("plan --calibrate-metrics: each role's steps scaled by what they took while serving",
       rc == 0 and "prefill steps x2.000" in out and "decode steps x1.500" in out and
       abs((saved.get("decode_ms", 0) + 4 * saved.get("decode_ms_per_row", 0)) /
           (1.5 * (profile_fit["decode_ms"] + 4 * profile_fit["decode_ms_per_row"])) - 1) < 1e-4, out + err)
baseline = os.path.join(WORK, "cli-metrics-before.txt")
with open(baseline, "w") as f:  # half the steps, at the profile's own speed: the load added 3x and 2x
    pre0 = 50 * (profile_fit["prefill_ms"] + 16 * profile_fit["prefill_ms_per_token"])
    dec0 = 500 * (profile_fit["decode_ms"] + 4 * profile_fit["decode_ms_per_row"])
    f.write(f'cleave_actor_stat{{actor="prefill/0",name="steps"}} 50\n'
            f'cleave_actor_stat{{actor="prefill/0",name="step_us"}} {int(round(pre0 * 1e3))}\n'
            f'cleave_actor_stat{{actor="prefill/0",name="prefill_tokens"}} 800\n'
            f'cleave_actor_stat{{actor="decode/0",name="steps"}} 500\n'
            f'cleave_actor_stat{{actor="decode/0",name="step_us"}} {int(round(dec0 * 1e3))}\n'
            f'cleave_actor_stat{{actor="decode/0",name="decode_rows"}} 2000\n')
rc, out, err = run("plan", "--profile", prof, "--calibrate-metrics", metrics, "--calibrate-baseline", baseline,
                   "--trace", trace, "--max-stages", "2")
expect("plan --calibrate-baseline: only what the load added counts",
       rc == 0 and "prefill steps x3.000 (50 steps, spread 0.000)" in out and "decode steps x2.000 (500 steps" in out,
       out + err)
# Steps that spread: half the prefill steps at 1.5 times the profile, half
# at 2.5 (x2 on average, each 0.25 of it off), with the stage's second
# moments: coefficient of variation 0.25, kept by the saved profile and
# drawn by the simulation (a p90 TTFT of a lone request above the mean).
spread_metrics = os.path.join(WORK, "cli-metrics-spread.txt")
m1 = profile_fit["prefill_ms"] + 16 * profile_fit["prefill_ms_per_token"]
with open(spread_metrics, "w") as f:
    us = [m1 * 1.5e3] * 50 + [m1 * 2.5e3] * 50
    f.write(f'cleave_actor_stat{{actor="prefill/0",name="steps"}} 100\n'
            f'cleave_actor_stat{{actor="prefill/0",name="step_us"}} {sum(us):.0f}\n'
            f'cleave_actor_stat{{actor="prefill/0",name="prefill_tokens"}} 1600\n'
            f'cleave_actor_stat{{actor="prefill/0",name="step_us_sq"}} {sum(x * x for x in us):.0f}\n'
            f'cleave_actor_stat{{actor="prefill/0",name="step_tokens_sq"}} 25600\n'
            f'cleave_actor_stat{{actor="prefill/0",name="step_us_tokens"}} {16 * sum(us):.0f}\n'
            f'cleave_actor_stat{{actor="decode/0",name="steps"}} 1000\n'
            f'cleave_actor_stat{{actor="decode/0",name="step_us"}} {int(round(dec * 1e3))}\n'
            f'cleave_actor_stat{{actor="decode/0",name="decode_rows"}} 4000\n')
cal_spread = os.path.join(WORK, "cli-calibrated-spread.json")
rc, out, err = run("plan", "--profile", prof, "--calibrate-metrics", spread_metrics, "--save-profile", cal_spread,
                   "--rate", "1", "--max-stages", "2")
saved_spread = json.load(open(cal_spread)) if os.path.exists(cal_spread) else {}
expect("plan --calibrate-metrics: the steps' spread from the stage's second moments",
       rc == 0 and "prefill steps x2.000 (100 steps, spread 0.250)" in out and "decode steps x1.500 (1000 steps, "
       "spread 0.000)" in out and "coefficient of variation 0.250 (prefill) and 0.000 (decode)" in out
       and abs(saved_spread.get("prefill_step_cv", 0) - 0.25) < 1e-3, out + err)
ttft_cols = lambda o: [(float(l.split()[5]), float(l.split()[6])) for l in o.splitlines() if l.split()[:2] == ["1", "1"]]
rcs, outs, _ = run("plan", "--profile", cal_spread, "--rate", "0.5", "--requests", "400", "--max-stages", "2")
expect("plan: a profile with spread draws each step around its cost (p90 TTFT above p50)",
       rcs == 0 and ttft_cols(outs) and ttft_cols(outs)[0][1] > ttft_cols(outs)[0][0] * 1.1, outs)
expect_error("plan: a baseline taken after the load is refused",
             ["plan", "--profile", prof, "--calibrate-metrics", baseline, "--calibrate-baseline", metrics, "--rate", "4"],
             1, "went down")
expect_error("plan: --calibrate-baseline needs --calibrate-metrics",
             ["plan", "--profile", prof, "--calibrate-baseline", metrics, "--rate", "4"], 2, "--calibrate-baseline")
expect_error("plan: metrics that name no prefill or decode stage are refused",
             ["plan", "--profile", prof, "--calibrate-metrics", os.path.join(WORK, "cli-trace.jsonl"), "--rate", "4"],
             1, "the metrics name no prefill stage")
# Two loads at their rates: each role's factor as a line in the load a stage
# serves. metrics: x2 / x1.5 at 4/s; metrics2: x3 / x2 at 8/s -> at 6/s
# x2.5 / x1.75, then +0.25 / 2.5 = 10 % and +0.125 / 1.75 = 7.14 % a step
# per request/s.
metrics2 = os.path.join(WORK, "cli-metrics2.txt")
with open(metrics2, "w") as f:
    f.write(f'cleave_actor_stat{{actor="prefill/0",name="steps"}} 100\n'
            f'cleave_actor_stat{{actor="prefill/0",name="step_us"}} {int(round(pre / 2 * 3 * 1e3))}\n'
            f'cleave_actor_stat{{actor="prefill/0",name="prefill_tokens"}} 1600\n'
            f'cleave_actor_stat{{actor="decode/0",name="steps"}} 1000\n'
            f'cleave_actor_stat{{actor="decode/0",name="step_us"}} {int(round(dec / 1.5 * 2 * 1e3))}\n'
            f'cleave_actor_stat{{actor="decode/0",name="decode_rows"}} 4000\n')
cal2 = os.path.join(WORK, "cli-calibrated-loads.json")
rc, out, err = run("plan", "--profile", prof, "--calibrate-metrics", metrics, "--calibrate-rate", "4",
                   "--calibrate-metrics", metrics2, "--calibrate-rate", "8", "--save-profile", cal2, "--rate", "6",
                   "--max-stages", "2")
saved2 = json.load(open(cal2)) if os.path.exists(cal2) else {}
expect("plan --calibrate-rate: two loads fit each role's slowdown per request/s",
       rc == 0 and "load 4 requests/s: prefill steps x2.000" in out and "load 8 requests/s: prefill steps x3.000" in out
       and "at 6 requests/s a stage, then +10.00 % (prefill) and +7.14 % (decode)" in out
       and abs((saved2.get("prefill_ms", 0) + 16 * saved2.get("prefill_ms_per_token", 0)) /
               (2.5 * (profile_fit["prefill_ms"] + 16 * profile_fit["prefill_ms_per_token"])) - 1) < 1e-4
       and saved2.get("load_rate") == 6, out + err)
rc8, out8, _ = run("plan", "--profile", cal2, "--rate", "8", "--max-stages", "2")
rc4, out4, _ = run("plan", "--profile", cal2, "--rate", "4", "--max-stages", "2")
ttft = lambda o: [float(l.split()[5]) for l in o.splitlines() if l.split()[:2] == ["1", "1"]]
expect("plan: a profile with a slowdown simulates slower steps at a higher rate",
       rc8 == 0 and rc4 == 0 and ttft(out8) and ttft(out4) and ttft(out8)[0] > ttft(out4)[0], out8 + out4)
for name, args, code, needles in (
        ("two loads need their rates", ["--calibrate-metrics", metrics, "--calibrate-metrics", metrics2], 2,
         ("--calibrate-metrics", "need their --calibrate-rate")),
        ("one load's rate is refused", ["--calibrate-metrics", metrics, "--calibrate-rate", "4"], 2,
         ("--calibrate-rate", "needs two or more")),
        ("a rate for each load", ["--calibrate-metrics", metrics, "--calibrate-metrics", metrics2, "--calibrate-rate",
                                  "4"], 2, ("--calibrate-rate", "one per")),
        ("a baseline for each load or none", ["--calibrate-metrics", metrics, "--calibrate-metrics", metrics2,
                                              "--calibrate-rate", "4", "--calibrate-rate", "8",
                                              "--calibrate-baseline", baseline], 2, ("--calibrate-baseline", "one per")),
        ("loads at one rate give no slope", ["--calibrate-metrics", metrics, "--calibrate-rate", "4",
                                             "--calibrate-metrics", metrics2, "--calibrate-rate", "4"], 1,
         ("must differ in requests/s per stage",))):
    expect_error("plan: " + name, ["plan", "--profile", prof, *args, "--rate", "4"], code, *needles)
expect_error("plan: a profile calibrated over loads is not calibrated again",
             ["plan", "--profile", cal2, "--calibrate-metrics", metrics, "--rate", "4"], 2, "--calibrate-metrics",
             "calibrated already")
expect_error("plan: --save-profile that would copy --profile is refused",
             ["plan", "--profile", prof, "--save-profile", cal, "--rate", "4"], 2, "--save-profile")

checks.finish("plan")
