#!/usr/bin/env bash
# Installs, builds, then:
#  1. the trained shapes VLM (models/shapes/) describes a generated picture
#     (examples/shapes_demo.png) in one engine, then through E/P/D in one
#     process (vision_encoder actor -> prefill actor -> decode actor), then
#     as three processes from examples/epd_3nodes.lua, with per-stage timings;
#  2. text: a generated demo model (deterministic weights with the Llama-2
#     vocabulary) streams a generation in one engine, then the same request
#     through prefill and decode actors and as two processes (same text).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
LM=models/shapes/shapes-lm-f32.gguf MMPROJ=models/shapes/shapes-mmproj-f32.gguf
IMAGE=examples/shapes_demo.png
echo "== the shapes VLM describes $IMAGE (expected: $(sed -n 's/^describe\t//p' examples/shapes_demo.txt))"
build/apps/cleave generate -m "$LM" --mmproj "$MMPROJ" --image "$IMAGE" -p describe --temp 0 -n 24
echo
echo "== E/P/D in one process: vision_encoder actor -> prefill actor -> KV -> decode actor"
build/apps/cleave generate -m "$LM" --mmproj "$MMPROJ" --image "$IMAGE" -p describe --temp 0 -n 24 \
  --topology pd --vision-actors 1
echo
echo "== E/P/D as three processes (examples/epd_3nodes.lua): encoder node, head (prefill), decode node"
scripts/demo_epd.sh "$LM" "$MMPROJ" "$IMAGE" describe
echo
echo "== text: a generated 15M demo model (fluent-looking gibberish: it shows the pipeline)"
MODEL=build/demo-15m-f16.gguf
if [ ! -f "$MODEL" ]; then
  build/apps/cleave make-model --out "$MODEL" --vocab models/vocab/ggml-vocab-llama-spm.gguf \
    --dim 288 --layers 6 --heads 6 --kv-heads 6 --ffn 768 --ctx 512 --type f16 --seed 7
fi
build/apps/cleave inspect "$MODEL" | sed -n 1,2p
build/apps/cleave generate -m "$MODEL" -p "Once upon a time" -n 48 --temp 0.8 --seed 42
echo
echo "== the same request, disaggregated: prefill actor -> KV store actor -> decode actor"
build/apps/cleave generate -m "$MODEL" -p "Once upon a time" -n 48 --temp 0.8 --seed 42 --topology pd
echo
echo "== P/D as two processes (examples/pd_2nodes.lua): head + decode node over loopback"
scripts/demo_nodes.sh "$MODEL"
