#!/usr/bin/env bash
# ferry set-up: makes this machine able to build ferry, using what is already there. Idempotent, no
# prompts. The one dependency logic for every entry point (build.sh, test.sh, demo.sh, gpu_check.sh).
#
#  1. Tools: a C++17 compiler, CMake >= 3.25 and Ninja from PATH; missing ones from Debian's packages
#     (apt-get) when the network allows, else CMake/Ninja from PyPI (pip) if that works. ccache is
#     optional (used when present, installed only together with other Debian packages).
#  2. Libraries (oneTBB, spdlog, GoogleTest, Gloo's headers): the system's when CMake can find them; else Debian's
#     packages with apt-get; else, offline, the Debian packages carried in third_party/gpu-deps,
#     unpacked into ${FERRY_CACHE}/deps (no network needed; FERRY_CARRIED_DEPS=1 forces this path).
#  3. LibTorch 2.11: a python3 (or $FERRY_PYTHON) that already imports torch 2.11 is used as it is (the
#     GPU machine); otherwise the PyPI wheel torch==2.11.0 is installed once per machine into a virtual
#     environment in ${FERRY_CACHE:-~/.cache/ferry}, outside the clone, so every clone (and CI) reuses it.
#  4. transformers (optional, into that virtual environment only): the LLaMA tests' reference.
#  FERRY_OFFLINE=1: never try the network (apt-get, pip); say what is missing instead.
#
# Prints on stdout only two lines for its callers, `python=PATH` (the python3 that imports torch) and
# `prefix=DIRS` (extra CMAKE_PREFIX_PATH entries, ';'-separated, may be empty); progress goes to stderr.
# Exits 1 with the list of what is missing when something cannot be had.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TORCH_VERSION=2.11.0
FERRY_CACHE=${FERRY_CACHE:-$HOME/.cache/ferry}
say() { echo "[ferry setup] $*" >&2; }
offline=${FERRY_OFFLINE:-0}
sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"

apt_updated=0
apt_install() {  # apt_install PKG...: 0 on success
  [[ "$offline" == 1 ]] && return 1
  command -v apt-get >/dev/null || return 1
  if [[ $apt_updated == 0 ]]; then
    say "apt-get update"
    if ! timeout 300 $sudo apt-get update -qq >&2; then
      say "apt-get update failed: treating this machine as offline"; offline=1; return 1
    fi
    apt_updated=1
  fi
  say "installing $* with apt-get"
  DEBIAN_FRONTEND=noninteractive timeout 1200 $sudo apt-get install -y -qq --no-install-recommends "$@" >&2
}

# --- 1. tools -------------------------------------------------------------------------------
cmake_ok() {
  local v
  v=$(cmake --version 2>/dev/null | sed -n '1s/^cmake version \([0-9.]*\).*/\1/p')
  [[ -n $v && $(printf '%s\n3.25\n' "$v" | sort -V | head -1) == 3.25 ]]
}
want_pkgs=() missing=()
command -v g++ >/dev/null || command -v c++ >/dev/null || want_pkgs+=(g++)
cmake_ok || want_pkgs+=(cmake)
command -v ninja >/dev/null || want_pkgs+=(ninja-build)

# --- 2. libraries: found by CMake in the system? ----------------------------------------------
libdir=/usr/lib/$(uname -m)-linux-gnu
lib_pkgs=()
[[ -f $libdir/cmake/TBB/TBBConfig.cmake ]] || lib_pkgs+=(libtbb-dev)
[[ -f $libdir/cmake/spdlog/spdlogConfig.cmake ]] || lib_pkgs+=(libspdlog-dev)
[[ -f $libdir/cmake/GTest/GTestConfig.cmake ]] || lib_pkgs+=(libgtest-dev)
# Gloo's headers only (c10d's ProcessGroupGloo.hpp includes them; the torch wheel ships none). ferry
# links no libgloo: the Gloo code it runs is the copy inside libtorch_cpu (docs/ARCHITECTURE.md D44).
[[ -f /usr/include/gloo/rendezvous/store.h ]] || lib_pkgs+=(libgloo-dev)

prefix=""
use_carried() {
  local deps="$FERRY_CACHE/deps"
  local stamp="$deps/.stamp" want
  want=$(cd "$root/third_party/gpu-deps" && ls *.deb | sort | tr '\n' ' ')
  if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    rm -rf "$deps"; mkdir -p "$deps"
    for deb in "$root"/third_party/gpu-deps/*.deb; do
      if command -v dpkg-deb >/dev/null; then
        dpkg-deb -x "$deb" "$deps"
      else  # a .deb is an ar archive holding data.tar.*
        (cd "$deps" && ar p "$deb" "$(ar t "$deb" | grep '^data.tar')" | tar -x -J 2>/dev/null ||
           ar p "$deb" "$(ar t "$deb" | grep '^data.tar')" | tar -x)
      fi
    done
    echo "$want" > "$stamp"
  fi
  prefix="$deps/usr"
  say "using the Debian packages carried in third_party/gpu-deps for oneTBB/spdlog/GoogleTest/Gloo headers ($deps)"
}

if [[ "${FERRY_CARRIED_DEPS:-0}" == 1 ]]; then
  use_carried; lib_pkgs=()
fi
# ccache only rides along with other Debian packages (it is optional).
if ((${#want_pkgs[@]} + ${#lib_pkgs[@]})); then
  extra=(); command -v ccache >/dev/null || extra+=(ccache)
  if ! apt_install "${want_pkgs[@]}" "${lib_pkgs[@]}" "${extra[@]}"; then
    if ((${#lib_pkgs[@]})); then use_carried; fi
    # Tools from PyPI when Debian's are out of reach.
    for t in "${want_pkgs[@]}"; do
      case $t in
        cmake|ninja-build)
          py=${t%-build}
          if [[ "$offline" != 1 ]] && python3 -m pip install -q --user "$py" >&2 2>/dev/null; then
            export PATH="$HOME/.local/bin:$PATH"
          fi ;;
      esac
    done
  fi
fi
command -v g++ >/dev/null || command -v c++ >/dev/null || missing+=("a C++17 compiler (Debian: g++)")
cmake_ok || missing+=("CMake >= 3.25 on PATH (Debian: cmake; PyPI: cmake)")
command -v ninja >/dev/null || missing+=("Ninja on PATH (Debian: ninja-build; PyPI: ninja)")

# --- 3. torch --------------------------------------------------------------------------------
torch_ok() { "$1" -c "import torch,sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; }
python=""
if [[ -n "${FERRY_PYTHON:-}" ]] && torch_ok "$FERRY_PYTHON"; then
  python=$FERRY_PYTHON
elif command -v python3 >/dev/null && torch_ok python3; then
  python=$(command -v python3)
else
  venv="$FERRY_CACHE/venv-torch-$TORCH_VERSION"
  if ! torch_ok "$venv/bin/python3"; then
    if [[ "$offline" == 1 ]]; then
      missing+=("a python3 that imports torch $TORCH_VERSION (set FERRY_PYTHON), or network access to PyPI")
    else
      python3 -c "import venv, ensurepip" 2>/dev/null || apt_install python3-venv || true
      say "installing torch==$TORCH_VERSION into $venv (once per machine; a few GB)"
      mkdir -p "$FERRY_CACHE"
      # One installer at a time: a second clone waits for the first instead of racing it.
      exec 9>"$FERRY_CACHE/.install.lock"
      flock 9
      if ! torch_ok "$venv/bin/python3"; then
        rm -rf "$venv"
        python3 -m venv "$venv" >&2 && "$venv/bin/python3" -m pip install -q --disable-pip-version-check \
          "torch==$TORCH_VERSION" >&2 || missing+=("torch==$TORCH_VERSION from PyPI (pip install failed)")
      fi
      flock -u 9
    fi
  fi
  torch_ok "$venv/bin/python3" && python="$venv/bin/python3"
fi

# transformers (with tokenizers): the reference the LLaMA example's tests compare with. Optional: without
# it those tests are reported skipped, by name. Installed only into ferry's own virtual environment,
# never into a python that came with the machine.
TRANSFORMERS_VERSION=5.24.0
if [[ -n $python && $python == "$FERRY_CACHE"/venv-* ]] && ! "$python" -c "import transformers" 2>/dev/null; then
  if [[ "$offline" == 1 ]]; then
    say "transformers is not importable by $python (offline): the llama_vs_transformers tests will be skipped"
  else
    exec 9>"$FERRY_CACHE/.install.lock"
    flock 9
    if ! "$python" -c "import transformers" 2>/dev/null; then
      say "installing transformers==$TRANSFORMERS_VERSION into $(dirname "$(dirname "$python")") (the LLaMA tests' reference)"
      "$python" -m pip install -q --disable-pip-version-check "transformers==$TRANSFORMERS_VERSION" >&2 ||
        say "pip install transformers failed: the llama_vs_transformers tests will be skipped"
    fi
    flock -u 9
  fi
fi

if ((${#missing[@]})); then
  say "cannot build ferry here; missing:"
  for m in "${missing[@]}"; do say "  - $m"; done
  exit 1
fi
echo "python=$python"
echo "prefix=$prefix"
