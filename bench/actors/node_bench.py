"""Helpers the multi-process benchmarks share (experts_nodes.py,
pipeline_nodes.py): the machine's limits measured in the same run, a
process's peak resident memory, and median-with-range cells."""
import json
import subprocess
import threading
import time


def limits(actors_bench, model, work, threads=1):
    """cleave_actors_bench --limits: read bandwidth, FP32 FMA peak, and the
    weight bytes one token reads of `model`."""
    p = subprocess.run([actors_bench, "--limits", "-t", str(threads), "--limits-model", model, "--workdir", work],
                       capture_output=True, text=True, timeout=600, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def median_range(v):
    v = sorted(v)
    return {"median": v[len(v) // 2], "min": v[0], "max": v[-1]}


class Peak:
    """Peak VmHWM of a process, and the peak RssAnon / RssFile once serving
    (after `serving` is set: the engines exist, the file's fingerprint pass
    is over and its pages went back), polled every 20 ms."""

    def __init__(self, pid):
        self.pid, self.hwm, self.anon, self.file = pid, 0, 0, 0
        self.stop = self.serving = False
        self.t = threading.Thread(target=self.loop, daemon=True)
        self.t.start()

    def loop(self):
        while not self.stop:
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    kv = dict(l.split(":", 1) for l in f if ":" in l)
                kb = lambda k: int(kv.get(k, "0 kB").split()[0])  # noqa: E731
                self.hwm = max(self.hwm, kb("VmHWM"))
                if self.serving:
                    self.anon = max(self.anon, kb("RssAnon"))
                    self.file = max(self.file, kb("RssFile"))
            except (OSError, ValueError):
                return
            time.sleep(0.02)

    def done(self):
        self.stop = True
        self.t.join()
        return {"hwm_mib": self.hwm / 1024, "anon_mib": self.anon / 1024, "file_mib": self.file / 1024}
