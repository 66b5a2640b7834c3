#!/usr/bin/env python3
"""A TCP relay for the namespace tests: listens on LISTEN_HOST:LISTEN_PORT,
forwards each connection to TARGET_HOST:TARGET_PORT, holding every chunk
DELAY_US microseconds in each direction (the kernels here have no netem).
Signals act on the connections open at that moment:
  SIGUSR1 toggles a stall (nothing is forwarded, connections stay open);
  SIGUSR2 resets every one on both sides (RST);
  SIGHUP  half-opens every one: the accepting side is shut at once (FIN,
          then RST), the target's side stays open and what it sends is
          dropped, so the target sees a peer that went quiet, not one that
          went away.
It keeps listening throughout. Prints "relay listening on HOST:PORT" once it
accepts.

A socket is closed only by the threads that use it, once both are done
(closing it under a thread blocked in recv() would let a new connection
reuse the descriptor that thread then reads).

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
pairs = []
lock = threading.Lock()


class Pair:
    """One relayed connection: the accepted socket and the one to the target."""

    def __init__(self, client, upstream):
        self.client, self.upstream = client, upstream
        self.reset = set()   # sockets to close with RST once the pumps stop
        self.mute = False    # half-open: drop what the target sends
        self.ended = 0

    def abort(self, s, how=socket.SHUT_RD):
        """Ends s with RST: linger 0, reads woken (shutdown RD sends nothing);
        its pumps stop and close it. how=SHUT_RDWR sends a FIN at once too,
        for a socket whose pumps may not stop soon."""
        self.reset.add(s)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.shutdown(how)
        except OSError:
            pass

    def pump_ended(self):
        with lock:
            self.ended += 1
            if self.ended < 2:
                return
            if self in pairs:
                pairs.remove(self)
        for s in (self.client, self.upstream):
            s.close()


def pump(pair, src, dst):
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
            if dst in pair.reset or (pair.mute and src is pair.upstream):
                continue
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
    # A half-open pair's target side is never shut: the target must not hear.
    if dst not in pair.reset and not (pair.mute and dst is pair.upstream):
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    pair.pump_ended()


def serve(client):
    try:
        upstream = socket.create_connection((THOST, TPORT), timeout=5)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pair = Pair(client, upstream)
    with lock:
        pairs.append(pair)
    threading.Thread(target=pump, args=(pair, client, upstream), daemon=True).start()
    threading.Thread(target=pump, args=(pair, upstream, client), daemon=True).start()


def reset_all(*_):
    with lock:
        for p in pairs:
            p.abort(p.client)
            p.abort(p.upstream)


def half_open_all(*_):
    with lock:
        for p in pairs:
            p.mute = True
            p.abort(p.client, socket.SHUT_RDWR)  # its pair ends only when the target hangs up


def toggle(*_):
    if stalled.is_set():
        stalled.clear()
    else:
        stalled.set()


signal.signal(signal.SIGUSR1, toggle)
signal.signal(signal.SIGUSR2, reset_all)
signal.signal(signal.SIGHUP, half_open_all)
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((LHOST, LPORT))
ls.listen(64)
print(f"relay listening on {LHOST}:{ls.getsockname()[1]}", flush=True)
while True:
    c, _ = ls.accept()
    serve(c)
