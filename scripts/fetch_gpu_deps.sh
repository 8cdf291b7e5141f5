#!/usr/bin/env bash
# Re-downloads the Debian packages that scripts/gpu_check.sh carries to the GPU machine.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir="$root/third_party/gpu-deps"
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libgtest-dev libgloo-dev)
rm -f "$dir"/*.deb
mv "$tmp"/*.deb "$dir"/
rm -rf "$tmp"
ls -la "$dir"
