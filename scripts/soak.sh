#!/usr/bin/env bash
# Soak run of the drawn tests over seeds CI does not run (a developer's check, not part of
# scripts/test.sh). Each drawn suite takes its seeds from FERRY_TEST_SEEDS=<first>:<count>
# (tests/seeds.h); this runs each over a range that starts where CI's cases end, from an existing
# build (scripts/build.sh first; BUILD_DIR= picks another, e.g. build-asan). A failure prints its seed
# and draw; FERRY_TEST_SEEDS=<seed>:1 on the same binary reproduces it. A suite whose log stops growing
# for FERRY_SOAK_STALL_S seconds (default 300; every case prints its draw, and takes seconds) is a hang:
# it is killed and its last drawn case named.
#   scripts/soak.sh [scale]   scale multiplies the counts below (default 1: ~25 min on an idle 2-core
#                             machine; each suite's time is printed)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
scale=${1:-1}
stall=${FERRY_SOAK_STALL_S:-300}
[[ $scale =~ ^[1-9][0-9]*$ ]] || { echo "soak.sh: scale must be a positive integer, got '$scale'" >&2; exit 2; }
[[ $stall =~ ^[1-9][0-9]*$ ]] || { echo "soak.sh: FERRY_SOAK_STALL_S must be a positive integer, got '$stall'" >&2; exit 2; }
# As ctest runs the sanitizer build's tests (cmake/FerryTargets.cmake); no effect on other builds.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:protect_shadow_gap=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
logs=$(mktemp -d "${TMPDIR:-/tmp}/ferry-soak-XXXXXX")
failed=()
# name, binary, CI's count (the soak's first seed), the soak's count, gtest filter
soak() {
  local name=$1 bin=$build/$2 first=$3 count=$(( $4 * scale )) filter=${5:-*}
  [[ -x $bin ]] || { echo "soak.sh: $bin not built" >&2; exit 2; }
  local log=$logs/$name.log start=$(date +%s) rc=0 size=-1 idle=0 hung=0
  # Its own process group (setsid), so that a hung suite is killed with the ranks it forked.
  FERRY_TEST_SEEDS=$first:$count setsid "$bin" --gtest_brief=1 "--gtest_filter=$filter" > "$log" 2>&1 &
  local pid=$!
  running() { local st; st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) && [[ $st != Z ]]; }
  while running; do
    sleep 1
    local now; now=$(stat -c %s "$log")
    if [[ $now == "$size" ]]; then idle=$(( idle + 1 )); else idle=0; size=$now; fi
    if (( idle >= stall )); then hung=1; kill -KILL -- "-$pid" 2>/dev/null || true; break; fi
  done
  wait "$pid" 2>/dev/null || rc=$?
  local seeds="seeds $first..$(( first + count - 1 ))"
  if (( hung )); then
    echo "[ferry soak] $name: HUNG ($seeds: no output for $stall s, killed; log $log); the last case drawn:"
    grep -E "^case |drawn|^\[ RUN" "$log" | tail -1 | cut -c1-2000
    failed+=("$name")
  elif (( rc == 0 )); then
    echo "[ferry soak] $name: $seeds passed in $(( $(date +%s) - start )) s"
  else
    echo "[ferry soak] $name: FAILED ($seeds, exit $rc, log $log):"
    grep -E "^\[  FAILED  \]|drawn|seed" "$log" | head -20
    failed+=("$name")
  fi
}
soak plan_combinations tests/optim/test_plan_combinations 32 4000
soak config_space tests/optim/test_config_space 120 12000
soak dist_drawn tests/dist/test_dist 10 150 'Dist.DrawnCombinationsOfOptionsEqualOneProcess'
soak mechanism_combinations tests/optim/test_mechanism_combinations 160 12000
if (( ${#failed[@]} )); then echo "[ferry soak] failed: ${failed[*]}"; exit 1; fi
echo "[ferry soak] all passed (logs $logs)"
