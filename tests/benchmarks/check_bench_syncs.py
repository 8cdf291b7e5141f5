#!/usr/bin/env python3
"""Checks the host synchronisations per step in bench_gpt's JSON, run on the stream-model engine.

    bench_gpt --preset=tiny ... --device-budget=1MiB --no-baseline --copies=stream [--unpipelined] |
        check_bench_syncs.py

On --copies=stream a copy stays pending until the host waits for it (chunk/stream_model_engine.h), as a
CUDA copy does, so syncs_per_step counts the training thread's waits (on the synchronous engine it is 0
whatever the code does). The pipelined step must wait O(1) times per step, its per-chunk waits done by
the optimizer's worker (background); the unpipelined one waits once per host-state chunk at least. The
budget must leave optimizer state on the host. Exits non-zero with the first violation.
"""
import json
import sys

MAX_PIPELINED_SYNCS = 2  # the end-of-iteration settle and the one read of the device norms


def main():
    doc = json.load(sys.stdin)
    cfg, f = doc["config"], doc["ferry"]
    if cfg.get("copies") != "stream":
        sys.exit(f"check_bench_syncs: run with --copies=stream, got copies={cfg.get('copies')}")
    host_chunks = f["chunks"] - f["device_state_chunks"]
    if host_chunks < 2:
        sys.exit(f"check_bench_syncs: the budget left {host_chunks} host-state chunk(s); the check needs 2 or more")
    syncs, background = f["syncs_per_step"], f["background_syncs_per_step"]
    if cfg["step"] == "pipelined":
        if syncs > MAX_PIPELINED_SYNCS:
            sys.exit(f"check_bench_syncs: the pipelined step waited {syncs} times per step on the training thread "
                     f"({host_chunks} host-state chunks); at most {MAX_PIPELINED_SYNCS} expected")
        if background < 1:
            sys.exit("check_bench_syncs: the pipelined step's worker never waited for a gradient copy: were the "
                     "copies pending at all?")
    elif syncs < host_chunks:
        sys.exit(f"check_bench_syncs: the unpipelined step waited {syncs} times per step, fewer than its "
                 f"{host_chunks} host-state chunks: are the copies still pending on this engine?")
    print(f"check_bench_syncs: ok ({cfg['step']}: {syncs} syncs per step, {background} on the worker, "
          f"{host_chunks} host-state chunks, {f['transfers_per_step']} transfers)")


if __name__ == "__main__":
    main()
