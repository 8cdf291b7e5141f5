#!/usr/bin/env bash
# The whole test suite (README's test command; .ci/run calls exactly this):
#  0. what machine this is: CPU model, cores, the thread count torch and CPU Adam will use, and (after
#     the build) the CPU Adam kernel ferry picks here — so every log says what it ran on;
#  1. set-up, Release build into build/, every ctest test (tests labelled `gpu` skip without a GPU);
#  2. ferry's own code rebuilt with AddressSanitizer + UndefinedBehaviorSanitizer into build-asan/
#     (without examples and benchmarks), and the CPU tests run under it. FERRY_SANITIZE=0 skips this.
# Both suites run even when the first fails; the exit status is non-zero if either failed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
jobs=${FERRY_JOBS:-$(getconf _NPROCESSORS_ONLN)}
start=$(date +%s)
say() { echo "[ferry test] $*" >&2; }

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)
say "machine: ${cpu:-unknown CPU}, $(getconf _NPROCESSORS_ONLN) cores, $(free -g 2>/dev/null | awk '/^Mem:/{print $2 " GiB"}'); threads: OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset (OpenMP default: one per core)}, MKL_DYNAMIC=${MKL_DYNAMIC:-unset}"

failed=()
if "$root/scripts/build.sh" "$@"; then
  build=${BUILD_DIR:-$root/build}
  say "ferry's view of it: $("$build/examples/ferry_info" --json 2>/dev/null | python3 -c '
import json, sys
r = json.load(sys.stdin)
cap = " (FERRY_CPU_ISA_MAX=%s)" % r["cpu_isa_cap"] if "cpu_isa_cap" in r else ""
print("CPU Adam kernel", r.get("cpu_isa", "?") + cap, "| CPU features", r.get("cpu_features", "?"),
      "|", r.get("openmp", "?"), "| GPUs", r.get("gpu_count", 0))' 2>/dev/null || echo "(ferry_info unavailable)")"
  if ctest --test-dir "$build" --output-on-failure -j "$jobs"; then
    say "release suite passed in $(( $(date +%s) - start )) s"
  else
    failed+=(release)
  fi
else
  failed+=("release build")
fi

if [[ "${FERRY_SANITIZE:-1}" != 0 ]]; then
  asan_start=$(date +%s)
  # The install test rebuilds a consumer outside the sanitizer set-up; it ran in the release suite.
  # The examples (and their tests) run in the release suite only: under the sanitizers they took
  # minutes on 2 cores, and test_hybrid_adam / test_chunked_model cover the same library paths.
  # -g1 (functions and lines, no locals) is all a sanitizer's report needs, and compiles a quarter
  # faster than -g; the gpu-labelled binaries are not run here (-L cpu), so not built (D102).
  if BUILD_DIR="$root/build-asan" FERRY_BUILD_TYPE=RelWithDebInfo "$root/scripts/build.sh" \
       -DFERRY_SANITIZE=ON -DFERRY_BUILD_BENCHMARKS=OFF -DFERRY_BUILD_EXAMPLES=OFF -DFERRY_BUILD_GPU_TESTS=OFF \
       "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" "$@"; then
    if ctest --test-dir "$root/build-asan" --output-on-failure -j "$jobs" -L cpu -E install_consumer; then
      say "sanitizer suite passed in $(( $(date +%s) - asan_start )) s"
    else
      failed+=(sanitizer)
    fi
  else
    failed+=("sanitizer build")
  fi
fi
if ((${#failed[@]})); then
  say "FAILED: ${failed[*]} ($(( $(date +%s) - start )) s)"
  exit 1
fi
echo "[ferry test] all passed in $(( $(date +%s) - start )) s"
