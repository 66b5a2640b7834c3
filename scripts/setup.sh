#!/usr/bin/env bash
# Installs what is missing (Debian 12), then configures and builds cleave.
# Usage: scripts/setup.sh [BUILD_DIR] [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
shift || true

PACKAGES=(build-essential cmake pkg-config ccache doctest-dev nlohmann-json3-dev libcli11-dev
          librocksdb-dev libxxhash-dev python3 python3-numpy libcaf-dev capnproto libcapnp-dev
          clang libclang-rt-14-dev liblua5.4-dev libstb-dev libboost-dev prometheus python3-aiohttp
          python3-matplotlib iproute2)
missing=()
# The HTTP tests drive the server with the official openai npm package: a
# machine without Node.js gets Debian's (one that has it keeps its own npm).
command -v npm >/dev/null || missing+=(nodejs npm)
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The official openai client for the server tests (tests/server/js), pinned by its lock file.
if [ ! -d tests/server/js/node_modules/openai ]; then
  (cd tests/server/js && npm ci --no-audit --no-fund --loglevel=error)
fi

cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)"
