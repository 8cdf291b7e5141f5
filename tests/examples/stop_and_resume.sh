#!/usr/bin/env bash
# train_gpt on SIGTERM (README): it stops cleanly after the current step, exits 0, saves with --save,
# and --resume goes on from the step it saved. Usage: stop_and_resume.sh TRAIN_GPT
set -uo pipefail
bin=${1:?usage: stop_and_resume.sh TRAIN_GPT}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() {
  echo "FAIL: $*"
  for f in "$dir"/*.log; do echo "--- $f"; cat "$f"; done
  exit 1
}
"$bin" --steps=100000 --log-every=2 --save="$dir/ckpt" > "$dir/run.log" 2>&1 &
pid=$!
# Until the first progress line (at most 120 s): training is under way.
for _ in $(seq 1200); do
  grep -q '^step ' "$dir/run.log" && break
  kill -0 "$pid" 2> /dev/null || break
  sleep 0.1
done
grep -q '^step ' "$dir/run.log" || fail "no progress line from the first run"
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
((status == 0)) || fail "the first run exited $status after SIGTERM"
stopped=$(sed -n 's/^interrupted: stopped cleanly after step \([0-9][0-9]*\)$/\1/p' "$dir/run.log")
[[ -n $stopped ]] || fail "no 'interrupted: stopped cleanly after step N' line"
[[ -n $(ls -A "$dir/ckpt" 2> /dev/null) ]] || fail "nothing saved in $dir/ckpt"
"$bin" --steps=2 --log-every=2 --resume="$dir/ckpt" > "$dir/resume.log" 2>&1 || fail "the resumed run failed"
resumed=$(sed -n 's/^step *\([0-9][0-9]*\) .*/\1/p' "$dir/resume.log" | head -1)
((resumed == stopped + 2)) || fail "the resumed run's first progress line is step '$resumed', expected $((stopped + 2))"
echo "stopped after step $stopped, resumed to step $resumed"
