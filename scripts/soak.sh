#!/usr/bin/env bash
# Soak run of the drawn tests over seeds CI does not run (a developer's check, not part of
# scripts/test.sh). Each drawn suite takes its seeds from FERRY_TEST_SEEDS=<first>:<count>
# (tests/seeds.h); this runs each over a range that starts where CI's cases end, from an existing
# build (scripts/build.sh first; BUILD_DIR= picks another, e.g. build-asan). A failure prints its seed
# and draw; FERRY_TEST_SEEDS=<seed>:1 on the same binary reproduces it.
#   scripts/soak.sh [scale]   scale multiplies the counts below (default 1: ~25 min on 2 cores, of which
#                             mechanism_combinations ~19: ~64 cases a minute, the others 1-2 minutes)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
scale=${1:-1}
[[ $scale =~ ^[1-9][0-9]*$ ]] || { echo "soak.sh: scale must be a positive integer, got '$scale'" >&2; exit 2; }
logs=$(mktemp -d "${TMPDIR:-/tmp}/ferry-soak-XXXXXX")
failed=()
# name, binary, CI's count (the soak's first seed), the soak's count, gtest filter
soak() {
  local name=$1 bin=$build/$2 first=$3 count=$(( $4 * scale )) filter=${5:-*}
  [[ -x $bin ]] || { echo "soak.sh: $bin not built" >&2; exit 2; }
  local start=$(date +%s)
  if FERRY_TEST_SEEDS=$first:$count "$bin" --gtest_brief=1 "--gtest_filter=$filter" > "$logs/$name.log" 2>&1; then
    echo "[ferry soak] $name: seeds $first..$(( first + count - 1 )) passed in $(( $(date +%s) - start )) s"
  else
    echo "[ferry soak] $name: FAILED (seeds $first..$(( first + count - 1 )), log $logs/$name.log):"
    grep -E "^\[  FAILED  \]|drawn|seed" "$logs/$name.log" | head -20
    failed+=("$name")
  fi
}
soak plan_combinations tests/optim/test_plan_combinations 32 1000
soak config_space tests/optim/test_config_space 120 4000
soak dist_drawn tests/dist/test_dist 10 50 'Dist.DrawnCombinationsOfOptionsEqualOneProcess'
soak mechanism_combinations tests/optim/test_mechanism_combinations 160 1200
if (( ${#failed[@]} )); then echo "[ferry soak] failed: ${failed[*]}"; exit 1; fi
echo "[ferry soak] all passed (logs $logs)"
