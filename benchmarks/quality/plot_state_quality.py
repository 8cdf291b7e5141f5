#!/usr/bin/env python3
"""Plots bench_state_quality's curves (training and held-out loss against steps, one colour per
optimizer) into one PNG, and prints each run's final held-out loss and its difference from the first
run's (the reference) as JSON.

    plot_state_quality.py OUT.png REFERENCE.json OTHER.json...
"""
import json
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, runs = sys.argv[1], [json.load(open(p)) for p in sys.argv[2:]]
    ref = runs[0]["final_heldout_loss"]
    print(json.dumps([{"optimizer": r["optimizer"], "state_bytes_per_param": r["state_bytes_per_param"],
                       "final_heldout_loss": r["final_heldout_loss"],
                       "relative_to_" + runs[0]["optimizer"]: r["final_heldout_loss"] / ref - 1} for r in runs], indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        pts = [p for p in r["curve"] if "train_loss" in p]
        label = f'{r["optimizer"]} ({r["state_bytes_per_param"]:.2f} B/param state)'
        axes[0].plot([p["step"] for p in pts], [p["train_loss"] for p in pts], label=label)
        axes[1].plot([p["step"] for p in r["curve"]], [p["heldout_loss"] for p in r["curve"]], label=label)
    r0 = runs[0]
    for ax, what in zip(axes, ("training loss (mean of each interval)", "held-out loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(what + ", nats/byte")
        ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend()
    commits = sorted({r["commit"] for r in runs})
    made = (f'commit {commits[0]}' if len(commits) == 1
            else 'commits ' + ', '.join(f'{r["commit"]} ({r["optimizer"]})' for r in runs))
    seeds = sorted({r.get("seed", 1) for r in runs})
    fig.suptitle(f'GPT {r0["preset"]} ({r0["parameters"] / 1e6:.2f}M), {r0["steps"]} steps of {r0["batch"]} x {r0["seq"]} bytes, '
                 f'seed {",".join(map(str, seeds))}, {made}')
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
