#!/usr/bin/env bash
# P/D as separate processes from a topology file (examples/pd_2nodes.lua):
# the head ("prefill": router, prefill actor, KV store) and a decode node
# join over CAF's middleman on loopback; the head runs one request, and the
# result shows which actor on which node made each token, with step times.
# Usage: scripts/demo_nodes.sh MODEL   (scripts/demo.sh runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$1
B=build/apps/cleave
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
export CLEAVE_CLUSTER_SECRET=demo-secret-$RANDOM

# The same request as the single-process run (request id 0, as generate uses:
# sampling draws are keyed by seed, request id and position).
$B generate -m "$MODEL" -p "Once upon a time" -n 48 --temp 0.8 --seed 42 --json > "$WORK/mono.json"
/usr/bin/python3 - "$WORK" <<'PY'
import json, sys
w = sys.argv[1]
mono = json.load(open(w + "/mono.json"))
req = {"id": 0, "prompt_ids": mono["prompt_ids"], "max_tokens": 48, "temperature": 0.8, "seed": 42}
open(w + "/requests.jsonl", "w").write(json.dumps(req) + "\n")
PY

$B node --topology examples/pd_2nodes.lua --name prefill -m "$MODEL" \
  --requests "$WORK/requests.jsonl" --out "$WORK/out.jsonl" --wait-stages 2 > "$WORK/head.log" &
head_pid=$!
for _ in $(seq 100); do grep -q "listening on" "$WORK/head.log" && break; sleep 0.1; done
port=$(sed -n 's/.*listening on .*:\([0-9]*\)$/\1/p' "$WORK/head.log")
echo "head 'prefill' (router, prefill actor, KV store) listening on 127.0.0.1:$port"
$B node --topology examples/pd_2nodes.lua --name decode -m "$MODEL" --set prefill_port="$port" \
  > "$WORK/decode.log" 2>&1 &
wait $head_pid
grep joined "$WORK/decode.log" || cat "$WORK/decode.log"  # it exits once the head has gone

/usr/bin/python3 - "$WORK" <<'PY'
import json, sys
w = sys.argv[1]
mono = json.load(open(w + "/mono.json"))
r = json.loads(open(w + "/out.jsonl").readline())
print(f"request {r['id']}: {len(r['tokens'])} tokens, finish {r.get('finish_reason', r.get('error'))}, "
      f"TTFT {r['ttft_ms']:.1f} ms, total {r['total_ms']:.1f} ms")
for stage, s in sorted(r["stages"].items()):
    print(f"  stage {stage:<18} {s['tokens']:3d} tokens {s['ms']:8.1f} ms")
same = r["tokens"] == mono["generated_ids"]
print("same tokens as the single-process run:", "yes" if same else "NO")
sys.exit(0 if same else 1)
PY
