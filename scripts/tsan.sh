#!/usr/bin/env bash
# ThreadSanitizer over the CPU tests (a developer's check, not part of scripts/test.sh: the build and
# the run take ~35 min on 2 cores). Builds ferry's own code with -fsanitize=thread into build-tsan/
# (without examples, benchmarks and the gpu-labelled tests, at -O2 -g1 as test.sh's sanitizer build:
# a report needs functions and lines) and runs the cpu-labelled tests there with one OpenMP thread
# (cmake/FerryTargets.cmake says why) and scripts/tsan.supp. Extra arguments go to ctest (e.g.
# -R test_hybrid_adam). A report fails its test: halt_on_error=1.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
jobs=${FERRY_JOBS:-$(getconf _NPROCESSORS_ONLN)}
BUILD_DIR="$root/build-tsan" FERRY_BUILD_TYPE=RelWithDebInfo "$root/scripts/build.sh" \
  -DFERRY_TSAN=ON -DFERRY_BUILD_BENCHMARKS=OFF -DFERRY_BUILD_EXAMPLES=OFF -DFERRY_BUILD_GPU_TESTS=OFF \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
ctest --test-dir "$root/build-tsan" --output-on-failure -j "$jobs" -L cpu -E install_consumer "$@"
