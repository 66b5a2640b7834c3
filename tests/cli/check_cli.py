#!/usr/bin/env python3
"""The cleave CLI as a user meets it: exit codes, one-line errors that name
the problem, --json and --logits output, inspect, streaming text."""
import json
import os
import subprocess
import sys

CLEAVE, VOCAB, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(WORK, exist_ok=True)
failures = []


def run(*args):
    p = subprocess.run([CLEAVE, *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def expect(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else ": " + detail))
    if not cond:
        failures.append(name)


def expect_error(name, args, code, *needles):
    rc, out, err = run(*args)
    lines = [l for l in err.splitlines() if l.strip()]
    ok = rc == code and len(lines) == 1 and all(n in err for n in needles)
    expect(name, ok, f"rc={rc} stderr={err!r}")


model = os.path.join(WORK, "cli.gguf")
rc, out, err = run("make-model", "--out", model, "--vocab", VOCAB, "--dim", "64", "--layers", "2",
                   "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--ctx", "64", "--type", "f16")
expect("make-model writes a model", rc == 0 and os.path.exists(model), err)

# Usage errors: exit 2, one line.
expect_error("unknown flag", ["generate", "-m", model, "--bogus"], 2, "--bogus")
expect_error("missing model file", ["generate", "-m", os.path.join(WORK, "nope.gguf"), "-p", "x"], 2,
             "nope.gguf")
expect_error("bad prompt ids", ["generate", "-m", model, "--prompt-ids", "1,x"], 2, "'x'")
expect_error("both prompt kinds", ["generate", "-m", model, "-p", "a", "--prompt-ids", "1"], 2,
             "exactly one")
expect_error("no subcommand", [], 2, "subcommand")
expect_error("bad type name", ["make-model", "--out", os.path.join(WORK, "x.gguf"), "--vocab", VOCAB,
                               "--type", "q4_k"], 1, "q4_k")

# Run-time errors: exit 1, one line naming the values.
bad = os.path.join(WORK, "corrupt.gguf")
with open(model, "rb") as f:
    data = bytearray(f.read())
data[0:4] = b"GGUX"
with open(bad, "wb") as f:
    f.write(data)
expect_error("corrupt model", ["generate", "-m", bad, "-p", "x"], 1, "magic")
with open(bad, "wb") as f:
    f.write(bytes(data[:len(data) // 2]).replace(b"GGUX", b"GGUF", 1))
expect_error("truncated model", ["generate", "-m", bad, "-p", "x"], 1, "gguf")
long_ids = ",".join(["5"] * 80)
expect_error("prompt longer than context", ["generate", "-m", model, "--prompt-ids", long_ids], 1,
             "80", "64")
expect_error("token outside the vocabulary", ["generate", "-m", model, "--prompt-ids", "1,99999"], 1,
             "99999")
expect_error("context beyond the model's", ["generate", "-m", model, "-p", "x", "-c", "4096"], 1,
             "4096")

# --json and --logits.
logits = os.path.join(WORK, "l.bin")
rc, out, err = run("generate", "-m", model, "--prompt-ids", "1,15043,3186", "-n", "5", "--temp", "0",
                   "--ignore-eos", "--json", "--logits", logits, "-t", "2")
try:
    j = json.loads(out)
except ValueError:
    j = {}
expect("--json is one object", rc == 0 and out.count("\n") == 1 and "timings" in j, out + err)
expect("--json prompt ids", j.get("prompt_ids") == [1, 15043, 3186], str(j.get("prompt_ids")))
expect("--json generated 5 ids", len(j.get("generated_ids", [])) == 5, str(j))
expect("--json timings", j.get("timings", {}).get("decode_tok_per_s", 0) > 0, str(j.get("timings")))
expect("--logits is steps x n_vocab float32", os.path.getsize(logits) == 5 * 32000 * 4,
       str(os.path.getsize(logits)))
# Greedy is deterministic, and the text equals what the ids decode to.
rc2, out2, _ = run("generate", "-m", model, "--prompt-ids", "1,15043,3186", "-n", "5", "--temp", "0",
                   "--ignore-eos", "--json", "-t", "1")
expect("greedy runs repeat, any thread count", json.loads(out2)["generated_ids"] == j.get("generated_ids"))

# Streaming text mode echoes the prompt and reports timings on stderr.
rc, out, err = run("generate", "-m", model, "-p", "Hello world", "-n", "8", "--seed", "3")
expect("text generation streams after the prompt", rc == 0 and out.startswith("Hello world"), out)
expect("timings on stderr", "decode:" in err and "tok/s" in err, err)
# Sampling with a seed repeats exactly.
rc_b, out_b, _ = run("generate", "-m", model, "-p", "Hello world", "-n", "8", "--seed", "3")
expect("seeded sampling repeats", out_b == out, out_b)

# Actor topologies give the mono run's tokens (seeded sampling too) and
# per-stage timings.
base = ["generate", "-m", model, "--prompt-ids", "1,15043,3186", "-n", "6", "--temp", "0.9",
        "--seed", "11", "--ignore-eos", "--json", "-t", "1"]
rc, out, err = run(*base)
mono_ids = json.loads(out)["generated_ids"] if rc == 0 else None
for topo in (["--topology", "colocated"], ["--topology", "pd"],
             ["--topology", "pd", "--prefill-actors", "2", "--decode-actors", "3"]):
    rc, out, err = run(*base, *topo)
    try:
        j = json.loads(out)
    except ValueError:
        j = {}
    name = " ".join(topo)
    expect(name + " gives the mono tokens", rc == 0 and j.get("generated_ids") == mono_ids,
           f"{j.get('generated_ids')} vs {mono_ids}: {err}")
    stages = j.get("stages", {})
    expect(name + " reports stage timings",
           sum(s["tokens"] for s in stages.values()) == 6 and all(s["seconds"] > 0 for s in stages.values()),
           str(stages))
    if topo[1] == "pd":
        expect(name + ": first token from prefill, the rest from decode",
               any(k.startswith("prefill") and v["tokens"] == 1 for k, v in stages.items()) and
               sum(v["tokens"] for k, v in stages.items() if k.startswith("decode")) == 5, str(stages))
rc, out, err = run("generate", "-m", model, "-p", "Hello world", "-n", "8", "--seed", "3",
                   "--topology", "pd")
expect("pd text mode streams and prints stage timings",
       rc == 0 and out.startswith("Hello world") and "stage prefill" in err and "stage decode" in err,
       out + err)
expect_error("bad topology", ["generate", "-m", model, "-p", "x", "--topology", "ring"], 2, "ring")
expect_error("--logits needs mono", ["generate", "-m", model, "-p", "x", "--topology", "pd", "--logits",
                                     logits], 2, "mono")

# inspect.
rc, out, err = run("inspect", model)
expect("inspect shows metadata and tensors",
       rc == 0 and "llama.block_count" in out and "blk.1.ffn_down.weight" in out and "parameters:" in out,
       out[:400])

# topology check / show: exit 0 with a summary or the table; a bad script
# exits 1 with one line naming file:line and the problem.
examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
for name in ("one_process.lua", "pd_2nodes.lua", "p1_d2.lua", "epd_3nodes.lua"):
    rc, out, err = run("topology", "check", os.path.join(examples, name))
    expect("topology check " + name, rc == 0 and out.startswith("ok: ") and "head" in out, out + err)
rc, out, err = run("topology", "show", os.path.join(examples, "p1_d2.lua"), "--set", "p0_port=7000",
                   "--set", "d1_port=7002")
expect("topology show prints the placement",
       rc == 0 and all(s in out for s in ("127.0.0.1:7000", "127.0.0.1:7002", "d0", "prefill 1",
                                          "decode 1", "total: 3 nodes")), out + err)
bad_topo = os.path.join(WORK, "bad_topo.lua")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1 } }\n"
            "node { name = 'd', actors = { decoder = 1 } }\n")
expect_error("topology: unknown actor kind", ["topology", "check", bad_topo], 1,
             "bad_topo.lua:2:", "unknown actor kind 'decoder'")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1 } }\nwhile true do end\n")
expect_error("topology: endless loop", ["topology", "show", bad_topo], 1, "bad_topo.lua:2:",
             "instruction limit")
expect_error("topology: missing file", ["topology", "check", os.path.join(WORK, "nope.lua")], 2,
             "nope.lua")
expect_error("topology: --set without =", ["topology", "check", bad_topo, "--set", "port"], 2,
             "'port' is not key=value")
expect_error("topology: --set value of the wrong type",
             ["topology", "check", os.path.join(examples, "one_process.lua"), "--set", "head_port=x"],
             1, "one_process.lua:", "--set head_port=x is not a number")

print(f"cli: {len(failures)} failed")
sys.exit(1 if failures else 0)
