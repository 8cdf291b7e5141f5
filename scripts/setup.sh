#!/usr/bin/env bash
# ferry set-up: makes this machine able to build ferry. Idempotent, no prompts.
#
#  1. System packages (Debian): compiler, CMake, Ninja, ccache, oneTBB, spdlog, GoogleTest.
#     Installed only when missing, with apt-get (as root, or through sudo).
#  2. LibTorch 2.11: a python3 that already imports torch 2.11 is used as it is (the GPU machine);
#     otherwise the PyPI wheel torch==2.11.0 is installed once per machine into a virtual environment
#     in the cache ${FERRY_CACHE:-~/.cache/ferry}, outside the clone, so every clone (and CI) reuses it.
#
# Prints nothing on stdout but the path of the python3 that imports torch (callers capture it);
# progress goes to stderr.
set -euo pipefail

TORCH_VERSION=2.11.0
FERRY_CACHE=${FERRY_CACHE:-$HOME/.cache/ferry}
say() { echo "[ferry setup] $*" >&2; }

# --- 1. system packages ----------------------------------------------------------------------
need=()
for pkg in g++ cmake ninja-build ccache libtbb-dev libspdlog-dev libgtest-dev; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
# Debian's python3 needs python3-venv for the torch cache; pyenv's or the GPU image's has venv built in.
python3 -c "import venv, ensurepip" 2>/dev/null || need+=(python3-venv)
if ((${#need[@]})); then
  if ! command -v apt-get >/dev/null; then
    say "missing packages ${need[*]} and no apt-get: install them by hand"; exit 1
  fi
  sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"
  say "installing ${need[*]}"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

# --- 2. torch --------------------------------------------------------------------------------
torch_ok() { "$1" -c "import torch,sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; }

if [[ -n "${FERRY_PYTHON:-}" ]] && torch_ok "$FERRY_PYTHON"; then
  echo "$FERRY_PYTHON"; exit 0
fi
if command -v python3 >/dev/null && torch_ok python3; then
  command -v python3; exit 0
fi
venv="$FERRY_CACHE/venv-torch-$TORCH_VERSION"
if ! torch_ok "$venv/bin/python3"; then
  say "installing torch==$TORCH_VERSION into $venv (once per machine; a few GB)"
  mkdir -p "$FERRY_CACHE"
  # One installer at a time: a second clone waits for the first instead of racing it.
  exec 9>"$FERRY_CACHE/.install.lock"
  flock 9
  if ! torch_ok "$venv/bin/python3"; then
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/python3" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" >&2
  fi
  flock -u 9
fi
echo "$venv/bin/python3"
