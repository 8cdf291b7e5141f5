#!/usr/bin/env python3
"""Before (ea424b9) against after (the structure change, issue 46) on the CPU machine: the medians of
the interleaved rounds in this folder, ferry over the same run's own baseline (bench_gpt) or over the
same run's memory roof (bench_cpu_adam), so that the machine's drift between rounds cancels.

    python3 benchmarks/results/structure-cpu2-20261126/compare.py
"""
import collections
import glob
import json
import os
import re
import statistics

here = os.path.dirname(os.path.abspath(__file__))
runs = collections.defaultdict(lambda: collections.defaultdict(list))
for path in sorted(glob.glob(os.path.join(here, "*.json"))):
    name, _, side = re.match(r"(.*)-r(\d)-(before|after)\.json", os.path.basename(path)).groups()
    doc = json.load(open(path))
    if doc["benchmark"] == "gpt":
        f, b = doc["ferry"], doc["baseline"]
        runs[name][side].append({"commit": doc["commit"], "step_s": f["time"]["step_s"],
                                 "forward_s": f["time"]["forward_s"],
                                 "ratio": f["time"]["step_s"] / b["time"]["step_s"]})
    else:
        for r in doc["results"]:
            runs[f"{name}-{r['n'] >> 20}M-{r['threads']}t"][side].append(
                {"commit": doc["commit"], "step_s": r["ferry"]["median_s"], "forward_s": float("nan"),
                 "ratio": r["ferry_vs_roof"]})

print("| run | rounds | commit before / after | median ratio before | after | median step s before | after |")
print("|---|---:|---|---:|---:|---:|---:|")
for name, sides in runs.items():
    b, a = sides["before"], sides["after"]
    med = lambda xs, k: statistics.median(x[k] for x in xs)
    print(f"| {name} | {len(b)}/{len(a)} | {b[0]['commit'][:7]} / {a[0]['commit'][:7]} | {med(b, 'ratio'):.3f} | "
          f"{med(a, 'ratio'):.3f} | {med(b, 'step_s'):.4f} | {med(a, 'step_s'):.4f} |")
