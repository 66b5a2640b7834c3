#!/usr/bin/env bash
# Fuzzes the Cap'n Proto decoder (tests/schema/fuzz/fuzz_codec.cpp) with
# libFuzzer + ASan + UBSan in a clang build of its own.
#   scripts/fuzz.sh [SECONDS=600] [BUILD_DIR=build-fuzz]
# Builds only the fuzz targets, seeds the corpus with one encoded example of
# every message kind, runs for SECONDS and prints the exec count. Exits
# non-zero when the fuzzer finds a crash, leak, UB or timeout (the input is
# saved under BUILD_DIR/artifacts/).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-600}
build=${2:-$root/build-fuzz}
mkdir -p "$build"
build=$(cd "$build" && pwd)

if [[ ! -f $build/CMakeCache.txt ]]; then
  # Storage's RocksDB tier, CUDA and the test suites are not needed here.
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCLEAVE_FUZZ=ON -DCLEAVE_CUDA=OFF -DCLEAVE_STORAGE=OFF -DBUILD_TESTING=OFF >"$build/configure.log" 2>&1 ||
    { cat "$build/configure.log"; exit 1; }
fi
cmake --build "$build" -j2 --target fuzz_codec fuzz_codec_seeds >"$build/build.log" 2>&1 ||
  { tail -50 "$build/build.log"; exit 1; }

seeds=$build/seeds corpus=$build/corpus artifacts=$build/artifacts
mkdir -p "$seeds" "$corpus" "$artifacts"
"$build/schema/fuzz_codec_seeds" "$seeds"

log=$build/fuzz.log
set +e
"$build/schema/fuzz_codec" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "$corpus" "$seeds" >"$log" 2>&1
rc=$?
set -e
execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
seconds_run=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
if [[ $rc -ne 0 ]]; then
  tail -60 "$log"
  echo "fuzz_codec: FAILED (exit $rc) after ${execs:-?} execs; artifacts in $artifacts" >&2
  exit 1
fi
echo "fuzz_codec: ${execs:-?} execs in $seconds s (${seconds_run:-?} execs/s), 0 crashes," \
  "corpus $(ls "$corpus" | wc -l) inputs"
