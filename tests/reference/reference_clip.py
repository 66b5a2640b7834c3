#!/usr/bin/python3
"""Float64 numpy reference for cleave's CLIP vision encoder + MLP projector.

  /usr/bin/python3 tests/reference/reference_clip.py --clip-dump build/tests/clip_dump \
      --workdir /tmp/cleave-clip-ref [--cases NAME,...]

Independent of cleave's C++: it reads the mmproj GGUF with gguf_reader.py and
writes its test images with its own PNG writer (zlib). For each case,
`clip_dump make` writes a deterministic test mmproj, and for each image of
random content `clip_dump encode` dumps the decoded RGB, the preprocessed CHW
tensor and the projected embeddings. Checks:
  decode       the decoded RGB equals the pixels written (PNG is lossless)
  preprocess   numpy's half-pixel bilinear resize + normalise of those pixels
               equals cleave's tensor (max abs <= 1e-6)
  encoder      float64 forward pass on cleave's tensor vs cleave's embeddings:
               max abs error <= 1e-4 for F32, F16, BF16 and Q8_0 weights (the
               reference dequantises the very values stored and cleave's
               kernels do not quantise activations, so only float32
               arithmetic differs)
  end to end   the same pass on numpy's own tensor, same bound
Vacuous-pass guards: embedding std > 0.1, distinct images give distinct
embeddings, distinct patches give distinct rows. Exit status 0 on success.
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import time
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gguf_reader import GGUFFile  # noqa: E402

# name, weight type, model seed, clip_dump make fields, images (w, h, seed), bound
# feature_layer: llama.cpp's hidden-state index (blocks that run); no key: layers - 1.
CASES = [
    ("all_blocks_postln_f32", "f32", 201, dict(feature_layer=2), [(45, 37, 1), (32, 32, 2), (20, 24, 3)],
     1e-4),
    ("quick_penultimate_f32", "f32", 202,
     dict(layers=3, use_gelu=0, class_embd=0, pre_ln=0, patch_bias=1, hidden=96, proj=40),
     [(64, 64, 4), (33, 31, 5)], 1e-4),
    ("wide_f32", "f32", 203,
     dict(image_size=48, patch_size=12, dim=96, heads=6, ffn=192, proj=72, layers=3),
     [(100, 80, 6), (7, 9, 7)], 1e-4),
    ("all_blocks_postln_f16", "f16", 204, dict(feature_layer=2), [(45, 37, 8), (50, 50, 9)], 1e-4),
    ("first_block_bf16", "bf16", 205, dict(layers=3, feature_layer=1), [(40, 28, 10)], 1e-4),
    ("q8_0", "q8_0", 206, dict(image_size=64, patch_size=32, dim=64, ffn=128, proj=48, hidden=64),
     [(90, 70, 11), (64, 64, 12)], 1e-4),
]


class CaseFailure(Exception):
    pass


# ---- PNG writer (8-bit RGB, filter 0) -------------------------------------

def write_png(path, rgb):
    h, w, _ = rgb.shape

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data +
                struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    raw = b"".join(b"\x00" + rgb[y].astype(np.uint8).tobytes() for y in range(h))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
           chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


# ---- preprocessing ----------------------------------------------------------

def _taps(n_in, n_out):
    s = (np.arange(n_out, dtype=np.float64) + 0.5) * n_in / n_out - 0.5
    s = np.clip(s, 0.0, n_in - 1)
    i0 = np.floor(s).astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, s - i0


def resize_bilinear(rgb, out_w, out_h):
    """Half-pixel bilinear (align_corners=False, no antialias), float64 then float32."""
    img = rgb.astype(np.float64)
    y0, y1, fy = _taps(img.shape[0], out_h)
    x0, x1, fx = _taps(img.shape[1], out_w)
    fx = fx[None, :, None]
    fy = fy[:, None, None]
    top = (1 - fx) * img[y0][:, x0] + fx * img[y0][:, x1]
    bot = (1 - fx) * img[y1][:, x0] + fx * img[y1][:, x1]
    return ((1 - fy) * top + fy * bot).astype(np.float32)


def preprocess(rgb, size, mean, std):
    hwc = resize_bilinear(rgb, size, size).astype(np.float64)
    mean = np.asarray(mean, dtype=np.float32).astype(np.float64)
    std = np.asarray(std, dtype=np.float32).astype(np.float64)
    chw = ((hwc / 255.0 - mean) / std).astype(np.float32)
    return np.ascontiguousarray(chw.transpose(2, 0, 1))


# ---- the encoder --------------------------------------------------------------

def layer_norm(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def gelu_quick(x):
    return x / (1.0 + np.exp(-1.702 * x))


class ClipReference:
    def __init__(self, path):
        g = self.g = GGUFFile(path)
        kv = g.kv
        if kv.get("general.architecture") != "clip":
            raise CaseFailure(f"{path}: architecture {kv.get('general.architecture')!r} is not clip")
        if kv.get("clip.projector_type", "mlp") != "mlp":
            raise CaseFailure(f"projector type {kv['clip.projector_type']!r}")
        self.S = int(kv["clip.vision.image_size"])
        self.P = int(kv["clip.vision.patch_size"])
        self.D = int(kv["clip.vision.embedding_length"])
        self.F = int(kv["clip.vision.feed_forward_length"])
        self.L = int(kv["clip.vision.block_count"])
        self.H = int(kv["clip.vision.attention.head_count"])
        self.eps = float(kv["clip.vision.attention.layer_norm_epsilon"])
        self.mean = np.asarray(kv["clip.vision.image_mean"], dtype=np.float64)
        self.std = np.asarray(kv["clip.vision.image_std"], dtype=np.float64)
        self.use_gelu = bool(kv.get("clip.use_gelu", False))
        # llama.cpp's hidden-state index: 0 = encoder input, h = output of block h - 1.
        fl = kv.get("clip.vision.feature_layer", self.L - 1)
        fl = np.atleast_1d(np.asarray(fl, dtype=np.int64))
        if fl.size != 1:
            raise CaseFailure(f"feature_layer {fl.tolist()}: one layer expected")
        self.feature_layer = int(fl[0])
        self.has_class = g.has("v.class_embd")
        self.side = self.S // self.P
        self.n_patches = self.side ** 2
        self.proj = self.g.tensors["mm.2.weight"].ne[1]  # clip.vision.projection_dim is CLIP's own

    def t(self, name):
        return self.g.tensor(name)

    def patch_embed(self, pixels):
        """Convolution with kernel = stride = patch size, written as the sum it is."""
        S, P, side = self.S, self.P, self.side
        W = self.t("v.patch_embd.weight")  # (D, 3, P, P)
        assert W.shape == (self.D, 3, P, P), W.shape
        x = pixels.reshape(3, side, P, side, P)  # c, py, ky, px, kx
        out = np.einsum("cyixj,dcij->yxd", x, W).reshape(self.n_patches, self.D)
        if self.g.has("v.patch_embd.bias"):
            out = out + self.t("v.patch_embd.bias")
        return out

    def attention(self, h, pre):
        T, D, H = h.shape[0], self.D, self.H
        hd = D // H
        q = h @ self.t(pre + "attn_q.weight").T + self.t(pre + "attn_q.bias")
        k = h @ self.t(pre + "attn_k.weight").T + self.t(pre + "attn_k.bias")
        v = h @ self.t(pre + "attn_v.weight").T + self.t(pre + "attn_v.bias")
        q, k, v = (a.reshape(T, H, hd) for a in (q, k, v))
        s = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        p = s / s.sum(axis=-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", p, v).reshape(T, D)
        return o @ self.t(pre + "attn_out.weight").T + self.t(pre + "attn_out.bias")

    def forward(self, pixels):
        """pixels: 3 x S x S (float). Returns n_patches x projection_dim float64."""
        pixels = np.asarray(pixels, dtype=np.float64).reshape(3, self.S, self.S)
        x = self.patch_embed(pixels)
        if self.has_class:
            x = np.concatenate([self.t("v.class_embd")[None, :], x], axis=0)
        x = x + self.t("v.position_embd.weight")
        if self.g.has("v.pre_ln.weight"):
            x = layer_norm(x, self.t("v.pre_ln.weight"), self.t("v.pre_ln.bias"), self.eps)
        act = gelu_tanh if self.use_gelu else gelu_quick
        for i in range(self.feature_layer):
            pre = f"v.blk.{i}."
            x = x + self.attention(layer_norm(x, self.t(pre + "ln1.weight"), self.t(pre + "ln1.bias"),
                                              self.eps), pre)
            h = layer_norm(x, self.t(pre + "ln2.weight"), self.t(pre + "ln2.bias"), self.eps)
            up, down = self.t(pre + "ffn_up.weight"), self.t(pre + "ffn_down.weight")
            up_b, down_b = self.t(pre + "ffn_up.bias"), self.t(pre + "ffn_down.bias")
            if up.shape[1] != self.D:  # legacy fc1/fc2 naming
                up, down, up_b, down_b = down, up, down_b, up_b
            x = x + act(h @ up.T + up_b) @ down.T + down_b
        if self.feature_layer == self.L and self.g.has("v.post_ln.weight"):
            x = layer_norm(x, self.t("v.post_ln.weight"), self.t("v.post_ln.bias"), self.eps)
        if self.has_class:
            x = x[1:]
        h = gelu_tanh(x @ self.t("mm.0.weight").T + self.t("mm.0.bias"))
        return h @ self.t("mm.2.weight").T + self.t("mm.2.bias")


# ---- driver -------------------------------------------------------------------

def run(cmd, timeout=120):
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CaseFailure(f"timed out after {timeout}s: {' '.join(cmd)}")
    if p.returncode != 0:
        raise CaseFailure(f"exit status {p.returncode}: {' '.join(cmd)}\n{p.stderr.decode(errors='replace')}")
    return p.stdout.decode()


def self_test():
    """The reference's own building blocks against hand-computed values."""
    # 2 -> 4 upscale: sample points -0.25 (clamped), 0.25, 0.75, 1.25 (clamped).
    got = resize_bilinear(np.array([[[0, 0, 0], [100, 200, 40]]], dtype=np.uint8), 4, 1)
    want = np.array([[[0, 0, 0], [25, 50, 10], [75, 150, 30], [100, 200, 40]]], dtype=np.float32)
    assert np.array_equal(got, want), got
    # Halving a 2x2 image averages it.
    sq = np.array([[[0] * 3, [40] * 3], [[80] * 3, [120] * 3]], dtype=np.uint8)
    assert np.array_equal(resize_bilinear(sq, 1, 1), np.full((1, 1, 3), 60, np.float32))
    # Same size is the identity.
    r = np.random.default_rng(0).integers(0, 256, size=(3, 5, 3)).astype(np.uint8)
    assert np.array_equal(resize_bilinear(r, 5, 3), r.astype(np.float32))
    # GELU tanh at 1: 0.5 * (1 + tanh(sqrt(2/pi) * 1.044715)) = 0.8411920...
    assert abs(gelu_tanh(1.0) - 0.8411919906) < 1e-9
    assert abs(gelu_quick(1.0) - 1.0 / (1.0 + np.exp(-1.702))) < 1e-15
    ln = layer_norm(np.array([[1.0, 3.0]]), np.ones(2), np.zeros(2), 0.0)
    assert np.allclose(ln, [[-1.0, 1.0]])


def run_case(args, case):
    name, wtype, seed, fields, images, tol = case
    model = os.path.join(args.workdir, f"{name}.gguf")
    run([args.clip_dump, "make", model, wtype, str(seed)] + [f"{k}={v}" for k, v in fields.items()])
    ref = ClipReference(model)
    if ref.g.type_name("v.blk.0.attn_q.weight") != wtype.upper():
        raise CaseFailure(f"model stored as {ref.g.type_name('v.blk.0.attn_q.weight')}, asked {wtype}")
    res = dict(name=name, type=wtype, images=len(images), max_err=0.0, max_err_e2e=0.0, max_pre=0.0,
               failures=[])
    embs = []
    for (w, h, iseed) in images:
        rgb = np.random.default_rng(1000 * seed + iseed).integers(0, 256, size=(h, w, 3)).astype(np.uint8)
        png = os.path.join(args.workdir, f"{name}_{w}x{h}_{iseed}.png")
        write_png(png, rgb)
        prefix = png[:-4]
        info = json.loads(run([args.clip_dump, "encode", model, png, prefix]).strip().splitlines()[-1])
        tag = f"image {w}x{h} seed {iseed}"
        if (info["width"], info["height"]) != (w, h):
            raise CaseFailure(f"{tag}: decoded as {info['width']}x{info['height']}")
        got_rgb = np.fromfile(prefix + ".rgb", dtype=np.uint8)
        if not np.array_equal(got_rgb, rgb.reshape(-1)):
            res["failures"].append(f"{tag}: decoded RGB differs from the PNG's pixels "
                                   f"({int(np.sum(got_rgb != rgb.reshape(-1)))} bytes)")
        pixels = np.fromfile(prefix + ".pixels", dtype="<f4")
        if pixels.size != 3 * ref.S * ref.S:
            raise CaseFailure(f"{tag}: {pixels.size} preprocessed floats, expected {3 * ref.S * ref.S}")
        mine = preprocess(rgb, ref.S, ref.mean, ref.std)
        pre_err = float(np.max(np.abs(mine.reshape(-1).astype(np.float64) - pixels)))
        res["max_pre"] = max(res["max_pre"], pre_err)
        if pre_err > 1e-6:
            res["failures"].append(f"{tag}: preprocessed tensor differs from numpy's by {pre_err:.3g} > 1e-6")
        emb = np.fromfile(prefix + ".emb", dtype="<f4").astype(np.float64)
        if emb.size != ref.n_patches * ref.proj:
            raise CaseFailure(f"{tag}: {emb.size} embedding floats, expected {ref.n_patches}x{ref.proj}")
        emb = emb.reshape(ref.n_patches, ref.proj)
        if not np.all(np.isfinite(emb)):
            raise CaseFailure(f"{tag}: non-finite embeddings")
        want = ref.forward(pixels)
        err = float(np.max(np.abs(emb - want)))
        e2e = float(np.max(np.abs(emb - ref.forward(mine))))
        res["max_err"] = max(res["max_err"], err)
        res["max_err_e2e"] = max(res["max_err_e2e"], e2e)
        if err > tol:
            i, j = np.unravel_index(int(np.argmax(np.abs(emb - want))), emb.shape)
            res["failures"].append(f"{tag}: max |cleave - reference| = {err:.3g} > {tol:g} at patch {i}, "
                                   f"dim {j}: cleave {emb[i, j]:.7f}, reference {want[i, j]:.7f}")
        if e2e > tol:
            res["failures"].append(f"{tag}: end to end (numpy's own preprocessing) error {e2e:.3g} > {tol:g}")
        if np.std(want) <= 0.1:
            res["failures"].append(f"{tag}: degenerate reference embeddings (std {np.std(want):.3g})")
        if np.min(np.max(np.abs(want[1:] - want[:-1]), axis=1)) < 1e-3:
            res["failures"].append(f"{tag}: two neighbouring patches have (almost) the same embedding")
        embs.append(emb)
    for a in range(len(embs)):
        for b in range(a + 1, len(embs)):
            if np.max(np.abs(embs[a] - embs[b])) < 1e-2:
                res["failures"].append(f"images {a} and {b} give (almost) the same embeddings")
    res["tol"] = tol
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clip-dump", required=True, help="path to the clip_dump test binary")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--cases", default="")
    args = ap.parse_args()
    if not (os.path.isfile(args.clip_dump) and os.access(args.clip_dump, os.X_OK)):
        print(f"FAIL: clip_dump {args.clip_dump!r} not found or not executable")
        return 1
    os.makedirs(args.workdir, exist_ok=True)
    cases = CASES
    if args.cases:
        wanted = args.cases.split(",")
        unknown = set(wanted) - {c[0] for c in CASES}
        if unknown:
            print(f"unknown case(s) {sorted(unknown)}; known: {[c[0] for c in CASES]}")
            return 2
        cases = [c for c in CASES if c[0] in wanted]
    t0 = time.time()
    self_test()
    print("reference self-test passed")
    failed = []
    for case in cases:
        try:
            r = run_case(args, case)
        except CaseFailure as e:
            r = dict(name=case[0], failures=[str(e)])
        ok = not r["failures"]
        if "max_err" in r:
            print(f"[{'PASS' if ok else 'FAIL'}] {r['name']} ({r['type']}, {r['images']} images): "
                  f"max abs err {r['max_err']:.3g} (bound {r['tol']:g}), end to end {r['max_err_e2e']:.3g}, "
                  f"preprocess {r['max_pre']:.3g}")
        else:
            print(f"[FAIL] {r['name']}")
        for f in r["failures"]:
            print(f"    FAIL {r['name']}: {f}")
        if not ok:
            failed.append(r["name"])
        sys.stdout.flush()
    print(f"total {time.time() - t0:.1f}s")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print("all clip reference checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
