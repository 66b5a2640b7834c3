#!/usr/bin/env bash
# Build the CUDA backend and its tests, then run them on the GPU (H200).
# Usage: scripts/gpu_check.sh [build-dir]      (default build-gpu)
# Env:   BUILD_TYPE (default Release), JOBS (default: nproc),
#        TEST_TIMEOUT seconds per test executable (default 600).
# Prints every command it runs; exits non-zero if the build or a test fails.
set -uo pipefail

cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build-gpu}
BUILD_TYPE=${BUILD_TYPE:-Release}
JOBS=${JOBS:-$(nproc)}
TEST_TIMEOUT=${TEST_TIMEOUT:-600}

run() {
  echo "+ $*" >&2
  "$@"
}

echo "== gpu_check: $(date -u +%FT%TZ) in $(pwd)"
if command -v nvidia-smi >/dev/null; then
  run nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
else
  echo "warning: nvidia-smi not found"
fi

# CMake packages the configure step needs; install what is missing, but go on
# without network (the configure step will then say what is absent).
missing=()
for pkg in doctest-dev nlohmann-json3-dev libcli11-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "== installing missing packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo"
  run $SUDO apt-get update -qq || echo "warning: apt-get update failed (no network?)"
  run $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    "${missing[@]}" || echo "warning: apt-get install failed; continuing"
fi

NVCC=/usr/local/cuda/bin/nvcc
[ -x "$NVCC" ] || NVCC=$(command -v nvcc || true)
[ -n "$NVCC" ] || { echo "error: nvcc not found"; exit 2; }
run "$NVCC" --version | tail -1

echo "== configure + build ($BUILD_TYPE, -j$JOBS)"
mkdir -p "$BUILD_DIR"
# The GPU machine may lack RocksDB; storage/ is not needed for these tests.
extra=()
dpkg -s librocksdb-dev >/dev/null 2>&1 || extra+=(-DCLEAVE_STORAGE=OFF)
run cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
  -DCMAKE_CUDA_COMPILER="$NVCC" "${extra[@]}" 2>&1 | tee "$BUILD_DIR/gpu_check_configure.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
grep -q "CUDA backend ON" "$BUILD_DIR/gpu_check_configure.log" ||
  { echo "error: CMake did not enable the CUDA backend"; exit 1; }
targets=(test_cuda cleave)
ls tests/kernels/*.cpp >/dev/null 2>&1 && targets+=(test_kernels)
run cmake --build "$BUILD_DIR" -j"$JOBS" --target "${targets[@]}" || exit 1

status=0
echo "== test_cuda (CUDA backend vs CPU backend op by op with both matmuls (tensor cores, FMA), the engine on cuda:0 against the CPU engine, batch invariance, IPC between two processes, KV handed GPU to GPU between two processes by the kv actors, NCCL ids and join timeout, the device checksum, the kv_store tiers on the device, benchmarks)"
run timeout "$TEST_TIMEOUT" "$BUILD_DIR/tests/test_cuda" --duration=true 2>&1 | tee "$BUILD_DIR/gpu_check_test_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== cleave generate --device cuda:0 against --device cpu (greedy, 24 tokens)"
gen_model="$BUILD_DIR/gpu_check_model.gguf"
if run "$BUILD_DIR/apps/cleave" make-model --out "$gen_model" --vocab models/vocab/ggml-vocab-llama-spm.gguf \
    --dim 256 --layers 4 --heads 8 --kv-heads 4 --ffn 512 --ctx 256 --type f16; then
  for dev in cpu cuda:0; do
    run timeout "$TEST_TIMEOUT" "$BUILD_DIR/apps/cleave" generate -m "$gen_model" --device "$dev" \
      --prompt-ids 1,50,60,70,80,90,100 -n 24 --temp 0 --ignore-eos --json > "$BUILD_DIR/gpu_check_gen_$dev.json" ||
      status=1
    cat "$BUILD_DIR/gpu_check_gen_$dev.json"
  done
else
  status=1
fi
echo "== P/D on cuda:0 across two cleave node processes (tokens equal generate on cuda:0; KV GPU to GPU through CUDA IPC)"
run timeout "$TEST_TIMEOUT" /usr/bin/python3 tests/nodes/check_pd_device.py "$BUILD_DIR/apps/cleave" "$gen_model" cuda:0 ||
  status=1
if [ -x "$BUILD_DIR/tests/test_kernels" ]; then
  echo "== test_kernels (CPU backend)"
  run timeout "$TEST_TIMEOUT" "$BUILD_DIR/tests/test_kernels" || status=1
fi
if grep -q "SKIPPED: no GPU" "$BUILD_DIR/gpu_check_test_cuda.log"; then
  echo "warning: test_cuda found no GPU: the CUDA cases were skipped, not run"
  status=1
fi
echo "== gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
