#!/usr/bin/env python3
"""Where two runs of the same step differ: two torch-profiler Chrome traces (bench_gpt --profile or
--profile-ferry, and benchmarks/peers/gpt_peer.py --profile), phase by phase (the phase.* scopes they
write, each ending after a device sync), and the whole step (first phase's start to last phase's end).
Per phase: wall time, GPU busy time (union of kernel, memcpy and memset intervals), the idle rest, the
number of kernels and of operators launched (an operator recorded inside one of the same name, a
re-dispatch, counts once), the kernels whose total time differs most, and those run a different number
of times. With no GPU events (a CPU run) the operators take the kernels' place.

    python3 benchmarks/profile_compare.py A.json B.json [--labels=cpp,python] [--top=12] [--json]
"""
import argparse
import collections
import json
import sys

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path):
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    phases = {e["name"][len("phase."):]: (e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase.")}
    if not phases:
        sys.exit(f"profile_compare: {path} has no phase.* scopes (was it written by --profile?)")
    # The whole step, from its first phase's start to its last one's end: what two runs whose steps are
    # cut into different phases (ferry's pipelined backward_step) still have in common.
    phases["step"] = (min(lo for lo, _ in phases.values()), max(hi for _, hi in phases.values()))
    return events, phases


def busy(intervals):
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def shorten(name, width=70):
    return name if len(name) <= width else name[:width - 3] + "..."


def outermost(ops):
    """The operators less their re-dispatches: an operator recorded inside one of the same name on the
    same thread is the same call run again (ferry's interceptor runs each op it sees once more, below
    its dispatch key), and would count it and its time twice."""
    kept = []
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        enclosing = []
        for e in thread:
            while enclosing and e["ts"] + e["dur"] > enclosing[-1]["ts"] + enclosing[-1]["dur"]:
                enclosing.pop()
            if not (enclosing and enclosing[-1]["name"] == e["name"]):
                kept.append(e)
            enclosing.append(e)
    return kept


def phase_stats(events, lo, hi):
    gpu = [e for e in events if e.get("cat") in GPU_CATS and lo <= e["ts"] < hi]
    ops = outermost([e for e in events if e.get("cat") == "cpu_op" and lo <= e["ts"] < hi])
    rows = gpu if gpu else ops
    per_name = collections.defaultdict(float)
    count = collections.Counter()
    for e in rows:
        per_name[e["name"]] += e["dur"]
        count[e["name"]] += 1
    return {
        "wall_ms": (hi - lo) / 1e3,
        "gpu_busy_ms": busy([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) / 1e3,
        "kernels": len(gpu),
        "operators": len(ops),
        "by_name_ms": {k: v / 1e3 for k, v in per_name.items()},
        "by_name_count": dict(count),
        "unit": "kernel" if gpu else "operator",
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--labels", default="A,B")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON too")
    args = ap.parse_args()
    la, lb = args.labels.split(",")
    (ea, pa), (eb, pb) = load(args.a), load(args.b)
    report = {}
    for phase in [p for p in pa if p in pb]:
        sa, sb = phase_stats(ea, *pa[phase]), phase_stats(eb, *pb[phase])
        print(f"== {phase}")
        for key in ("wall_ms", "gpu_busy_ms", "kernels", "operators"):
            va, vb = sa[key], sb[key]
            print(f"  {key:12s} {la}: {va:10.2f}   {lb}: {vb:10.2f}   {la}-{lb}: {va - vb:+10.2f}")
        idle_a, idle_b = sa["wall_ms"] - sa["gpu_busy_ms"], sb["wall_ms"] - sb["gpu_busy_ms"]
        print(f"  {'gpu_idle_ms':12s} {la}: {idle_a:10.2f}   {lb}: {idle_b:10.2f}   {la}-{lb}: {idle_a - idle_b:+10.2f}")
        names = set(sa["by_name_ms"]) | set(sb["by_name_ms"])
        diff = sorted(names, key=lambda n: -abs(sa["by_name_ms"].get(n, 0) - sb["by_name_ms"].get(n, 0)))
        print(f"  {sa['unit']}s whose total time differs most (ms):")
        for n in diff[:args.top]:
            va, vb = sa["by_name_ms"].get(n, 0.0), sb["by_name_ms"].get(n, 0.0)
            print(f"    {va:8.2f} {vb:8.2f} {va - vb:+8.2f}  {shorten(n)}")
        ca, cb = sa["by_name_count"], sb["by_name_count"]
        counted = sorted((n for n in names if ca.get(n, 0) != cb.get(n, 0)),
                         key=lambda n: (-abs(ca.get(n, 0) - cb.get(n, 0)), n))
        if counted:
            print(f"  {sa['unit']}s run a different number of times ({la} {lb}):")
            for n in counted[:args.top]:
                print(f"    {ca.get(n, 0):8d} {cb.get(n, 0):8d} {ca.get(n, 0) - cb.get(n, 0):+8d}  {shorten(n)}")
        report[phase] = {la: {k: v for k, v in sa.items() if not k.startswith("by_name")},
                         lb: {k: v for k, v in sb.items() if not k.startswith("by_name")},
                         "largest_differences_ms": [[n, sa["by_name_ms"].get(n, 0.0), sb["by_name_ms"].get(n, 0.0)]
                                                    for n in diff[:args.top]],
                         "count_differences": [[n, ca.get(n, 0), cb.get(n, 0)] for n in counted[:args.top]]}
    if args.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
