#!/usr/bin/env bash
# Issue 48's quality runs: bench_state_quality with torch's AdamW, ferry's fp32 state and ferry's compact
# state over the same model, batches and schedule, then the curves as one PNG.
#   [OPTIMIZERS="torch fp32 compact"] benchmarks/quality/run_state_quality.sh [TAG] [bench_state_quality options...]
# OPTIMIZERS: which runs, the first the reference of the summary (hybrid-fp32 and hybrid-compact: through
# ChunkedModel + HybridAdam). PYTHON: an interpreter with matplotlib for the PNG (default python3).
# The corpus: the Python standard library's top-level modules on this machine (STDLIB, default
# /usr/lib/python3.11/*.py), sorted by name; every 10th file is held out (the held-out split), the rest
# are the training text. Results: benchmarks/results/state_quality-TAG-{torch,fp32,compact}.json,
# state_quality-TAG.png and the final losses against the first run, state_quality-TAG-summary.json (TAG
# default cpu<cores>-<date>).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${BUILD_DIR:-$root/build}
stdlib=${STDLIB:-/usr/lib/python3.11}
tag=${1:-cpu$(getconf _NPROCESSORS_ONLN)-$(date +%Y%m%d)}
shift || true
work=$(mktemp -d /tmp/ferry-state-quality-XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/train" "$work/heldout"
i=0
for f in $(ls "$stdlib"/*.py | sort); do
  if ((i % 10 == 0)); then cp "$f" "$work/heldout/"; else cp "$f" "$work/train/"; fi
  i=$((i + 1))
done
echo "[state quality] $(ls "$work/train" | wc -l) training files, $(ls "$work/heldout" | wc -l) held out, from $stdlib" >&2
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
out=$root/benchmarks/results
read -ra optimizers <<<"${OPTIMIZERS:-torch fp32 compact}"
jsons=()
for opt in "${optimizers[@]}"; do
  "$build/benchmarks/bench_state_quality" --optimizer=$opt --train="$work/train" --heldout="$work/heldout" \
    --commit="$commit" "$@" > "$out/state_quality-$tag-$opt.json"
  jsons+=("$out/state_quality-$tag-$opt.json")
done
"${PYTHON:-python3}" "$root/benchmarks/quality/plot_state_quality.py" "$out/state_quality-$tag.png" "${jsons[@]}" \
  | tee "$out/state_quality-$tag-summary.json"
