"""Processes for the multi-process tests (check_nodes.py, check_epd.py, ...): a
process's stdout lines arrive on a queue, its stderr goes to a file, and
stop_all() kills every one still running; results(), stats_of() and
mono_results() read what the heads and `cleave generate` wrote;
run_head_p0_d0() runs tests/nodes/cluster.lua's smallest cluster; make_model()
writes a test model; post_completion() and mono_answers() ask an HTTP server."""
import json
import os
import queue
import random
import re
import signal
import subprocess
import threading
import time
import urllib.request

procs = []
failures = []


def expect(name, cond, detail=""):
    """Prints ok / FAIL for one check; failed names go to failures."""
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else ": " + str(detail)[:2000]), flush=True)
    if not cond:
        failures.append(name)


class NodeProcess:
    def __init__(self, cmd, err_path, env=None):
        self.err_path = err_path
        self.err_file = open(err_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.err_file, text=True, env=env)
        procs.append(self.proc)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, pattern, timeout=30):
        """The first stdout line matching pattern (its match), or None."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            if line is None:
                break
            m = re.search(pattern, line)
            if m:
                return m
        return None

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def run_pid(self):
        """The process that runs the node: a worker's supervisor (the process
        started here) runs each run as its child (apps/process_args.h); the
        head and a --no-rejoin worker run in the process itself."""
        me = self.proc.pid
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # the field after the state: the parent
                return int(d)
        return me

    def freeze(self):
        """SIGSTOP of the node's run: a host that hangs, its connections open."""
        os.kill(self.run_pid(), signal.SIGSTOP)

    def thaw(self):
        os.kill(self.run_pid(), signal.SIGCONT)

    def stderr(self):
        self.err_file.flush()
        with open(self.err_path) as f:
            return f.read()


def stop_all():
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    procs.clear()


def results(path):
    """A --out JSONL file: id -> tokens, text, logits hashes, finish reason, error."""
    try:
        with open(path) as f:
            return {j["id"]: {k: j.get(k) for k in ("tokens", "text", "logits_hash", "finish_reason", "error")}
                    for j in (json.loads(l) for l in f if l.strip())}
    except (OSError, ValueError):
        return {}


def stats_of(err, actor):
    """The counters of `actor` from a node's 'stats ACTOR k=v ...' line."""
    m = re.search(r"stats " + re.escape(actor) + r" (.*)", err)
    return {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())} if m else {}


def mono_results(cleave, model, req, *flags):
    """The one-process reference: `cleave generate --requests` on one thread
    (flags: more generate flags)."""
    out = req + ".mono" + "".join(flags).replace("-", "_")
    p = subprocess.run([cleave, "generate", "-m", model, "--requests", req, "--out", out, "-t", "1", *flags],
                       capture_output=True, text=True, timeout=300)
    expect("mono run of " + os.path.basename(req), p.returncode == 0, p.stderr)
    return results(out)


def run_head_p0_d0(cleave, topology, model, req, work, *sets):
    """tests/nodes/cluster.lua's head (router + KV store, serving the requests
    file req), prefill node p0 and decode node d0 on loopback, one thread
    each, with --set sets (e.g. "compute=int8"), run until the head is done.
    (head's exit status, its results(), {"head" | "p0" | "d0": stderr})."""
    common = ["--topology", topology, "-m", model, "-t", "1"] + [a for s in sets for a in ("--set", s)]
    out = os.path.join(work, "out.jsonl")
    head = NodeProcess([cleave, "node", *common, "--name", "head", "--requests", req, "--out", out,
                        "--wait-stages", "2"], os.path.join(work, "head.err"))
    m = head.wait_line(r"listening on ([0-9.]+):(\d+)")
    expect("head prints its port", m is not None, head.stderr())
    port = m.group(2) if m else "1"
    workers = {name: NodeProcess([cleave, "node", *common, "--name", name, "--set", f"head_port={port}",
                                  "--join-timeout", "20", "--no-rejoin"], os.path.join(work, name + ".err"))
               for name in ("p0", "d0")}
    rc = head.wait(300)
    for w in workers.values():
        w.wait(30)
    stop_all()
    return rc, results(out), {"head": head.stderr(), **{n: w.stderr() for n, w in workers.items()}}


def make_model(cleave, vocab, out, *shape):
    """`cleave make-model --out OUT --vocab VOCAB SHAPE...` (a checked step)."""
    p = subprocess.run([cleave, "make-model", "--out", out, "--vocab", vocab, *shape],
                       capture_output=True, text=True, timeout=120)
    expect("make-model " + os.path.basename(out), p.returncode == 0, p.stderr)


def make_two_models(cleave, vocab, work):
    """The several-model tests' models in work (models.lua, models_pool.lua):
    alpha (dim 64, GQA 4:2) and beta (dim 96, 3 layers), context 512. Their
    paths and the --set arguments that name them (model_a, model_b)."""
    os.makedirs(work, exist_ok=True)
    a, b = os.path.join(work, "alpha.gguf"), os.path.join(work, "beta.gguf")
    make_model(cleave, vocab, a, "--name", "alpha", "--dim", "64", "--layers", "4", "--heads", "4",
               "--kv-heads", "2", "--ffn", "128", "--ctx", "512")
    make_model(cleave, vocab, b, "--name", "beta", "--dim", "96", "--layers", "3", "--heads", "4",
               "--kv-heads", "4", "--ffn", "192", "--ctx", "512")
    return a, b, ["--set", f"model_a={a}", "--set", f"model_b={b}"]


def make_gqa128(cleave, vocab, work):
    """The serving tests' model (dim 128, 4 layers, GQA 4:2, context 512) in
    work: its path."""
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "gqa128.gguf")
    make_model(cleave, vocab, path, "--dim", "128", "--layers", "4", "--heads", "4", "--kv-heads", "2",
               "--ffn", "256", "--ctx", "512")
    return path


def expect_same_answers(name, got, want):
    """Every answer in got equals want's at the same index (a checked step
    naming the first two that differ)."""
    differ = [i for i in range(len(want)) if i >= len(got) or got[i] != want[i]]
    expect(name, not differ and len(got) == len(want),
           [(i, got[i] if i < len(got) else None, want[i]) for i in differ[:2]])


def start_two_model_head(cmd, err_path):
    """Starts a cluster head serving alpha and beta (cmd: its command line,
    with --http-port): the process, its join port and its HTTP base URL
    (checked steps)."""
    head = NodeProcess(cmd, err_path)
    m = head.wait_line(r"listening on ([0-9.]+):(\d+)")
    expect("head prints its port", m is not None, head.stderr())
    url = head.wait_line(r"listening on (http://[0-9.]+:\d+) \(models ([^)]*)\)", 30)
    expect("head serves HTTP for both models", url is not None and url.group(2) == "alpha, beta",
           (url.group(0) if url else None, head.stderr()[-1500:]))
    return head, m.group(2) if m else "1", url.group(1) if url else "http://127.0.0.1:1"


def post_json(base, path, body):
    """POST body to base + path: the answer's JSON, or {"error": ...}."""
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except Exception as e:
        return {"error": str(e)[:300]}


def post_completion(base, body):
    """POST /v1/completions: the first choice's text, finish reason and
    per-token logprobs, or {"error": ...} (an answer that differs from mono's)."""
    j = post_json(base, "/v1/completions", body)
    if "error" in j:
        return j
    c = j["choices"][0]
    return {"text": c["text"], "finish_reason": c["finish_reason"],
            "logprobs": (c.get("logprobs") or {}).get("token_logprobs")}


def post_chat(base, body):
    """POST /v1/chat/completions: the first choice's text, finish reason and
    per-token logprobs, or {"error": ...}."""
    j = post_json(base, "/v1/chat/completions", body)
    if "error" in j:
        return j
    c = j["choices"][0]
    lp = [t["logprob"] for t in ((c.get("logprobs") or {}).get("content") or [])]
    return {"text": c["message"]["content"], "finish_reason": c["finish_reason"], "logprobs": lp}


def mono_answers(cleave, model, bodies, err_path):
    """The one-process reference over HTTP: `cleave serve` on one thread
    answers each body in turn."""
    p = NodeProcess([cleave, "serve", "-m", model, "--port", "0", "-t", "1"], err_path)
    m = p.wait_line(r"listening on (http://[0-9.]+:\d+)", 60)
    expect("mono serve starts", m is not None, p.stderr()[-2000:])
    answers = [post_completion(m.group(1), body) for body in bodies] if m else []
    p.proc.send_signal(signal.SIGTERM)
    p.wait(30)
    stop_all()
    return answers


def random_completions(seed, n, model, prompt_len, max_tokens):
    """n /v1/completions bodies (fixed seed): prompts of ids with lengths in
    prompt_len = (lo, hi), max_tokens in (lo, hi), logprobs, no early stop;
    odd ones sampled (temperature 0.8, seed i), even ones greedy."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [200 + rng.randrange(3000) for _ in range(rng.randrange(*prompt_len))]
        body = {"model": model, "prompt": prompt, "max_tokens": rng.randrange(*max_tokens), "logprobs": 1,
                "ignore_eos": True}
        body.update(temperature=0.8, seed=i) if i % 2 else body.update(temperature=0)
        out.append(body)
    return out


def run_clients(base, bodies, threads, during=None):
    """Posts every body, `threads` at a time; during(done) runs beside them
    (done[0] counts the answers so far). The answers, in body order."""
    answers = [None] * len(bodies)
    done, nxt = [0], [0]
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(bodies):
                return
            a = post_completion(base, bodies[i])
            with lock:
                answers[i] = a
                done[0] += 1
    ts = [threading.Thread(target=client) for _ in range(threads)]
    for t in ts:
        t.start()
    if during:
        during(done)
    for t in ts:
        t.join()
    return answers


def wait_until(cond, timeout=60):
    """Polls cond every 20 ms until it holds or timeout seconds pass; its last value."""
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()
