#!/usr/bin/env python3
"""`cleave run-batch` killed with SIGKILL and restarted with the same command.

  kill:   a job of N requests (completions and chats, greedy and sampled with
          and without seeds, logprobs, stop strings, a shared ~512-token system
          prompt, images as data URLs and as file:// paths, bad lines) is
          killed at K random moments (seed 1); every restart runs the same
          command. Then: exactly one output line per custom_id, each line equal
          to the uninterrupted run's (text, logprobs bit for bit, usage,
          finish_reason, errors; only "created" and cached_tokens may differ), the input's bad
          lines in the errors file, and the recomputation bound: in mono each
          resumed request recomputes less than one KV block of tokens (the
          rest of its KV is read back from the job's RocksDB store).
  faults: the same job killed by the fault hook at each step of the output's
          append protocol (CLEAVE_JOB_FAULT=STEP:N), then continued: nothing
          lost or doubled, lines equal to the uninterrupted run's.
  input:  a different input for the same job directory is refused naming both
          fingerprints; duplicate custom_ids are refused before anything runs;
          on a terminal (a pty from script(1)) the run shows a progress bar,
          without one it does not.
  disk:   the job directory on a small tmpfs: the disk fills up and the job
          stops with one line saying so (exit 1); the same directory mounted
          read-only: refused naming it; then room again: the same command
          finishes the job, each custom_id once, lines as the uninterrupted
          run's. Needs mount (root); exits 77 (skipped) where it is refused.
  cluster: the job as a batch of the Batch API on a cluster head
          (examples/epd_3nodes.lua: an encoder node, the head with the router,
          the store and a prefill, a node with two decoders; chats with and
          without images and the shared system prompt): the head killed with
          SIGKILL and restarted 3 times, the decode and the encoder node
          killed and restarted once each (the requests that find no stage of
          the kind wait and go on); the workers rejoin the restarted head by
          themselves; the batch's counts never go back; its output equals the
          uninterrupted one-process run's, each custom_id exactly once.

usage: check_batch_kill.py MODE CLEAVE VOCAB MMPROJ PNG WORKDIR [--requests N]
       [--kills K] [--topology mono|colocated|pd]"""
import argparse
import base64
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["kill", "faults", "input", "cluster", "disk"])
ap.add_argument("cleave")
ap.add_argument("vocab")
ap.add_argument("mmproj")
ap.add_argument("png")
ap.add_argument("work")
ap.add_argument("--requests", type=int, default=500)
ap.add_argument("--kills", type=int, default=20)
ap.add_argument("--topology", default="mono")
ap.add_argument("--cluster-script", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                         "examples", "epd_3nodes.lua"))
ap.add_argument("--head", default="prefill", help="the script's head node")
ap.add_argument("--workers", default="encoder,decode", help="the script's other nodes")
args = ap.parse_args()

WORK = os.path.abspath(args.work)
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
MEDIA = os.path.join(WORK, "media")
os.makedirs(MEDIA)
MODEL = os.path.join(WORK, "m.gguf")
BLOCK = 16  # the engine's KV block size (EngineOptions::block_size)
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)
    return cond


subprocess.run([args.cleave, "make-model", "-o", MODEL, "--vocab", args.vocab, "--dim", "128", "--layers", "2",
                "--heads", "4", "--kv-heads", "2", "--ffn", "256", "--ctx", "2048", "--seed", "7",
                "--name", "batch-test"], check=True, stdout=subprocess.DEVNULL)
shutil.copy(args.png, os.path.join(MEDIA, "img.png"))
with open(args.png, "rb") as f:
    DATA_URL = "data:image/png;base64," + base64.b64encode(f.read()).decode()

WORDS = ("the a small large red green blue yellow square circle triangle star shape sits above below left "
         "right of next to and with one two three many color image shows where is").split()
SYSTEM = "You are a careful assistant who describes pictures of shapes. " + " ".join(
    WORDS[(i * 7) % len(WORDS)] for i in range(440))


def make_input(path, n, seed, chat_only=False):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        cid = f"req-{i:04d}"
        kind = rng.random()
        if chat_only:  # chats only: a batch has one endpoint
            kind = 0.4 + kind * 0.6
        sampling = {}
        if rng.random() < 0.5:
            sampling["temperature"] = 0
        else:
            sampling["temperature"] = 0.9
            if rng.random() < 0.7:
                sampling["seed"] = rng.randrange(1 << 30)
        sampling["max_tokens"] = rng.randint(4, 40)
        if rng.random() < 0.1:
            sampling["stop"] = [rng.choice(WORDS)]
        if kind < 0.04:  # bad lines: an error record each
            bad = rng.choice(["url", "field", "method"])
            line = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]}}
            if bad == "url":
                line["url"] = "/v1/embeddings"
            elif bad == "field":
                line["body"]["frobnicate"] = 1
            else:
                line["method"] = "GET"
        elif kind < 0.40:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 150)))
            body = {"prompt": prompt, **sampling}
            if rng.random() < 0.2:
                body["logprobs"] = 2
            line = {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}
        else:
            content = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
            user = content
            if kind > 0.85:  # an image, inline or from the media directory
                url = DATA_URL if rng.random() < 0.5 else "file://" + os.path.join(MEDIA, "img.png")
                user = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": content}]
            msgs = [{"role": "user", "content": user}]
            if kind < 0.75:
                msgs.insert(0, {"role": "system", "content": SYSTEM})
            body = {"messages": msgs, "model": "batch-test", **sampling}
            if rng.random() < 0.2:
                body["logprobs"] = True
                body["top_logprobs"] = 2
            line = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
        lines.append(json.dumps(line))
    if chat_only:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return []
    # Lines without a custom_id: the errors file, by line number.
    lines.insert(n // 3, "{not json")
    lines.insert(2 * n // 3, json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return n // 3 + 1, 2 * n // 3 + 1


def batch_cmd(inp, out, job):
    cmd = [args.cleave, "run-batch", "-i", inp, "-o", out, "-m", MODEL, "--mmproj", args.mmproj,
           "--job-dir", job, "--media-path", MEDIA, "-a", "batch-test", "-t", "1", "--parallel", "16", "--topology", args.topology]
    if args.topology == "pd":
        cmd += ["--decode-actors", "2"]
    return cmd


def run(cmd, env=None, timeout=900):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=timeout)


def read_output(path):
    by_id = {}
    counts = {}
    with open(path) as f:
        for raw in f:
            line = json.loads(raw)
            cid = line["custom_id"]
            counts[cid] = counts.get(cid, 0) + 1
            body = line["response"]["body"]
            body.pop("created", None)
            # Which prompt blocks a cache held depends on what ran before.
            body.get("usage", {}).get("prompt_tokens_details", {}).pop("cached_tokens", None)
            by_id[cid] = line
    return by_id, counts


def status(job):
    r = run([args.cleave, "job", "status", job, "--json"])
    check(r.returncode == 0, f"job status failed: {r.stderr.strip()}")
    return json.loads(r.stdout) if r.returncode == 0 else {}


def compare(ref, out_path, what):
    got, counts = read_output(out_path)
    doubled = [c for c, k in counts.items() if k != 1]
    check(not doubled, f"{what}: custom_ids written more than once: {doubled[:5]}")
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    check(not missing and not extra, f"{what}: missing {missing[:5]}, unexpected {extra[:5]}")
    differ = [c for c in ref if c in got and got[c] != ref[c]]
    check(not differ, f"{what}: {len(differ)} lines differ from the uninterrupted run, e.g. {differ[:3]}")
    if differ:
        print("  ref:", json.dumps(ref[differ[0]])[:600])
        print("  got:", json.dumps(got[differ[0]])[:600])


inp = os.path.join(WORK, "in.jsonl")
n_requests = args.requests if args.mode in ("kill", "cluster") else min(args.requests, 60)
bad_line_numbers = make_input(inp, n_requests, seed=1, chat_only=args.mode == "cluster")

# The uninterrupted run.
t0 = time.time()
r = run(batch_cmd(inp, os.path.join(WORK, "ref.jsonl"), os.path.join(WORK, "ref.job")))
T = time.time() - t0
if not check(r.returncode == 0, f"uninterrupted run failed: {r.stderr[-2000:]}"):
    sys.exit(1)
ref, _ = read_output(os.path.join(WORK, "ref.jsonl"))
ok_lines = sum(1 for l in ref.values() if l["response"]["status_code"] == 200)
print(f"uninterrupted: {len(ref)} lines ({ok_lines} answered) in {T:.1f} s")
check(len(ref) == n_requests, f"uninterrupted run wrote {len(ref)} lines for {n_requests} requests")
check(ok_lines >= n_requests * 0.9, f"only {ok_lines} of {n_requests} requests were answered")
with open(os.path.join(WORK, "ref.job", "input_errors.jsonl")) as f:
    err_lines = sorted(json.loads(l)["line"] for l in f)
check(err_lines == sorted(bad_line_numbers), f"errors file names lines {err_lines}, expected {bad_line_numbers}")
if args.mode == "cluster":
    check(ok_lines == n_requests, f"cluster input: {ok_lines} of {n_requests} answered")
st = status(os.path.join(WORK, "ref.job"))
check(st.get("status") == "completed" and st["request_counts"]["total"] == n_requests,
      f"uninterrupted status: {st.get('status')} {st.get('request_counts')}")

if args.mode == "kill":
    out, job = os.path.join(WORK, "out.jsonl"), os.path.join(WORK, "out.job")
    rng = random.Random(1)
    kills = starts = 0
    def sampled():  # tokens the job has journaled so far (0 before its journal exists)
        if not os.path.exists(os.path.join(job, "journal", "CURRENT")):
            return 0
        r = run([args.cleave, "job", "status", job, "--json"])
        return json.loads(r.stdout)["cleave"]["generated_tokens"] if r.returncode == 0 else 0

    while kills < args.kills:
        before = sampled()
        p = subprocess.Popen(batch_cmd(inp, out, job), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        starts += 1
        # Each kill lands while this run works: after it journaled tokens of
        # its own, then a random moment later (however slow the start-up).
        deadline = time.time() + 120
        while p.poll() is None and sampled() <= before and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.03 * T))
        if p.poll() is not None:
            err = p.stderr.read()
            check(p.returncode == 0, f"run {starts} failed on its own: {err[-1500:]}")
            break
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
    check(kills == args.kills, f"the job finished after {kills} kills, before {args.kills}: kill sooner")
    r = run(batch_cmd(inp, out, job))
    check(r.returncode == 0, f"the last run failed: {r.stderr[-2000:]}")
    compare(ref, out, f"after {kills} kills")
    st = status(job)
    c = st.get("cleave", {})
    print(f"kills {kills}, runs {c.get('runs')}: resumed {c.get('resumed_requests')} requests "
          f"({c.get('resumed_tokens')} tokens replayed), KV imported for {c.get('imported_tokens')} tokens, "
          f"recomputed {c.get('recomputed_tokens')}; tokens sampled {c.get('generated_tokens')} "
          f"(uninterrupted: {status(os.path.join(WORK, 'ref.job')).get('cleave', {}).get('generated_tokens')})")
    check(c.get("runs") == kills + 1, f"runs {c.get('runs')} != kills + 1")
    check(st.get("status") == "completed", f"status {st.get('status')}")
    check(st["request_counts"]["completed"] + st["request_counts"]["failed"] == n_requests, "counts do not add up")
    check(c.get("resumed_requests", 0) > 0, "no request was ever resumed: the kills missed the work")
    check(c.get("imported_tokens", 0) > 0, "no KV was read back from the store")
    if args.topology == "mono":
        bound = (BLOCK - 1) * c.get("resumed_requests", 0)
        check(c.get("recomputed_tokens", 0) <= bound,
              f"recomputed {c.get('recomputed_tokens')} tokens: more than {BLOCK - 1} per resumed request ({bound})")

if args.mode == "cluster":
    import socket
    import urllib.request

    def free_port():
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            return sk.getsockname()[1]

    HEAD_PORT = free_port()
    BD = os.path.join(WORK, "batch-dir")
    common = ["-m", MODEL, "--mmproj", args.mmproj, "-t", "1", "--topology", args.cluster_script,
              "--set", f"{args.head}_port={HEAD_PORT}"]
    worker_names = args.workers.split(",")
    logs = []

    def spawn(name, extra):
        log = open(os.path.join(WORK, f"{name}-{len(logs)}.log"), "w")
        logs.append(log)
        return subprocess.Popen([args.cleave, "node", "--name", name, *common, *extra], stdout=subprocess.PIPE,
                                stderr=log, text=True)

    def start_head():
        for _ in range(50):  # the old head's port may take a moment to be free
            h = spawn(args.head, ["--http-port", "0", "--batch-dir", BD, "-a", "batch-test", "--media-path", MEDIA])
            line = h.stdout.readline()
            while line and "http://" not in line:
                line = h.stdout.readline()
            if line:
                return h, line.split("http://")[1].split()[0]
            h.wait()
            time.sleep(0.2)
        raise SystemExit("the head never started")

    def call(base, method, path, body=None, headers=None):
        req = urllib.request.Request("http://" + base + path, data=body, method=method, headers=headers or {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    def batch(base, bid):
        return json.loads(call(base, "GET", f"/v1/batches/{bid}"))

    head, base = start_head()
    workers = {n: spawn(n, []) for n in worker_names}
    boundary = "cleave-batch-boundary"
    with open(inp, "rb") as f:
        data = f.read()
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    fid = json.loads(call(base, "POST", "/v1/files", body,
                          {"Content-Type": f"multipart/form-data; boundary={boundary}"}))["id"]
    bid = json.loads(call(base, "POST", "/v1/batches", json.dumps(
        {"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}).encode(),
        {"Content-Type": "application/json"}))["id"]
    events = ["head", worker_names[-1], "head", worker_names[0], "head"]  # 3 head kills, 2 worker kills
    done_counts, last = [], 0
    rng = random.Random(2)
    t_end = time.time() + 600
    while time.time() < t_end:
        try:
            b = batch(base, bid)
        except OSError:
            time.sleep(0.05)
            continue
        n = b["request_counts"]["completed"] + b["request_counts"]["failed"]
        check(n >= last, f"the batch's counts went back: {last} -> {n}")
        last = n
        if b["status"] == "completed":
            break
        if events and n >= (len(done_counts) + 1) * n_requests // 7:
            what = events.pop(0)
            time.sleep(rng.uniform(0, 0.3))
            if what == "head":
                head.kill()
                head.wait()
                head, base = start_head()
            else:
                workers[what].kill()
                workers[what].wait()
                workers[what] = spawn(what, [])
            done_counts.append((what, n))
            print(f"killed {what} at {n}/{n_requests} done", flush=True)
        time.sleep(0.05)
    check(not events, f"the batch completed before every kill: {events} left")
    check(b["status"] == "completed", f"the batch is {b['status']} {b['request_counts']} at the end")
    out_text = call(base, "GET", f"/v1/files/{b['output_file_id']}/content").decode()
    out_path = os.path.join(WORK, "cluster.jsonl")
    with open(out_path, "w") as f:
        f.write(out_text)
    compare(ref, out_path, f"cluster after {len(done_counts)} kills")
    print(f"cluster: kills {done_counts}; runs {b['cleave']['runs']}, resumed {b['cleave']['resumed_requests']} "
          f"requests ({b['cleave']['resumed_tokens']} tokens replayed)")
    check(b["cleave"]["runs"] == 4, f"the job ran {b['cleave']['runs']} times, not 4 (3 head restarts)")
    for p in [head, *workers.values()]:
        p.kill()
        p.wait()

if args.mode == "disk":
    mnt = os.path.join(WORK, "mnt")
    os.makedirs(mnt)
    r = run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", mnt])
    if r.returncode != 0:
        print("SKIPPED: cannot mount a tmpfs here:", r.stderr.strip())
        sys.exit(77)
    try:
        out, job = os.path.join(mnt, "out.jsonl"), os.path.join(mnt, "out.job")
        def error_lines(r):  # cleave's own (RocksDB's log lines may follow)
            return [l for l in r.stderr.splitlines() if l.startswith("cleave: error:")]

        r = run(batch_cmd(inp, out, job))
        err = error_lines(r)
        check(r.returncode == 1 and len(err) == 1 and "disk full" in err[0],
              f"disk full: exit {r.returncode}, {r.stderr[-1500:]}")
        print("disk full:", err[0][:200] if err else "")
        run(["mount", "-o", "remount,ro", mnt])
        r = run(batch_cmd(inp, out, job))
        err = error_lines(r)
        check(r.returncode == 1 and len(err) == 1 and mnt in err[0], f"read-only: exit {r.returncode}, {r.stderr[-1500:]}")
        print("read-only:", err[0][:200] if err else "")
        run(["mount", "-o", "remount,rw,size=256m", mnt])
        r = run(batch_cmd(inp, out, job))
        check(r.returncode == 0, f"with room again the job did not finish: {r.stderr[-1500:]}")
        compare(ref, out, "after disk full and read-only")
        st = status(job)
        # The read-only start never opened the job: two runs.
        check(st.get("cleave", {}).get("runs") == 2, f"runs {st.get('cleave', {}).get('runs')}")
        print("room again: finished, exactly once, the uninterrupted run's lines")
    finally:
        run(["umount", "-l", mnt])

if args.mode == "faults":
    for step in ["result.before_write", "result.after_write", "result.after_sync", "result.after_commit"]:
        for nth in (1, 3):
            out, job = os.path.join(WORK, f"{step}-{nth}.jsonl"), os.path.join(WORK, f"{step}-{nth}.job")
            env = dict(os.environ, CLEAVE_JOB_FAULT=f"{step}:{nth}")
            r = run(batch_cmd(inp, out, job), env=env)
            check(r.returncode == -signal.SIGKILL, f"{step}:{nth}: exit {r.returncode}, not killed by the hook")
            r = run(batch_cmd(inp, out, job))
            check(r.returncode == 0, f"{step}:{nth}: the restart failed: {r.stderr[-1500:]}")
            compare(ref, out, f"killed at {step}:{nth}")
            print(f"{step}:{nth}: killed, restarted, exactly once", flush=True)

if args.mode == "input":
    other = os.path.join(WORK, "other.jsonl")
    with open(inp) as f, open(other, "w") as g:
        g.write(f.read().replace("req-0001", "req-x001"))
    r = run(batch_cmd(other, os.path.join(WORK, "ref.jsonl"), os.path.join(WORK, "ref.job")))
    fp = st.get("cleave", {}).get("input_fingerprint", "?")
    check(r.returncode == 1 and fp in r.stderr and "fingerprint" in r.stderr and r.stderr.count("\n") == 1,
          f"another input for the job dir: exit {r.returncode}, {r.stderr.strip()}")
    # The same job under another --block-size (or -ctk, --compute, model)
    # would write its remaining lines with other bits: refused in one line
    # naming both settings; the status names the settings it ran with.
    r = run(batch_cmd(inp, os.path.join(WORK, "ref.jsonl"), os.path.join(WORK, "ref.job")) + ["--block-size", "32"])
    settings = st.get("cleave", {}).get("settings", "")
    check(r.returncode == 1 and "in blocks of 16" in settings and settings in r.stderr and
          "in blocks of 32" in r.stderr and r.stderr.count("\n") == 1,
          f"the job under another --block-size: exit {r.returncode}, {r.stderr.strip()} (settings {settings!r})")
    dup = os.path.join(WORK, "dup.jsonl")
    with open(inp) as f, open(dup, "w") as g:
        g.write(f.read().replace("req-0002", "req-0001"))
    r = run(batch_cmd(dup, os.path.join(WORK, "dup.out"), os.path.join(WORK, "dup.job")))
    check(r.returncode == 1 and "req-0001" in r.stderr and "already used on line" in r.stderr,
          f"duplicate custom_ids: exit {r.returncode}, {r.stderr.strip()}")
    check(not os.path.exists(os.path.join(WORK, "dup.out")), "duplicate custom_ids: an output was written")
    print("another input refused; duplicate custom_ids refused before anything ran")
    # On a terminal (a pty from script(1)) the run shows a progress bar with
    # the status line's figures; without one, no bar.
    import shlex
    tty_cmd = " ".join(shlex.quote(c) for c in batch_cmd(inp, os.path.join(WORK, "tty.jsonl"), os.path.join(WORK, "tty.job")))
    r = run(["script", "-qec", tty_cmd, "/dev/null"])
    bar = re.compile(r"\[[#.]{30}\] +\d+% status \w+: \d+/\d+ .* req/s .* tok/s \| ETA")
    check(r.returncode == 0 and bar.search(r.stdout) and "] 100% status completed" in r.stdout,
          f"no progress bar on a terminal: {r.stdout[-600:]!r}")
    r = run(batch_cmd(inp, os.path.join(WORK, "notty.jsonl"), os.path.join(WORK, "notty.job")))
    check(r.returncode == 0 and not bar.search(r.stderr), "a progress bar without a terminal")
    print("a terminal shows the progress bar")

print("FAILED" if failures else "OK", len(failures), "failure(s)")
sys.exit(1 if failures else 0)
