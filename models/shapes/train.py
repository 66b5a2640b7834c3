"""Trains the embedded default model: a tiny CLIP-style ViT, an MLP projector
and a llama-architecture language model (dense, and a Mixtral-style MoE
variant) on the shapes task (shapes_data.py), then exports GGUF files that
cleave loads: the vision encoder as a llama.cpp-style mmproj file and each
language model with its tokenizer vocabulary in the file.

    apt-get install python3-torch libopenblas0-pthread
    /usr/bin/python3 models/shapes/train.py --out models/shapes   # < 1 hour on 2 cores

The forward passes here are written to be exactly what cleave computes:
RMSNorm, RoPE over adjacent pairs (2i, 2i+1), SwiGLU, softmax-top-k-
renormalise routing; pre-norm ViT blocks with LayerNorm, tanh GELU, class
token dropped before the projector. Everything is seeded.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "reference"))
import shapes_data as D  # noqa: E402
from gguf_writer import GGML_F32, write_gguf  # noqa: E402

# ---- vocabulary -------------------------------------------------------------

UNK, BOS, EOS = 0, 1, 2
SPACE = "\u2581"


def build_vocab():
    """SentencePiece-style: control tokens, 256 byte tokens, then every prefix
    of every task word (so SPM's bigram merges reach each whole word)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = []
    for w in D.WORDS:
        for k in range(1, len(w) + 1):
            p = SPACE + w[:k]
            if p not in pieces:
                pieces.append(p)
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    word_id = {w: tokens.index(SPACE + w) for w in D.WORDS}
    return tokens, types, scores, word_id


TOKENS, TYPES, SCORES, WORD_ID = build_vocab()
ID_WORD = {i: w for w, i in WORD_ID.items()}


def encode_words(text):
    return [WORD_ID[w] for w in text.split()]


# ---- model --------------------------------------------------------------------

class Cfg:
    image = D.IMAGE_SIZE
    patch = 8
    v_dim = 64
    v_layers = 2
    v_heads = 4
    v_ffn = 128
    dim = 128
    layers = 4
    heads = 4
    ffn = 320
    experts = 0
    experts_used = 0
    context = 128
    rope_base = 10000.0
    rms_eps = 1e-5
    ln_eps = 1e-5
    mean = [0.48145466, 0.4578275, 0.40821073]
    std = [0.26862954, 0.26130258, 0.27577711]


def gelu(x):
    return F.gelu(x, approximate="tanh")


class VitBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.v_dim
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=c.ln_eps), nn.LayerNorm(d, eps=c.ln_eps)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, c.v_ffn), nn.Linear(c.v_ffn, d)
        self.heads = c.v_heads

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        hd = d // self.heads
        q, k, v = (m(h).view(b, t, self.heads, hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(gelu(self.up(self.ln2(x))))


class Vision(nn.Module):
    def __init__(self, c):
        super().__init__()
        n = (c.image // c.patch) ** 2
        self.patch = nn.Conv2d(3, c.v_dim, c.patch, stride=c.patch)
        self.cls = nn.Parameter(torch.randn(c.v_dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(n + 1, c.v_dim) * 0.02)
        self.pre_ln = nn.LayerNorm(c.v_dim, eps=c.ln_eps)
        self.blocks = nn.ModuleList(VitBlock(c) for _ in range(c.v_layers))
        self.post_ln = nn.LayerNorm(c.v_dim, eps=c.ln_eps)
        self.mm0, self.mm2 = nn.Linear(c.v_dim, c.dim), nn.Linear(c.dim, c.dim)

    def forward(self, img):  # img: B x 3 x H x W, normalised
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], dim=1) + self.pos
        x = self.pre_ln(x)
        for blk in self.blocks:
            x = blk(x)
        x = self.post_ln(x)[:, 1:]  # the class token is dropped (LLaVA)
        return self.mm2(gelu(self.mm0(x)))


def rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, base):  # x: B x H x T x hd; rotates pairs (2i, 2i+1)
    t, hd = x.shape[2], x.shape[3]
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


class LmLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.dim
        self.attn_norm, self.ffn_norm = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.c = c
        if c.experts:
            self.router = nn.Linear(d, c.experts, bias=False)
            s = 1 / math.sqrt(d)
            self.gate = nn.Parameter(torch.randn(c.experts, c.ffn, d) * s)
            self.up = nn.Parameter(torch.randn(c.experts, c.ffn, d) * s)
            self.down = nn.Parameter(torch.randn(c.experts, d, c.ffn) / math.sqrt(c.ffn))
        else:
            self.gate, self.up = nn.Linear(d, c.ffn, bias=False), nn.Linear(d, c.ffn, bias=False)
            self.down = nn.Linear(c.ffn, d, bias=False)

    def ffn(self, h):
        c = self.c
        if not c.experts:
            return self.down(F.silu(self.gate(h)) * self.up(h))
        p = torch.softmax(self.router(h), dim=-1)
        w, idx = p.topk(c.experts_used, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        gates = torch.zeros_like(p).scatter(-1, idx, w)  # dense mixture of the top-k
        g = torch.einsum("btd,efd->btef", h, self.gate)
        u = torch.einsum("btd,efd->btef", h, self.up)
        y = torch.einsum("btef,edf->bted", F.silu(g) * u, self.down)
        return (y * gates[..., None]).sum(2)

    def forward(self, x, mask):
        c = self.c
        b, t, d = x.shape
        hd = d // c.heads
        h = rms(x, self.attn_norm, c.rms_eps)
        q, k, v = (m(h).view(b, t, c.heads, hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        q, k = rope(q, c.rope_base), rope(k, c.rope_base)
        a = (q @ k.transpose(-1, -2)) / math.sqrt(hd) + mask
        a = torch.softmax(a, dim=-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ffn(rms(x, self.ffn_norm, c.rms_eps))


class Lm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embd = nn.Embedding(len(TOKENS), c.dim)
        nn.init.normal_(self.embd.weight, std=0.02)
        self.layers = nn.ModuleList(LmLayer(c) for _ in range(c.layers))
        self.norm = nn.Parameter(torch.ones(c.dim))
        self.out = nn.Linear(c.dim, len(TOKENS), bias=False)

    def forward(self, x):  # x: B x T x dim (embeddings)
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)
        for layer in self.layers:
            x = layer(x, mask)
        return self.out(rms(x, self.norm, self.c.rms_eps))


# ---- data ---------------------------------------------------------------------

def normalise(img_u8, c):
    x = torch.from_numpy(img_u8).float().permute(2, 0, 1) / 255.0
    return (x - torch.tensor(c.mean)[:, None, None]) / torch.tensor(c.std)[:, None, None]


def n_patches(c):
    return (c.image // c.patch) ** 2


def batch(rng, c, size, caption_share=0.4):
    """Images, input ids (BOS, image slots, prompt, answer), targets (-100 off the answer)."""
    imgs, seqs = [], []
    for _ in range(size):
        img, objs = D.make_sample(rng)
        tasks = D.tasks(objs)
        prompt, answer = tasks[0] if rng.random() < caption_share else tasks[rng.integers(1, len(tasks))]
        imgs.append(normalise(img, c))
        seqs.append((encode_words(prompt), encode_words(answer) + [EOS]))
    p = n_patches(c)
    t = 1 + p + max(len(a) + len(b) for a, b in seqs)
    ids = torch.zeros(size, t, dtype=torch.long)
    tgt = torch.full((size, t), -100, dtype=torch.long)
    for i, (pr, an) in enumerate(seqs):
        s = [BOS] + [0] * p + pr + an
        ids[i, :len(s)] = torch.tensor(s)
        start = 1 + p + len(pr)  # position of the first answer token
        tgt[i, start - 1:start - 1 + len(an)] = torch.tensor(an)
    return torch.stack(imgs), ids, tgt


def embed(vision, lm, imgs, ids):
    c = lm.c
    x = lm.embd(ids)
    p = n_patches(c)
    return torch.cat([x[:, :1], vision(imgs), x[:, 1 + p:]], dim=1)


@torch.no_grad()
def greedy(vision, lm, imgs, prompts, max_new=20):
    """Greedy answers for images with prompts of one length (batched, no cache)."""
    c = lm.c
    ids = torch.tensor([[BOS] + [0] * n_patches(c) + encode_words(p) for p in prompts])
    img_emb = vision(imgs)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out = [[] for _ in prompts]
    for _ in range(max_new):
        x = lm.embd(ids)
        x = torch.cat([x[:, :1], img_emb, x[:, 1 + n_patches(c):]], dim=1)
        nxt = lm(x)[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                if t == EOS:
                    done[i] = True
                else:
                    out[i].append(ID_WORD.get(t, "?"))
        if bool(done.all()):
            break
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return [" ".join(o) for o in out]


@torch.no_grad()
def accuracy(vision, lm, seed, n):
    """Greedy exact match on n fresh images: the caption and one question each."""
    rng = np.random.default_rng(seed)
    groups = {}  # prompt length -> [(image, prompt, answer)]
    for _ in range(n):
        img, objs = D.make_sample(rng)
        tasks = D.tasks(objs)
        for prompt, answer in (tasks[0], tasks[rng.integers(1, len(tasks))]):
            groups.setdefault(len(prompt.split()), []).append((normalise(img, lm.c), prompt, answer))
    ok = total = 0
    for items in groups.values():
        got = greedy(vision, lm, torch.stack([i for i, _, _ in items]), [p for _, p, _ in items])
        ok += sum(g == a for g, (_, _, a) in zip(got, items))
        total += len(items)
    return ok / total


# ---- export -------------------------------------------------------------------

def f32(t):
    return t.detach().float().numpy()


def export_mmproj(vision, c, path):
    kv = {
        "general.architecture": "clip",
        "general.name": "shapes-vit",
        "clip.has_vision_encoder": True,
        "clip.has_text_encoder": False,
        "clip.projector_type": "mlp",
        "clip.use_gelu": True,
        "clip.vision.image_size": c.image,
        "clip.vision.patch_size": c.patch,
        "clip.vision.embedding_length": c.v_dim,
        "clip.vision.feed_forward_length": c.v_ffn,
        "clip.vision.block_count": c.v_layers,
        "clip.vision.attention.head_count": c.v_heads,
        "clip.vision.attention.layer_norm_epsilon": float(c.ln_eps),
        "clip.vision.projection_dim": c.dim,
        # Hidden state after every block (then v.post_ln): without the key,
        # llama.cpp (and cleave) run block_count - 1 blocks, as for LLaVA.
        "clip.vision.feature_layer": [c.v_layers],
        "clip.vision.image_mean": [float(v) for v in c.mean],
        "clip.vision.image_std": [float(v) for v in c.std],
    }
    v = vision
    ts = [("v.patch_embd.weight", f32(v.patch.weight)), ("v.patch_embd.bias", f32(v.patch.bias)),
          ("v.class_embd", f32(v.cls)), ("v.position_embd.weight", f32(v.pos)),
          ("v.pre_ln.weight", f32(v.pre_ln.weight)), ("v.pre_ln.bias", f32(v.pre_ln.bias))]
    for i, b in enumerate(v.blocks):
        p = f"v.blk.{i}."
        for name, m in (("attn_q", b.q), ("attn_k", b.k), ("attn_v", b.v), ("attn_out", b.o),
                        ("ffn_up", b.up), ("ffn_down", b.down), ("ln1", b.ln1), ("ln2", b.ln2)):
            ts += [(p + name + ".weight", f32(m.weight)), (p + name + ".bias", f32(m.bias))]
    ts += [("v.post_ln.weight", f32(v.post_ln.weight)), ("v.post_ln.bias", f32(v.post_ln.bias)),
           ("mm.0.weight", f32(v.mm0.weight)), ("mm.0.bias", f32(v.mm0.bias)),
           ("mm.2.weight", f32(v.mm2.weight)), ("mm.2.bias", f32(v.mm2.bias))]
    write_gguf(path, kv, [(n, a, GGML_F32) for n, a in ts])


def export_lm(lm, path, name):
    c = lm.c
    kv = {
        "general.architecture": "llama",
        "general.name": name,
        "llama.context_length": c.context,
        "llama.embedding_length": c.dim,
        "llama.block_count": c.layers,
        "llama.feed_forward_length": c.ffn,
        "llama.attention.head_count": c.heads,
        "llama.attention.head_count_kv": c.heads,
        "llama.rope.freq_base": float(c.rope_base),
        "llama.rope.dimension_count": c.dim // c.heads,
        "llama.attention.layer_norm_rms_epsilon": float(c.rms_eps),
        "llama.vocab_size": len(TOKENS),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.scores": SCORES,
        "tokenizer.ggml.token_type": TYPES,
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": EOS,
        "tokenizer.ggml.unknown_token_id": UNK,
        # The model's own chat template (cleave recognises it by this text).
        "tokenizer.chat_template": open(os.path.join(HERE, "chat_template.jinja")).read(),
    }
    if c.experts:
        kv["llama.expert_count"] = c.experts
        kv["llama.expert_used_count"] = c.experts_used
    ts = [("token_embd.weight", f32(lm.embd.weight))]
    for i, l in enumerate(lm.layers):
        p = f"blk.{i}."
        ts += [(p + "attn_norm.weight", f32(l.attn_norm)), (p + "attn_q.weight", f32(l.q.weight)),
               (p + "attn_k.weight", f32(l.k.weight)), (p + "attn_v.weight", f32(l.v.weight)),
               (p + "attn_output.weight", f32(l.o.weight)), (p + "ffn_norm.weight", f32(l.ffn_norm))]
        if c.experts:
            ts += [(p + "ffn_gate_inp.weight", f32(l.router.weight)),
                   (p + "ffn_gate_exps.weight", f32(l.gate)), (p + "ffn_up_exps.weight", f32(l.up)),
                   (p + "ffn_down_exps.weight", f32(l.down))]
        else:
            ts += [(p + "ffn_gate.weight", f32(l.gate.weight)), (p + "ffn_up.weight", f32(l.up.weight)),
                   (p + "ffn_down.weight", f32(l.down.weight))]
    ts += [("output_norm.weight", f32(lm.norm)), ("output.weight", f32(lm.out.weight))]
    write_gguf(path, kv, [(n, a, GGML_F32) for n, a in ts])


# ---- training -----------------------------------------------------------------

def upcycle(moe, dense):
    """Sparse upcycling: the MoE starts as the dense model with every expert a
    copy of its FFN (router random), then trains on."""
    with torch.no_grad():
        moe.embd.weight.copy_(dense.embd.weight)
        moe.norm.copy_(dense.norm)
        moe.out.weight.copy_(dense.out.weight)
        for m, d in zip(moe.layers, dense.layers):
            for name in ("attn_norm", "ffn_norm"):
                getattr(m, name).copy_(getattr(d, name))
            for name in ("q", "k", "v", "o"):
                getattr(m, name).weight.copy_(getattr(d, name).weight)
            m.gate.copy_(d.gate.weight.expand_as(m.gate))
            m.up.copy_(d.up.weight.expand_as(m.up))
            m.down.copy_(d.down.weight.expand_as(m.down))


def train(c, vision, steps, batch_size, lr, seed, log, label, eval_seed, init=None):
    torch.manual_seed(seed)
    lm = Lm(c)
    if init is not None:
        upcycle(lm, init)
    params = [p for p in list(lm.parameters()) + list(vision.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    t0 = time.time()
    for step in range(1, steps + 1):
        frac = step / steps
        for g in opt.param_groups:  # warmup then cosine
            g["lr"] = lr * min(1.0, step / 200) * 0.5 * (1 + math.cos(math.pi * frac))
        imgs, ids, tgt = batch(rng, c, batch_size)
        logits = lm(embed(vision, lm, imgs, ids))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0 or step == 1:
            entry = {"model": label, "step": step, "loss": round(float(loss), 5),
                     "seconds": round(time.time() - t0, 1)}
            if step % 500 == 0 or step == steps:
                entry["eval_exact_match"] = accuracy(vision, lm, eval_seed, 100)
            print(json.dumps(entry), flush=True)
            log.append(entry)
            if entry.get("eval_exact_match", 0) >= 0.995 and step >= steps // 2:
                break  # converged: the rest of the schedule would only polish
    return lm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--moe-steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    log = []
    c = Cfg()
    vision = Vision(c)
    lm = train(c, vision, args.steps, args.batch, 2e-3, args.seed, log, "dense", eval_seed=777)
    export_mmproj(vision, c, os.path.join(args.out, "shapes-mmproj-f32.gguf"))
    export_lm(lm, os.path.join(args.out, "shapes-lm-f32.gguf"), "shapes-lm")

    cm = Cfg()
    cm.experts, cm.experts_used = 4, 2
    for p in vision.parameters():  # the MoE variant shares the trained encoder, frozen
        p.requires_grad_(False)
    moe = train(cm, vision, args.moe_steps, args.batch, 5e-4, args.seed + 1, log, "moe",
                eval_seed=778, init=lm)
    export_lm(moe, os.path.join(args.out, "shapes-lm-moe-f32.gguf"), "shapes-lm-moe")
    final = {"dense": accuracy(vision, lm, 4242, 200), "moe": accuracy(vision, moe, 4242, 200)}
    with open(os.path.join(args.out, "training_log.json"), "w") as f:
        json.dump({"seed": args.seed, "steps": args.steps, "moe_steps": args.moe_steps,
                   "batch": args.batch, "final_exact_match_seed_4242": final, "log": log}, f, indent=1)
    print(json.dumps({"final": final}))


if __name__ == "__main__":
    main()
