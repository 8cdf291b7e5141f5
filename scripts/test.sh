#!/usr/bin/env bash
# The whole test suite: set-up, build into build/, then every ctest test.
# Tests labelled `gpu` skip (GTEST_SKIP) where no GPU is present.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
start=$(date +%s)
"$root/scripts/build.sh" "$@"
ctest --test-dir "${BUILD_DIR:-$root/build}" --output-on-failure -j "${FERRY_JOBS:-$(nproc)}"
echo "[ferry test] finished in $(( $(date +%s) - start )) s"
