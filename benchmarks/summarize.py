#!/usr/bin/env python3
"""Turns benchmark JSON files (benchmarks/results/*.json) into Markdown tables.

    python3 benchmarks/summarize.py benchmarks/results/cpu_adam-*.json
"""
import json
import sys


def cpu_adam_table(doc, path):
    env = doc["env"]
    lines = [
        f"`{path}` — commit `{doc['commit']}`, CPU {env['cpu']} ({env['logical_cpus']} logical CPUs, "
        f"kernel {doc['kernel']}), torch {env['torch']}, GPU: {env['gpu_name'] or 'none'}",
        "",
        "| N | threads | ferry GB/s | roof GB/s | ferry/roof | torch fused GB/s | ferry/fused | "
        "torch optim GB/s | ferry/optim | ferry+finite check GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['n'] // (1 << 20)}M | {r['threads']} | {r['ferry']['gb_per_s']:.1f} | "
            f"{r['roof']['gb_per_s']:.1f} | {r['ferry_vs_roof']:.2f} | {r['torch_fused']['gb_per_s']:.1f} | "
            f"{r['ferry_vs_torch_fused']:.2f}x | {r['torch_optim_adamw']['gb_per_s']:.1f} | "
            f"{r['ferry_vs_torch_optim']:.2f}x | {r['ferry_with_finite_check']['gb_per_s']:.1f} |")
    return "\n".join(lines)


def chunk_move_table(doc, path):
    env = doc["env"]
    lines = [
        f"`{path}` — commit `{doc['commit']}`, engine {doc['engine']}, GPU: {env['gpu_name'] or 'none'}, "
        f"CPU {env['cpu']}, torch {env['torch']}",
        "",
        "| chunk | host memory | host->device GB/s | best | device->host GB/s | best | trips |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['size_bytes'] // (1 << 20)} MiB | {r['host_memory']} | {r['h2d']['gbps']:.1f} | "
            f"{r['h2d']['gbps_best']:.1f} | {r['d2h']['gbps']:.1f} | {r['d2h']['gbps_best']:.1f} | "
            f"{r['h2d']['reps']} |")
    return "\n".join(lines)


TABLES = {"cpu_adam": cpu_adam_table, "chunk_move": chunk_move_table}


def main(paths):
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        make = TABLES.get(doc.get("benchmark"))
        if make is None:
            print(f"{path}: no table for benchmark {doc.get('benchmark')!r}", file=sys.stderr)
            return 1
        print(make(doc, path))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
