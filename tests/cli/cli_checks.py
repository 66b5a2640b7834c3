"""What the CLI checks share: run a binary, print ok / FAIL per check and
count the failures, and expect a one-line error."""
import os
import subprocess
import sys


class Checks:
    def __init__(self, binary, timeout=120):
        self.binary, self.timeout, self.failures = binary, timeout, []

    def run(self, *args):
        p = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=self.timeout)
        return p.returncode, p.stdout, p.stderr

    def expect(self, name, cond, detail=""):
        print(("ok   " if cond else "FAIL ") + name + ("" if cond else ": " + detail))
        if not cond:
            self.failures.append(name)

    def expect_error(self, name, args, code, *needles):
        """Exit `code` with exactly one line on stderr holding every needle."""
        rc, out, err = self.run(*args)
        lines = [l for l in err.splitlines() if l.strip()]
        ok = rc == code and len(lines) == 1 and all(n in err for n in needles)
        self.expect(name, ok, f"rc={rc} stderr={err!r}")

    def small_model(self, vocab, path):
        """`cleave make-model` of the checks' tiny F16 model (dim 64, 2 layers) at path."""
        rc, _, err = self.run("make-model", "--out", path, "--vocab", vocab, "--dim", "64", "--layers", "2",
                              "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--ctx", "64", "--type", "f16")
        self.expect("make-model writes a model", rc == 0 and os.path.exists(path), err)
        return path

    def finish(self, what):
        print(f"{what}: {len(self.failures)} failed" + (f": {self.failures}" if self.failures else ""))
        sys.exit(1 if self.failures else 0)
