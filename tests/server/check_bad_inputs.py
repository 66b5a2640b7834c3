#!/usr/bin/env python3
"""Bad input against a real `cleave serve`: every request of the matrix gets
its expected HTTP status and OpenAI error type (never a 5xx, never a hang),
and the server still answers a good request afterwards.

  check_bad_inputs.py CLEAVE LM MMPROJ IMAGE WORKDIR
"""
import base64
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time

KEY = "sk-bad-inputs"


def start(cleave, lm, mmproj):
    p = subprocess.Popen([cleave, "serve", "-m", lm, "--mmproj", mmproj, "--port", "0", "-t", "1",
                          "--api-key", KEY, "-a", "shapes", "--metrics", "--timeout", "2",
                          "--max-connections", "64"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        line = p.stdout.readline()
        m = re.search(r"listening on http://([0-9.]+):(\d+)", line)
        if m:
            return p, m.group(1), int(m.group(2))
        if p.poll() is not None:
            break
    raise SystemExit("server did not start: " + p.stderr.read())


def request(host, port, method, path, body=None, headers=None, raw=None, timeout=30):
    """(status, parsed JSON or text, headers) for one request; raw sends bytes as they are."""
    if raw is not None:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(raw)
            data = b""
            while True:
                try:
                    chunk = s.recv(65536)
                except socket.timeout:
                    break
                if not chunk:
                    break
                data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
        try:
            return status, json.loads(rest), {}
        except ValueError:
            return status, rest.decode("latin-1"), {}
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    h = {"Authorization": "Bearer " + KEY, "Content-Type": "application/json"}
    h.update(headers or {})
    h = {k: v for k, v in h.items() if v is not None}
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    text = r.read()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = text.decode("latin-1")
    c.close()
    return r.status, parsed, dict(r.getheaders())


def main():
    cleave, lm, mmproj, image, workdir = sys.argv[1:6]
    os.makedirs(workdir, exist_ok=True)
    png = open(image, "rb").read()
    good_url = "data:image/png;base64," + base64.b64encode(png).decode()
    corrupt = bytearray(png)
    corrupt[len(corrupt) // 2] ^= 0xFF  # a flipped byte inside the image data: the CRC fails
    corrupt_url = "data:image/png;base64," + base64.b64encode(bytes(corrupt)).decode()

    def chat(**kw):
        b = {"model": "shapes", "messages": [{"role": "user", "content": "describe"}], "max_tokens": 4}
        b.update(kw)
        return b

    def comp(**kw):
        b = {"model": "shapes", "prompt": "describe", "max_tokens": 4}
        b.update(kw)
        return b

    def img(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "describe"}]}]

    C, CH = "/v1/completions", "/v1/chat/completions"
    IR = "invalid_request_error"
    # (name, method, path, body, headers, raw, status, error type, param or None)
    cases = [
        ("malformed JSON", "POST", C, '{"prompt": "x",', None, None, 400, IR, None),
        ("JSON not an object", "POST", C, "[1, 2]", None, None, 400, IR, None),
        ("empty body", "POST", C, "", None, None, 400, IR, None),
        ("prompt missing", "POST", C, {"max_tokens": 4}, None, None, 400, IR, "prompt"),
        ("prompt a number", "POST", C, comp(prompt=5), None, None, 400, IR, "prompt"),
        ("prompt empty list", "POST", C, comp(prompt=[]), None, None, 400, IR, "prompt"),
        ("prompt token out of vocabulary", "POST", C, comp(prompt=[1, 99999999]), None, None, 400, IR, "prompt"),
        ("negative token id", "POST", C, comp(prompt=[-3]), None, None, 400, IR, "prompt[0]"),
        ("max_tokens negative", "POST", C, comp(max_tokens=-1), None, None, 400, IR, "max_tokens"),
        ("max_tokens zero", "POST", C, comp(max_tokens=0), None, None, 400, IR, "max_tokens"),
        ("max_tokens huge", "POST", C, comp(max_tokens=10**30), None, None, 400, IR, "max_tokens"),
        ("max_tokens a string", "POST", C, comp(max_tokens="4"), None, None, 400, IR, "max_tokens"),
        ("max_tokens a float", "POST", C, comp(max_tokens=4.5), None, None, 400, IR, "max_tokens"),
        ("temperature negative", "POST", C, comp(temperature=-0.5), None, None, 400, IR, "temperature"),
        ("temperature huge", "POST", C, comp(temperature=1e308), None, None, 400, IR, "temperature"),
        ("top_p zero", "POST", C, comp(top_p=0), None, None, 400, IR, "top_p"),
        ("top_p above one", "POST", C, comp(top_p=1.5), None, None, 400, IR, "top_p"),
        ("n zero", "POST", C, comp(n=0), None, None, 400, IR, "n"),
        ("n huge", "POST", C, comp(n=100000), None, None, 400, IR, "n"),
        ("presence_penalty out of range", "POST", C, comp(presence_penalty=3), None, None, 400, IR, "presence_penalty"),
        ("stop list too long", "POST", C, comp(stop=["a", "b", "c", "d", "e"]), None, None, 400, IR, "stop"),
        ("stop empty string", "POST", C, comp(stop=[""]), None, None, 400, IR, "stop"),
        ("stop a number", "POST", C, comp(stop=3), None, None, 400, IR, "stop"),
        ("completion logprobs too many", "POST", C, comp(logprobs=50), None, None, 400, IR, "logprobs"),
        ("unknown field", "POST", C, comp(frobnicate=1), None, None, 400, IR, "frobnicate"),
        ("echo true", "POST", C, comp(echo=True), None, None, 400, IR, "echo"),
        ("stream_options without stream", "POST", C, comp(stream_options={"include_usage": True}), None, None, 400, IR, "stream_options"),
        ("context exceeded", "POST", C, comp(prompt="describe " * 5000), None, None, 400, IR, None),
        ("invalid UTF-8 prompt", "POST", C, b'{"prompt": "\xff\xfe", "max_tokens": 2}', None, None, 400, IR, None),
        ("unknown model", "POST", C, comp(model="gpt-9"), None, None, 404, "not_found_error", "model"),
        ("messages missing", "POST", CH, {"model": "shapes"}, None, None, 400, IR, "messages"),
        ("messages empty", "POST", CH, chat(messages=[]), None, None, 400, IR, "messages"),
        ("message without role", "POST", CH, chat(messages=[{"content": "hi"}]), None, None, 400, IR, None),
        ("unknown role", "POST", CH, chat(messages=[{"role": "wizard", "content": "hi"}]), None, None, 400, IR, None),
        ("content a number", "POST", CH, chat(messages=[{"role": "user", "content": 7}]), None, None, 400, IR, None),
        ("unknown content part", "POST", CH, chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]), None, None, 400, IR, None),
        ("image URL not data", "POST", CH, chat(messages=img("http://example.com/a.png")), None, None, 400, IR, None),
        ("file URL", "POST", CH, chat(messages=img("file:///etc/passwd")), None, None, 400, IR, None),
        ("bad base64", "POST", CH, chat(messages=img("data:image/png;base64,!!!not-base64!!!")), None, None, 400, IR, None),
        ("corrupt PNG", "POST", CH, chat(messages=img(corrupt_url)), None, None, 400, IR, None),
        ("not an image", "POST", CH, chat(messages=img("data:image/png;base64," + base64.b64encode(b"hello world").decode())), None, None, 400, IR, None),
        ("top_logprobs without logprobs", "POST", CH, chat(top_logprobs=2), None, None, 400, IR, "top_logprobs"),
        ("tools unsupported", "POST", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}]), None, None, 400, IR, "tools"),
        ("response_format json", "POST", CH, chat(response_format={"type": "json_object"}), None, None, 400, IR, "response_format"),
        ("max_tokens and max_completion_tokens differ", "POST", CH, chat(max_tokens=3, max_completion_tokens=5), None, None, 400, IR, None),
        ("missing key", "GET", "/v1/models", None, {"Authorization": None}, None, 401, "authentication_error", None),
        ("wrong key", "GET", "/v1/models", None, {"Authorization": "Bearer sk-nope"}, None, 401, "authentication_error", None),
        ("key without Bearer", "GET", "/v1/models", None, {"Authorization": KEY}, None, 401, "authentication_error", None),
        ("unknown route", "GET", "/v1/nothing", None, None, None, 404, "not_found_error", None),
        ("GET on a POST route", "GET", C, None, None, None, 405, IR, None),
        ("DELETE models", "DELETE", "/v1/models", None, None, None, 405, IR, None),
        ("form content type", "POST", C, "prompt=x", {"Content-Type": "application/x-www-form-urlencoded"}, None, 415, IR, None),
        ("text content type", "POST", C, json.dumps(comp()), {"Content-Type": "text/plain"}, None, 415, IR, None),
        ("detokenize bad ids", "POST", "/detokenize", {"tokens": [1, -5]}, None, None, 400, IR, None),
        ("tokenize without content", "POST", "/tokenize", {}, None, None, 400, IR, None),
        ("body over the limit", None, None, None, None,
         b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
         + KEY.encode() + b"\r\nContent-Length: 999999999999\r\n\r\n", 413, IR, None),
        ("garbage request line", None, None, None, None, b"\x16\x03\x01\x02\x00 hello\r\n\r\n", 400, IR, None),
        ("headers over the limit", None, None, None, None,
         b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431, IR, None),
    ]
    server, host, port = start(cleave, lm, mmproj)
    failures = []
    try:
        for name, method, path, body, headers, raw, want_status, want_type, want_param in cases:
            try:
                status, parsed, _ = request(host, port, method, path, body, headers, raw)
            except Exception as e:  # noqa: BLE001: any transport failure is a test failure
                failures.append(f"{name}: {type(e).__name__}: {e}")
                continue
            err = parsed.get("error") if isinstance(parsed, dict) else None
            problems = []
            if status != want_status:
                problems.append(f"status {status}, want {want_status}")
            if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not err["message"]:
                problems.append(f"no OpenAI error body: {str(parsed)[:200]}")
            else:
                if err.get("type") != want_type:
                    problems.append(f"type {err.get('type')}, want {want_type}")
                if want_param is not None and err.get("param") != want_param:
                    problems.append(f"param {err.get('param')}, want {want_param}")
            if status >= 500:
                problems.append("a 5xx for bad input")
            if problems:
                failures.append(f"{name}: " + "; ".join(problems))
            else:
                print(f"ok {status} {name}: {err['message'][:100]}")
        # The context error names both numbers.
        _, parsed, _ = request(host, port, "POST", C, comp(prompt="describe " * 5000))
        msg = parsed["error"]["message"]
        if parsed["error"].get("code") != "context_length_exceeded" or len(re.findall(r"\d+", msg)) < 2:
            failures.append(f"context error does not name both numbers: {msg}")
        # A client that sends nothing after its first byte gets 408 once --timeout (2 s) passes.
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            t0 = time.time()
            data = s.recv(65536)
            if not data.startswith(b"HTTP/1.1 408") or time.time() - t0 > 6:
                failures.append(f"slow client: got {data[:40]!r} after {time.time() - t0:.1f} s")
            else:
                print(f"ok 408 slow client after {time.time() - t0:.1f} s")
        # Still serving.
        status, parsed, _ = request(host, port, "POST", C, comp(temperature=0))
        if status != 200 or not parsed["choices"][0]["text"]:
            failures.append(f"a good request after the matrix failed: {status} {parsed}")
        # The live server's metrics after all that pass Prometheus's own linter.
        status, text, hdrs = request(host, port, "GET", "/metrics")
        lint = subprocess.run(["promtool", "check", "metrics"], input=text if isinstance(text, str) else "",
                              capture_output=True, text=True)
        if status != 200 or lint.returncode != 0 or lint.stdout.strip() or lint.stderr.strip():
            failures.append(f"promtool check metrics on /metrics: status {status}, rc {lint.returncode}: "
                            f"{lint.stdout[:500]} {lint.stderr[:500]}")
        elif "cleave_http_requests_total" not in text or 'status="415"' not in text:
            failures.append("/metrics lacks the HTTP requests by status")
        else:
            print(f"ok promtool check metrics: clean on {len(text.splitlines())} lines of /metrics")
        if server.poll() is not None:
            failures.append(f"the server exited with {server.returncode}")
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            failures.append("the server did not stop on SIGTERM within 15 s")
    print(f"{len(cases)} bad requests, {len(failures)} failures")
    if failures:
        print("\n".join("FAIL " + f for f in failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
