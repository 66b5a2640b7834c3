#!/usr/bin/env python3
"""A TCP relay for the namespace tests: listens on LISTEN_HOST:LISTEN_PORT,
forwards each connection to TARGET_HOST:TARGET_PORT, holding every chunk
DELAY_US microseconds in each direction (the kernels here have no netem).
SIGUSR1 toggles a stall (nothing is forwarded, connections stay open);
SIGUSR2 resets every open connection (RST) and keeps listening. Prints
"relay listening on HOST:PORT" once it accepts.

usage: tcp_relay.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_US"""
import collections
import signal
import socket
import struct
import sys
import threading
import time

LHOST, LPORT, THOST, TPORT, DELAY_US = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
DELAY = DELAY_US / 1e6
stalled = threading.Event()
conns = []
lock = threading.Lock()


def pump(src, dst):
    """Reads src, writes each chunk to dst once DELAY has passed since it came."""
    q = collections.deque()
    cv = threading.Condition()
    done = [False]

    def writer():
        while True:
            with cv:
                while not q and not done[0]:
                    cv.wait()
                if not q:
                    return
                t, data = q.popleft()
            while stalled.is_set():
                time.sleep(0.01)
            wait = t + DELAY - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                dst.sendall(data)
            except OSError:
                return
    w = threading.Thread(target=writer, daemon=True)
    w.start()
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            with cv:
                q.append((time.monotonic(), data))
                cv.notify()
    except OSError:
        pass
    with cv:
        done[0] = True
        cv.notify()
    w.join()
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def serve(client):
    try:
        upstream = socket.create_connection((THOST, TPORT), timeout=5)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with lock:
        conns.extend([client, upstream])
    a = threading.Thread(target=pump, args=(client, upstream), daemon=True)
    b = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    a.start()
    b.start()


def reset(*_):
    with lock:
        for s in conns:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass
        conns.clear()


def toggle(*_):
    if stalled.is_set():
        stalled.clear()
    else:
        stalled.set()


signal.signal(signal.SIGUSR1, toggle)
signal.signal(signal.SIGUSR2, reset)
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((LHOST, LPORT))
ls.listen(64)
print(f"relay listening on {LHOST}:{ls.getsockname()[1]}", flush=True)
while True:
    c, _ = ls.accept()
    serve(c)
