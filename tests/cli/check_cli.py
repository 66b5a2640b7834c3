#!/usr/bin/env python3
"""The cleave CLI as a user meets it: exit codes, one-line errors that name
the problem, --json and --logits output, inspect, streaming text.
(`cleave plan`: check_plan.py.)"""
import json
import os
import subprocess
import sys

from cli_checks import Checks

CLEAVE, VOCAB, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
CLIP_DUMP = sys.argv[4] if len(sys.argv) > 4 else None  # tests/reference/clip_dump: writes mmproj files
os.makedirs(WORK, exist_ok=True)
checks = Checks(CLEAVE)
run, expect, expect_error = checks.run, checks.expect, checks.expect_error


model = checks.small_model(VOCAB, os.path.join(WORK, "cli.gguf"))

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

expect_error("--scheduling-policy on one prompt", ["generate", "-m", model, "-p", "x", "--scheduling-policy",
                                                   "priority"], 2, "--scheduling-policy", "needs --requests")
expect_error("unknown --scheduling-policy", ["serve", "-m", model, "--scheduling-policy", "lifo"], 2,
             "--scheduling-policy", "lifo")

# "priority" in request lines: the priority policy gives each request the
# tokens it has without one; fcfs refuses the nonzero ones, naming them.
prio_reqs = os.path.join(WORK, "priority.jsonl")
with open(prio_reqs, "w") as f:
    for i, prio in enumerate([4, 0, -2, 4]):
        f.write(json.dumps({"id": i + 1, "prompt_ids": [1, 20 + i, 30 + i], "max_tokens": 6, "ignore_eos": True,
                            "temperature": 0, "priority": prio}) + "\n")
plain_reqs = os.path.join(WORK, "plain.jsonl")
with open(prio_reqs) as f, open(plain_reqs, "w") as g:
    for line in f:
        r = json.loads(line)
        del r["priority"]
        g.write(json.dumps(r) + "\n")


def run_requests(path, *flags):
    out_path = os.path.join(WORK, "prio-results.jsonl")
    rc, out, err = run("generate", "-m", model, "--requests", path, "--out", out_path, "-t", "1", *flags)
    rows = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            rows = {r["id"]: r for r in map(json.loads, f)}
        os.remove(out_path)
    return rc, rows, out + err


rc_p, prio_rows, log_p = run_requests(prio_reqs, "--scheduling-policy", "priority")
rc_f, plain_rows, log_f = run_requests(plain_reqs)
expect("--scheduling-policy priority runs prioritised requests with their plain tokens",
       rc_p == 0 and len(prio_rows) == 4 and
       all(prio_rows[i].get("tokens") == plain_rows.get(i, {}).get("tokens") and
           len(prio_rows[i].get("tokens", [])) == 6 for i in prio_rows), log_p + log_f)
rc_r, refused_rows, log_r = run_requests(prio_reqs)
expect("fcfs refuses the lines with a nonzero priority, naming it",
       "priority 4" in refused_rows.get(1, {}).get("error", "") and
       "--scheduling-policy priority" in refused_rows.get(3, {}).get("error", "") and
       len(refused_rows.get(2, {}).get("tokens", [])) == 6, log_r + str(refused_rows))

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

# Images (llama.cpp's mtmd spelling): --mmproj and --image, in every topology.
if CLIP_DUMP:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
    import numpy as np
    from reference_clip import write_png

    mmproj, mmproj32 = os.path.join(WORK, "mmproj.gguf"), os.path.join(WORK, "mmproj32.gguf")
    for path, proj in ((mmproj, 64), (mmproj32, 32)):  # 32x32 images, patch 8: 16 tokens
        p = subprocess.run([CLIP_DUMP, "make", path, "f32", "5", f"proj={proj}"], capture_output=True, text=True)
        expect("clip_dump writes " + os.path.basename(path), p.returncode == 0, p.stderr)
    png, png2 = os.path.join(WORK, "img.png"), os.path.join(WORK, "img2.png")
    write_png(png, (np.arange(40 * 30 * 3).reshape(30, 40, 3) * 7 % 251).astype(np.uint8))
    write_png(png2, (np.arange(32 * 32 * 3).reshape(32, 32, 3) * 13 % 241).astype(np.uint8))
    corrupt = os.path.join(WORK, "corrupt.png")
    with open(png, "rb") as f:
        data = bytearray(f.read())
    data[40] ^= 0xFF  # inside IDAT: the CRC no longer matches
    with open(corrupt, "wb") as f:
        f.write(data)
    img = ["generate", "-m", model, "-n", "5", "--temp", "0", "--ignore-eos", "--json", "-t", "1"]
    rc, out, err = run(*img, "--mmproj", mmproj, "--image", png, "-p", "Hello")
    try:
        j = json.loads(out)
    except ValueError:
        j = {}
    ids = j.get("prompt_ids", [])
    expect("--image: BOS, 16 placeholder ids, then the text", rc == 0 and ids[:17] == [1] + [0] * 16
           and len(ids) > 17 and j.get("images") == 1, out + err)
    expect("--image: 5 tokens and an encode time", len(j.get("generated_ids", [])) == 5 and
           j.get("timings", {}).get("encode_seconds", 0) > 0, str(j))
    rc2, out2, _ = run(*img, "--mmproj", mmproj, "--image", png2, "-p", "Hello")
    expect("another image: the same prompt ids",
           rc2 == 0 and json.loads(out2)["prompt_ids"] == ids, out2)
    rc3, out3, err3 = run(*img, "--mmproj", mmproj, "--image", png, "--image", png2,
                          "-p", "one <image> two <image>")
    ids3 = json.loads(out3).get("prompt_ids", []) if rc3 == 0 else []
    expect("two <image> markers place two runs", rc3 == 0 and ids3.count(0) == 32 and ids3[1] != 0, out3 + err3)

    # --requests: one batched run gives each request's single-run tokens.
    reqs = os.path.join(WORK, "requests.jsonl")
    with open(reqs, "w") as f:
        f.write(json.dumps({"id": 7, "prompt": "Hello", "images": [png], "max_tokens": 5,
                            "ignore_eos": True, "temperature": 0}) + "\n")
        f.write(json.dumps({"id": 8, "prompt_ids": [1, 15043, 3186], "max_tokens": 5,
                            "ignore_eos": True, "temperature": 0}) + "\n")
    res = os.path.join(WORK, "results.jsonl")
    rc, out, err = run("generate", "-m", model, "--mmproj", mmproj, "--requests", reqs, "--out", res,
                       "-t", "1")
    got = {}
    if rc == 0:
        with open(res) as f:
            got = {r["id"]: r for r in map(json.loads, f)}
    expect("--requests runs image and text requests together",
           rc == 0 and got.get(7, {}).get("tokens") == j.get("generated_ids") and
           len(got.get(8, {}).get("tokens", [])) == 5, out + err + str(got))

    expect_error("--image without --mmproj", [*img, "--image", png, "-p", "x"], 2, "--mmproj")
    # E/P/D and colocated with vision_encoder actors: mono's tokens, and the
    # encoder among the stages.
    for topo in (["--topology", "pd", "--vision-actors", "2"], ["--topology", "colocated"]):
        rc4, out4, err4 = run(*img, "--mmproj", mmproj, "--image", png, "-p", "Hello", *topo)
        j4 = json.loads(out4) if rc4 == 0 else {}
        expect("--image " + " ".join(topo) + " gives the mono tokens",
               j4.get("generated_ids") == j.get("generated_ids") and
               any("vision_encoder" in k for k in j4.get("stages", {})), out4 + err4)
    rc5, out5, err5 = run("generate", "-m", model, "--mmproj", mmproj, "--requests", reqs, "--out", res,
                          "-t", "1", "--topology", "pd")
    got5 = {}
    if rc5 == 0:
        with open(res) as f:
            got5 = {r["id"]: r for r in map(json.loads, f)}
    expect("--requests through E/P/D gives the mono tokens",
           got5.get(7, {}).get("tokens") == j.get("generated_ids") and
           got5.get(7, {}).get("encoder", "").startswith("vision_encoder") and
           got5.get(8, {}).get("tokens") == got.get(8, {}).get("tokens"), out5 + err5 + str(got5))
    expect_error("--image with --prompt-ids", [*img, "--mmproj", mmproj, "--image", png,
                                               "--prompt-ids", "1,2"], 2, "--prompt")
    expect_error("missing image file", [*img, "--mmproj", mmproj, "--image", os.path.join(WORK, "no.png"),
                                        "-p", "x"], 2, "no.png")
    expect_error("corrupt image file", [*img, "--mmproj", mmproj, "--image", corrupt, "-p", "x"], 1,
                 "corrupt.png", "CRC")
    expect_error("not an image", [*img, "--mmproj", mmproj, "--image", reqs, "-p", "x"], 1,
                 "requests.jsonl")
    expect_error("projection_dim differs from n_embd", [*img, "--mmproj", mmproj32, "--image", png,
                                                         "-p", "x"], 1, "projection_dim 32", "n_embd 64")
    expect_error("more <image> markers than images", [*img, "--mmproj", mmproj, "--image", png,
                                                       "-p", "<image> and <image>"], 1, "2 <image> markers")
    expect_error("--mmproj that is no clip file", [*img, "--mmproj", model, "--image", png, "-p", "x"], 1,
                 "clip")

# inspect.
rc, out, err = run("inspect", model)
expect("inspect shows metadata and tensors",
       rc == 0 and "llama.block_count" in out and "blk.1.ffn_down.weight" in out and "parameters:" in out,
       out[:400])

# topology check / show: exit 0 with a summary or the table; a bad script
# exits 1 with one line naming file:line and the problem.
examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
for name in ("one_process.lua", "pd_2nodes.lua", "p1_d2.lua", "epd_3nodes.lua", "pipeline_nodes.lua",
             "kv_pool_nodes.lua"):
    rc, out, err = run("topology", "check", os.path.join(examples, name))
    expect("topology check " + name, rc == 0 and out.startswith("ok: ") and "head" in out, out + err)
rc, out, err = run("topology", "check", os.path.join(examples, "kv_pool_nodes.lua"), "--set", "pool=0",
                   "--set", "nodes=2")
expect("topology check kv_pool_nodes.lua pool=0: no node stores but the head's",
       rc == 0 and "3 nodes, 3 actors (colocated 2, kv_store 1)" in out, out + err)
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

# Every setting has effect or is refused: a stage actor without its
# layers, a device the node cannot run on, request flags that --requests
# would ignore, JSONL fields nobody reads.
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1, stage = 1 } }\n")
expect_error("topology: a stage actor without stage{} is refused", ["topology", "check", bad_topo], 1,
             "bad_topo.lua:1:", "a stage actor needs stage = { layers = {first, last} }")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1, nope = 1 } }\n")
expect_error("topology: an unknown kind names the kinds", ["topology", "check", bad_topo], 1, "bad_topo.lua:1:",
             "unknown actor kind 'nope'", "prefill, decode, colocated, kv_store, vision_encoder, expert, stage")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1, attention = 2 } }\n")
expect_error("topology: attention is a role, not a kind", ["topology", "check", bad_topo], 1, "bad_topo.lua:1:",
             "actor kind 'attention': prefill, decode and colocated actors are the attention actors")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, device = 'cuda:3', actors = { colocated = 1 } }\n")
rc, out, err = run("node", "--topology", bad_topo, "--name", "h", "-m", model)
last = (err.strip().splitlines() or [""])[-1]
expect("node: device cuda:3 is refused at start, naming it",
       rc == 1 and last.startswith("cleave: error: ") and "node 'h': device cuda:3: " in last and
       "listening" not in out, f"rc={rc} {out} {err}")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1 } }\n"
            "cluster { router = { policy = 'round_robin', decode_weight = 2 } }\n")
expect_error("topology: weights only for kv_aware", ["topology", "check", bad_topo], 1, "bad_topo.lua:2:",
             "decode_weight applies to policy kv_aware only")
expect_error("--prefill-actors without pd", ["generate", "-m", model, "-p", "x", "--prefill-actors", "2"], 2,
             "--prefill-actors", "needs --topology pd")
expect_error("--decode-actors with colocated", ["generate", "-m", model, "-p", "x", "--topology", "colocated",
                                                "--decode-actors", "2"], 2, "--decode-actors", "needs --topology pd")
expect_error("--vision-actors without --mmproj", ["generate", "-m", model, "-p", "x", "--topology", "pd",
                                                  "--vision-actors", "2"], 2, "--vision-actors", "needs --mmproj")
one_req = os.path.join(WORK, "one.jsonl")
with open(one_req, "w") as f:
    f.write(json.dumps({"id": 1, "prompt_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
for flag in (["--temp", "0"], ["-n", "4"], ["--seed", "3"], ["--ignore-eos"], ["--ubatch-size", "8"]):
    expect_error("--requests refuses " + flag[0], ["generate", "-m", model, "--requests", one_req, *flag], 2,
                 flag[0], "each line sets its own")
with open(one_req, "w") as f:
    f.write(json.dumps({"id": 1, "prompt_ids": [1, 2, 3], "max_token": 2}) + "\n")
expect_error("--requests: an unknown field is refused", ["generate", "-m", model, "--requests", one_req], 1,
             "one.jsonl:1:", "unknown field \"max_token\"")
# One file, the same defaults: generate --requests and a node head give the
# same tokens and logits hashes for lines that set nothing but id, prompt
# and max_tokens.
with open(one_req, "w") as f:
    for i in range(4):
        f.write(json.dumps({"id": 10 + i, "prompt_ids": [1, 400 + i, 500, 600], "max_tokens": 6}) + "\n")
gen_out, node_out = os.path.join(WORK, "gen_out.jsonl"), os.path.join(WORK, "node_out.jsonl")
rc_g, _, err_g = run("generate", "-m", model, "--requests", one_req, "--out", gen_out, "-t", "1")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1 } }\n")
rc_n, _, err_n = run("node", "--topology", bad_topo, "--name", "h", "-m", model, "--requests", one_req,
                     "--out", node_out)
def results(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["id"]: (r["tokens"], r["logits_hash"]) for r in map(json.loads, f)}
g_res, n_res = results(gen_out), results(node_out)
expect("generate --requests and node --requests read one file alike",
       rc_g == 0 and rc_n == 0 and len(g_res) == 4 and g_res == n_res and
       all(len(t) == 6 and len(h) == 6 for t, h in g_res.values()), err_g + err_n + str(g_res) + str(n_res))

# cleave serve / node --http-port: flags that would be ignored are refused.
expect_error("serve: --prefill-actors needs pd", ["serve", "-m", model, "--prefill-actors", "2"], 2,
             "--prefill-actors", "needs --topology pd")
expect_error("serve: --colocated-actors needs colocated", ["serve", "-m", model, "--colocated-actors", "2"], 2,
             "--colocated-actors")
expect_error("serve: --vision-actors needs --mmproj", ["serve", "-m", model, "--topology", "pd",
                                                        "--vision-actors", "2"], 2, "--vision-actors")
expect_error("serve: an unknown chat template is refused with the known names",
             ["serve", "-m", model, "--port", "0", "--chat-template", "jinja-9"], 1,
             "jinja-9", "chatml", "llama-2", "llama-3", "shapes")
import socket
with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    expect_error("serve: a port taken is an error naming it", ["serve", "-m", model, "--port", port], 1,
                 "127.0.0.1:" + port)
expect_error("serve: -np takes a number", ["serve", "-m", model, "-np", "zero"], 2, "parallel")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1 } }\n"
            "node { name = 'w', actors = { decode = 1 } }\n")
expect_error("node: --api-key without --http-port is refused",
             ["node", "--topology", bad_topo, "--name", "h", "-m", model, "--api-key", "k"], 2,
             "--api-key", "needs --http-port")
expect_error("node: a worker does not serve HTTP",
             ["node", "--topology", bad_topo, "--name", "w", "-m", model, "--http-port", "0"], 2,
             "--http-port", "only the head")
expect_error("node: --name is required (unless the command is drain)",
             ["node", "--topology", bad_topo, "-m", model], 2, "--name is required")
expect_error("node drain: a node's flag is refused",
             ["node", "-m", model, "drain", "w", "--topology", bad_topo], 2, "--model", "node drain")
expect_error("node drain: the head needs its real port",
             ["node", "drain", "w", "--topology", bad_topo], 1, "drain needs its real port")

# --experts: the FFN experts on their own hosts give mono's tokens and logits
# hashes (generate --requests over every topology); bad sets are refused.
moe = os.path.join(WORK, "cli-moe.gguf")
rc, _, err = run("make-model", "--out", moe, "--vocab", VOCAB, "--dim", "64", "--layers", "3", "--heads", "4",
                 "--kv-heads", "2", "--ffn", "64", "--experts", "8", "--experts-used", "2", "--ctx", "128")
expect("make-model writes a MoE model", rc == 0, err)
moe_req = os.path.join(WORK, "moe_requests.jsonl")
with open(moe_req, "w") as f:
    for i in range(24):
        f.write(json.dumps({"id": i, "prompt_ids": [1] + [300 + 7 * j + i for j in range(3 + i)],
                            "max_tokens": 8, "temperature": 0 if i % 2 else 0.9, "seed": i}) + "\n")
moe_ref = os.path.join(WORK, "moe_mono.jsonl")
rc, _, err = run("generate", "-m", moe, "--requests", moe_req, "--out", moe_ref, "-t", "1")
ref = results(moe_ref)
expect("generate --requests on the MoE model", rc == 0 and len(ref) == 24, err)
for topo, spec in (("mono", "0-3;4-7"), ("colocated", "all;all;0,1"), ("pd", "0,4;1,5;2,6;3,7"),
                   ("pd", "all@0;all@1-2")):
    out_path = os.path.join(WORK, f"moe_{topo}.jsonl")
    rc, _, err = run("generate", "-m", moe, "--requests", moe_req, "--out", out_path, "-t", "1",
                     "--topology", topo, "--experts", spec)
    expect(f"--experts '{spec}' on {topo} gives mono's tokens and logits hashes", rc == 0 and results(out_path) == ref,
           err)
# Micro-batch ping-pong: any number of groups gives the same bits.
for topo, spec, micro in (("mono", "0-3;4-7", "3"), ("colocated", "all;all", "2"), ("pd", "0-3;4-7", "5")):
    out_path = os.path.join(WORK, f"moe_{topo}_micro.jsonl")
    rc, _, err = run("generate", "-m", moe, "--requests", moe_req, "--out", out_path, "-t", "1",
                     "--topology", topo, "--experts", spec, "--expert-micro-batches", micro)
    expect(f"--expert-micro-batches {micro} on {topo} gives mono's tokens and logits hashes",
           rc == 0 and results(out_path) == ref, err)
# The trained shapes MoE LM (models/shapes, 4 experts, top-2): 100 mixed
# requests through expert actors, with ping-pong and replication, give mono's bits.
shapes_moe = os.path.join(os.path.dirname(VOCAB), "..", "shapes", "shapes-lm-moe-f32.gguf")
shapes_req = os.path.join(WORK, "shapes_moe_requests.jsonl")
with open(shapes_req, "w") as f:
    for i in range(100):
        f.write(json.dumps({"id": i, "prompt_ids": [1] + [3 + (13 * j + 7 * i) % 340 for j in range(2 + i % 30)],
                            "max_tokens": 8, "temperature": 0 if i % 2 else 0.8, "seed": i}) + "\n")
shapes_ref_path = os.path.join(WORK, "shapes_moe_mono.jsonl")
rc, _, err = run("generate", "-m", shapes_moe, "--requests", shapes_req, "--out", shapes_ref_path, "-t", "1")
shapes_ref = results(shapes_ref_path)
expect("generate --requests on the shapes MoE LM", rc == 0 and len(shapes_ref) == 100, err)
for topo, extra in (("colocated", ["--experts", "0,1;2,3", "--expert-micro-batches", "2", "--enable-eplb"]),
                    ("pd", ["--experts", "all@0-1;all@2-3;all"])):
    out_path = os.path.join(WORK, f"shapes_moe_{topo}.jsonl")
    rc, _, err = run("generate", "-m", shapes_moe, "--requests", shapes_req, "--out", out_path, "-t", "1",
                     "--topology", topo, *extra)
    expect(f"shapes MoE LM, {topo} {' '.join(extra)}: mono's tokens and logits hashes",
           rc == 0 and results(out_path) == shapes_ref, err)
# Hot-expert replication (--enable-eplb): replicas added at run time, same bits.
for topo in ("mono", "colocated"):
    out_path = os.path.join(WORK, f"moe_{topo}_eplb.jsonl")
    rc, _, err = run("generate", "-m", moe, "--requests", moe_req, "--out", out_path, "-t", "1",
                     "--topology", topo, "--experts", "0,1;2,3;4,5;6,7", "--enable-eplb")
    expect(f"--enable-eplb on {topo} gives mono's tokens and logits hashes", rc == 0 and results(out_path) == ref, err)
expect_error("--enable-eplb needs --experts", ["generate", "-m", moe, "--prompt-ids", "1,2", "--enable-eplb"], 2,
             "--enable-eplb", "needs expert hosts")
expect_error("--expert-micro-batches needs --experts",
             ["generate", "-m", moe, "--prompt-ids", "1,2", "--expert-micro-batches", "2"], 2,
             "--expert-micro-batches", "needs expert hosts")
expect_error("--expert-micro-batches: out of range", ["generate", "-m", moe, "--prompt-ids", "1,2", "--experts", "all",
                                                       "--expert-micro-batches", "0"], 2, "--expert-micro-batches")
expect_error("serve: --expert-micro-batches needs --experts",
             ["serve", "-m", moe, "--expert-micro-batches", "2"], 2, "--expert-micro-batches", "needs expert hosts")
rc, out1, err = run("generate", "-m", moe, "--prompt-ids", "1,300,301", "-n", "6", "--temp", "0", "--json",
                    "--experts", "0-3;4-7")
rc0, out0, _ = run("generate", "-m", moe, "--prompt-ids", "1,300,301", "-n", "6", "--temp", "0", "--json")
expect("generate (one prompt) with --experts gives the same ids", rc == 0 and rc0 == 0 and
       json.loads(out1)["generated_ids"] == json.loads(out0)["generated_ids"], err + out1 + out0)
expect_error("--experts: a bad spelling names the piece", ["generate", "-m", moe, "--requests", moe_req, "--out",
                                                           os.path.join(WORK, "x.jsonl"), "--experts", "0-3;x"],
             2, "--experts", "'x'")
expect_error("--experts: an expert without a host is named",
             ["generate", "-m", moe, "--requests", moe_req, "--out", os.path.join(WORK, "x.jsonl"),
              "--topology", "colocated", "--experts", "0-3;4-6"], 1, "expert 7 of layer 0 has no host")
expect_error("--experts: an expert the model lacks is named",
             ["generate", "-m", moe, "--prompt-ids", "1,2", "--experts", "0-8"], 1,
             "expert 8 is not one of the model's 8 experts")
expect_error("make-model: --router-skew needs experts",
             ["make-model", "--out", os.path.join(WORK, "x.gguf"), "--vocab", VOCAB, "--router-skew", "2"], 1,
             "router_skew", "needs a MoE model")
# Topology scripts place experts: `topology check -m` checks the placement
# against the model, naming an expert without a host; the nodes refuse it too.
ex_topo = os.path.join(examples, "experts_3nodes.lua")
rc, out, err = run("topology", "check", ex_topo, "-m", moe)
expect("topology check -m: the example places every expert", rc == 0 and "expert 2" in out, out + err)
rc, out, err = run("topology", "show", ex_topo, "--set", "replicas=true")
expect("topology show: each expert node's set", rc == 0 and out.count("expert 1 (layers 0-last, experts all)") == 2,
       out + err)
rc, out, err = run("topology", "show", ex_topo)
expect("topology show: the halves", rc == 0 and "experts {0, 1, 2, 3}" in out and "experts {4, 5, 6, 7}" in out,
       out + err)
expect_error("topology check -m: an expert the script leaves unplaced is named",
             ["topology", "check", ex_topo, "-m", moe, "--set", "experts=7"], 1,
             "expert 7 of layer 0 has no host")
expect_error("topology check -m: more experts than the model has",
             ["topology", "check", ex_topo, "-m", moe, "--set", "experts=10"], 1,
             "node 'ex1'", "expert 8 is not one of the model's 8 experts")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1, expert = 1 },\n"
            "       expert = { experts = {0, 1}, layers = {1, 2} } }\n")
expect_error("topology check -m: layers left without their experts",
             ["topology", "check", bad_topo, "-m", moe], 1, "expert 0 of layer 0 has no host")
rc, _, err = run("node", "--topology", bad_topo, "--name", "h", "-m", moe)
expect("node: a head whose script leaves experts unplaced refuses to start",
       rc == 1 and "expert 0 of layer 0 has no host" in err, err)
expect_error("node: --expert-micro-batches on an expert node (no attention side)",
             ["node", "--topology", ex_topo, "--name", "ex0", "-m", moe, "--expert-micro-batches", "2"], 2,
             "--expert-micro-batches", "'ex0' has no prefill, decode or colocated actors")
expect_error("node: --enable-eplb on an expert node (no attention side)",
             ["node", "--topology", ex_topo, "--name", "ex1", "-m", moe, "--enable-eplb"], 2,
             "--enable-eplb", "'ex1' has no prefill, decode or colocated actors")
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1 } }\n")
expect_error("node: --expert-micro-batches in a cluster without experts",
             ["node", "--topology", bad_topo, "--name", "h", "-m", moe, "--expert-micro-batches", "2"], 2,
             "--expert-micro-batches", "needs expert actors in the topology script")
for script, needle in (
        ("expert = { experts = {0, 0} }", "expert 0 is listed twice"),
        ("expert = { experts = {} }", "expert.experts is empty"),
        ("expert = { experts = {0, 'x'} }", "expert.experts[2] must be an integer"),
        ("expert = { layers = {3, 1} }", "expert.layers {3, 1} is not a range"),
        ("expert = { layers = {1} }", "expert.layers must be {first, last}"),
        ("expert = { layer = {1, 2} }", "unknown field 'layer' (did you mean 'layers'?")):
    with open(bad_topo, "w") as f:
        f.write("node { name = 'h', head = true, actors = { colocated = 1, expert = 1 }, %s }\n" % script)
    expect_error("topology: " + needle, ["topology", "check", bad_topo], 1, "bad_topo.lua:1:", needle)
with open(bad_topo, "w") as f:
    f.write("node { name = 'h', head = true, actors = { colocated = 1 }, expert = { experts = {0} } }\n")
expect_error("topology: expert{} without expert actors", ["topology", "check", bad_topo], 1,
             "expert{} is set but the node has no expert actor")
skewed = os.path.join(WORK, "cli-moe-skewed.gguf")
rc, _, err = run("make-model", "--out", skewed, "--vocab", VOCAB, "--dim", "64", "--layers", "3", "--heads", "4",
                 "--kv-heads", "2", "--ffn", "64", "--experts", "8", "--experts-used", "2", "--ctx", "128",
                 "--router-skew", "4")
with open(moe, "rb") as f1, open(skewed, "rb") as f2:
    differs = f1.read() != f2.read()
expect("make-model --router-skew changes the router and only with experts", rc == 0 and differs, err)
expect_error("serve: --experts is checked before loading", ["serve", "-m", moe, "--experts", "all@3-1"], 2,
             "--experts", "layers")

# --pipeline-parallel-size: every engine's layers cut into stages (threads
# in mono, stage actors otherwise) give mono's tokens and logits hashes, with
# any number of micro-batches; the flags that need a pipeline say so.
for topo, pp, micro in (("mono", "3", "2"), ("colocated", "2", "3"), ("pd", "3", "1")):
    out_path = os.path.join(WORK, f"moe_{topo}_pp.jsonl")
    rc, _, err = run("generate", "-m", moe, "--requests", moe_req, "--out", out_path, "-t", "1",
                     "--topology", topo, "--pipeline-parallel-size", pp, "--pipeline-micro-batches", micro)
    expect(f"--pipeline-parallel-size {pp} --pipeline-micro-batches {micro} on {topo} gives mono's tokens and "
           "logits hashes", rc == 0 and results(out_path) == ref, err)
rc0, out0, _ = run("generate", "-m", moe, "--prompt-ids", "1,5,9,13", "-n", "8", "--temp", "0", "--json")
rc1, out1, err = run("generate", "-m", moe, "--prompt-ids", "1,5,9,13", "-n", "8", "--temp", "0", "--json",
                     "--pipeline-parallel-size", "2")
expect("generate (one prompt, mono) over 2 stages gives the same ids",
       rc0 == 0 and rc1 == 0 and json.loads(out0)["generated_ids"] == json.loads(out1)["generated_ids"],
       err + out0 + out1)
expect_error("--pipeline-micro-batches needs --pipeline-parallel-size",
             ["generate", "-m", moe, "--prompt-ids", "1,2", "--pipeline-micro-batches", "2"], 2,
             "--pipeline-micro-batches", "needs --pipeline-parallel-size above 1")
expect_error("serve: --pipeline-micro-batches needs --pipeline-parallel-size",
             ["serve", "-m", moe, "--pipeline-micro-batches", "2"], 2, "--pipeline-micro-batches")
expect_error("--pipeline-parallel-size with --experts is refused",
             ["generate", "-m", moe, "--prompt-ids", "1,2", "--pipeline-parallel-size", "2", "--experts", "all"], 2,
             "--pipeline-parallel-size", "not supported")
expect_error("--pipeline-parallel-size past the model's layers",
             ["generate", "-m", moe, "--prompt-ids", "1,2", "--pipeline-parallel-size", "4"], 1,
             "pipeline of 4 stages: must be in [1, 3]")
pp_topo = os.path.join(examples, "pipeline_nodes.lua")
rc, out, err = run("topology", "show", pp_topo, "--set", "layers=3")
expect("topology show: each stage's pipeline and layers", rc == 0 and "prefill 1 (pipeline prefill1, layers [0, 1])"
       in out and "stage 1 (pipeline prefill1, layers [2, 2])" in out, out + err)
expect_error("topology check -m: a cut past the model's layers",
             ["topology", "check", pp_topo, "-m", moe, "--set", "layers=4"], 1,
             "pipeline 'decode1'", "holds [0, 3], past the model's layers [0, 2]")
expect_error("topology check -m: a cut short of the model's layers",
             ["topology", "check", pp_topo, "-m", moe, "--set", "layers=2"], 1,
             "pipeline 'decode1'", "layers [2, 2] are held by no stage")
expect_error("node: the hidden --kv-fault-corrupt-chunk on a node without prefill actors",
             ["node", "--topology", os.path.join(examples, "pd_2nodes.lua"), "--name", "decode", "-m", model,
              "--set", "prefill_port=1", "--kv-fault-corrupt-chunk", "0"], 2, "--kv-fault-corrupt-chunk",
             "'decode' has no prefill actors")
expect_error("node: --pipeline-micro-batches on a later stage",
             ["node", "--topology", pp_topo, "--name", "prefill1_2", "-m", moe, "--set", "layers=3",
              "--pipeline-micro-batches", "2"], 2, "--pipeline-micro-batches", "is not a pipeline's first stage")

# KV cache types (-ctk / -ctv, llama.cpp's spellings): each changes the
# numbers (the logits differ from F32 KV's), runs the same twice, and a
# type the model's head_dim cannot hold is refused in one line.
kvm = os.path.join(WORK, "kv32.gguf")  # head_dim 32: Q8_0 blocks fit
rc, _, err = run("make-model", "--out", kvm, "--vocab", VOCAB, "--dim", "64", "--layers", "2",
                 "--heads", "2", "--kv-heads", "1", "--ffn", "128", "--ctx", "64", "--type", "f16")
expect("make-model writes a head_dim-32 model", rc == 0, err)


def kv_logits(model_path, *flags):
    path = os.path.join(WORK, "kv-logits.bin")
    rc, out, err = run("generate", "-m", model_path, "--prompt-ids", "1,50,60,70,80,90,100,110,120", "-n", "6",
                       "--temp", "0", "--ignore-eos", "--json", "--logits", path, *flags)
    if rc != 0:
        return None, err
    with open(path, "rb") as f:
        return (json.loads(out)["generated_ids"], f.read()), err


base, err = kv_logits(kvm)
expect("generate with F32 KV", base is not None, err)
for flags in (["-ctk", "f16", "-ctv", "f16"], ["-ctk", "q8_0", "-ctv", "q8_0"], ["--cache-type-k", "q8_0"],
              ["-ctv", "f16"], ["-ctk", "q4_0", "-ctv", "q4_0"], ["-ctk", "q8_0", "-ctv", "q4_0"]):
    got, err = kv_logits(kvm, *flags)
    again, _ = kv_logits(kvm, *flags)
    expect("generate " + " ".join(flags) + ": other logits than F32 KV, the same twice",
           got is not None and got[1] != base[1] and got == again and len(got[0]) == 6, err)
expect_error("-ctk q8_0 on head_dim 16", ["generate", "-m", model, "--prompt-ids", "1,2", "-ctk", "q8_0"], 1,
             "cache type k q8_0 needs head_dim a multiple of 32 (it is 16)")
expect_error("-ctv bf16", ["generate", "-m", model, "--prompt-ids", "1,2", "-ctv", "bf16"], 2,
             "--cache-type-v", "bf16")
expect_error("-ctv q4_0 on head_dim 16", ["generate", "-m", model, "--prompt-ids", "1,2", "-ctv", "q4_0"], 1,
             "cache type v q4_0 needs head_dim a multiple of 32 (it is 16)")
expect_error("serve -ctk q5_0", ["serve", "-m", model, "-ctk", "q5_0"], 2, "--cache-type-k", "q5_0")

# --block-size (vLLM's spelling): positions per KV block, the tile attention
# reduces over. A 46-position run is 6, 3, 2 or 1 blocks of 8, 16, 32 or 64:
# each size gives its own logits (the same twice), pd gives mono's tokens at
# that size, and a size outside vLLM's choices is refused in one line.
def bs_run(*flags, logits=True):
    path = os.path.join(WORK, "bs-logits.bin")
    rc, out, err = run("generate", "-m", kvm, "--prompt-ids", ",".join(str(40 + 23 * i) for i in range(40)),
                       "-n", "6", "--temp", "0", "--ignore-eos", "--json", *(["--logits", path] if logits else []),
                       *flags)
    if rc != 0:
        return None, err
    ids = json.loads(out)["generated_ids"]
    if not logits:
        return ids, err
    with open(path, "rb") as f:
        return (ids, f.read()), err


by_size = {}
for bs in ("8", "16", "32", "64"):
    got, err = bs_run("--block-size", bs)
    again, _ = bs_run("--block-size", bs)
    expect(f"generate --block-size {bs}: six tokens, the same twice", got is not None and got == again and
           len(got[0]) == 6, err)
    by_size[bs] = got
default, _ = bs_run()
expect("the default block size is 16", default == by_size["16"] and default is not None)
expect("each block size gives its own logits",
       None not in by_size.values() and len({v[1] for v in by_size.values()}) == 4)
pd_ids, err = bs_run("--block-size", "64", "--topology", "pd", logits=False)
expect("generate --block-size 64 --topology pd: mono's tokens at that size",
       by_size["64"] is not None and pd_ids == by_size["64"][0], err)
expect_error("--block-size 24", ["generate", "-m", kvm, "--prompt-ids", "1,2", "--block-size", "24"], 2,
             "--block-size", "24")
expect_error("serve --block-size 0", ["serve", "-m", kvm, "--block-size", "0"], 2, "--block-size", "0")

# --compute int8: other logits than exact on a Q8_0 model, the same twice and
# the same under pd (batch-invariant); refused on a model without Q8_0
# weights and for an unknown value.
q8m = os.path.join(WORK, "q8.gguf")
rc, _, err = run("make-model", "--out", q8m, "--vocab", VOCAB, "--dim", "64", "--layers", "2",
                 "--heads", "2", "--kv-heads", "1", "--ffn", "128", "--ctx", "64", "--type", "q8_0")
expect("make-model writes a Q8_0 model", rc == 0, err)
exact, err = kv_logits(q8m)
expect("generate a Q8_0 model exactly", exact is not None, err)
i8, err = kv_logits(q8m, "--compute", "int8")
i8_again, _ = kv_logits(q8m, "--compute", "int8")
expect("generate --compute int8: other logits than exact, the same twice",
       i8 is not None and i8[1] != exact[1] and i8 == i8_again, err)
rc, out, err = run("generate", "-m", q8m, "--prompt-ids", "1,50,60,70,80,90,100,110,120", "-n", "6", "--temp", "0",
                   "--ignore-eos", "--json", "--compute", "int8", "--topology", "pd")
expect("generate --compute int8 --topology pd: mono's tokens",
       rc == 0 and i8 is not None and json.loads(out)["generated_ids"] == i8[0], err)
expect_error("--compute int8 on an F16 model", ["generate", "-m", kvm, "--prompt-ids", "1,2", "--compute", "int8"],
             1, "compute int8 needs Q8_0 weights; this model's matrices are F16")
expect_error("generate --compute int4", ["generate", "-m", q8m, "--prompt-ids", "1,2", "--compute", "int4"], 2,
             "--compute", "int4")
expect_error("serve --compute int4", ["serve", "-m", q8m, "--compute", "int4"], 2, "--compute", "int4")

# --device: cpu is the default (the same logits); a bad spelling is refused
# naming --device; a GPU that is not there is refused when the engine is
# made, saying why (expert hosts and pipeline stages run on the device too,
# so they are no reason to refuse the flag).
cpu_logits, err = kv_logits(kvm, "--device", "cpu")
expect("generate --device cpu: the default's logits", cpu_logits is not None and cpu_logits == base, err)
expect_error("generate --device gpu0", ["generate", "-m", kvm, "--prompt-ids", "1,2", "--device", "gpu0"], 2,
             "--device", "device 'gpu0' is not one of cpu, cuda:N")
expect_error("run-batch --device cuda:x", ["run-batch", "-m", kvm, "--device", "cuda:x", "-i", kvm,
             "-o", os.path.join(WORK, "device.jsonl")], 2, "--device", "cuda:x")
if not os.path.exists("/dev/nvidia0"):
    expect_error("generate --device cuda:0 without a GPU", ["generate", "-m", kvm, "--prompt-ids", "1,2",
                 "--device", "cuda:0"], 1, "engine: cuda backend: ")
    expect_error("generate --device cuda:0 --experts without a GPU", ["generate", "-m", kvm, "--prompt-ids", "1,2",
                 "--device", "cuda:0", "--experts", "all"], 1, "engine: cuda backend: ")
    expect_error("generate --device cuda:0 --pipeline-parallel-size 2 without a GPU",
                 ["generate", "-m", kvm, "--prompt-ids", "1,2", "--device", "cuda:0",
                  "--pipeline-parallel-size", "2"], 1, "engine: cuda backend: ")

checks.finish("cli")
