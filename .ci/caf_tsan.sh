#!/usr/bin/env bash
# Builds CAF 0.17.6 (libcaf_core, libcaf_io) with ThreadSanitizer from
# Debian's source package and prints the folder that holds the two shared
# libraries. The TSan actor tests run with LD_LIBRARY_PATH set to it.
#
# Why: Debian's libcaf is not instrumented, so TSan sees none of the
# synchronisation inside it (mailbox CAS, work-stealing queues, reference
# counts). Every message then looks like a race between its sender and its
# receiver (hundreds of reports per test, in cleave's frames as much as in
# CAF's), and suppressions wide enough to hide them would hide every race
# between actors too. The instrumented build has the same soname, version
# and headers as the installed one (libcaf-dev 0.17.6), so the test binary
# runs unchanged against it.
#
# Cached: ${CLEAVE_CAF_TSAN_DIR:-~/.cache/cleave/caf-0.17.6-tsan}; the build
# goes through ccache when it is there: 8-12 min on 2 cores when cold, 40 s
# with ccache warm, nothing when cached.
# usage: .ci/caf_tsan.sh   (prints the library folder on stdout, logs on stderr)
set -euo pipefail
VERSION=0.17.6
ORIG_SHA256=e2bf5bd243f08bb7d8adde197cfe3e6d71314ed3378fe0692f8932f4c3b3928c
DEST=${CLEAVE_CAF_TSAN_DIR:-${HOME:-/root}/.cache/cleave/caf-$VERSION-tsan}
STAMP="caf $VERSION tsan 1"  # bump when the build below changes

if [ -f "$DEST/lib/stamp" ] && [ "$(cat "$DEST/lib/stamp")" = "$STAMP" ]; then
  echo "$DEST/lib"
  exit 0
fi

installed=$(dpkg-query -W -f='${Version}' libcaf-dev 2>/dev/null || true)
case "$installed" in
  "$VERSION"-*) ;;
  *) echo "caf_tsan: libcaf-dev is '${installed:-not installed}', not $VERSION: the headers would not match" >&2
     exit 1 ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# Debian's source index, read with a private apt configuration (the system's
# sources, as deb-src) so that nothing under /etc changes.
mkdir -p parts lists/partial archives/partial
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] && sed -E 's/^Types:.*/Types: deb-src/' "$f" > "parts/$(basename "$f")"
done
if [ -f /etc/apt/sources.list ]; then
  sed -nE 's/^deb (.*)/deb-src \1/p' /etc/apt/sources.list > parts/list.list
fi
apt_opts=(-o Dir::Etc::SourceParts="$work/parts" -o Dir::Etc::SourceList="$work/none.list"
          -o Dir::State::Lists="$work/lists" -o Dir::Cache::Archives="$work/archives"
          -o APT::Sandbox::User=root)
echo "caf_tsan: fetching Debian's actor-framework source" >&2
apt-get "${apt_opts[@]}" -qq update >&2
# Only the upstream tarball is needed (Debian's one header fix is applied
# below); apt-get fails when the Debian part is missing from the mirror.
apt-get "${apt_opts[@]}" -qq source --download-only actor-framework > apt-source.log 2>&1 || true
orig=actor-framework_$VERSION.orig.tar.gz
if [ ! -f "$orig" ] || ! echo "$ORIG_SHA256  $orig" | sha256sum -c --quiet - >&2; then
  cat apt-source.log >&2
  echo "caf_tsan: could not fetch $orig (or its checksum differs)" >&2
  exit 1
fi
tar xzf "$orig"
src=$work/actor-framework-$VERSION
# Debian's patch: receive_buffer.hpp uses std::numeric_limits without <limits>.
sed -i 's|#include <cstddef>|#include <cstddef>\n#include <limits>|' \
  "$src/libcaf_io/caf/io/network/receive_buffer.hpp"
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v cmake);-E;env;CCACHE_BASEDIR=$work;CCACHE_NOHASHDIR=1;$(command -v ccache)")
fi
echo "caf_tsan: building libcaf_core and libcaf_io with -fsanitize=thread" >&2
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread \
  -DCAF_NO_EXAMPLES=yes -DCAF_NO_UNIT_TESTS=yes -DCAF_NO_OPENSSL=yes -DCAF_NO_OPENCL=yes \
  -DCAF_NO_TOOLS=yes -DCAF_NO_PYTHON=yes -DCAF_NO_COMPILER_CHECK=yes -DCAF_NO_SUMMARY=yes \
  "${launcher[@]}" >&2
cmake --build "$work/build" -j"$(nproc)" --target libcaf_core_shared libcaf_io_shared >&2
mkdir -p "$DEST/lib"
cp -P "$work"/build/lib/libcaf_core.so* "$work"/build/lib/libcaf_io.so* "$DEST/lib/"
echo "$STAMP" > "$DEST/lib/stamp"
echo "$DEST/lib"
