"""Tiny GGUF v3 writer used only by the reference's self-test.

Lets the reference be validated without the cleave binary: it writes random
llama models (dense / MoE, F32 / F16 / BF16 / Q8_0, tied or not).
"""

import struct

import numpy as np

from gguf_reader import (GGML_BF16, GGML_F16, GGML_F32, GGML_Q8_0, QK8_0, T_ARRAY, T_BOOL,
                         T_FLOAT32, T_INT32, T_STRING, T_UINT32)


def _s(b):
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def _kv(key, value):
    """str, bool, float (f32), int (u32), or a list of str, float (f32) or int (i32)."""
    out = _s(key)
    if isinstance(value, str):
        return out + struct.pack("<I", T_STRING) + _s(value)
    if isinstance(value, bool):
        return out + struct.pack("<IB", T_BOOL, int(value))
    if isinstance(value, float):
        return out + struct.pack("<If", T_FLOAT32, value)
    if isinstance(value, int):
        return out + struct.pack("<II", T_UINT32, value)
    if isinstance(value, list) and value and isinstance(value[0], str):
        return out + struct.pack("<IIQ", T_ARRAY, T_STRING, len(value)) + \
            b"".join(_s(v) for v in value)
    if isinstance(value, list) and value and isinstance(value[0], float):
        return out + struct.pack("<IIQ", T_ARRAY, T_FLOAT32, len(value)) + \
            np.asarray(value, dtype="<f4").tobytes()
    if isinstance(value, list):  # list of int32
        return out + struct.pack("<IIQ", T_ARRAY, T_INT32, len(value)) + \
            np.asarray(value, dtype="<i4").tobytes()
    raise TypeError(type(value))


def encode_tensor(a, ggml_type):
    a = np.ascontiguousarray(a, dtype=np.float32)
    if ggml_type == GGML_F32:
        return a.astype("<f4").tobytes()
    if ggml_type == GGML_F16:
        return a.astype("<f2").tobytes()
    if ggml_type == GGML_BF16:
        u = a.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
        return u.astype("<u2").tobytes()
    if ggml_type == GGML_Q8_0:
        b = a.reshape(-1, QK8_0).astype(np.float64)
        amax = np.max(np.abs(b), axis=1)
        d = (amax / 127.0).astype(np.float16)
        dd = d.astype(np.float64)
        inv = np.where(dd > 0, 1.0 / np.where(dd > 0, dd, 1), 0.0)
        q = np.clip(np.rint(b * inv[:, None]), -127, 127).astype(np.int8)
        rec = np.zeros(len(b), dtype=[("d", "<f2"), ("q", "i1", (QK8_0,))])
        rec["d"] = d
        rec["q"] = q
        return rec.tobytes()
    raise ValueError(ggml_type)


def write_gguf(path, kvs, tensors, alignment=32):
    """kvs: dict key -> value; tensors: list of (name, ndarray row-major, ggml_type)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs) + 1)
    head += b"".join(_kv(k, v) for k, v in kvs.items())
    head += _kv("general.alignment", alignment)
    blobs = []
    off = 0
    infos = b""
    for name, a, t in tensors:
        data = encode_tensor(a, t)
        ne = list(reversed(a.shape))
        infos += _s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        infos += struct.pack("<IQ", t, off)
        pad = (-len(data)) % alignment
        blobs.append(data + b"\0" * pad)
        off += len(data) + pad
    hdr = head + infos
    hdr += b"\0" * ((-len(hdr)) % alignment)
    with open(path, "wb") as f:
        f.write(hdr)
        for b in blobs:
            f.write(b)


def make_llama(path, vocab=300, dim=32, layers=2, heads=4, kv_heads=2, ffn=48, experts=0,
               experts_used=0, ggml_type=GGML_F32, tied=False, seed=0, rope_base=10000.0,
               eps=1e-5, scale=0.3):
    """Random llama model; returns dict name -> float32 array as intended before encoding."""
    rng = np.random.default_rng(seed)
    hd = dim // heads

    def w(*shape):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1]) * 3).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    ts = [("token_embd.weight", (rng.standard_normal((vocab, dim))).astype(np.float32), ggml_type)]
    for i in range(layers):
        b = f"blk.{i}."
        ts += [(b + "attn_norm.weight", norm(dim), GGML_F32),
               (b + "attn_q.weight", w(heads * hd, dim), ggml_type),
               (b + "attn_k.weight", w(kv_heads * hd, dim), ggml_type),
               (b + "attn_v.weight", w(kv_heads * hd, dim), ggml_type),
               (b + "attn_output.weight", w(dim, heads * hd), ggml_type),
               (b + "ffn_norm.weight", norm(dim), GGML_F32)]
        if experts:
            ts += [(b + "ffn_gate_inp.weight", w(experts, dim), GGML_F32),
                   (b + "ffn_gate_exps.weight", w(experts, ffn, dim), ggml_type),
                   (b + "ffn_up_exps.weight", w(experts, ffn, dim), ggml_type),
                   (b + "ffn_down_exps.weight", w(experts, dim, ffn), ggml_type)]
        else:
            ts += [(b + "ffn_gate.weight", w(ffn, dim), ggml_type),
                   (b + "ffn_up.weight", w(ffn, dim), ggml_type),
                   (b + "ffn_down.weight", w(dim, ffn), ggml_type)]
    ts.append(("output_norm.weight", norm(dim), GGML_F32))
    if not tied:
        ts.append(("output.weight", w(vocab, dim), ggml_type))
    kvs = {
        "general.architecture": "llama",
        "llama.embedding_length": dim,
        "llama.block_count": layers,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.feed_forward_length": ffn,
        "llama.rope.freq_base": float(rope_base),
        "llama.attention.layer_norm_rms_epsilon": float(eps),
        "llama.context_length": 256,
    }
    if experts:
        kvs["llama.expert_count"] = experts
        kvs["llama.expert_used_count"] = experts_used
    write_gguf(path, kvs, ts)
    return {n: a for n, a, _ in ts}
