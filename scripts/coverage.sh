#!/usr/bin/env bash
# Line and branch coverage of the library (the folders of libferry.so) by the CPU tests: a developer's
# check, not part of scripts/test.sh (the build and the run take ~50 min on 2 cores). Builds ferry with
# gcov counters into build-cov/ (-DFERRY_COVERAGE=ON: --coverage at -O1), clears old counts, runs the
# cpu-labelled tests, then writes with gcovr (installed once into ~/.cache/ferry/venv-gcovr):
#   build-cov/coverage/summary.txt   per file: lines, covered, %; sorted by uncovered lines
#   build-cov/coverage/index.html    the sources with each line's count
#   build-cov/coverage/coverage.json gcovr's per-line JSON (what an uncovered-line search reads)
# Extra arguments go to ctest (e.g. -R test_chunk_store). Fails if a test failed, after the report.
# A counted line ran; it does not say that a test checked what it did (docs/ARCHITECTURE.md, D95).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="$root/build-cov"
jobs=${FERRY_JOBS:-$(getconf _NPROCESSORS_ONLN)}
venv=${FERRY_CACHE:-$HOME/.cache/ferry}/venv-gcovr

BUILD_DIR="$build" FERRY_BUILD_TYPE=RelWithDebInfo "$root/scripts/build.sh" -DFERRY_COVERAGE=ON
if [[ ! -x "$venv/bin/gcovr" ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet 'gcovr==8.8'
fi

find "$build" -name '*.gcda' -delete
status=0
ctest --test-dir "$build" --output-on-failure -j "$jobs" -L cpu "$@" || status=$?

out="$build/coverage"
mkdir -p "$out"
library='(common|chunk|scheduler|cpu_adam|hooks|dist|optim)/'
# Counters are merged per object file; a file compiled into several targets (none today) would be
# merged by gcovr. --gcov-ignore-parse-errors: gcov 12 notes negative counts of OpenMP outlined bodies.
"$venv/bin/gcovr" --root "$root" --object-directory "$build" --filter "$root/$library" \
  --gcov-ignore-parse-errors=negative_hits.warn_once_per_file --exclude-unreachable-branches \
  --exclude-throw-branches --sort uncovered-number --sort-reverse --txt "$out/summary.txt" \
  --html-details "$out/index.html" --json "$out/coverage.json" --json-summary "$out/summary.json" \
  --print-summary
echo "coverage: $out/summary.txt, $out/index.html" >&2
exit "$status"
