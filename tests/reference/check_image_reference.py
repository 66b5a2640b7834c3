#!/usr/bin/python3
"""Image prompts against the float64 numpy reference: the engine's rows fed
from embeddings instead of token ids.

  /usr/bin/python3 tests/reference/check_image_reference.py --cleave build/apps/cleave \\
      --clip-dump build/tests/clip_dump --vocab models/vocab/ggml-vocab-llama-spm.gguf \\
      --workdir /tmp/cleave-image-ref

For each case: `cleave make-model` writes a random llama GGUF and `clip_dump
make` an mmproj whose projection_dim is the model's width; PNGs are written
with tests/reference's writer; `clip_dump encode` gives cleave's embeddings
for each image; `cleave generate --mmproj --image -p TEXT --temp 0 --json
--logits` runs the prompt. The reference (reference_llama.py, its own GGUF
reader) recomputes every step's logits over prompt + generated tokens with
those embedding rows at the image spans cleave reports, in one float64 pass.
Checks: max |cleave - reference| <= 1e-4, every id equals the reference
argmax, the prompt ids hold the placeholder runs where the spans say, and
(against a vacuous pass) the images move the logits: the same ids fed as
plain tokens differ from the reference by more than 1e-2.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from reference_clip import write_png  # noqa: E402
from reference_llama import LlamaReference  # noqa: E402

TOL = 1e-4
DENSE = dict(dim=64, layers=2, heads=4, kv_heads=4, ffn=160, experts=0, experts_used=0)
GQA = dict(dim=96, layers=3, heads=6, kv_heads=2, ffn=256, experts=0, experts_used=0)
MOE = dict(dim=64, layers=2, heads=4, kv_heads=2, ffn=96, experts=4, experts_used=2)

# name, architecture, model seed, prompt text, image sizes (w, h), extra generate flags
CASES = [
    ("dense_one_image", DENSE, 201, "describe <image> in words", [(32, 32)], []),
    ("gqa_images_first", GQA, 202, "what is this", [(40, 28)], ["--ubatch-size", "5"]),
    ("moe_two_images", MOE, 203, "<image> then <image> compared", [(32, 32), (48, 48)], []),
]


class CaseFailure(Exception):
    pass


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, timeout=300)
    if p.returncode != 0:
        raise CaseFailure(f"exit {p.returncode}: {' '.join(cmd)}\n{p.stderr.decode(errors='replace')[-2000:]}")
    return p.stdout.decode(errors="replace")


def run_case(args, case):
    name, arch, seed, text, sizes, extra = case
    d = os.path.join(args.workdir, name)
    os.makedirs(d, exist_ok=True)
    model, mmproj = os.path.join(d, "lm.gguf"), os.path.join(d, "mmproj.gguf")
    run([args.cleave, "make-model", "--out", model, "--vocab", args.vocab, "--dim", str(arch["dim"]),
         "--layers", str(arch["layers"]), "--heads", str(arch["heads"]), "--kv-heads", str(arch["kv_heads"]),
         "--ffn", str(arch["ffn"]), "--experts", str(arch["experts"]),
         "--experts-used", str(arch["experts_used"]), "--ctx", "256", "--seed", str(seed)])
    run([args.clip_dump, "make", mmproj, "f32", str(seed), f"proj={arch['dim']}"])
    rng = np.random.default_rng(seed)
    pngs, rows = [], []
    for i, (w, h) in enumerate(sizes):
        png = os.path.join(d, f"img{i}.png")
        write_png(png, rng.integers(0, 256, (h, w, 3)).astype(np.uint8))
        info = json.loads(run([args.clip_dump, "encode", mmproj, png, os.path.join(d, f"img{i}")]))
        emb = np.fromfile(os.path.join(d, f"img{i}.emb"), dtype="<f4")
        rows.append(emb.reshape(info["n_patches"], info["projection_dim"]).astype(np.float64))
        pngs.append(png)

    logits_path = os.path.join(d, "logits.bin")
    cmd = [args.cleave, "generate", "-m", model, "--mmproj", mmproj, "-p", text, "-n", str(args.steps),
           "--temp", "0", "--ignore-eos", "--json", "--logits", logits_path, "-t", str(args.threads)]
    for png in pngs:
        cmd += ["--image", png]
    js = json.loads(run(cmd + extra))
    prompt, gen = js["prompt_ids"], js["generated_ids"]
    spans = js.get("image_spans", [])
    if len(spans) != len(pngs) or len(gen) != args.steps:
        raise CaseFailure(f"{len(spans)} image spans for {len(pngs)} images, {len(gen)} tokens: {js}")
    for (pos, n), r in zip(spans, rows):
        if n != r.shape[0] or prompt[pos:pos + n] != [0] * n:
            raise CaseFailure(f"span ({pos}, {n}) does not hold {r.shape[0]} placeholder ids: {prompt}")
    if sum(n for _, n in spans) != prompt.count(0):
        raise CaseFailure(f"placeholder ids outside the spans: {prompt}")

    ref = LlamaReference(model)
    V = ref.n_vocab
    got = np.fromfile(logits_path, dtype="<f4").reshape(-1, V).astype(np.float64)
    seq = prompt + gen[:-1]
    want = ref.forward(seq, embeddings=[(pos, r) for (pos, _), r in zip(spans, rows)])[len(prompt) - 1:]
    plain = ref.forward(seq)[len(prompt) - 1:]
    if got.shape != want.shape:
        raise CaseFailure(f"logits {got.shape}, reference {want.shape}")
    err = float(np.abs(got - want).max())
    moved = float(np.abs(plain - want).max())
    ids_ok = [int(t) for t in np.argmax(want, axis=1)] == gen
    print(f"{name:18s} prompt {len(prompt):3d} tokens ({len(spans)} images), {len(gen)} steps: "
          f"max err {err:.2e} (bound {TOL:.0e}), images move logits by {moved:.3f}, ids "
          f"{'equal' if ids_ok else 'DIFFER'}")
    if err > TOL:
        raise CaseFailure(f"max |cleave - reference| = {err:.3e} > {TOL}")
    if not ids_ok:
        raise CaseFailure(f"ids {gen} differ from the reference argmax {np.argmax(want, axis=1).tolist()}")
    if moved <= 1e-2:
        raise CaseFailure(f"the image rows barely change the logits ({moved:.3g}): a vacuous test")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cleave", required=True)
    ap.add_argument("--clip-dump", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    failed = 0
    for case in CASES:
        try:
            run_case(args, case)
        except CaseFailure as e:
            failed += 1
            print(f"FAIL {case[0]}: {e}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
