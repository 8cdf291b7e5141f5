#!/usr/bin/env python3
"""Checks that a wrapped model runs the operators the unwrapped one runs, from two torch-profiler traces
of the same step (bench_gpt --unpipelined --profile=BASE.json --profile-ferry=FERRY.json, everything
resident on the device, fp32).

    check_profile_ops.py FERRY.json BASE.json

Counted with benchmarks/profile_compare.py's rules (an operator re-dispatched by ferry's interceptor
counts once). Forward must run the same operators the same number of times: ferry's hooks move chunks
and account, they add no op to the model's forward. Backward may add only `aten::copy_`, one per
parameter gradient at most (Note [Gradient in the parameter slot], D37): each gradient is copied into
its parameter's slot. Exits non-zero with the first difference.
"""
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import profile_compare  # noqa: E402


def counts(events, lo, hi):
    ops = profile_compare.outermost([e for e in events if e.get("cat") == "cpu_op" and lo <= e["ts"] < hi])
    return collections.Counter(e["name"] for e in ops)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    (ef, pf), (eb, pb) = profile_compare.load(sys.argv[1]), profile_compare.load(sys.argv[2])
    for phase in ("forward", "backward"):
        if phase not in pf or phase not in pb:
            sys.exit(f"check_profile_ops: both traces need a phase.{phase} scope (run bench_gpt with --unpipelined)")
    fwd_f, fwd_b = counts(ef, *pf["forward"]), counts(eb, *pb["forward"])
    if sum(fwd_b.values()) == 0:
        sys.exit("check_profile_ops: the baseline's forward recorded no operator")
    diff = {n: (fwd_f[n], fwd_b[n]) for n in set(fwd_f) | set(fwd_b) if fwd_f[n] != fwd_b[n]}
    if diff:
        sys.exit(f"check_profile_ops: forward runs different operators (name: ferry, baseline): {diff}")
    bwd_f, bwd_b = counts(ef, *pf["backward"]), counts(eb, *pb["backward"])
    grads = bwd_b["torch::autograd::AccumulateGrad"]
    if grads == 0:
        sys.exit("check_profile_ops: the baseline's backward accumulated no gradient")
    diff = {n: (bwd_f[n], bwd_b[n]) for n in set(bwd_f) | set(bwd_b) if bwd_f[n] != bwd_b[n]}
    copies = diff.pop("aten::copy_", (0, 0))
    if diff:
        sys.exit(f"check_profile_ops: backward runs different operators (name: ferry, baseline): {diff}")
    extra = copies[0] - copies[1]
    if extra < 0 or extra > grads:
        sys.exit(f"check_profile_ops: backward ran {extra:+d} copies against the baseline's; expected between 0 and "
                 f"one per gradient ({grads})")
    print(f"check_profile_ops: ok (forward: {sum(fwd_f.values())} operators, as the baseline; backward: "
          f"{sum(bwd_f.values())}, the baseline's {sum(bwd_b.values())} + {extra} gradient copies for {grads} gradients)")


if __name__ == "__main__":
    main()
