#!/usr/bin/env bash
# GPU validation on a machine with torch preinstalled and no network (the device machine):
#   scripts/gpu_check.sh OUT_DIR [BENCHMARK [benchmark args...]]
#
#  1-2. scripts/setup.sh with FERRY_OFFLINE=1: the python3 that imports torch 2.11 (FERRY_PYTHON to
#     choose another); spdlog, oneTBB, GoogleTest from the system if CMake finds them, else the Debian
#     packages carried in third_party/gpu-deps (FERRY_CARRIED_DEPS=1 forces that path); installs nothing;
#  3. builds ferry into build-gpu/ (Release, Ninja; only FERRY_BUILD_TARGETS when set) and runs the
#     `gpu`-labelled tests, then the whole ctest suite (CPU tests also exercise the AVX-512 kernels if
#     this CPU has them) unless FERRY_GPU_TESTS_ONLY=1;
#  4. optionally runs benchmarks/bench_BENCHMARK with the given arguments.
# Writes to OUT_DIR: env.txt, env.json, nvidia-smi.txt, build.log, tests.log, gpu_tests.log,
# bench_BENCHMARK.json and bench_BENCHMARK.log. Exits non-zero if the build or a test fails.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [BENCHMARK [args...]]}
shift
bench=${1:-}
[[ $# -gt 0 ]] && shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
: > "$out/summary.txt"
build=${BUILD_DIR:-$root/build-gpu}
say() { echo "[gpu_check] $*" | tee -a "$out/summary.txt" >&2; }

# The same dependency logic as every other entry point (scripts/setup.sh), offline: a python3 that
# imports torch 2.11, CMake/Ninja from PATH, the system's oneTBB/spdlog/GoogleTest or the Debian
# packages carried in third_party/gpu-deps. Installs nothing from the network.
if ! setup=$(FERRY_OFFLINE=1 "$root/scripts/setup.sh"); then
  say "set-up failed (see above)"; exit 1
fi
python=$(sed -n 's/^python=//p' <<<"$setup")
deps_prefix=$(sed -n 's/^prefix=//p' <<<"$setup")
torch_prefix=$("$python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
prefix_path="$torch_prefix${deps_prefix:+;$deps_prefix}"
{ nvidia-smi 2>&1 || true; } > "$out/nvidia-smi.txt"

jobs=$(getconf _NPROCESSORS_ONLN)  # not nproc: it honours OMP_NUM_THREADS
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# FERRY_BUILD_TARGETS="a b ...": build only these (a short lease: the gpu-labelled tests and the
# benchmarks its stages run, about half the full build); a failed targeted build falls back to all.
targets=()
[[ -n ${FERRY_BUILD_TARGETS:-} ]] && read -ra targets <<<"$FERRY_BUILD_TARGETS"
build_all() {
  if ((${#targets[@]})); then
    cmake --build "$build" -j "$jobs" --target "${targets[@]}" && return 0
    echo "[gpu_check] the targeted build failed: building everything"
  fi
  cmake --build "$build" -j "$jobs"
}
say "configuring and building in $build with $jobs jobs${targets:+ (targets: ${targets[*]})}"
if ! { cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix_path" \
         -DPython3_EXECUTABLE="$python" "${launcher[@]}" && build_all; } > "$out/build.log" 2>&1; then
  say "build FAILED (see build.log)"; tail -40 "$out/build.log" >&2; exit 1
fi
"$build/examples/ferry_info" > "$out/env.txt" 2>&1
"$build/examples/ferry_info" --json > "$out/env.json" 2>/dev/null
cat "$out/env.txt" >&2

status=0
ctest --test-dir "$build" -L gpu --output-on-failure > "$out/gpu_tests.log" 2>&1 || status=1
say "gpu-labelled tests: $(grep -E 'tests passed|tests failed' "$out/gpu_tests.log" | tail -1)"
if [[ ${FERRY_GPU_TESTS_ONLY:-0} == 1 ]]; then
  say "all tests: not run (FERRY_GPU_TESTS_ONLY=1)"
else
  ctest --test-dir "$build" --output-on-failure -j "$jobs" > "$out/tests.log" 2>&1 || status=1
  say "all tests: $(grep -E 'tests passed|tests failed' "$out/tests.log" | tail -1)"
fi
# Skips are reported by name so a skipped GPU test is never mistaken for a pass.
grep -h "SKIPPED \]" "$out"/gpu_tests.log "$out"/tests.log 2>/dev/null | sort -u | head -40 >> "$out/summary.txt"

if [[ -n "$bench" ]]; then
  commit=$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  say "benchmark $bench $*"
  if "$build/benchmarks/bench_$bench" --commit="$commit" "$@" > "$out/bench_$bench.json" 2> "$out/bench_$bench.log"; then
    say "benchmark $bench done: $out/bench_$bench.json"
  else
    say "benchmark $bench FAILED (see bench_$bench.log)"; status=1
  fi
fi
exit $status
