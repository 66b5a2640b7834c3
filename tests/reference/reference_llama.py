"""Float64 numpy reference forward pass for llama-architecture GGUF models.

Dense and Mixtral-style MoE, llama.cpp semantics:
  - RMSNorm x / sqrt(mean(x^2) + eps), then times the norm weight
  - RoPE on adjacent pairs (2i, 2i+1), theta = pos * base^(-2i/n_rot)
  - causal GQA attention, query head h reads kv head h // (H / KV),
    scale 1/sqrt(head_dim)
  - SwiGLU FFN down(silu(gate h) * up h)
  - MoE: softmax over all router logits, top-k (ties -> lower index),
    renormalise the k weights to sum to 1
  - output.weight, or token_embd.weight when tied

Independent of cleave: uses only gguf_reader.py (its own reader) and numpy.
"""

import numpy as np

from gguf_reader import GGUFFile, GGUFError


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def rope(x, positions, base, n_rot):
    """x: (T, n_heads, head_dim). Rotates adjacent pairs of the first n_rot dims."""
    T, _, hd = x.shape
    half = n_rot // 2
    inv_freq = base ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)  # (half,)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # (T, half)
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    out = x.copy()
    x0 = x[:, :, 0:n_rot:2]
    x1 = x[:, :, 1:n_rot:2]
    out[:, :, 0:n_rot:2] = x0 * cos - x1 * sin
    out[:, :, 1:n_rot:2] = x0 * sin + x1 * cos
    return out


def kv_round(x, kind):
    """K or V rows (..., head_dim) as a KV cache of `kind` stores them, back
    in float64: the float32 value (what cleave computes) rounded to F16
    (nearest even, numpy's astype), or quantised to Q8_0 as ggml does it:
    per 32 elements d = max|x| / 127 in float32, q = roundf(x / d) (halves
    away from zero), the value q * fp16(d); or to Q4_0 (q4_blocks)."""
    if kind == "f32":
        return x
    x32 = np.asarray(x, dtype=np.float32)
    if kind == "f16":
        return x32.astype(np.float16).astype(np.float64)
    if kind == "q4_0":
        q, d = q4_blocks(x32)
        return (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)
    if kind != "q8_0":
        raise ValueError(f"unknown KV type {kind!r}")
    q, d = q8_blocks(x32)
    return (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)


def q4_blocks(x32):
    """x32 (..., n) float32, n a multiple of 32, per 32 elements as ggml's
    quantize_row_q4_0_ref: m = the first element of largest |x|, d = m / -8
    in float32, q = min(15, trunc(x * (1 / d) + 8.5)) with the product and
    the sum each rounded to float32. Returns q - 8 (..., n/32, 32) float64
    and d (..., n/32, 1) float32."""
    b = x32.reshape(*x32.shape[:-1], -1, 32)
    first = np.argmax(np.abs(b), axis=-1)[..., None]  # argmax: the first of equal maxima
    m = np.take_along_axis(b, first, axis=-1)
    d = (m / np.float32(-8)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    t = ((b * inv).astype(np.float32) + np.float32(8.5)).astype(np.float32)
    q = np.minimum(np.trunc(t.astype(np.float64)), 15)
    return q - 8, d


def q8_blocks(x32):
    """x32 (..., n) float32, n a multiple of 32, per 32 elements as ggml's
    Q8_0: d = max|x| / 127 in float32, q = roundf(x * (1 / d)) (halves away
    from zero). Returns q (..., n/32, 32) float64 and d (..., n/32, 1) float32."""
    b = x32.reshape(*x32.shape[:-1], -1, 32)
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = (b * inv).astype(np.float32)
    q = np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)  # float64: |v| + 0.5 exact
    return q.astype(np.float64), d


def act_round(x):
    """Activation rows as cleave's --compute int8 quantises them before a
    Q8_0 matmul (kernels/cpu/int8.h): Q8_0 blocks of the float32 values with
    the scale kept in float32 (not rounded to fp16), back in float64."""
    x32 = np.asarray(x, dtype=np.float32)
    q, d = q8_blocks(x32)
    return (q * d.astype(np.float64)).reshape(x.shape)


def moe_topk(probs, k):
    """probs: (T, E). Returns (idx (T,k), weights (T,k)) with ties -> lower index."""
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, idx, axis=-1)
    w = w / np.sum(w, axis=-1, keepdims=True)
    return idx, w


class LlamaReference:
    def __init__(self, path, kv_types=("f32", "f32"), compute="exact"):
        """kv_types: the KV cache's (K, V) element types, as cleave's -ctk / -ctv.
        compute: cleave's --compute; "int8" quantises the activations that
        meet a Q8_0 matrix (act_round) before the float64 product."""
        if compute not in ("exact", "int8"):
            raise ValueError(f"unknown compute {compute!r}")
        self.kv_types = kv_types
        self.int8 = compute == "int8"
        g = GGUFFile(path)
        self.gguf = g
        self.route_log = []
        arch = g.kv.get("general.architecture", "llama")
        if arch != "llama":
            raise GGUFError(f"{path}: architecture {arch!r} is not llama")
        p = "llama."

        def key(name, default=None):
            if p + name in g.kv:
                return g.kv[p + name]
            if default is None:
                raise GGUFError(f"{path}: missing metadata {p + name}")
            return default

        self.D = int(key("embedding_length"))
        self.L = int(key("block_count"))
        self.H = int(key("attention.head_count"))
        self.KV = int(key("attention.head_count_kv", self.H))
        self.hd = self.D // self.H
        self.n_rot = int(key("rope.dimension_count", self.hd))
        self.base = float(key("rope.freq_base", 10000.0))
        self.eps = float(key("attention.layer_norm_rms_epsilon", 1e-5))
        self.E = int(key("expert_count", 0))
        self.K = int(key("expert_used_count", 0))
        if self.D % self.H or self.H % self.KV or self.n_rot % 2 or self.n_rot > self.hd:
            raise GGUFError(f"{path}: inconsistent dims D={self.D} H={self.H} KV={self.KV} "
                            f"n_rot={self.n_rot}")

        t = g.tensor
        # Matrices stored as Q8_0 (what --compute int8 changes), by id.
        self.q8 = set()

        def t(name):
            a = g.tensor(name)
            if g.type_name(name) == "Q8_0":
                self.q8.add(id(a))
            return a
        self.tok_embd = t("token_embd.weight")  # (V, D)
        self.n_vocab = self.tok_embd.shape[0]
        self.output_norm = t("output_norm.weight")
        self.tied = not g.has("output.weight")
        self.output = self.tok_embd if self.tied else t("output.weight")
        self.layers = []
        for i in range(self.L):
            b = f"blk.{i}."
            lay = {
                "attn_norm": t(b + "attn_norm.weight"),
                "wq": t(b + "attn_q.weight"),
                "wk": t(b + "attn_k.weight"),
                "wv": t(b + "attn_v.weight"),
                "wo": t(b + "attn_output.weight"),
                "ffn_norm": t(b + "ffn_norm.weight"),
            }
            if self.E > 0:
                lay["router"] = t(b + "ffn_gate_inp.weight")       # (E, D)
                lay["gate_exps"] = t(b + "ffn_gate_exps.weight")   # (E, F, D)
                lay["up_exps"] = t(b + "ffn_up_exps.weight")       # (E, F, D)
                lay["down_exps"] = t(b + "ffn_down_exps.weight")   # (E, D, F)
            else:
                lay["gate"] = t(b + "ffn_gate.weight")             # (F, D)
                lay["up"] = t(b + "ffn_up.weight")                 # (F, D)
                lay["down"] = t(b + "ffn_down.weight")             # (D, F)
            self._check_layer(i, lay)
            self.layers.append(lay)
        if self.output.shape != (self.n_vocab, self.D):
            raise GGUFError(f"output matrix shape {self.output.shape}, expected ({self.n_vocab}, {self.D})")

    def _check_layer(self, i, lay):
        D, H, KV, hd = self.D, self.H, self.KV, self.hd
        exp = {"attn_norm": (D,), "ffn_norm": (D,), "wq": (H * hd, D), "wk": (KV * hd, D),
               "wv": (KV * hd, D), "wo": (D, H * hd)}
        for k, s in exp.items():
            if lay[k].shape != s:
                raise GGUFError(f"blk.{i} {k}: shape {lay[k].shape}, expected {s}")
        if self.E > 0:
            E = self.E
            F = lay["gate_exps"].shape[1]
            for k, s in {"router": (E, D), "gate_exps": (E, F, D), "up_exps": (E, F, D),
                         "down_exps": (E, D, F)}.items():
                if lay[k].shape != s:
                    raise GGUFError(f"blk.{i} {k}: shape {lay[k].shape}, expected {s}")
            if not (1 <= self.K <= E):
                raise GGUFError(f"expert_used_count {self.K} not in [1, {E}]")

    # ---- forward ------------------------------------------------------------
    def mm(self, h, w, q8_parent=None):
        """h @ w.T, h quantised first where cleave's int8 path would (w, or
        the tensor w is a slice of, stored as Q8_0)."""
        if self.int8 and id(w if q8_parent is None else q8_parent) in self.q8:
            h = act_round(h)
        return h @ w.T

    def attention(self, lay, h, positions):
        T = h.shape[0]
        H, KV, hd = self.H, self.KV, self.hd
        q = self.mm(h, lay["wq"]).reshape(T, H, hd)
        k = self.mm(h, lay["wk"]).reshape(T, KV, hd)
        v = self.mm(h, lay["wv"]).reshape(T, KV, hd)
        q = rope(q, positions, self.base, self.n_rot)
        k = kv_round(rope(k, positions, self.base, self.n_rot), self.kv_types[0])
        v = kv_round(v, self.kv_types[1])
        group = H // KV
        kh = np.repeat(k, group, axis=1)  # (T, H, hd): head h -> kv head h // group
        vh = np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, kh) / np.sqrt(hd)  # (H, T, T)
        mask = np.triu(np.ones((T, T), dtype=bool), k=1)
        scores = np.where(mask[None], -np.inf, scores)
        p = softmax(scores, axis=-1)
        o = np.einsum("hts,shd->thd", p, vh).reshape(T, H * hd)
        return self.mm(o, lay["wo"])

    def ffn(self, lay, h):
        if self.E == 0:
            return self.mm(silu(self.mm(h, lay["gate"])) * self.mm(h, lay["up"]), lay["down"])
        probs = softmax(self.mm(h, lay["router"]), axis=-1)  # (T, E)
        idx, w = moe_topk(probs, self.K)
        self.route_log.append(idx)
        out = np.zeros_like(h)
        for e in range(self.E):
            rows, slot = np.nonzero(idx == e)
            if rows.size == 0:
                continue
            he = h[rows]
            g, u, dn = lay["gate_exps"], lay["up_exps"], lay["down_exps"]
            y = self.mm(silu(self.mm(he, g[e], g)) * self.mm(he, u[e], u), dn[e], dn)
            out[rows] += w[rows, slot][:, None] * y
        return out

    def forward(self, tokens, embeddings=()):
        """Logits (T, n_vocab) for every position of one causal sequence.

        embeddings: (position, rows (n, D)) pairs; rows position..position+n-1
        take those rows instead of their token embeddings (image prompts)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ValueError("token id out of range")
        positions = np.arange(len(tokens))
        self.route_log = []  # per MoE layer: (T, K) chosen experts, for test diagnostics
        x = self.tok_embd[tokens].copy()
        for pos, rows in embeddings:
            rows = np.asarray(rows, dtype=np.float64)
            if rows.ndim != 2 or rows.shape[1] != self.D or pos < 0 or pos + rows.shape[0] > len(tokens):
                raise ValueError(f"embedding rows {rows.shape} at {pos} do not fit {len(tokens)} x {self.D}")
            x[pos:pos + rows.shape[0]] = rows
        for lay in self.layers:
            x = x + self.attention(lay, rmsnorm(x, lay["attn_norm"], self.eps), positions)
            x = x + self.ffn(lay, rmsnorm(x, lay["ffn_norm"], self.eps))
        h = rmsnorm(x, self.output_norm, self.eps)
        return self.mm(h, self.output)

    def greedy(self, prompt, n):
        """Reference greedy decoding (recomputes the full sequence each step)."""
        seq = list(prompt)
        out = []
        for _ in range(n):
            t = int(np.argmax(self.forward(seq)[-1]))
            out.append(t)
            seq.append(t)
        return out
