#!/usr/bin/env bash
# Builds the plain C++ core (csrc/core) with its parity test program (csrc/tests/test_core.cpp,
# which compares against a scalar reference written inside the program) and runs it:
#   1. natively (x86-64: AVX-512 / AVX2 / scalar paths the CPU supports; arm64: NEON + scalar),
#   2. cross-compiled for arm64 with Debian's aarch64-linux-gnu-g++, under qemu-aarch64 (NEON EXACT,
#      and FAST with sdot / i8mm usdot) on three emulated CPUs (see neon()).
# Usage: scripts/check_neon.sh [native|neon|all]   (default: all)
# Exit: 0 all ran and passed, 1 a build or a test failed, 77 a required tool is missing (skip).
# Tools: apt-get install -y g++ g++-aarch64-linux-gnu qemu-user
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CORE="$ROOT/csrc/core"
TESTS="$ROOT/csrc/tests"
OUT="${QK_BUILD_DIR:-$ROOT/build/check_core}"
WHAT="${1:-all}"
mkdir -p "$OUT"
# Every core source (csrc/core holds the library only; CMakeLists.txt lists the same files).
SRCS=("$CORE"/*.cpp "$TESTS/test_core.cpp")
FLAGS=(-O2 -std=c++17 -ffp-contract=fast -Wall -Wno-psabi -Wno-maybe-uninitialized -pthread
       -I"$CORE")
status=0

native() {
  local cxx="${CXX:-g++}"
  if ! command -v "$cxx" >/dev/null 2>&1; then
    echo "SKIP native: no C++ compiler ($cxx)"; return 77
  fi
  local arch=()
  case "$(uname -m)" in x86_64|amd64) arch=(-march=x86-64-v2) ;; esac
  echo "== native build ($(uname -m), $cxx ${arch[*]})"
  "$cxx" "${FLAGS[@]}" "${arch[@]}" "${SRCS[@]}" -o "$OUT/test_core_native" || return 1
  "$OUT/test_core_native" --quick || return 1
}

neon() {
  local cxx="${AARCH64_CXX:-aarch64-linux-gnu-g++}"
  if ! command -v "$cxx" >/dev/null 2>&1; then
    echo "SKIP neon: $cxx not found (apt-get install -y g++-aarch64-linux-gnu)"; return 77
  fi
  if ! command -v qemu-aarch64 >/dev/null 2>&1; then
    echo "SKIP neon: qemu-aarch64 not found (apt-get install -y qemu-user)"; return 77
  fi
  echo "== arm64 cross build ($cxx), run under qemu-aarch64"
  "$cxx" "${FLAGS[@]}" -static "${SRCS[@]}" -o "$OUT/test_core_arm64" || return 1
  local q=(env QEMU_LD_PREFIX=/usr/aarch64-linux-gnu qemu-aarch64)
  # Three emulated CPUs, so that the run-time pick of the NEON variant and every variant run:
  #   max         dotprod + i8mm: all variants forced in turn (neon-i8mm, neon-dotprod, neon-base)
  #   cortex-a76  dotprod only:   picks neon-dotprod, refuses neon-i8mm
  #   cortex-a53  neither:        picks plain neon (FAST requests run EXACT), refuses both
  echo "-- qemu-aarch64 -cpu max"
  "${q[@]}" -cpu max "$OUT/test_core_arm64" --quick --expect=neon-i8mm || return 1
  echo "-- qemu-aarch64 -cpu cortex-a76"
  "${q[@]}" -cpu cortex-a76 "$OUT/test_core_arm64" --quick --only=neon --expect=neon-dotprod \
    || return 1
  echo "-- qemu-aarch64 -cpu cortex-a53"
  "${q[@]}" -cpu cortex-a53 "$OUT/test_core_arm64" --quick --only=neon --expect=neon || return 1
  neon_clang
}

# Apple's compiler is Clang: when a clang++ is here, the same program cross-built with it (against
# the GCC cross toolchain's headers and libraries), run under qemu -cpu max and cortex-a53. Clang
# takes other paths in csrc/core (qk_permute's table lookup, the dot instructions by encoding).
# Optional: skipped without clang++.
neon_clang() {
  local clang="${AARCH64_CLANG:-}"
  if [ -z "$clang" ]; then
    for c in clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14; do
      command -v "$c" >/dev/null 2>&1 && { clang="$c"; break; }
    done
  fi
  local gccdir
  gccdir="$(dirname "$(aarch64-linux-gnu-g++ -print-libgcc-file-name 2>/dev/null)")"
  local cxxinc=(/usr/aarch64-linux-gnu/include/c++/*)
  if [ -z "$clang" ] || [ ! -d "$gccdir" ] || [ ! -d "${cxxinc[-1]}" ]; then
    echo "-- (no clang++ for the arm64 Clang build: skipped)"; return 0
  fi
  local v="${cxxinc[-1]##*/}"
  echo "== arm64 cross build ($clang), run under qemu-aarch64"
  # -ffp-contract=on after FLAGS' fast: what csrc/CMakeLists.txt gives Clang (see there).
  "$clang" --target=aarch64-linux-gnu "${FLAGS[@]}" -ffp-contract=on -Wno-unknown-warning-option -static \
    --gcc-toolchain=/usr \
    -isystem /usr/aarch64-linux-gnu/include -isystem "/usr/aarch64-linux-gnu/include/c++/$v" \
    -isystem "/usr/aarch64-linux-gnu/include/c++/$v/aarch64-linux-gnu" \
    -B"$gccdir" -L"$gccdir" "${SRCS[@]}" -o "$OUT/test_core_arm64_clang" || return 1
  echo "-- qemu-aarch64 -cpu max (clang)"
  "${q[@]}" -cpu max "$OUT/test_core_arm64_clang" --quick --only=neon,neon-dotprod \
    --expect=neon-i8mm || return 1
  echo "-- qemu-aarch64 -cpu cortex-a53 (clang)"
  "${q[@]}" -cpu cortex-a53 "$OUT/test_core_arm64_clang" --quick --only=neon --expect=neon \
    || return 1
}

run() {
  "$1"; local rc=$?
  if [ $rc -eq 77 ]; then
    [ $status -eq 0 ] && status=77
  elif [ $rc -ne 0 ]; then
    echo "FAILED: $1"; status=1
  fi
}

case "$WHAT" in
  native) run native ;;
  neon) run neon ;;
  all) run native; run neon ;;
  *) echo "usage: $0 [native|neon|all]"; exit 2 ;;
esac
exit $status
