#!/usr/bin/env python3
"""Files what one device call brought back (scripts/gpu_session.sh's results.tgz, or its folder) under
benchmarks/results/ with the names the project uses, and says what each stage did.

    scripts/gpu_unpack.py RESULTS.tgz|DIR --stamp=YYYYMMDD-HHMMSS [--dest=benchmarks/results] [--dry-run]

`--stamp` is when the call ran (the device's clock is not in the files). Per stage NAME (stages.tsv:
exit status, seconds):
  - NAME.out holding bench_gpt's JSON   -> gpt-DEV-STAMP-NAME.json
  - NAME.out holding gpt_peer's JSON    -> peer-MODE-DEV-STAMP-NAME.json
  - NAME.out holding another benchmark's JSON (device_adam, cpu_adam, ...) -> BENCH-DEV-STAMP-NAME.json
  - every other JSON the stages wrote into RES (traces, profiles) -> gpu-DEV-STAMP-FILE.json
  - the stages' stderr (NAME.log), gpu_check's summary and its gpu-labelled tests' output, one file:
    gpu-session-DEV-STAMP.log
DEV is h100 or h200 from the GPU's name in the JSONs (otherwise the name, shortened; "cpu" when there is
none, as in a dry run). Nothing is overwritten: an existing destination is an error. Prints one line
per stage and the files written; exits 1 when a stage failed (the files are still written).
"""
import argparse
import glob
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile


def device_tag(docs):
    for doc in docs:
        env = doc.get("env", {})
        name = env.get("gpu_name") or ""
        if name:
            for tag in ("h100", "h200", "a100", "b200"):
                if tag in name.lower():
                    return tag
            return re.sub(r"[^a-z0-9]+", "", name.lower())[:16] or "gpu"
    return "cpu"


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_stages(res):
    """[(name, exit, seconds)] from stages.tsv; stages without a line there (an older session script)
    are named by their .out files, exit unknown."""
    rows = []
    path = os.path.join(res, "stages.tsv")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 3:
                    rows.append(tuple(parts))
    named = {r[0] for r in rows}
    for out in sorted(glob.glob(os.path.join(res, "*.out"))):
        name = os.path.basename(out)[:-4]
        if name not in named:
            rows.append((name, "?", "?"))
    return rows


def plan(res, stamp, dest):
    """[(source, destination)] and the stage rows, without touching anything."""
    stages = read_stages(res)
    outs = {name: load_json(os.path.join(res, name + ".out")) for name, _, _ in stages}
    dev = device_tag([d for d in outs.values() if isinstance(d, dict)])
    moves = []
    for name, doc in outs.items():
        if not isinstance(doc, dict) or "benchmark" not in doc:
            continue
        bench = doc["benchmark"]
        if bench == "gpt":
            target = f"gpt-{dev}-{stamp}-{name}.json"
        elif bench == "gpt_peer":
            target = f"peer-{doc.get('mode', 'peer')}-{dev}-{stamp}-{name}.json"
        else:
            target = f"{bench}-{dev}-{stamp}-{name}.json"
        moves.append((os.path.join(res, name + ".out"), os.path.join(dest, target)))
    for path in sorted(glob.glob(os.path.join(res, "*.json"))):
        moves.append((path, os.path.join(dest, f"gpu-{dev}-{stamp}-{os.path.basename(path)}")))
    return stages, moves, os.path.join(dest, f"gpu-session-{dev}-{stamp}.log")


def session_log(res, stages):
    parts = []
    commit = os.path.join(res, "commit.txt")
    if os.path.exists(commit):
        parts.append(f"# commit {open(commit).read().strip()}")
    parts.append("# stage\texit\tseconds")
    parts += ["\t".join(s) for s in stages]
    for extra in ("check/summary.txt", "check/gpu_tests.log"):
        path = os.path.join(res, extra)
        if os.path.exists(path):
            parts.append(f"\n## {extra}\n" + open(path, errors="replace").read().rstrip())
    for name, _, _ in stages:
        path = os.path.join(res, name + ".log")
        if os.path.exists(path):
            parts.append(f"\n## {name}.log\n" + open(path, errors="replace").read().rstrip())
    return "\n".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="results.tgz or the folder it was packed from")
    ap.add_argument("--stamp", required=True, help="when the call ran, YYYYMMDD-HHMMSS")
    ap.add_argument("--dest", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                   "benchmarks", "results"))
    ap.add_argument("--dry-run", action="store_true", help="say what would be written, write nothing")
    args = ap.parse_args()
    if not re.fullmatch(r"\d{8}-\d{4,6}", args.stamp):
        sys.exit(f"gpu_unpack: --stamp must look like 20261124-1530 or 20261124-153000, got {args.stamp!r}")
    with tempfile.TemporaryDirectory(prefix="ferry-gpu-unpack-") as tmp:
        res = args.results
        if os.path.isfile(res):
            with tarfile.open(res) as tar:
                tar.extractall(tmp, filter="data")
            res = tmp
        if not os.path.isdir(res):
            sys.exit(f"gpu_unpack: {args.results} is neither a results.tgz nor a folder")
        stages, moves, log_path = plan(res, args.stamp, args.dest)
        if not stages:
            sys.exit(f"gpu_unpack: {args.results} holds no stage (no stages.tsv, no NAME.out)")
        clashes = [d for _, d in moves + [(None, log_path)] if os.path.exists(d)]
        if clashes:
            sys.exit("gpu_unpack: would overwrite " + ", ".join(clashes))
        failed = [s for s in stages if s[1] not in ("0", "?")]
        for name, rc, secs in stages:
            mark = "ok  " if rc == "0" else "?   " if rc == "?" else "FAIL"
            print(f"gpu_unpack: {mark} {name} (exit {rc}, {secs} s)")
        for src, dst in moves + [("(stage logs)", log_path)]:
            print(f"gpu_unpack: {os.path.basename(src)} -> {dst}")
        if not args.dry_run:
            os.makedirs(args.dest, exist_ok=True)
            for src, dst in moves:
                shutil.copyfile(src, dst)
            with open(log_path, "w") as f:
                f.write(session_log(res, stages))
    if failed:
        sys.exit(f"gpu_unpack: {len(failed)} stage(s) did not exit 0: " + ", ".join(s[0] for s in failed))
    print(f"gpu_unpack: {len(stages)} stage(s), {len(moves) + 1} file(s)" + (" (dry run)" if args.dry_run else ""))


if __name__ == "__main__":
    main()
