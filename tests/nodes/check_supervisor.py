#!/usr/bin/env python3
"""A worker's supervisor (apps/process_args.h) over real processes
(tests/nodes/cluster.lua: a head with the KV store, decoder d0):

1. The worker started here is the supervisor; its node runs in a child.
2. The head is killed: the run exits, the supervisor (same pid) starts
   another run, a new process; the head comes back and that run joins it.
3. SIGTERM to the supervisor reaches the run: it drains (d1 joins to take
   over) and exits 0, and so does the supervisor; no run is left.
4. SIGKILL of the supervisor takes its run with it (PR_SET_PDEATHSIG).
5. SIGTERM while the run dials a head that is gone ends both at once, by
   SIGTERM, and no run follows.
6. A head that goes while a worker that joined it still attaches its
   stages (--fault-stall-attach: it never answers the attach) is a lost
   head too: the run exits to rejoin, and the next run joins the next head.
   --fault-stall-attach on a worker is refused.

usage: check_supervisor.py CLEAVE VOCAB WORKDIR"""
import os
import signal
import socket
import subprocess
import sys
import time

CLEAVE, VOCAB, WORK = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGY = os.path.join(HERE, "cluster.lua")
sys.path.insert(0, HERE)
from node_process import NodeProcess, expect, failures, make_gqa128, stop_all, wait_until  # noqa: E402

MODEL = make_gqa128(CLEAVE, VOCAB, WORK)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = free_port()
SETS = ["--set", f"head_port={PORT}", "--set", "decoders=2"]  # p0 is declared and never started: not needed here


def node(name, tag, extra=()):
    return NodeProcess([CLEAVE, "node", "--topology", TOPOLOGY, "--name", name, "-m", MODEL, *SETS, *extra],
                       os.path.join(WORK, f"{tag}{name}.err"))


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def head(tag):
    h = node("head", tag)
    expect(f"{tag}head listens", h.wait_line(r"cleave node head listening") is not None, h.stderr()[-1500:])
    return h


def joined(h, times=1):
    return wait_until(lambda: h.stderr().count("node d0 joined") >= times, 30)


try:
    # 1. Supervisor and run.
    h = head("a_")
    d0 = node("d0", "a_", ["--join-timeout", "20"])
    expect("1. d0 joins", joined(h), h.stderr()[-1500:])
    sup, run1 = d0.proc.pid, d0.run_pid()
    expect("1. d0's node runs in a child of the process started here", run1 != sup and alive(run1), (sup, run1))

    # 2. The head goes; d0 starts a new run; the head comes back.
    h.proc.kill()
    h.wait(10)
    expect("2. the run that lost the head ends",
           wait_until(lambda: not alive(run1), 15) and "starting again to rejoin it" in d0.stderr(), d0.stderr()[-1500:])
    expect("2. the supervisor starts a new run, a new process",
           wait_until(lambda: d0.run_pid() not in (sup, run1), 15) and d0.proc.poll() is None,
           (sup, run1, d0.run_pid()))
    run2 = d0.run_pid()
    h = head("b_")
    expect("2. the new run joins the head that came back", joined(h), h.stderr()[-1500:] + d0.stderr()[-1500:])

    # 3. SIGTERM reaches the run: drained (d1 takes over), both exit 0.
    d1 = node("d1", "b_", ["--join-timeout", "20", "--no-rejoin"])
    expect("3. d1 joins", wait_until(lambda: "node d1 joined" in h.stderr(), 30), h.stderr()[-1500:])
    d0.proc.send_signal(signal.SIGTERM)
    rc = d0.wait(30)
    expect("3. SIGTERM to the supervisor drains the run and both exit 0",
           rc == 0 and "SIGTERM: drained" in d0.stderr() and not alive(run2), (rc, d0.stderr()[-1500:]))

    # 4. SIGKILL of the supervisor takes the run.
    d0 = node("d0", "c_", ["--join-timeout", "20"])
    expect("4. d0 joins again", joined(h, 2), h.stderr()[-1500:])
    run = d0.run_pid()
    d0.proc.kill()
    d0.wait(10)
    expect("4. SIGKILL of the supervisor ends its run", run != d0.proc.pid and wait_until(lambda: not alive(run), 5),
           run)

    # 5. SIGTERM while the run dials a head that is gone.
    d0 = node("d0", "d_", ["--join-timeout", "20"])
    expect("5. d0 joins", joined(h, 3), h.stderr()[-1500:])
    h.proc.kill()
    h.wait(10)
    first = d0.run_pid()
    wait_until(lambda: d0.run_pid() not in (d0.proc.pid, first), 15)
    dialling = d0.run_pid()
    time.sleep(0.5)
    t0 = time.time()
    d0.proc.send_signal(signal.SIGTERM)
    rc = d0.wait(10)
    expect("5. SIGTERM while the run dials: both end by SIGTERM at once, no run follows",
           dialling not in (d0.proc.pid, first) and rc == -signal.SIGTERM and time.time() - t0 < 5 and
           not alive(dialling) and d0.run_pid() == d0.proc.pid, (rc, dialling, d0.stderr()[-1000:]))

    # 6. The head goes while d0 attaches its stages.
    h = node("head", "e_", ["--fault-stall-attach"])
    expect("6. the stalling head listens", h.wait_line(r"cleave node head listening") is not None,
           h.stderr()[-1500:])
    d0 = node("d0", "e_", ["--join-timeout", "20"])
    expect("6. d0 joins the stalling head", joined(h), h.stderr()[-1500:])
    sup, stuck = d0.proc.pid, d0.run_pid()
    time.sleep(1.0)  # its attach is pending: this head never answers it
    expect("6. d0 is still starting (it has not printed that it joined)",
           alive(stuck) and d0.wait_line(r"cleave node d0 joined", timeout=0.2) is None, d0.stderr()[-1500:])
    h.proc.kill()
    h.wait(10)
    expect("6. the run that lost the head while starting exits to rejoin",
           wait_until(lambda: not alive(stuck), 15) and "lost the head while starting" in d0.stderr() and
           "starting again to rejoin it" in d0.stderr() and "cleave: error" not in d0.stderr(),
           d0.stderr()[-1500:])
    expect("6. the supervisor starts a new run", wait_until(lambda: d0.run_pid() not in (sup, stuck), 15) and
           d0.proc.poll() is None, (sup, stuck, d0.run_pid()))
    h = head("f_")
    expect("6. the new run joins the next head", joined(h), h.stderr()[-1500:] + d0.stderr()[-1500:])
    m = d0.wait_line(r"cleave node d0 joined \S+ with (\d+) stages", timeout=30)
    expect("6. its stage attached to the next head (the run finished starting)",
           m is not None and int(m.group(1)) >= 1 and d0.proc.poll() is None, d0.stderr()[-1500:])
    r = subprocess.run([CLEAVE, "node", "--topology", TOPOLOGY, "--name", "d0", "-m", MODEL, *SETS,
                        "--fault-stall-attach"], capture_output=True, text=True, timeout=30)
    expect("6. --fault-stall-attach on a worker is refused naming it",
           r.returncode != 0 and "--fault-stall-attach" in r.stderr and "only the head" in r.stderr,
           (r.returncode, r.stderr))
finally:
    stop_all()

print(f"{len(failures)} failures" if failures else "all supervisor checks passed")
sys.exit(1 if failures else 0)
