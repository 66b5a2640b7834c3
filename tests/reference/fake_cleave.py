#!/usr/bin/python3
"""A stand-in for the cleave CLI (make-model / generate) used to test check_reference.py itself.

  /usr/bin/python3 tests/reference/fake_cleave.py make-model --out m.gguf --vocab V.gguf ...
  FAKE_CLEAVE_BUG=rope_half /usr/bin/python3 tests/reference/fake_cleave.py generate -m m.gguf ...

generate decodes greedily with the reference and writes float32 logits. With
FAKE_CLEAVE_BUG set it injects a known bug, so one can see the driver catch it:
  rope_half     rotate-half RoPE instead of adjacent pairs
  gqa_tile      query head h reads kv head h % KV instead of h // (H/KV)
  moe_norenorm  top-k expert weights not renormalised
  eps           RMSNorm eps ignored
  noise         +2e-4 on one logit (just over the F32 bound)
"""

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import reference_llama as rl  # noqa: E402
from gguf_reader import GGML_BF16, GGML_F16, GGML_F32, GGML_Q8_0, GGUFFile  # noqa: E402
from gguf_writer import make_llama  # noqa: E402

BUG = os.environ.get("FAKE_CLEAVE_BUG", "")


def rope_half(x, positions, base, n_rot):
    T, _, hd = x.shape
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    out = x.copy()
    a, b = x[..., :half], x[..., half:n_rot]
    out[..., :half] = a * c - b * s
    out[..., half:n_rot] = a * s + b * c
    return out


class Buggy(rl.LlamaReference):
    def attention(self, lay, h, positions):
        if BUG != "gqa_tile":
            return super().attention(lay, h, positions)
        g = self.H // self.KV
        perm = np.array([(hh % self.KV) * g + hh // self.KV for hh in range(self.H)])
        # kv head used by query head hh becomes hh % KV: permute the query heads instead.
        T = h.shape[0]
        lay2 = dict(lay)
        wq = lay["wq"].reshape(self.H, self.hd, -1)
        inv = np.argsort(perm)
        lay2["wq"] = wq[inv].reshape(self.H * self.hd, -1)
        wo = lay["wo"].reshape(-1, self.H, self.hd)
        lay2["wo"] = wo[:, inv].reshape(-1, self.H * self.hd)
        del T
        return super().attention(lay2, h, positions)


def cmd_make_model(a):
    vocab = GGUFFile(a.vocab)
    n_vocab = len(vocab.kv["tokenizer.ggml.tokens"])
    types = {"f32": GGML_F32, "f16": GGML_F16, "bf16": GGML_BF16, "q8_0": GGML_Q8_0}
    make_llama(a.out, vocab=n_vocab, dim=a.dim, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
               ffn=a.ffn, experts=a.experts, experts_used=a.experts_used, ggml_type=types[a.type],
               tied=a.tied, seed=a.seed)


def cmd_generate(a):
    if BUG == "rope_half":
        rl.rope = rope_half
    if BUG == "moe_norenorm":
        rl.moe_topk = lambda p, k: (np.argsort(-p, axis=-1, kind="stable")[:, :k],
                                    np.take_along_axis(p, np.argsort(-p, axis=-1, kind="stable")[:, :k], -1))
    ref = Buggy(a.m)
    if BUG == "eps":
        ref.eps = 0.0
    prompt = [int(t) for t in a.prompt_ids.split(",")]
    seq = list(prompt)
    gen, rows = [], []
    for _ in range(a.n):
        row = ref.forward(seq)[-1].astype(np.float32)
        t = int(np.argmax(row))
        rows.append(row)
        gen.append(t)
        seq.append(t)
        if t == 2:
            break
    out = np.array(rows, dtype="<f4")
    if BUG == "noise":
        out[len(out) // 2, 1234] += 2e-4
    out.tofile(a.logits)
    print(json.dumps({"prompt_ids": prompt, "generated_ids": gen, "text": "", "timings": {}}))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    for k in ("out", "vocab", "type"):
        m.add_argument("--" + k, required=True)
    for k in ("dim", "layers", "heads", "kv-heads", "ffn", "experts", "experts-used", "ctx", "seed"):
        m.add_argument("--" + k, type=int, required=True)
    m.add_argument("--tied", action="store_true")
    g = sub.add_parser("generate")
    g.add_argument("-m", required=True)
    g.add_argument("--prompt-ids", required=True)
    g.add_argument("-n", type=int, required=True)
    g.add_argument("--temp", type=float, default=0.0)
    g.add_argument("--json", action="store_true")
    g.add_argument("--logits", required=True)
    g.add_argument("-t", type=int, default=1)
    a = ap.parse_args()
    (cmd_make_model if a.cmd == "make-model" else cmd_generate)(a)


if __name__ == "__main__":
    main()
