#!/usr/bin/env bash
# Serving sweeps of the 100M GQA test model over five topologies, with the
# machine's decode limit and the HTTP-vs-in-process overhead, in one command:
#
#   bench/serve/run_sweeps.sh
#
# 1. makes the model (docs/PERFORMANCE.md's "100M GQA", F16, context 1024) in
#    $WORK if it is missing; copies the binaries to $WORK/bin so that a
#    rebuild of build/ during the run cannot swap them;
# 2. waits until no build or test runs (pgrep -f "ctest|cmake --build|cc1plus"
#    finds nothing for $QUIET_S seconds in a row) and watches for one all
#    through the run (results/run_info.json lists what it saw, and when);
# 3. the physical limit: build/bench/cleave_bench --types f16 (memory read
#    bandwidth, batch-1 decode tok/s beside bandwidth / bytes per token);
# 4. per topology: start it, wait for /health (and, for clusters, for every
#    stage to join), warm up, a capacity probe (--max-concurrency 16, every
#    request at once), then one Poisson run per rate in $RATES; SIGTERM, wait;
#    writes results/<topology>.json (one serve_bench.py sweep file);
# 5. bench/serve/overhead.py: $OVERHEAD_N requests one at a time over HTTP
#    (mono) and in process (results/overhead.json);
# 6. plot_serve.py -> docs/serve/*.png; results/summary.md (the tables).
#
# Topologies (every engine with --parallel / --max-seqs 16 sequences):
#   mono        cleave serve --topology mono -t 2
#   colocated   cleave serve --topology colocated --colocated-actors 2 -t 1
#   pd          cleave serve --topology pd --prefill-actors 1 --decode-actors 1 -t 1
#   pd_2nodes   two processes, examples/pd_2nodes.lua: head "prefill" (router,
#               prefill, kv_store, HTTP) + "decode", -t 1 each
#   pd_3nodes   three processes: a head with the router, kv_store and HTTP but
#               no engine, one prefill node, one decode node, -t 1 each (the
#               topology is written to $WORK/p1d1_3nodes.lua; examples/p1_d2.lua
#               would put three engines on two cores)
#
# Dataset: serve_bench.py's ShareGPT-like lognormal lengths scaled to a mean
# of 128 prompt and 64 output tokens (--input-scale 0.795 --output-scale
# 0.1894), clipped to 512 / 256, random token ids. Prefix caching is on in
# every topology and serve_bench.py sends the same prompts at every rate, so
# each rate gets its own token ids (--vocab-range shifted by the rate's index:
# same lengths and arrival times, no shared blocks) and the warm-up uses other
# prompts; results/<topology>.json records the prefix-cache hits.
#
# SLO = 3x the unloaded p90, from a mono run of these lengths one request at
# a time on the 2-core VM (16 requests: TTFT p50 84 ms, p90 274 ms, p99
# 573 ms, ~1 ms per prompt token; TPOT p50 6.4 ms, p90 8.2 ms), rounded:
#   TTFT <= 800 ms, TPOT <= 25 ms   (SLO_TTFT_MS, SLO_TPOT_MS)
# (a clipped 512-token prompt takes ~500 ms to prefill unloaded, so every
# prompt of the dataset can meet the TTFT SLO on an idle server)
# Rates: mono gives ~3.5 req/s at 16 in flight (190 output tok/s), and at
# 3 req/s its TPOT p50 is already ~22 ms, so the sweep is 0.5,1,2,3,4 req/s.
# With seed 0 the 36 Poisson arrivals come at 0.73x the nominal rate (their
# 35 gaps sum to 1.37x the mean); the tables give the offered rate beside it.
#
# Knobs (environment): RATES, NUM_PROMPTS, TOPOLOGIES, QUIET_S (0: don't wait),
# OVERHEAD_N, WORK, RESULTS, PLOTS, SKIP_ROOFLINE=1, SKIP_OVERHEAD=1.
# `run_sweeps.sh --tables-only`: only the plots and results/summary.md, from
# the JSON already in $RESULTS.
# A dry run: NUM_PROMPTS=4 RATES=2 TOPOLOGIES="mono pd_2nodes" OVERHEAD_N=2 \
#   SKIP_ROOFLINE=1 QUIET_S=0 WORK=/tmp/x RESULTS=/tmp/x/r PLOTS=/tmp/x/p \
#   MODEL=/tmp/serve-bench/gqa100m.gguf bench/serve/run_sweeps.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=/usr/bin/python3
WORK=${WORK:-/tmp/serve-bench}
MODEL=${MODEL:-$WORK/gqa100m.gguf}
RESULTS=${RESULTS:-bench/serve/results}
PLOTS=${PLOTS:-docs/serve}
RATES=${RATES:-0.5,1,2,3,4}
NUM_PROMPTS=${NUM_PROMPTS:-36}
CAP_CONCURRENCY=${CAP_CONCURRENCY:-16}
WARMUP=${WARMUP:-3}
TOPOLOGIES=${TOPOLOGIES:-mono colocated pd pd_2nodes pd_3nodes}
QUIET_S=${QUIET_S:-30}
QUIET_MAX_S=${QUIET_MAX_S:-3600}
OVERHEAD_N=${OVERHEAD_N:-20}
SLO_TTFT_MS=${SLO_TTFT_MS:-800}
SLO_TPOT_MS=${SLO_TPOT_MS:-25}
PARALLEL=16
BUSY_RE="ctest|cmake --build|cc1plus"
DATASET=(--input-scale 0.795 --output-scale 0.1894 --max-input-len 512 --max-output-len 256
         --max-model-len 1024)
VOCAB_LO=100 VOCAB_HI=31900   # the vocabulary is 32000; shifted by up to len(RATES) + 2

# The plots and results/summary.md (the tables of docs/PERFORMANCE.md's
# serving section) from results/*.json; `run_sweeps.sh --tables-only` redoes
# just this.
plots_and_tables() {
  local files=() t
  for t in $($PY -c 'import json,sys; print(" ".join(t["topology"] for t in json.load(open(sys.argv[1]))["topologies"]))' "$RESULTS/run_info.json"); do
    files+=("$RESULTS/$t.json")
  done
  $PY bench/serve/plot_serve.py "${files[@]}" --out-dir "$PLOTS"
  $PY - "$RESULTS" <<'PY'
import json, os, sys
res = sys.argv[1]
info = json.load(open(f"{res}/run_info.json"))
L = []
def f(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"
def offered(run):  # the arrival rate the Poisson draws gave: (n - 1) / last arrival
    ts = [r["scheduled_s"] for r in run["requests"]]
    return (len(ts) - 1) / max(ts) if max(ts) > 0 else None

if os.path.exists(f"{res}/cleave_bench.json"):
    cb = json.load(open(f"{res}/cleave_bench.json"))
    L.append("Physical limit (cleave_bench, 100M-GQA f16, batch 1, same run):\n")
    L.append("| threads | read bandwidth (GB/s) | decode limit (tok/s) | TPOT floor (ms) | "
             "measured decode (tok/s) | measured ms/token |")
    L.append("|---|---|---|---|---|---|")
    for r in cb["runs"]:
        if r["model"] == "100M-GQA" and r["type"] == "f16":
            bw = cb["limits"][str(r["threads"])]["read_GBps"]
            L.append(f"| {r['threads']} | {f(bw)} | {f(r['decode_limit_tok_s'])} | "
                     f"{f(1000 / r['decode_limit_tok_s'], 2)} | {f(r['decode_tok_s'])} | "
                     f"{f(1000 / r['decode_tok_s'], 2)} |")
    L.append("")

for t in info["topologies"]:
    doc = json.load(open(f"{res}/{t['topology']}.json"))
    L.append(f"**{t['topology']}** (`{doc['topology_command']}`)\n")
    L.append("| rate (req/s) | offered (req/s) | done (req/s) | out tok/s | TTFT p50 / p90 / p99 (ms) "
             "| TPOT p50 / p90 / p99 (ms) | ITL p50 (ms) | E2E p50 (ms) | goodput (req/s) | SLO attainment |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    rows = [(f"{r['request_rate']:g}", f(offered(r), 2), r["summary"]) for r in doc["runs"]]
    cap = doc["capacity"]["summary"]
    rows.append((f"inf, ≤ {cap['max_concurrency']} in flight", "-", cap))
    for rate, off, s in rows:
        tt, tp = s["ttft_ms"], s["tpot_ms"]
        fail = f" ({s['failed']} failed)" if s["failed"] else ""
        L.append(f"| {rate} | {off} | {f(s['request_throughput'], 2)} | {f(s['output_throughput'])} | "
                 f"{f(tt.get('p50'))} / {f(tt.get('p90'))} / {f(tt.get('p99'))} | "
                 f"{f(tp.get('p50'))} / {f(tp.get('p90'))} / {f(tp.get('p99'))} | "
                 f"{f(s['itl_ms'].get('p50'))} | {f(s['e2e_ms'].get('p50'))} | {f(s['goodput'], 2)} | "
                 f"{f(100 * s['slo_attainment'])} %{fail} |")
    good = [r for r in doc["runs"] if r["summary"]["slo_attainment"] >= 0.9]
    best = max(good, key=lambda r: r["request_rate"]) if good else None
    steady = None  # the highest rate with every lower swept rate >= 90 % too
    for r in sorted(doc["runs"], key=lambda r: r["request_rate"]):
        if r["summary"]["slo_attainment"] < 0.9:
            break
        steady = r
    L.append("\nhighest rate with ≥ 90 % SLO attainment: "
             + ("none of the rates swept" if best is None else
                f"{best['request_rate']:g} req/s (offered {f(offered(best), 2)})")
             + ("" if steady is best else
                f"; every rate up to {'none' if steady is None else format(steady['request_rate'], 'g')}")
             + f"; prefix-cache hits {doc['prefix_cache']['hits_tokens']:g} of "
             f"{doc['prefix_cache']['queries_tokens']:g} prompt tokens; wall {t['wall_s']} s"
             + ("; a build/test ran during it" if t["build_or_test_seen"] else "") + "\n")

if os.path.exists(f"{res}/overhead.json"):
    o = json.load(open(f"{res}/overhead.json"))
    n = o["stats"]["http"]["ttft_ms"]["n"]
    L.append(f"Overhead: {n} requests one at a time, mono, -t {o['config']['threads']} "
             "(ms: median, p10-p90, min-max over the requests):\n")
    L.append("| path | TTFT median | TTFT p10-p90 | TTFT min-max | TPOT median | TPOT p10-p90 | TPOT min-max |")
    L.append("|---|---|---|---|---|---|---|")
    names = {"http": "HTTP client (cleave serve)", "pipeline": "in process, pipeline (generate --requests)",
             "engine": "in process, engine loop (generate --prompt-ids)",
             "http_minus_pipeline": "HTTP - pipeline, per request", "http_minus_engine": "HTTP - engine, per request"}
    for k, d in list(o["stats"].items()) + list(o["diffs"].items()):
        a, b = d["ttft_ms"], d["tpot_ms"]
        L.append(f"| {names[k]} | {f(a['median'], 2)} | {f(a['p10'], 2)} - {f(a['p90'], 2)} | "
                 f"{f(a['min'], 2)} - {f(a['max'], 2)} | {f(b['median'], 2)} | {f(b['p10'], 2)} - "
                 f"{f(b['p90'], 2)} | {f(b['min'], 2)} - {f(b['max'], 2)} |")
    c = o["cold_first_forward"]
    L.append(f"\nfresh process: first 1-token forward {f(c['first_forward_ms']['median'], 2)} ms, the next "
             f"{f(c['next_forward_ms']['median'], 2)} ms (median of {c['first_forward_ms']['n']})\n")
L.append(f"total run time {info['total_s']} s; {len(info['disturbances'])} samples with a build/test running")
open(f"{res}/summary.md", "w").write("\n".join(L) + "\n")
print("\n".join(L))
PY
}
if [[ ${1:-} == --tables-only ]]; then plots_and_tables; exit 0; fi

mkdir -p "$WORK/bin" "$RESULTS" "$PLOTS"
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" >&2; }

# ---- the model and the binaries ----
if [[ ! -f $MODEL ]]; then
  build/apps/cleave make-model --vocab models/vocab/ggml-vocab-llama-spm.gguf --dim 768 --layers 12 \
    --heads 12 --kv-heads 4 --ffn 2048 --type f16 --ctx 1024 -o "$MODEL"
fi
cp build/apps/cleave "$WORK/bin/cleave"
[[ ${SKIP_ROOFLINE:-0} == 1 ]] || cp build/bench/cleave_bench "$WORK/bin/cleave_bench"
CLEAVE=$WORK/bin/cleave
export CLEAVE_CLUSTER_SECRET=serve-bench-$RANDOM$RANDOM

# ---- a quiet machine, and a watch on it ----
busy() { pgrep -f "$BUSY_RE" >/dev/null; }
if (( QUIET_S > 0 )); then
  log "waiting for ${QUIET_S} s without '$BUSY_RE'"
  quiet=0 waited=0
  while (( quiet < QUIET_S )); do
    if busy; then quiet=0; else quiet=$((quiet + 1)); fi
    sleep 1; waited=$((waited + 1))
    (( waited < QUIET_MAX_S )) || { log "still busy after $QUIET_MAX_S s; running anyway"; break; }
  done
  log "quiet after $waited s"
fi
T_START=$(date +%s)
echo setup > "$WORK/phase"
: > "$WORK/disturb.log"
( set +e +o pipefail
  while true; do
    if pgrep -f "$BUSY_RE" >/dev/null; then
      p=$(pgrep -af "$BUSY_RE" | cut -c1-160 | head -3 | tr '\n' ';')
      echo "$(date +%s) $(cat "$WORK/phase") $p" >> "$WORK/disturb.log"
    fi
    sleep 2
  done ) &
WATCH_PID=$!

PIDS=()
stop_all() {
  local p i
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill -TERM "${PIDS[i]}" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do
    for _ in $(seq 200); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  PIDS=()
}
trap 'stop_all; kill $WATCH_PID 2>/dev/null || true' EXIT

# ---- 1. the physical limit ----
if [[ ${SKIP_ROOFLINE:-0} != 1 ]]; then
  echo roofline > "$WORK/phase"
  log "cleave_bench --types f16"
  "$WORK/bin/cleave_bench" --types f16 --workdir "$WORK/cleave_bench" --json "$RESULTS/cleave_bench.json" \
    | tee "$WORK/cleave_bench.txt"
fi

# ---- 2. the topologies ----
cat > "$WORK/p1d1_3nodes.lua" <<'EOF'
-- 1 P + 1 D on three processes: "head" (router, kv_store, HTTP; no engine),
-- "p0" prefills, "d0" decodes.
cluster { router = "least_loaded_prefix" }
local function at(name, t)
  t.name = name
  t.host = param(name .. "_host", "127.0.0.1")
  t.port = param(name .. "_port", 0)
  return t
end
node(at("head", { head = true, actors = { kv_store = 1 }, kv = { tier0 = 256 * MiB } }))
node(at("p0", { actors = { prefill = 1 } }))
node(at("d0", { actors = { decode = 1 } }))
EOF

wait_line() {  # FILE REGEX SECONDS -> the first match's group 1 on stdout
  local i
  for ((i = 0; i < $3 * 10; i++)); do
    if m=$(sed -n -E "s#.*$2.*#\\1#p" "$1" | head -1) && [[ -n $m ]]; then echo "$m"; return 0; fi
    sleep 0.1
  done
  echo "no '$2' in $1 after $3 s:" >&2; tail -20 "$1" >&2; return 1
}
metric() { curl -s "$URL/metrics" | sed -n -E "s/^$1 ([0-9.e+]+)$/\\1/p" | head -1; }
wait_stages() {  # PREFILL DECODE COLOCATED: the router sees every stage alive
  local i
  for ((i = 0; i < 600; i++)); do
    [[ $(metric 'cleave_actor_stat\{actor="router",name="alive_prefill"\}') == "$1" &&
       $(metric 'cleave_actor_stat\{actor="router",name="alive_decode"\}') == "$2" &&
       $(metric 'cleave_actor_stat\{actor="router",name="alive_colocated"\}') == "$3" ]] && return 0
    sleep 0.1
  done
  echo "stages not alive after 60 s" >&2; return 1
}
serve() {  # LOG ARGS...
  local log=$1; shift
  "$CLEAVE" serve -m "$MODEL" --port 0 --parallel $PARALLEL --metrics "$@" > "$log" 2>&1 &
  PIDS+=($!)
  URL=$(wait_line "$log" 'listening on (http://[0-9.]+:[0-9]+)' 60)
}
run_node() {  # LOG SCRIPT NAME ARGS...
  local log=$1 script=$2 name=$3; shift 3
  "$CLEAVE" node --topology "$script" --name "$name" -m "$MODEL" -t 1 --max-seqs $PARALLEL "$@" \
    > "$log" 2>&1 &
  PIDS+=($!)
}
start_topology() {
  local t=$1 d=$WORK/$1 port
  mkdir -p "$d"
  case $t in
    mono) serve "$d/serve.log" --topology mono -t 2; CMD="cleave serve --topology mono -t 2" ;;
    colocated) serve "$d/serve.log" --topology colocated --colocated-actors 2 -t 1
      CMD="cleave serve --topology colocated --colocated-actors 2 -t 1" ;;
    pd) serve "$d/serve.log" --topology pd --prefill-actors 1 --decode-actors 1 -t 1
      CMD="cleave serve --topology pd --prefill-actors 1 --decode-actors 1 -t 1" ;;
    pd_2nodes)
      run_node "$d/prefill.log" examples/pd_2nodes.lua prefill --http-port 0 --metrics
      port=$(wait_line "$d/prefill.log" 'head listening on [0-9.]+:([0-9]+)' 60)
      URL=$(wait_line "$d/prefill.log" 'listening on (http://[0-9.]+:[0-9]+)' 60)
      run_node "$d/decode.log" examples/pd_2nodes.lua decode --set prefill_port="$port"
      CMD="cleave node --topology examples/pd_2nodes.lua --name prefill --http-port 0 -t 1; cleave node ... --name decode --set prefill_port=P -t 1" ;;
    pd_3nodes)
      run_node "$d/head.log" "$WORK/p1d1_3nodes.lua" head --http-port 0 --metrics
      port=$(wait_line "$d/head.log" 'head listening on [0-9.]+:([0-9]+)' 60)
      URL=$(wait_line "$d/head.log" 'listening on (http://[0-9.]+:[0-9]+)' 60)
      run_node "$d/p0.log" "$WORK/p1d1_3nodes.lua" p0 --set head_port="$port"
      run_node "$d/d0.log" "$WORK/p1d1_3nodes.lua" d0 --set head_port="$port"
      CMD="cleave node --topology p1d1_3nodes.lua --name head|p0|d0 -t 1 (head: --http-port 0)" ;;
    *) echo "unknown topology $t" >&2; exit 2 ;;
  esac
  local i
  for ((i = 0; i < 600; i++)); do
    [[ $(curl -s -o /dev/null -w '%{http_code}' "$URL/health") == 200 ]] && break
    sleep 0.1
  done
  case $t in
    mono) ;;
    colocated) wait_stages 0 0 2 ;;
    *) wait_stages 1 1 0 ;;
  esac
  MODEL_NAME=$(curl -s "$URL/v1/models" | $PY -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
}

bench() {  # VOCAB_SHIFT ARGS...: serve_bench.py on the dataset, token ids shifted
  local s=$1; shift
  $PY bench/serve/serve_bench.py --base-url "$URL" --model "$MODEL_NAME" "${DATASET[@]}" \
    --vocab-range "$((VOCAB_LO + s)),$((VOCAB_HI + s))" --request-timeout 600 "$@"
}

IFS=, read -r -a RATE_LIST <<< "$RATES"
TOPO_META=()
for t in $TOPOLOGIES; do
  echo "$t" > "$WORK/phase"
  before=$(date +%s)
  busy_at_start=$(busy && echo true || echo false)
  load_at_start=$(cut -d' ' -f1-3 /proc/loadavg)
  log "$t: starting"
  start_topology "$t"
  log "$t: ready at $URL ($CMD)"
  d=$WORK/$t
  # warm-up: other prompts (seed 1000, ids shifted by 0 but other lengths)
  bench 0 --seed 1000 --num-prompts "$WARMUP" --request-rate inf --max-concurrency 1 \
    --json "$d/warmup.json" > "$d/warmup.txt"
  # capacity: every request at once, at most CAP_CONCURRENCY in flight
  bench $(( ${#RATE_LIST[@]} + 1 )) --num-prompts "$NUM_PROMPTS" --request-rate inf \
    --max-concurrency "$CAP_CONCURRENCY" --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" \
    --label "$t" --json "$d/capacity.json" | tee "$d/capacity.txt" >&2
  k=0
  for r in "${RATE_LIST[@]}"; do
    k=$((k + 1))
    bench "$k" --num-prompts "$NUM_PROMPTS" --request-rate "$r" \
      --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" --label "$t" \
      --json "$d/rate$k.json" | tee "$d/rate$k.txt" >&2
  done
  hits=$(metric cleave_prefix_cache_hits_total); queries=$(metric cleave_prefix_cache_queries_total)
  stop_all
  after=$(date +%s)
  busy_at_end=$(busy && echo true || echo false)
  log "$t: done in $((after - before)) s (prefix cache hits $hits of $queries prompt tokens)"
  $PY - "$d" "$RESULTS/$t.json" "$t" "$CMD" "${#RATE_LIST[@]}" "$hits" "$queries" \
      "$VOCAB_LO" "$VOCAB_HI" "$before" "$after" <<'PY'
import json, sys
d, out, label, cmd, n, hits, queries, lo, hi, t0, t1 = sys.argv[1:]
n, lo, hi = int(n), int(lo), int(hi)
parts = [json.load(open(f"{d}/rate{k}.json")) for k in range(1, n + 1)]
doc = parts[0]
doc["config"]["request_rate"] = None
doc["config"]["sweep_rates"] = ",".join(str(p["runs"][0]["request_rate"]) for p in parts)
doc["config"]["vocab_range"] = None
doc["runs"] = [p["runs"][0] for p in parts]
for k, run in enumerate(doc["runs"], 1):
    run["vocab_range"] = [lo + k, hi + k]
cap = json.load(open(f"{d}/capacity.json"))["runs"][0]
cap["vocab_range"] = [lo + n + 1, hi + n + 1]
doc["capacity"] = cap
doc["topology_command"] = cmd
doc["prefix_cache"] = {"hits_tokens": float(hits) if hits else None,
                       "queries_tokens": float(queries) if queries else None}
doc["wall"] = {"start": int(t0), "end": int(t1)}
json.dump(doc, open(out, "w"), indent=1, allow_nan=False)
open(out, "a").write("\n")
PY
  TOPO_META+=("$t:$before:$after:$busy_at_start:$busy_at_end:$load_at_start")
done

# ---- 3. server overhead ----
if [[ ${SKIP_OVERHEAD:-0} != 1 ]]; then
  echo overhead > "$WORK/phase"
  log "overhead.py, $OVERHEAD_N requests"
  $PY bench/serve/overhead.py --cleave "$CLEAVE" --model "$MODEL" --threads 2 --parallel $PARALLEL \
    --num-requests "$OVERHEAD_N" --vocab-range "$VOCAB_LO,$VOCAB_HI" "${DATASET[@]}" \
    --work "$WORK/overhead" --json "$RESULTS/overhead.json" | tee "$WORK/overhead.txt" >&2
fi
echo done > "$WORK/phase"
T_END=$(date +%s)
kill $WATCH_PID 2>/dev/null || true

# ---- 4. run info, plots and the tables ----
$PY - "$RESULTS" "$WORK" "$T_START" "$T_END" "$SLO_TTFT_MS" "$SLO_TPOT_MS" "$RATES" "$NUM_PROMPTS" \
    "${TOPO_META[@]}" <<'PY'
import json, os, platform, subprocess, sys
res, work, t0, t1, slo_ttft, slo_tpot, rates, nprompts, *meta = sys.argv[1:]
dist = []
for line in open(f"{work}/disturb.log"):
    ts, phase, *rest = line.rstrip("\n").split(" ", 2)
    dist.append({"t": int(ts) - int(t0), "phase": phase, "procs": " ".join(rest)})
topos = []
for m in meta:
    name, a, b, busy0, busy1, load = m.split(":", 5)
    seen = [x for x in dist if x["phase"] == name]
    topos.append({"topology": name, "start_s": int(a) - int(t0), "wall_s": int(b) - int(a),
                  "busy_at_start": busy0 == "true", "busy_at_end": busy1 == "true",
                  "loadavg_at_start": load, "build_or_test_seen": len(seen) > 0,
                  "first_seen_s": seen[0]["t"] if seen else None})
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
info = {"started": int(t0), "total_s": int(t1) - int(t0), "cpu": cpu, "cpus": os.cpu_count(),
        "kernel": platform.release(), "git_head": git, "slo_ttft_ms": float(slo_ttft),
        "slo_tpot_ms": float(slo_tpot), "rates": rates, "num_prompts": int(nprompts),
        "topologies": topos, "disturbances": dist}
json.dump(info, open(f"{res}/run_info.json", "w"), indent=1)
print(f"total {int(t1) - int(t0)} s; {len(dist)} samples with a build/test running")
PY

plots_and_tables
log "done: $RESULTS, $PLOTS"
