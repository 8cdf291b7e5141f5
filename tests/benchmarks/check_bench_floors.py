#!/usr/bin/env python3
"""Checks bench_gpt's floors (D52) against the counts in the same JSON document.

    bench_gpt --preset=tiny ... --device-budget=1MiB --no-baseline [--max-grad-norm=1] [--micro-batches=2] |
        check_bench_floors.py

The budget must leave optimizer state on the host, so every floor has something to count. Each floor is
recomputed from the rates and the per-step counts bench_gpt printed beside it; a formula changed in one
place and not the other, a floor that forgets the copies, or a measured / floor ratio of the wrong step
fails here. The start-up breakdown is checked the same way: its parts add up to the construction and
start-up times printed beside it, and the warm-up's repack lies inside the first step. Exits non-zero
with the first difference.
"""
import json
import sys


def close(name, got, want, rel=2e-4, abs_tol=0.0):
    # bench_gpt prints 6 significant digits.
    if abs(got - want) > max(rel * max(abs(want), 1e-12), abs_tol):
        sys.exit(f"check_bench_floors: {name} is {got}, expected {want}")


def check_startup(f):
    sb = f["startup_breakdown"]
    parts = sb["module_s"] + sb["wrap_s"] + sb["optimizer_construction_s"]
    # Each of the three is rounded to 6 digits on its own: allow a few units in the last place of the largest.
    close("module_s + wrap_s + optimizer_construction_s", parts, f["construction_s"], abs_tol=3e-5 * f["construction_s"])
    close("first_step_s", sb["first_step_s"], f["startup_s"] - f["construction_s"], abs_tol=3e-5 * f["startup_s"])
    if min(sb["module_s"], sb["wrap_s"], sb["optimizer_construction_s"]) < 0:
        sys.exit(f"check_bench_floors: a negative start-up part: {sb}")
    if not 0 < sb["repack_s"] < sb["first_step_s"]:
        sys.exit(f"check_bench_floors: the warm-up's repack ({sb['repack_s']} s) must lie inside the first step "
                 f"({sb['first_step_s']} s)")


def main():
    doc = json.load(sys.stdin)
    f, fl = doc["ferry"], doc["floor"]
    r = fl["rates"]
    host_params = f["host_state_params"]
    if host_params <= 0:
        sys.exit("check_bench_floors: no optimizer state on the host; run with a device budget that offloads")
    # The host Adam's bytes per parameter (read + written, bf16 gradients): fp32 state 28, compact 12.0625.
    per_param = {"fp32": 28.0, "compact": 12.0 + 16.0 / 256.0}[doc["config"].get("state_format", "fp32")]
    close("host_adam_bytes_per_param", fl["host_adam_bytes_per_param"], per_param)
    close("host_adam_s", fl["host_adam_s"], per_param * host_params / r["host_adam_bytes_per_s"])
    copies = f["h2d_bytes_per_step"] + f["d2h_bytes_per_step"]
    if copies <= 0:
        sys.exit("check_bench_floors: no chunk moved in a step; the floors of the transfers count nothing")
    per_copy = 1.0 if doc["device"] == "cuda" else 2.0  # the simulated device's copies read and write host memory
    micro = doc["config"]["micro_batches"]
    accumulation = 16.0 * micro * host_params if micro > 1 else 0.0  # each micro-batch's add and restore
    host_memory = (per_param * host_params + accumulation + per_copy * copies) / r["host_adam_bytes_per_s"]
    close("host_memory_s", fl["host_memory_s"], host_memory)
    transfers = max(f["h2d_bytes_per_step"] / r["h2d_bytes_per_s"], f["d2h_bytes_per_step"] / r["d2h_bytes_per_s"])
    close("transfers_s", fl["transfers_s"], transfers)
    floor = max(fl["compute_s"], transfers, host_memory)
    close("floor_s", fl["floor_s"], floor)
    cfg = doc["config"]
    forward = fl["compute_s"] * 2.0 / (8.0 if cfg["checkpoint_activations"] else 6.0)
    # Eager (pipelined, no clipping, no fp16 loss scaling): the host Adam overlaps backward; otherwise
    # only the copies do, and the host Adam follows backward (Note [Pipelined step]).
    eager = cfg["step"] == "pipelined" and cfg["max_grad_norm"] == 0 and cfg["precision"] != "fp16"
    # Note [Update behind the next forward]: not eager, where the run had it (older JSONs: never).
    behind = not eager and cfg.get("update_behind_forward", False)
    # D79: eager at world size 1, one micro-batch, with the update behind forward: the host updates still
    # queued at backward's end run beside the next forward, so the schedule floor is the resource floor.
    world = doc.get("dist", {}).get("world_size", 1)
    carried = eager and cfg.get("update_behind_forward", False) and cfg["micro_batches"] == 1 and world == 1
    want = ("host Adam inside backward and behind the next forward" if carried else
            "host Adam inside backward" if eager else
            "host Adam behind the next forward" if behind else "host Adam after backward")
    if fl["schedule"] != want:
        sys.exit(f"check_bench_floors: schedule '{fl['schedule']}' for config {cfg}, expected '{want}'")
    during_backward = host_memory if eager else (accumulation + per_copy * copies) / r["host_adam_bytes_per_s"]
    after_backward = 0.0 if eager else max(0.0, fl["host_adam_s"] - forward) if behind else fl["host_adam_s"]
    schedule = floor if carried else max(forward + max(fl["compute_s"] - forward, during_backward) + after_backward,
                                         transfers)
    close("schedule_floor_s", fl["schedule_floor_s"], schedule)
    if schedule < floor * (1 - 2e-4):
        sys.exit(f"check_bench_floors: the schedule floor {schedule} is below the resource floor {floor}")
    check_startup(f)
    step = f["time"]["step_s"]
    close("measured_over_floor", fl["measured_over_floor"], step / floor)
    close("measured_over_schedule_floor", fl["measured_over_schedule_floor"], step / schedule)
    print(f"check_bench_floors: ok (host Adam {fl['host_adam_s']:.4g} s, host memory {host_memory:.4g} s, "
          f"floor {floor:.4g} s, schedule floor {schedule:.4g} s, step {step:.4g} s)")


if __name__ == "__main__":
    main()
