#!/usr/bin/env bash
# Installs, builds, makes the default demo model (deterministic weights with
# the Llama-2 vocabulary), streams a generation from it in one engine, then
# the same request through prefill and decode actors (same text).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
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
