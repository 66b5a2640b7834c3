#!/usr/bin/env bash
# E/P/D as three processes from a topology file (examples/epd_3nodes.lua):
# the head ("prefill": router, prefill actor, KV store), an encoder node (a
# vision_encoder actor) and a decode node join over CAF's middleman on
# loopback. The head sends one image request: its pixels go to the encoder
# node, the embeddings come back as Cap'n Proto messages and go on to the
# prefill actor, the KV streams to the decode node. The result shows the
# caption and which actor on which node did what, with its time.
# Usage: scripts/demo_epd.sh LM MMPROJ IMAGE PROMPT   (scripts/demo.sh runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
LM=$1 MMPROJ=$2 IMAGE=$3 PROMPT=$4
B=build/apps/cleave
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
export CLEAVE_CLUSTER_SECRET=demo-secret-$RANDOM

/usr/bin/python3 -c 'import json, sys; print(json.dumps({"id": 0, "prompt": sys.argv[1], "images": [sys.argv[2]], "max_tokens": 24, "temperature": 0}))' \
  "$PROMPT" "$(realpath "$IMAGE")" > "$WORK/requests.jsonl"

topo=(--topology examples/epd_3nodes.lua -m "$LM" --mmproj "$MMPROJ" --set decoders=1)
$B node "${topo[@]}" --name prefill --requests "$WORK/requests.jsonl" --out "$WORK/out.jsonl" \
  --wait-stages 3 > "$WORK/head.log" 2> "$WORK/head.err" &
head_pid=$!
for _ in $(seq 100); do grep -q "listening on" "$WORK/head.log" && break; sleep 0.1; done
port=$(sed -n 's/.*listening on .*:\([0-9]*\)$/\1/p' "$WORK/head.log")
echo "head 'prefill' (router, prefill actor, KV store) listening on 127.0.0.1:$port"
$B node "${topo[@]}" --name encoder --set prefill_port="$port" > "$WORK/encoder.log" 2>&1 &
$B node "${topo[@]}" --name decode --set prefill_port="$port" > "$WORK/decode.log" 2>&1 &
wait $head_pid
grep -h joined "$WORK/encoder.log" "$WORK/decode.log" || cat "$WORK/encoder.log" "$WORK/decode.log"

/usr/bin/python3 - "$WORK" "$LM" <<'PY'
import json, sys
w = sys.argv[1]
r = json.loads(open(w + "/out.jsonl").readline())
print(f"answer: {r['text'].strip()!r}")
print(f"request {r['id']}: {len(r['tokens'])} tokens, finish {r.get('finish_reason', r.get('error'))}, "
      f"TTFT {r['ttft_ms']:.1f} ms, total {r['total_ms']:.1f} ms")
for stage, s in sorted(r["stages"].items()):
    print(f"  stage {stage:<26} {s['tokens']:3d} tokens {s['ms']:8.1f} ms")
sys.exit(0 if "error" not in r else 1)
PY
