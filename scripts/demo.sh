#!/usr/bin/env bash
# ferry's main job: builds ferry and trains the GPT example (examples/gpt/train_gpt) through
# ChunkedModel + HybridAdam on a byte-level text corpus from the machine's own packages
# (/usr/share/common-licenses). On a GPU machine it uses the GPU (bf16); otherwise the CPU with a
# simulated device budget of half the model, so chunks really move. A progress line every 20 steps
# and a summary at the end; Ctrl-C stops cleanly after the current step.
# Extra arguments go to train_gpt (e.g. --steps=1000 --preset=small --device-budget=8MiB; --help).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/build.sh" >/dev/null
exec "${BUILD_DIR:-$root/build}/examples/gpt/train_gpt" --steps=300 --log-every=20 "$@"
