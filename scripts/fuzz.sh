#!/usr/bin/env bash
# libFuzzer targets (ASan + UBSan, clang) in a build of their own:
#   codec     tests/schema/fuzz/fuzz_codec.cpp  schema/codec.h: every decoder, and
#                                               what decodes re-encodes and decodes again
#   gguf      tests/fuzz/fuzz_gguf.cpp          model/gguf.h: parse and open, typed getters
#   image     tests/fuzz/fuzz_image.cpp         model/image.h: PNG/JPEG decode under limits
#   topology  tests/fuzz/fuzz_topology.cpp      actors/topology.h: Lua scripts in the sandbox
#   request   tests/fuzz/fuzz_request.cpp       frontend/request_codec.h: JSONL request lines
#   openai    tests/fuzz/fuzz_openai.cpp        server/openai_request.h: OpenAI bodies, the engine
#                                               requests they build, the response builders
#
#   scripts/fuzz.sh TARGET [SECONDS=600] [BUILD_DIR=build-fuzz]
#       The long random run: a random seed, for SECONDS, over the corpus kept
#       in BUILD_DIR/corpus/TARGET (grows from run to run), the seeds and the
#       regression inputs. Exits non-zero on a crash, leak, UB or timeout; the
#       input is saved under BUILD_DIR/artifacts/TARGET/.
#   scripts/fuzz.sh ci TARGET|all [BUILD_DIR=build-fuzz]
#       Deterministic (ctest fuzz_TARGET): seed 1 and a fixed run count per
#       target (RUNS below) over the seeds and tests/fuzz/regressions/TARGET/,
#       new inputs into an empty folder. Prints the execs, coverage and new
#       inputs of each target; fails if any target fails.
#   scripts/fuzz.sh build [BUILD_DIR=build-fuzz]
#       Configures (clang, -DCLEAVE_FUZZ=ON, first time only) and builds every
#       target, and writes the seed corpora under BUILD_DIR/seeds/ (ctest
#       fuzz_build, the fixture of the fuzz_* tests). The other modes build
#       first too. FUZZ_DEBUG_INFO (-g, -g1, -g0; read when the build is
#       first configured) sets its debug info, -g by default.
#
# Seeds are written by the build from the code itself (fuzz_codec_seeds,
# fuzz_seeds) or copied (examples/*.lua, examples/*.png). Every input that
# ever made a target fail goes into tests/fuzz/regressions/TARGET/ with a
# doctest beside the library's tests, so CI replays it on every run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
targets=(codec gguf image topology request openai)
# Deterministic run counts: each target's ci run takes 5-25 s on one core.
declare -A RUNS=([codec]=60000 [gguf]=40000 [image]=40000 [topology]=16000 [request]=20000
                [openai]=13000)
declare -A BIN=([codec]=schema/fuzz_codec [gguf]=tests/fuzz/fuzz_gguf
                [image]=tests/fuzz/fuzz_image [topology]=tests/fuzz/fuzz_topology
                [request]=tests/fuzz/fuzz_request [openai]=tests/fuzz/fuzz_openai)
# topology: print() in scripts writes to stderr; close it (libFuzzer keeps its own).
# openai: bodies up to 16 KiB (several messages, a data URL).
declare -A OPTS=([codec]="" [gguf]="" [image]="" [topology]="-close_fd_mask=2" [request]=""
                 [openai]="-max_len=16384")

usage() { sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

build() {
  mkdir -p "$build"
  local start=$SECONDS
  if [[ ! -f $build/CMakeCache.txt ]]; then
    # RocksDB, CUDA and the test suites are not needed here.
    CC=clang CXX=clang++ cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCLEAVE_DEBUG_INFO="${FUZZ_DEBUG_INFO:--g}" -DCLEAVE_FUZZ=ON -DCLEAVE_CUDA=OFF -DCLEAVE_STORAGE=OFF -DBUILD_TESTING=OFF \
      >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
  fi
  cmake --build "$build" -j"${FUZZ_JOBS:-2}" --target fuzz_codec fuzz_codec_seeds fuzz_gguf \
    fuzz_image fuzz_topology fuzz_request fuzz_openai fuzz_seeds >"$build/build.log" 2>&1 ||
    { tail -50 "$build/build.log"; exit 1; }
  rm -rf "$build/seeds"
  mkdir -p "$build"/seeds/{codec,gguf,image,topology,request,openai}
  "$build/schema/fuzz_codec_seeds" "$build/seeds/codec" >/dev/null
  "$build/tests/fuzz/fuzz_seeds" gguf "$build/seeds/gguf" >/dev/null
  "$build/tests/fuzz/fuzz_seeds" image "$build/seeds/image" >/dev/null
  "$build/tests/fuzz/fuzz_seeds" request "$build/seeds/request" >/dev/null
  "$build/tests/fuzz/fuzz_seeds" openai "$build/seeds/openai" >/dev/null
  cp "$root"/examples/*.png "$build/seeds/image/"
  cp "$root"/examples/*.lua "$build/seeds/topology/"
  echo "fuzz build: ${targets[*]} built and seeded in $((SECONDS - start)) s ($build)"
}

# Corpus folders a target reads: its seeds and its regression inputs.
inputs() {
  echo "$build/seeds/$1"
  [[ -d $root/tests/fuzz/regressions/$1 ]] && echo "$root/tests/fuzz/regressions/$1"
  return 0
}

stat_of() { sed -n "s/^stat::$1: *//p" "$2" | tail -1; }

# run TARGET LOG ARGS...: libFuzzer with the common options; on failure the
# log's end and where the input went.
run() {
  local t=$1 log=$2
  shift 2
  local artifacts=$build/artifacts/$t
  mkdir -p "$artifacts"
  # shellcheck disable=SC2086
  if ! $fixed "$build/${BIN[$t]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$artifacts/" ${OPTS[$t]} "$@" >"$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz_$t: FAILED after $(stat_of number_of_executed_units "$log") execs; input in" \
      "$artifacts/ (add it to tests/fuzz/regressions/$t/ with a doctest once fixed)" >&2
    return 1
  fi
}

ci() {
  local t=$1 out=$build/ci/$t log=$build/ci/$t.log
  rm -rf "$out"
  mkdir -p "$out"
  local dirs=() n_in=0 n_reg=0 start=$SECONDS
  mapfile -t dirs < <(inputs "$t")
  n_in=$(find "${dirs[@]}" -type f | wc -l)
  [[ -d $root/tests/fuzz/regressions/$t ]] && n_reg=$(find "$root/tests/fuzz/regressions/$t" -type f | wc -l)
  # Same seed, same run count, the same process image ($fixed), no reload.
  run "$t" "$log" -seed=1 -runs="${RUNS[$t]}" -reload=0 "$out" "${dirs[@]}" || return 1
  # "#60000 DONE cov: 2246 ft: 3801 corp: 203/77Kb ...": coverage at the end.
  local cov ft
  read -r cov ft < <(sed -nE 's/^#[0-9]+[[:space:]]+DONE +cov: ([0-9]+) ft: ([0-9]+).*/\1 \2/p' "$log")
  echo "fuzz_$t: seed 1, -runs=${RUNS[$t]}: $(stat_of number_of_executed_units "$log") execs" \
    "over $n_in inputs ($n_reg regressions), 0 crashes; coverage $cov edges, $ft features," \
    "$(stat_of new_units_added "$log") new inputs, peak $(stat_of peak_rss_mb "$log") MB," \
    "$((SECONDS - start)) s"
}

random_run() {
  local t=$1 seconds=$2 corpus=$build/corpus/$1 log=$build/$1.log dirs=()
  mkdir -p "$corpus"
  mapfile -t dirs < <(inputs "$t")
  run "$t" "$log" -max_total_time="$seconds" "$corpus" "${dirs[@]}" || exit 1
  echo "fuzz_$t: $(stat_of number_of_executed_units "$log") execs in $seconds s" \
    "($(stat_of average_exec_per_sec "$log") execs/s), 0 crashes, corpus $(ls "$corpus" | wc -l)" \
    "inputs, peak $(stat_of peak_rss_mb "$log") MB"
}

# ci runs: the same process every time. libFuzzer learns the operands of
# comparisons, addresses and descriptor numbers among them, so neither may
# move: no address-space randomisation, a fixed environment (its size shifts
# the stack) and no inherited descriptors (ctest leaves its log open, which
# shifts every fd a target opens). 255 is the one bash reads this script on.
fixed=""
if [[ ${1:-} == ci ]]; then
  fixed="env -i PATH=/usr/bin:/bin"
  setarch "$(uname -m)" -R true 2>/dev/null && fixed+=" setarch $(uname -m) -R"
  for fd in $(ls /proc/$$/fd); do
    [[ $fd -gt 2 && $fd -ne 255 ]] && eval "exec $fd>&-" 2>/dev/null || true
  done
fi

known() { [[ -n ${BIN[$1]:-} ]] || { echo "fuzz.sh: unknown target '$1' (${targets[*]})" >&2; exit 2; }; }
resolve() { mkdir -p "$1" && cd "$1" && pwd; }

case ${1:-} in
  build)
    build=$(resolve "${2:-$root/build-fuzz}")
    build
    ;;
  ci)
    [[ $# -ge 2 ]] || usage
    build=$(resolve "${3:-$root/build-fuzz}")
    [[ $2 == all ]] && which=("${targets[@]}") || { known "$2"; which=("$2"); }
    [[ -n ${FUZZ_NO_BUILD:-} ]] || build >/dev/null
    failed=0
    for t in "${which[@]}"; do ci "$t" || failed=1; done
    exit $failed
    ;;
  "" | -h | --help) usage ;;
  *)
    known "$1"
    build=$(resolve "${3:-$root/build-fuzz}")
    build >/dev/null
    random_run "$1" "${2:-600}"
    ;;
esac
