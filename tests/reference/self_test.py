"""Self-test of the float64 reference itself (no cleave needed).

  /usr/bin/python3 tests/reference/self_test.py

Checks, each against something written independently of reference_llama.py:
  - GGUF reader: hand-made bytes for F32/F16/BF16/Q8_0, alignment, writer round trip
  - RoPE: hand-computed values, norm preservation, relative-position property
  - the vectorised one-pass forward against a naive token-by-token
    implementation with a KV cache, scalar softmax loops and complex-number RoPE
    (dense, GQA, tied, MoE, quantised)
  - causality (prefix logits do not depend on later tokens)
  - GQA head mapping (KV=2 model == KV=H model with duplicated K/V rows)
  - MoE: top-k tie order, k=E with identical experts == dense
"""

import math
import os
import struct
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gguf_reader import GGML_BF16, GGML_F16, GGML_F32, GGML_Q8_0, GGUFFile  # noqa: E402
from gguf_writer import make_llama, write_gguf  # noqa: E402
from reference_llama import LlamaReference, moe_topk, rope  # noqa: E402


class Naive:
    """Token-by-token llama with a KV cache; deliberately different code paths."""

    def __init__(self, path):
        g = GGUFFile(path)
        kv = g.kv
        self.D = kv["llama.embedding_length"]
        self.L = kv["llama.block_count"]
        self.H = kv["llama.attention.head_count"]
        self.KV = kv["llama.attention.head_count_kv"]
        self.hd = self.D // self.H
        self.base = kv["llama.rope.freq_base"]
        self.eps = kv["llama.attention.layer_norm_rms_epsilon"]
        self.E = kv.get("llama.expert_count", 0)
        self.K = kv.get("llama.expert_used_count", 0)
        self.g = g
        self.t = {n: g.tensor(n) for n in g.tensors}

    def rms(self, x, w):
        ss = sum(float(v) * float(v) for v in x) / len(x)
        return np.array([x[i] / math.sqrt(ss + self.eps) * w[i] for i in range(len(x))])

    def rope(self, v, pos):
        hd = self.hd
        z = v[0::2] + 1j * v[1::2]
        theta = np.array([1.0 / (self.base ** ((2 * i) / hd)) for i in range(hd // 2)])
        z = z * np.exp(1j * pos * theta)
        out = np.empty(hd)
        out[0::2] = z.real
        out[1::2] = z.imag
        return out

    def swiglu(self, h, gate, up, down):
        gg = gate @ h
        a = np.array([v / (1.0 + math.exp(-v)) for v in gg]) * (up @ h)
        return down @ a

    def run(self, tokens):
        t = self.t
        cache = [([], []) for _ in range(self.L)]
        logits = []
        for pos, tok in enumerate(tokens):
            x = t["token_embd.weight"][tok].copy()
            for li in range(self.L):
                b = f"blk.{li}."
                h = self.rms(x, t[b + "attn_norm.weight"])
                q = t[b + "attn_q.weight"] @ h
                k = t[b + "attn_k.weight"] @ h
                v = t[b + "attn_v.weight"] @ h
                ks, vs = cache[li]
                ks.append([self.rope(k[j * self.hd:(j + 1) * self.hd], pos) for j in range(self.KV)])
                vs.append([v[j * self.hd:(j + 1) * self.hd] for j in range(self.KV)])
                att = np.zeros(self.H * self.hd)
                for hh in range(self.H):
                    kvh = hh * self.KV // self.H
                    qh = self.rope(q[hh * self.hd:(hh + 1) * self.hd], pos)
                    sc = [float(np.dot(qh, ks[s][kvh])) / math.sqrt(self.hd) for s in range(pos + 1)]
                    m = max(sc)
                    ex = [math.exp(s - m) for s in sc]
                    tot = sum(ex)
                    o = sum((ex[s] / tot) * vs[s][kvh] for s in range(pos + 1))
                    att[hh * self.hd:(hh + 1) * self.hd] = o
                x = x + t[b + "attn_output.weight"] @ att
                h = self.rms(x, t[b + "ffn_norm.weight"])
                if self.E:
                    r = t[b + "ffn_gate_inp.weight"] @ h
                    m = max(r)
                    p = [math.exp(v - m) for v in r]
                    p = [v / sum(p) for v in p]
                    order = sorted(range(self.E), key=lambda e: (-p[e], e))[:self.K]
                    wsum = sum(p[e] for e in order)
                    y = np.zeros(self.D)
                    for e in order:
                        y += (p[e] / wsum) * self.swiglu(h, t[b + "ffn_gate_exps.weight"][e],
                                                         t[b + "ffn_up_exps.weight"][e],
                                                         t[b + "ffn_down_exps.weight"][e])
                else:
                    y = self.swiglu(h, t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"],
                                    t[b + "ffn_down.weight"])
                x = x + y
            h = self.rms(x, t["output_norm.weight"])
            out = t["output.weight"] if "output.weight" in t else t["token_embd.weight"]
            logits.append(out @ h)
        return np.array(logits)


FAILS = []


def check(cond, msg):
    print(("  ok   " if cond else "  FAIL ") + msg)
    if not cond:
        FAILS.append(msg)


def test_reader(tmp):
    print("reader:")
    # Hand-built file: one Q8_0 tensor (1 block), one BF16, one F16, one F32, alignment 64.
    def s(b):
        return struct.pack("<Q", len(b)) + b
    q8 = struct.pack("<e", 0.5) + bytes((i - 16) & 0xFF for i in range(32))  # 34 bytes
    bf = struct.pack("<HHHH", 0x3F80, 0xC000, 0x3E80, 0x0000)               # 1, -2, 0.25, 0
    f16 = struct.pack("<eeee", 1.5, -0.125, 65504.0, 2.0 ** -24)
    f32 = struct.pack("<ff", 3.25, -7.0)
    kvs = s(b"general.alignment") + struct.pack("<II", 4, 64)
    kvs += s(b"x.arr") + struct.pack("<IIQ", 9, 8, 2) + s(b"ab") + s(b"c")
    infos = b""
    datas = [(b"q", [32], 8, q8), (b"b", [2, 2], 30, bf), (b"h", [4], 1, f16), (b"f", [1, 2], 0, f32)]
    off = 0
    blob = b""
    for name, ne, ty, d in datas:
        infos += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        infos += struct.pack("<IQ", ty, off)
        d = d + b"\0" * ((-len(d)) % 64)
        blob += d
        off += len(d)
    hdr = b"GGUF" + struct.pack("<IQQ", 3, len(datas), 2) + kvs + infos
    hdr += b"\xAA" * ((-len(hdr)) % 64)  # padding content must not matter
    p = os.path.join(tmp, "hand.gguf")
    with open(p, "wb") as f:
        f.write(hdr + blob)
    g = GGUFFile(p)
    check(g.alignment == 64 and g.kv["x.arr"] == ["ab", "c"], "metadata (alignment, string array)")
    check(np.array_equal(g.tensor("q"), 0.5 * (np.arange(32) - 16.0)), "Q8_0 hand block d*q")
    check(np.array_equal(g.tensor("b"), np.array([[1.0, -2.0], [0.25, 0.0]])), "BF16 hand values, shape (2,2)")
    check(np.array_equal(g.tensor("h"), np.array([1.5, -0.125, 65504.0, 2.0 ** -24])), "F16 hand values")
    check(g.tensor("f").shape == (2, 1) and np.array_equal(g.tensor("f")[:, 0], [3.25, -7.0]),
          "F32 ne=[1,2] -> shape (2,1)")
    # Writer round trip incl. a 3-D tensor.
    a = np.random.default_rng(1).standard_normal((3, 4, 64)).astype(np.float32)
    p2 = os.path.join(tmp, "rt.gguf")
    write_gguf(p2, {"general.architecture": "llama"},
               [("f32", a, GGML_F32), ("f16", a, GGML_F16), ("bf16", a, GGML_BF16), ("q8", a, GGML_Q8_0)])
    g = GGUFFile(p2)
    check(g.tensors["f32"].ne == [64, 4, 3], "3-D ne innermost-first")
    check(np.array_equal(g.tensor("f32"), a.astype(np.float64)), "F32 round trip exact")
    check(np.array_equal(g.tensor("f16"), a.astype(np.float16).astype(np.float64)), "F16 round trip exact")
    check(np.max(np.abs(g.tensor("bf16") - a)) <= np.max(np.abs(a)) * 2 ** -8, "BF16 within bf16 rounding")
    check(np.max(np.abs(g.tensor("q8") - a)) <= np.max(np.abs(a)) / 127 * 0.51 + 1e-3, "Q8_0 within quant step")


def test_rope():
    print("rope:")
    # head_dim 4, base 100, pos 1: pair 0 turns by 1 rad, pair 1 by 100^(-2/4) = 0.1 rad.
    x = np.array([1.0, 0.0, 0.0, 1.0]).reshape(1, 1, 4)
    y = rope(x, [1], 100.0, 4)[0, 0]
    want = [math.cos(1), math.sin(1), -math.sin(0.1), math.cos(0.1)]
    check(np.allclose(y, want, atol=1e-15, rtol=0), f"hand values {y} == {want}")
    x = np.random.default_rng(0).standard_normal((5, 3, 8))
    y = rope(x, np.arange(5), 10000.0, 8)
    check(np.array_equal(y[0], x[0]), "position 0 is identity")
    check(np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1)), "norm preserved")
    q = np.random.default_rng(2).standard_normal((1, 1, 8))
    k = np.random.default_rng(3).standard_normal((1, 1, 8))
    d1 = np.dot(rope(q, [7], 1e4, 8).ravel(), rope(k, [3], 1e4, 8).ravel())
    d2 = np.dot(rope(q, [24], 1e4, 8).ravel(), rope(k, [20], 1e4, 8).ravel())
    check(abs(d1 - d2) < 1e-12, "q.k depends only on position difference")
    # Partial rotation leaves the tail untouched.
    y = rope(x, np.arange(5), 10000.0, 4)
    check(np.array_equal(y[..., 4:], x[..., 4:]), "n_rot < head_dim leaves tail dims")


def test_forward(tmp):
    print("forward vs naive token-by-token implementation:")
    cfgs = [
        ("dense MHA f32", dict(heads=4, kv_heads=4)),
        ("GQA tied f32", dict(dim=48, heads=6, kv_heads=2, tied=True, layers=3)),
        ("MoE f32", dict(heads=4, kv_heads=2, experts=4, experts_used=2)),
        ("MoE top1 f16", dict(heads=4, kv_heads=1, experts=3, experts_used=1, ggml_type=GGML_F16)),
        ("dense q8_0", dict(ggml_type=GGML_Q8_0, ffn=64)),
        ("dense bf16", dict(ggml_type=GGML_BF16, rope_base=500000.0)),
    ]
    rng = np.random.default_rng(5)
    for i, (name, cfg) in enumerate(cfgs):
        p = os.path.join(tmp, f"m{i}.gguf")
        make_llama(p, seed=i, **cfg)
        ref = LlamaReference(p)
        toks = rng.integers(0, ref.n_vocab, size=9)
        a = ref.forward(toks)
        b = Naive(p).run(toks)
        err = np.max(np.abs(a - b))
        check(err < 1e-10 and np.std(a) > 0.1, f"{name}: max|vec - naive| = {err:.2e}, std {np.std(a):.2f}")
        if i == 0:
            c = ref.forward(toks[:5])
            check(np.max(np.abs(c - a[:5])) < 1e-12, "causality: prefix logits unchanged by later tokens")


def test_gqa_mapping(tmp):
    print("GQA mapping:")
    p = os.path.join(tmp, "gqa.gguf")
    w = make_llama(p, heads=4, kv_heads=2, seed=11)
    ref = LlamaReference(p)
    # Build an equivalent MHA model: kv head j serves query heads 2j, 2j+1.
    ref2 = LlamaReference(p)
    hd = ref.hd
    for lay in ref2.layers:
        for key in ("wk", "wv"):
            lay[key] = np.repeat(lay[key].reshape(2, hd, -1), 2, axis=0).reshape(4 * hd, -1)
    ref2.KV = 4
    toks = [3, 17, 42, 99, 5, 250]
    check(np.max(np.abs(ref.forward(toks) - ref2.forward(toks))) < 1e-12,
          "query head h reads kv head h // (H/KV)")
    del w


def test_moe(tmp):
    print("MoE routing:")
    idx, wts = moe_topk(np.array([[0.25, 0.25, 0.25, 0.25], [0.1, 0.4, 0.1, 0.4]]), 2)
    check(idx.tolist() == [[0, 1], [1, 3]] and np.allclose(wts, 0.5), "ties -> lower index, renormalised")
    p = os.path.join(tmp, "moe.gguf")
    make_llama(p, experts=3, experts_used=3, seed=4)
    ref = LlamaReference(p)
    pd = os.path.join(tmp, "dense.gguf")
    make_llama(pd, seed=4)
    dense = LlamaReference(pd)
    for lay_m, lay_d in zip(ref.layers, dense.layers):
        for key in ("gate", "up", "down"):
            lay_m[key + "_exps"] = np.stack([lay_d[key]] * 3)
        for key in ("wq", "wk", "wv", "wo", "attn_norm", "ffn_norm"):
            lay_m[key] = lay_d[key]
    ref.tok_embd, ref.output, ref.output_norm = dense.tok_embd, dense.output, dense.output_norm
    toks = [1, 2, 3, 4, 5]
    check(np.max(np.abs(ref.forward(toks) - dense.forward(toks))) < 1e-12,
          "k=E identical experts == dense FFN")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        test_reader(tmp)
        test_rope()
        test_forward(tmp)
        test_gqa_mapping(tmp)
        test_moe(tmp)
    if FAILS:
        print(f"reference self-test: {len(FAILS)} FAILED")
        return 1
    print("reference self-test: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
