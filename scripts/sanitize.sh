#!/usr/bin/env bash
# The sanitizer runs, each in a build tree of its own (CLEAVE_DEBUG_INFO=-g1:
# line tables, so every report names file:line).
#
#   scripts/sanitize.sh asan-unit   [BUILD_DIR=build-asan]   (in .ci/run)
#       ASan + UBSan over the libraries without actors: the kernels, the
#       engine (model/), storage, the Cap'n Proto codec, the JSONL front end
#       and the planner, every case of their doctest suites. About 20 min
#       on 2 cores from cold (18 of them building).
#   scripts/sanitize.sh tsan-storage [BUILD_DIR=build-tsan]  (in .ci/run)
#       ThreadSanitizer on the storage concurrency tests: racing
#       publishers, put/get with the background worker, the prefetch queue,
#       threads on one MemoryTier and on RocksDB. About 1 min from cold.
#   scripts/sanitize.sh asan        [BUILD_DIR=build-asan]
#       The whole suite (every ctest test, the node processes too) under
#       ASan + UBSan. Roughly an hour on 2 cores from cold: a developer's run
#       before a change to actors/, server/ or jobs/.
#   scripts/sanitize.sh tsan        [BUILD_DIR=build-tsan]
#       tsan-storage, then every case of the in-process actor tests, the
#       HTTP server and the job runner against CAF built with TSan
#       (.ci/caf_tsan.sh; 8-12 min once, then cached). About 50 min from
#       cold, 35 of them the actor tests.
#
# The packages come from scripts/setup.sh (run it, or scripts/test.sh, first).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

asan_configure() {
  cmake -S . -B "$1" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCLEAVE_SANITIZE=ON \
    -DCLEAVE_WERROR=ON -DCLEAVE_DEBUG_INFO=-g1 >/dev/null
}
tsan_configure() {
  cmake -S . -B "$1" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCLEAVE_TSAN=ON -DCLEAVE_WERROR=ON \
    -DCLEAVE_CUDA=OFF -DCLEAVE_DEBUG_INFO=-g1 >/dev/null
}

# Runs doctest binaries of BUILD/tests two at a time (their ctest working
# folder); fails if any fails, after all have run.
run_suites() {
  local build=$1; shift
  local failed=0 pids=() names=()
  for t in "$@"; do
    (cd "$build/tests" && "./$t" --no-intro=true > "$t.sanitize.log" 2>&1) &
    pids+=($!); names+=("$t")
    if ((${#pids[@]} == 2)); then
      wait_one || failed=1
    fi
  done
  while ((${#pids[@]})); do wait_one || failed=1; done
  return $failed
}
wait_one() {
  local pid=${pids[0]} name=${names[0]} rc=0
  wait "$pid" || rc=$?
  pids=("${pids[@]:1}"); names=("${names[@]:1}")
  local log=$build/tests/$name.sanitize.log
  if ((rc)); then
    echo "== $name FAILED (exit $rc):"; tail -60 "$log"; return 1
  fi
  echo "== $name: $(grep -E '^\[doctest\] (test cases|assertions)' "$log" | tr '\n' ' ')"
}

case $mode in
  asan-unit)
    build=${2:-build-asan}
    suites=(test_kernels test_model test_storage test_schema test_frontend test_planner)
    asan_configure "$build"
    start=$SECONDS
    cmake --build "$build" -j"$(nproc)" --target "${suites[@]}"
    echo "== asan-unit: built in $((SECONDS - start)) s"
    run_suites "$build" "${suites[@]}"
    echo "== asan-unit: done in $((SECONDS - start)) s"
    ;;
  tsan-storage)
    build=${2:-build-tsan}
    tsan_configure "$build"
    start=$SECONDS
    cmake --build "$build" -j"$(nproc)" --target test_storage
    TSAN_OPTIONS=halt_on_error=1 "$build/tests/test_storage" --no-intro=true \
      -tc="*concurrent*,*threads*,*background*"
    echo "== tsan-storage: done in $((SECONDS - start)) s"
    ;;
  asan)
    BUILD_DIR=${2:-build-asan} scripts/test.sh -DCLEAVE_SANITIZE=ON -DCLEAVE_WERROR=ON \
      -DCLEAVE_DEBUG_INFO=-g1
    ;;
  tsan)
    build=${2:-build-tsan}
    "$0" tsan-storage "$build"
    cmake --build "$build" -j"$(nproc)" --target test_actors test_server test_jobs
    # The actor tests need CAF itself instrumented: Debian's libcaf is not,
    # and TSan then reports every message between actors (.ci/caf_tsan.sh).
    caf_tsan=$(.ci/caf_tsan.sh)
    if ! LD_LIBRARY_PATH=$caf_tsan ldd "$build/tests/test_actors" |
         grep -q "libcaf_core.so.* => $caf_tsan/"; then
      echo "test_actors does not load the TSan build of CAF from $caf_tsan" >&2
      exit 1
    fi
    export LD_LIBRARY_PATH=$caf_tsan TSAN_OPTIONS=halt_on_error=1
    # Every case: the pipelines of each kind, the router's policies, P:D
    # role switches, drain, autoscale, KV streams and sockets, experts,
    # pipeline stages; the HTTP server's threads and routes; the job runner.
    for t in test_actors test_server test_jobs; do
      (cd "$build/tests" && "./$t" --no-intro=true)
    done
    ;;
  *) usage ;;
esac
