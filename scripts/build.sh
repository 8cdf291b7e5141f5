#!/usr/bin/env bash
# Configures and builds ferry into build/ (Release, Ninja, ccache). Runs setup.sh first.
# Extra arguments are passed to CMake's configure step (e.g. -DFERRY_SANITIZE=ON).
# BUILD_DIR overrides the build directory (default: build/ at the repository root).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
setup=$("$root/scripts/setup.sh")
python=$(sed -n 's/^python=//p' <<<"$setup")
deps_prefix=$(sed -n 's/^prefix=//p' <<<"$setup")
torch_prefix=$("$python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
prefix_path="$torch_prefix${deps_prefix:+;$deps_prefix}"
jobs=${FERRY_JOBS:-$(getconf _NPROCESSORS_ONLN)}

launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_DIR=${CCACHE_DIR:-${FERRY_CACHE:-$HOME/.cache/ferry}/ccache}
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
  export CCACHE_BASEDIR=$root        # clones at other paths share hits
  export CCACHE_NOHASHDIR=1
  # The tests' precompiled header (D102): ccache caches it and the compiles that use it only when told
  # that the header's macros and times do not matter (the .gch is hashed as it is).
  export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi

cmake -S "$root" -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=${FERRY_BUILD_TYPE:-Release} \
  -DCMAKE_PREFIX_PATH="$prefix_path" \
  -DPython3_EXECUTABLE="$python" \
  "${launcher[@]}" "$@" >&2
cmake --build "$build" -j "$jobs" >&2
