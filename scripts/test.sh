#!/usr/bin/env bash
# The whole test suite (README's test command; .ci/run calls exactly this):
#  1. set-up, Release build into build/, every ctest test (tests labelled `gpu` skip without a GPU);
#  2. ferry's own code rebuilt with AddressSanitizer + UndefinedBehaviorSanitizer into build-asan/
#     (without examples and benchmarks), and the CPU tests run under it. FERRY_SANITIZE=0 skips this.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
jobs=${FERRY_JOBS:-$(nproc)}
start=$(date +%s)

"$root/scripts/build.sh" "$@"
ctest --test-dir "${BUILD_DIR:-$root/build}" --output-on-failure -j "$jobs"
echo "[ferry test] release suite passed in $(( $(date +%s) - start )) s" >&2

if [[ "${FERRY_SANITIZE:-1}" != 0 ]]; then
  asan_start=$(date +%s)
  BUILD_DIR="$root/build-asan" FERRY_BUILD_TYPE=RelWithDebInfo "$root/scripts/build.sh" \
    -DFERRY_SANITIZE=ON -DFERRY_BUILD_BENCHMARKS=OFF -DFERRY_BUILD_EXAMPLES=OFF "$@"
  # The install test rebuilds a consumer outside the sanitizer set-up; it ran in the release suite.
  # The examples (and their tests) run in the release suite only: under the sanitizers they took
  # minutes on 2 cores, and test_hybrid_adam / test_chunked_model cover the same library paths.
  ctest --test-dir "$root/build-asan" --output-on-failure -j "$jobs" -L cpu -E install_consumer
  echo "[ferry test] sanitizer suite passed in $(( $(date +%s) - asan_start )) s" >&2
fi
echo "[ferry test] all passed in $(( $(date +%s) - start )) s"
