#!/usr/bin/env bash
# ferry's main job. Until the GPT example lands (issue 7) this builds ferry and prints the environment
# report: torch / CUDA / NCCL / oneTBB / spdlog versions, the CPU vector ISA detected, GPU present or not.
# Extra arguments go to the program (e.g. --log-level=debug).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/build.sh" >/dev/null
exec "${BUILD_DIR:-$root/build}/examples/ferry_info" "$@"
