#!/usr/bin/env bash
# The whole tree built with Clang into build-clang/ (the library, examples, benchmarks and tests, with
# the build's -Wall -Wextra), then the CPU tests run there (D96). A developer's check, like tsan.sh:
# CI compiles only the examples and README's example with Clang (ctest clang_syntax). Extra arguments
# go to ctest (e.g. -R HybridAdam). Clang's OpenMP is LLVM's libomp; LibTorch's wheel brings GNU's
# libgomp: both load, each with its own threads (D96 says what was checked).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build-clang}
command -v clang++ >/dev/null || { echo "clang_check: no clang++ on PATH (apt-get install clang libomp-dev)" >&2; exit 1; }
if [[ -f "$build/CMakeCache.txt" ]] && ! grep -q "CMAKE_CXX_COMPILER:.*clang" "$build/CMakeCache.txt"; then
  echo "clang_check: $build was configured with another compiler; remove it or set BUILD_DIR" >&2
  exit 1
fi
CC=clang CXX=clang++ BUILD_DIR=$build "$root/scripts/build.sh"
ctest --test-dir "$build" --output-on-failure -j "${FERRY_JOBS:-$(getconf _NPROCESSORS_ONLN)}" -L cpu "$@"
