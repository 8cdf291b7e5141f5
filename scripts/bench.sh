#!/usr/bin/env bash
# Builds ferry and runs one benchmark, storing its JSON under benchmarks/results/ with the commit it
# was built from.   scripts/bench.sh NAME [benchmark args...]     (NAME: cpu_adam, ...)
# OUT_DIR overrides where the JSON goes (default benchmarks/results). LAUNCH prefixes the command, e.g.
# LAUNCH="torchrun --standalone --nproc-per-node=2 --no-python" for a data-parallel run (rank 0's JSON).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=${1:?usage: scripts/bench.sh NAME [args...]}
shift
"$root/scripts/build.sh" >/dev/null
commit=$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
git -C "$root" diff --quiet HEAD -- 2>/dev/null || commit="$commit-dirty"
host=$(if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
         nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_'; else echo "cpu$(nproc)"; fi)
out_dir=${OUT_DIR:-$root/benchmarks/results}
mkdir -p "$out_dir"
out="$out_dir/${name}-${host}-$(date +%Y%m%d-%H%M%S)${SUFFIX:+-$SUFFIX}.json"
${LAUNCH:-} "${BUILD_DIR:-$root/build}/benchmarks/bench_$name" --commit="$commit" "$@" > "$out.tmp"
mv "$out.tmp" "$out"
echo "$out"
