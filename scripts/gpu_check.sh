#!/usr/bin/env bash
# GPU validation on a machine with torch preinstalled and no network (the device machine):
#   scripts/gpu_check.sh OUT_DIR [BENCHMARK [benchmark args...]]
#
#  1. uses the python3 that imports torch 2.11 (FERRY_PYTHON to choose another), installs nothing;
#  2. spdlog, oneTBB, GoogleTest: the system's if CMake finds them, else the Debian packages in
#     third_party/gpu-deps unpacked into build-gpu/_deps (no network needed; FERRY_CARRIED_DEPS=1
#     forces this path, to test it on a machine that has the packages);
#  3. builds ferry into build-gpu/ (Release, Ninja) and runs the whole ctest suite (the `gpu`-labelled
#     tests run for real here; CPU tests also exercise the AVX-512 kernels if this CPU has them);
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

python=${FERRY_PYTHON:-python3}
if ! "$python" -c "import torch; assert torch.__version__.startswith('2.11')" 2>/dev/null; then
  say "no python3 with torch 2.11 (set FERRY_PYTHON)"; exit 1
fi
torch_prefix=$("$python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
{ nvidia-smi 2>&1 || true; } > "$out/nvidia-smi.txt"

# Dependencies: prefer the system's; otherwise the carried Debian packages.
prefix_path="$torch_prefix"
deps="$build/_deps"
if [[ "${FERRY_CARRIED_DEPS:-0}" == 1 || \
      ! -f /usr/lib/x86_64-linux-gnu/cmake/spdlog/spdlogConfig.cmake || \
      ! -f /usr/lib/x86_64-linux-gnu/cmake/TBB/TBBConfig.cmake || \
      ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ]]; then
  mkdir -p "$deps"
  for deb in "$root"/third_party/gpu-deps/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$deps"
    else  # a .deb is an ar archive holding data.tar.*
      (cd "$deps" && ar p "$deb" "$(ar t "$deb" | grep '^data.tar')" | tar -x -J 2>/dev/null || \
                     ar p "$deb" "$(ar t "$deb" | grep '^data.tar')" | tar -x)
    fi
  done
  prefix_path="$torch_prefix;$deps/usr"
  say "using carried Debian packages for spdlog/oneTBB/GoogleTest ($deps)"
fi

jobs=$(nproc)
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
say "configuring and building in $build with $jobs jobs"
if ! { cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix_path" \
         -DPython3_EXECUTABLE="$(command -v "$python")" "${launcher[@]}" &&
       cmake --build "$build" -j "$jobs"; } > "$out/build.log" 2>&1; then
  say "build FAILED (see build.log)"; tail -40 "$out/build.log" >&2; exit 1
fi
"$build/examples/ferry_info" > "$out/env.txt" 2>&1
"$build/examples/ferry_info" --json > "$out/env.json" 2>/dev/null
cat "$out/env.txt" >&2

status=0
ctest --test-dir "$build" -L gpu --output-on-failure > "$out/gpu_tests.log" 2>&1 || status=1
say "gpu-labelled tests: $(grep -E 'tests passed|tests failed' "$out/gpu_tests.log" | tail -1)"
ctest --test-dir "$build" --output-on-failure -j "$jobs" > "$out/tests.log" 2>&1 || status=1
say "all tests: $(grep -E 'tests passed|tests failed' "$out/tests.log" | tail -1)"
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
