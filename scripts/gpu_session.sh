#!/usr/bin/env bash
# Everything one device call does, inside the call's time limit (the device tool's `run`):
#   scripts/gpu_session.sh STAGES_FILE
# 1. scripts/gpu_check.sh (build into build-gpu/, the `gpu`-labelled tests; the whole suite too unless
#    FERRY_GPU_TESTS_ONLY=1; FERRY_SKIP_BUILD=1 skips this step: a warm machine, or Python-only stages);
# 2. each line of STAGES_FILE, "NAME SECONDS COMMAND...", run by bash under `timeout SECONDS` (cut to
#    what is left of the call's deadline, FERRY_DEADLINE seconds, default 570), stdout to NAME.out and
#    stderr to NAME.log; blank lines and lines starting with '#' are skipped;
# 3. packs everything into $OUT/results.tgz (the device tool brings back at most 8 files; small.tgz holds
#    all but the traces and profiles, in case results.tgz is over the tool's 16 MiB a file), with
#    stages.tsv (each step's exit status and seconds) and commit.txt; scripts/gpu_unpack.py files it
#    under benchmarks/results/.
# Stages see BUILD (the build directory), RES (the results directory) and COMMIT (FERRY_COMMIT, or
# `git rev-parse` where .git travelled, else "unknown": the device gets the working tree without .git)
# in their environment. Stage files for the open measurements live in scripts/gpu_stages/;
# scripts/gpu_dryrun.py runs their stages shrunk on the CPU (ctest gpu_stages_dryrun), so that no
# stage is lost on the GPU to a misspelt option.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
stages=${1:?usage: scripts/gpu_session.sh STAGES_FILE}
out=${OUT:?OUT must name the folder that comes back}
deadline=$((SECONDS + ${FERRY_DEADLINE:-570}))
export RES=/tmp/ferry-gpu-results BUILD=$root/build-gpu
export COMMIT=${FERRY_COMMIT:-$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
rm -rf "$RES" && mkdir -p "$RES"
# Two packs: everything, and everything but the traces and profiles (small.tgz): a results.tgz over the
# tool's 16 MiB a file would not come back, and the stages' JSON and logs must.
pack() {
  echo "$COMMIT" > "$RES/commit.txt"
  tar czf "$out/results.tgz" -C "$RES" .
  tar czf "$out/small.tgz" --exclude='./trace-*' --exclude='./profile-*' -C "$RES" .
}
# One line per step, "NAME<TAB>EXIT<TAB>SECONDS" (EXIT "skipped" when no time was left): what
# scripts/gpu_unpack.py reports beside the files.
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$RES/stages.tsv"; }
trap pack EXIT
cd "$root"
if [[ ${FERRY_SKIP_BUILD:-0} != 1 ]]; then
  timeout $((deadline - SECONDS - 60)) scripts/gpu_check.sh "$RES/check"
  rc=$?
  echo "[gpu_session] gpu_check exit $rc after $SECONDS s"
  record gpu_check "$rc" "$SECONDS"
fi
while IFS= read -r line || [[ -n $line ]]; do
  [[ -z ${line// } || $line == \#* ]] && continue
  read -r name t cmd <<<"$line"
  left=$((deadline - SECONDS - 10))
  if ((left < 15)); then echo "[gpu_session] $name: skipped, ${left}s left"; record "$name" skipped 0; continue; fi
  ((t > left)) && t=$left
  echo "[gpu_session] $name (limit ${t}s): $cmd"
  start=$SECONDS
  timeout --kill-after=5 "$t" bash -c "$cmd" > "$RES/$name.out" 2> "$RES/$name.log"
  rc=$?
  echo "[gpu_session] $name exit $rc after $((SECONDS - start)) s"
  record "$name" "$rc" "$((SECONDS - start))"
  tail -4 "$RES/$name.log"
done < "$stages"
