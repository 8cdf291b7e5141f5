#!/usr/bin/env python3
"""Runs the stages of GPU stage files on the CPU, shrunk, so that a device call is not lost to a
misspelt option, a renamed binary or a path that does not exist (scripts/gpu_session.sh runs them
for real on a GPU; each stage has one chance there).

    scripts/gpu_dryrun.py --build=BUILD_DIR [--timeout=120] [--keep=DIR] STAGES_FILE...

Every stage's command is rewritten: the CUDA device becomes the simulated one (ferry's binaries) or
the CPU (the Python peers), NCCL becomes Gloo, the preset tiny, the batch 2 x 32 tokens, one warm-up
and one measured step, no loss expectation, and bench_device_adam's sizes a few thousand elements.
`python3` is the interpreter that runs this script (it needs torch). Everything else, options
included, runs as written, with BUILD, RES (a temporary results folder)
and COMMIT set as gpu_session.sh sets them; like it, each stage's stdout goes to RES/NAME.out, its
stderr to RES/NAME.log and its exit status to RES/stages.tsv (--keep=DIR: RES is DIR, kept, for
scripts/gpu_unpack.py). What this does not check: anything CUDA does (kernels, memory, NCCL) and
whether the stage fits its time limit on the GPU. Prints one line per stage and exits 1 if any stage
fails.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

# (pattern, replacement) applied in order to every stage's command.
REWRITES = [
    (r"--device=cuda", "--device=simulated"),
    (r"--dist-backend=nccl", "--dist-backend=gloo"),
    (r"--preset=\S+", "--preset=tiny"),
    (r"--batch=\d+", "--batch=2"),
    (r"--seq=\d+", "--seq=32"),
    (r"--steps=\d+", "--steps=1"),
    (r"--warmup-steps=\d+", "--warmup-steps=1"),
    (r"--log-every=\d+", "--log-every=1"),
    (r" --expect-loss-below=\S+", ""),
]


def shrink(cmd):
    """The stage's command as it runs on the CPU."""
    for pattern, replacement in REWRITES:
        cmd = re.sub(pattern, replacement, cmd)
    # The interpreter running this script (ctest's, with torch) for the stages' `python3`.
    cmd = re.sub(r"(^|\s)python3(?=\s)", lambda m: m.group(1) + sys.executable, cmd)
    if "gpt_peer.py" in cmd:
        cmd = cmd.replace("--device=simulated", "--device=cpu")
        if "--device=" not in cmd:
            cmd += " --device=cpu"
    if "bench_device_adam" in cmd:
        cmd += " --small=4096 --large=65536 --min-time=0"
    if "train_gpt" in cmd and "--preset=" not in cmd:
        cmd += " --preset=tiny"
    return cmd


def stages(path):
    """(name, seconds, command) of each stage line, as gpu_session.sh reads them."""
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            name, seconds, cmd = line.rstrip("\n").split(None, 2)
            yield name, int(seconds), cmd


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="the build directory (BUILD in the stages)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per shrunk stage (default 120)")
    ap.add_argument("--keep", default="", help="results folder to keep (RES); default: a temporary one")
    ap.add_argument("stage_files", nargs="+")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    failed = 0
    seen = {}  # shrunk command -> the stage that ran it (several presets shrink to the same run)
    names = set()
    with tempfile.TemporaryDirectory(prefix="ferry-gpu-dryrun-") as tmp:
        res = os.path.abspath(args.keep) if args.keep else tmp
        os.makedirs(res, exist_ok=True)
        env = dict(os.environ, BUILD=os.path.abspath(args.build), RES=res, COMMIT="dryrun")
        for path in args.stage_files:
            for name, _, cmd in stages(path):
                small = shrink(cmd)
                label = f"{os.path.basename(path)}:{name}"
                if small in seen:
                    print(f"gpu_dryrun: same {label} (shrinks to {seen[small]}'s run)", flush=True)
                    continue
                seen[small] = label
                if name in names:  # the same stage name in two files: RES holds one NAME.out per name
                    name = f"{os.path.splitext(os.path.basename(path))[0]}-{name}"
                names.add(name)
                start = time.time()
                out_path, log_path = os.path.join(res, name + ".out"), os.path.join(res, name + ".log")
                with open(out_path, "w") as out, open(log_path, "w") as err:
                    try:
                        rc = subprocess.run(["bash", "-c", small], cwd=root, env=env, stdout=out, stderr=err,
                                            timeout=args.timeout).returncode
                        ok, why = rc == 0, f"exit {rc}"
                    except subprocess.TimeoutExpired:
                        rc, ok, why = 124, False, f"over {args.timeout} s"
                with open(os.path.join(res, "stages.tsv"), "a") as tsv:
                    tsv.write(f"{name}\t{rc}\t{round(time.time() - start)}\n")
                with open(log_path, errors="replace") as err:
                    tail = err.read().strip().splitlines()[-3:]
                print(f"gpu_dryrun: {'ok  ' if ok else 'FAIL'} {label} ({why})", flush=True)
                if not ok:
                    failed += 1
                    print(f"  ran: {small}", flush=True)
                    for line in tail:
                        print(f"  {line}", flush=True)
    if failed:
        sys.exit(f"gpu_dryrun: {failed} stage(s) failed")
    print("gpu_dryrun: every stage ran")


if __name__ == "__main__":
    main()
