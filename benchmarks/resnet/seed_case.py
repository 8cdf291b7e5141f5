#!/usr/bin/env python3
"""The seed's case (issue 47): at a device capacity where the ResNet example trains batch B without
recomputing anything (activations=keep) and 2B does not fit, activations=auto trains 2B. Runs
bench_resnet_plan for B and 2B under keep, recompute and auto, and writes one JSON with every run.

    python3 benchmarks/resnet/seed_case.py --build=build --batch=64 --capacity=80MiB --out=FILE.json
"""
import argparse
import json
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--capacity", default="80MiB")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    runs = []
    for batch in (a.batch, 2 * a.batch):
        for policy in ("keep", "recompute", "auto"):
            cmd = [f"{a.build}/benchmarks/bench_resnet_plan", f"--batch={batch}", f"--activations={policy}",
                   f"--device-capacity={a.capacity}", f"--commit={a.commit}", "--log-level=warn"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out))
            r = runs[-1]
            print(f"batch {batch:4d} {policy:9s} fits {r.get('fits')}  total peak {r.get('total_peak_bytes', 0) / 2**20:7.1f} MiB"
                  f"  step {r.get('step_s', 0):.4f} s  plan {r.get('plan')}", file=sys.stderr)
    keep_b, keep_2b = runs[0], runs[3]
    auto_2b = runs[5]
    verdict = bool(keep_b.get("fits")) and not keep_2b.get("fits") and bool(auto_2b.get("fits"))
    with open(a.out, "w") as f:
        json.dump({"benchmark": "resnet_seed_case", "commit": a.commit, "capacity": a.capacity, "batch": a.batch,
                   "keep_fits_b": keep_b.get("fits"), "keep_fits_2b": keep_2b.get("fits"),
                   "auto_fits_2b": auto_2b.get("fits"), "seed_case_holds": verdict, "runs": runs}, f, indent=1)
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
