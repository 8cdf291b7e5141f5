#!/usr/bin/env python3
"""Turns benchmark JSON files (benchmarks/results/*.json) into Markdown tables, and bench_gpt results
into PNG plots next to them (step-time breakdown, memory) when matplotlib is installed.

    python3 benchmarks/summarize.py benchmarks/results/cpu_adam-*.json
    python3 benchmarks/summarize.py --plots benchmarks/results/gpt-*.json
    python3 benchmarks/summarize.py --scaling=OUT.png benchmarks/results/gpt-h100-*.json \
        benchmarks/results/peer-*-h100-*.json
        (tokens/s against model size, one line per system: ferry, and the peers by mode)
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


def device_adam_table(doc, path):
    env = doc["env"]
    lines = [
        f"`{path}` — commit `{doc['commit']}`, device {doc['device']} ({env['gpu_name'] or 'no GPU'}), "
        f"torch {env['torch']}, {doc['declared_bytes_per_param']:g} B/param declared",
        "",
        "| N | roof GB/s | floor ms | ferry ms | ferry GB/s | ferry/floor | torch fused ms | torch/floor | "
        "ferry speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["results"]:
        f, t = r["ferry"], r["torch_fused"]
        lines.append(
            f"| {r['n'] / (1 << 20):g}M | {r['roof_gb_per_s']:.0f} | {r['floor_s'] * 1e3:.2f} | "
            f"{f['median_s'] * 1e3:.2f} | {f['gb_per_s']:.0f} | {f['over_floor']:.2f} | {t['median_s'] * 1e3:.2f} | "
            f"{t['over_floor']:.2f} | {r['ferry_vs_torch_fused']:.2f}x |")
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


def mib(b):
    return f"{b / (1 << 20):.1f}"


def watched_ops(i):
    """Ops outside the scopes while a thread watches (D57), where the JSON has them."""
    if "watched_plain_ns_per_op" not in i:
        return ""
    return (f"; outside the scopes while watched: {i['watched_plain_ns_per_op'] - i['plain_ns_per_op']:.0f} ns "
            f"more per op, {i['watched_managed_ns_per_op'] - i['plain_ns_per_op']:.0f} ns on a parameter")


def gpt_table(doc, path):
    env, c = doc["env"], doc["config"]
    mem = doc.get("ferry", {}).get("memory")
    chunk = mib(mem["chunk_size_bytes"]) + " MiB (auto)" if mem and not c["chunk_size_bytes"] else \
        mib(c["chunk_size_bytes"]) + " MiB"
    head = (f"`{path}` — commit `{doc['commit']}`, device {doc['device']} ({env['gpu_name'] or env['cpu']}), "
            f"torch {env['torch']}, {c['precision']}, chunk {chunk}, device budget "
            f"{mib(c['device_budget_bytes']) + ' MiB' if c['device_budget_bytes'] else 'none'}, batch {c['batch']} x "
            f"seq {c['seq']}, checkpointing {'on' if c['checkpoint_activations'] else 'off'}")
    if "find_max" in doc:
        lines = [head, "", "| preset | parameters | outcome |", "|---|---:|---|"]
        for r in doc["find_max"]:
            lines.append(f"| {r['preset']} | {r['params'] / 1e6:.1f}M | {r['outcome']} |")
        lines.append(f"\nLargest preset that trains 3 steps: **{doc['largest_preset']}**")
        return "\n".join(lines)
    m, f = doc["model"], doc["ferry"]
    lines = [head, "",
             f"Model {m['preset']}: {m['params'] / 1e6:.1f}M parameters. Interception: "
             f"{doc['interception']['overhead_ns_per_op']:.0f} ns per op over a plain op "
             f"({doc['interception']['plain_ns_per_op']:.0f} ns)" + watched_ops(doc['interception']) + ".", "",
             "| run | fwd s | bwd s | opt s | copy wait s | step s | tokens/s | TFLOPS 6N | TFLOPS 8N | "
             "activations MiB | device peak MiB | host peak MiB | pinned MiB | moved MiB/step | moved/optimal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    t = f["time"]
    lines.append(f"| ferry | {t['forward_s']:.3f} | {t['backward_s']:.3f} | {t['optimizer_s']:.3f} | "
                 f"{t['copy_wait_s']:.3f} | {t['step_s']:.3f} | {f['tokens_per_s']:.0f} | {f['tflops_6n']:.3f} | "
                 f"{f['tflops_8n']:.3f} | {mib(f.get('activation_bytes', 0))} | {mib(f['device_peak_bytes'])} | {mib(f['host_peak_bytes'])} | "
                 f"{mib(f['pinned_peak_bytes'])} | {mib(f['moved_bytes_per_step'])} | {f['moved_over_optimal']:.2f} |")
    if "baseline" in doc:
        b = doc["baseline"]
        tb = b["time"]
        lines.append(f"| baseline ({b['kind']}) | {tb['forward_s']:.3f} | {tb['backward_s']:.3f} | "
                     f"{tb['optimizer_s']:.3f} | - | {tb['step_s']:.3f} | {b['tokens_per_s']:.0f} | "
                     f"{b['tflops_6n']:.3f} | - | - | - | - | - | - | - |")
        lines.append("")
        lines.append(f"ferry/baseline: step time {doc['ferry_over_baseline_step_time']:.3f}x, forward+backward "
                     f"{doc['ferry_over_baseline_fwd_bwd']:.3f}x")
    if doc.get("device") == "cuda" and doc["config"].get("step") == "pipelined":
        lines.append("")
        lines.append(f"ferry's split: {f['phase_clock']}." if "phase_clock" in f else
                     "ferry's split is the host's clock (a run before D54): the GPU's backward tail counts as "
                     "optimizer; the step time is right.")
    if mem:
        gib = lambda x: f"{x / (1 << 30):.2f}"
        lines += ["", "| host B/param | device B/param | total B/param | waste | pinned peak GiB | pinnable peak GiB | "
                      "state pool peak GiB | RSS after construction GiB | RSS peak GiB | fp32 model GiB | init scope | "
                      "construction s | start-up s |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
                  f"| {mem['host_bytes_per_param']:.2f} | {mem['device_bytes_per_param']:.2f} | "
                  f"{mem['total_bytes_per_param']:.2f} | {mem['waste'] * 100:.1f}% | {gib(mem['pinned_peak_bytes'])} | "
                  f"{gib(mem['pinnable_peak_bytes'])} | {gib(mem['unpinned_state_pool_peak_bytes'])} | "
                  f"{gib(mem['host_rss_peak_after_construction_bytes'])} | {gib(mem['host_rss_peak_bytes'])} | "
                  f"{gib(mem['fp32_model_bytes'])} | {'yes' if mem['init_scope'] else 'no'} | "
                  f"{f['construction_s']:.1f} | {f['startup_s']:.1f} |"]
        if "startup_breakdown" in f:
            sb = f["startup_breakdown"]
            lines += ["", f"Start-up {f['startup_s']:.1f} s: module {sb['module_s']:.1f} s, ChunkedModel "
                          f"{sb['wrap_s']:.1f} s, HybridAdam {sb['optimizer_construction_s']:.1f} s, first step "
                          f"{sb['first_step_s']:.1f} s (its repack {sb['repack_s']:.2f} s)."]
    if "syncs_per_step" in f:
        lines += ["", f"Step: {c.get('step', 'unpipelined')}; per step {f['syncs_per_step']:.1f} host syncs of the "
                      f"training thread (+{f['background_syncs_per_step']:.1f} on the optimizer's worker), "
                      f"{f['transfers_per_step']:.1f} chunk transfers, {f['overlapped_chunks_per_step']:.1f} chunks "
                      f"pipelined during backward."]
    if "floor" in doc:
        fl, r = doc["floor"], doc["floor"]["rates"]
        gbs = lambda x: f"{x / 1e9:.1f}"
        lines += ["", "| floor | s | rate |", "|---|---:|---|",
                  f"| GPU compute | {fl['compute_s']:.3f} | {r['compute_flops_per_s'] / 1e12:.1f} TFLOPS ({r['compute_rate_from']}) |",
                  f"| transfers | {fl['transfers_s']:.3f} | {gbs(r['h2d_bytes_per_s'])} GB/s h2d, {gbs(r['d2h_bytes_per_s'])} GB/s d2h |",
                  f"| host Adam | {fl['host_adam_s']:.3f} | {gbs(r['host_adam_bytes_per_s'])} GB/s at 28 B/param |"]
        if "host_memory_s" in fl:
            lines += [f"| host memory (host Adam + copies) | {fl['host_memory_s']:.3f} | the same roof |"]
        lines += [f"| **measured / floor** | **{fl['measured_over_floor']:.2f}x** | step {t['step_s']:.3f} s, floor {fl['floor_s']:.3f} s |"]
        if "schedule_floor_s" in fl:
            lines += [f"| measured / schedule floor (D52) | {fl['measured_over_schedule_floor']:.2f}x | "
                      f"forward + max(backward, host memory) = {fl['schedule_floor_s']:.3f} s |"]
    if "dist" in doc:
        d = doc["dist"]
        lines += ["", f"Data parallel: {d['world_size']} ranks over {d['backend']} (rank {d['rank']}'s report), "
                      f"{d['batch_per_rank']} sequences per rank, {d['global_tokens_per_s']:.0f} tokens/s over all ranks.", "",
                  "| sent / step (ring) MiB | floor MiB (2(N-1)/N x param bytes) | sent / floor | chunk floor MiB | "
                  "collectives / step | comm s / step | optimizer state on this rank MiB |",
                  "|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {mib(d['ring_bytes_per_step'])} | {mib(d['floor_bytes_per_step'])} | {d['over_floor']:.3f} | "
                  f"{mib(d['chunk_floor_bytes_per_step'])} | {d['collectives_per_step']:.0f} | {d['comm_s_per_step']:.3f} | "
                  f"{mib(d['optimizer_state_bytes_this_rank'])} |"]
        if "memory_per_rank" in d:
            m = d["memory_per_rank"]
            lines += ["", f"Memory per rank: parameter chunks {m['parameter_chunk_bytes_per_param']:.2f} + optimizer state "
                          f"{m['state_bytes_per_param']:.2f} B/param; fully sharded (parameters and state 1/N) "
                          f"{m['fully_sharded_bytes_per_param']:.2f} B/param."]
    return "\n".join(lines)


def gpt_plots(doc, path):
    """Step-time breakdown (ferry vs baseline) and memory of one step, as PNGs next to the JSON."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{path}: matplotlib not installed, no plots", file=sys.stderr)
        return []
    if "ferry" not in doc:
        return []
    runs = [("ferry", doc["ferry"]["time"])]
    if "baseline" in doc:
        runs.append(("baseline", doc["baseline"]["time"]))
    import os
    trace_path = doc["config"].get("trace") or ""
    if trace_path:  # stored next to the JSON (the recorded path may be from another checkout)
        trace_path = os.path.join(os.path.dirname(path), os.path.basename(trace_path))
    has_trace = bool(trace_path) and os.path.exists(trace_path)
    fig, axes = plt.subplots(1, 3 if has_trace else 2, figsize=(17 if has_trace else 11, 4))
    ax1, ax2 = axes[0], axes[1]
    parts = [("forward_s", "forward"), ("backward_s", "backward"), ("optimizer_s", "optimizer")]
    bottom = [0.0] * len(runs)
    for key, label in parts:
        vals = [t[key] for _, t in runs]
        ax1.bar([r for r, _ in runs], vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("seconds per step")
    ax1.set_title(f"{doc['model']['preset']}: step time")
    ax1.legend()
    f = doc["ferry"]
    labels = ["device peak", "host peak", "pinned peak", "opt. state device", "opt. state host", "moved / step"]
    vals = [f["device_peak_bytes"], f["host_peak_bytes"], f["pinned_peak_bytes"], f["optimizer_state_device_bytes"],
            f["optimizer_state_host_bytes"], f["moved_bytes_per_step"]]
    ax2.barh(labels, [v / (1 << 20) for v in vals])
    ax2.set_xlabel("MiB")
    ax2.set_title("ferry memory and traffic per step")
    if has_trace:  # memory over one step, from the Chrome trace's counters
        with open(trace_path) as tf:
            events = json.load(tf)["traceEvents"]
        ax3 = axes[2]
        series = {}
        for e in events:
            if e["ph"] == "C":
                series.setdefault(e["name"], []).append((e["ts"] / 1000.0, e["args"]["bytes"] / (1 << 20)))
        for name, pts in sorted(series.items()):
            ax3.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=name)
        for e in events:
            if e["ph"] == "X" and e["cat"] in ("model", "adam") and e["name"] in ("forward", "backward", "adam.step"):
                ax3.axvspan(e["ts"] / 1000.0, (e["ts"] + e["dur"]) / 1000.0, alpha=0.08)
                ax3.text(e["ts"] / 1000.0, 0.02, e["name"], fontsize=7, rotation=90, va="bottom",
                         transform=ax3.get_xaxis_transform())
        ax3.set_xlabel("ms")
        ax3.set_ylabel("MiB")
        ax3.set_title("chunk memory over one step")
        ax3.legend(fontsize=7)
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=100)
    return [out]


def trace_breakdown(path):
    """The step breakdown of a Chrome trace written by --trace: time in forward, backward and the
    optimizer's phases; the pipelined host Adam (on CpuAdam's worker) and how much of it ran while
    backward went on; the host Adam left running behind the step and how much of it forward covered; the copies as the copy stream ran them (or, untimed, in flight) per direction;
    the host's waits for copies."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    def spans(pred):
        return [(e["ts"], e["ts"] + e["dur"]) for e in events if pred(e)]
    def total(iv):
        return sum(b - a for a, b in iv) / 1000.0
    def overlap(iv, windows):
        return sum(max(0.0, min(b, wb) - max(a, wa)) for a, b in iv for wa, wb in windows) / 1000.0
    backward = spans(lambda e: e["cat"] == "model" and e["name"] == "backward")
    rows = [("forward", total(spans(lambda e: e["cat"] == "model" and e["name"] == "forward")), "host"),
            ("backward", total(backward), "host: the backward() call")]
    for name in ("forward", "backward"):  # ChunkedModel::trace_last_phases: as the device ran them
        iv = spans(lambda e, n=name: e["cat"] == "device" and e["name"] == n)
        if iv:
            late = max(b for _, b in iv) - max(b for _, b in backward) if name == "backward" and backward else 0.0
            rows.append((f"{name} on the device", total(iv),
                         f"ends {late / 1000.0:+.3f} ms from the end of the host's call" if name == "backward" else ""))
    for name in ("adam.finish_pipelined_step", "adam.finish_dist_pipelined_step", "adam.step", "adam.dist_step",
                 "adam.stage_param_chunks", "adam.grad_norm", "adam.reduce_scatter_grads", "adam.device_update",
                 "adam.host_update", "adam.writeback", "adam.all_gather_params"):
        iv = spans(lambda e, n=name: e["cat"] == "adam" and e["name"] == n)
        if iv:
            rows.append((name, total(iv), ""))
    for kind in ("host", "device", "owner"):
        iv = spans(lambda e, k=kind: e["cat"] == "adam" and e["name"].startswith(f"pipelined {k} adam chunk"))
        if iv:
            rows.append((f"pipelined {kind} Adam ({len(iv)} chunks)", total(iv),
                         f"{overlap(iv, backward):.3f} ms of it during backward"))
    # Note [Update behind the next forward]: host updates left running by the previous step, how much of
    # them the forward (on the host) covered, and the forward's waits for them.
    forward = spans(lambda e: e["cat"] == "model" and e["name"] == "forward")
    iv = spans(lambda e: e["cat"] == "adam" and e["name"].startswith("deferred host adam chunk"))
    if iv:
        rows.append((f"host Adam behind the step ({len(iv)} chunks)", total(iv),
                     f"{overlap(iv, forward):.3f} ms of it during forward"))
    iv = spans(lambda e: e["cat"] == "adam" and e["name"].startswith("wait for host adam chunk"))
    if iv:
        rows.append((f"forward's waits for them ({len(iv)})", total(iv), ""))
    for op in ("reduce_scatter", "all_gather", "all_reduce", "wait reduce_scatter"):  # collectives (dist)
        iv = spans(lambda e, o=op: e["cat"] == "dist" and e["name"] == o)
        if iv:
            rows.append((f"{op} ({len(iv)})", total(iv), f"{overlap(iv, backward):.3f} ms of it during backward"))
    iv = spans(lambda e: e["cat"] == "adam" and e["name"].startswith("reduce_scatter group"))
    if iv:
        rows.append((f"group reduce-scatters started ({len(iv)})", total(iv),
                     f"{overlap(iv, backward):.3f} ms of it during backward"))
    # Copies as the copy stream ran them (ChunkStore::trace_copies; category "link"): the link's busy
    # time per direction, the rate while busy, and how much of it the device's backward hid.
    device_backward = spans(lambda e: e["cat"] == "device" and e["name"] == "backward")
    link = [e for e in events if e["cat"] == "link"]
    for d in ("h2d", "d2h"):
        ev = [e for e in link if e["name"].startswith(d)]
        if ev:
            iv = [(e["ts"], e["ts"] + e["dur"]) for e in ev]
            gb = sum(e.get("args", {}).get("bytes", 0) for e in ev) / 1e9
            busy = total(iv)
            rows.append((f"{d} on the copy stream ({len(ev)})", busy,
                         f"{gb:.2f} GB at {gb / (busy / 1e3) if busy else 0:.1f} GB/s while copying; "
                         f"{overlap(iv, device_backward):.3f} ms during the device's backward"))
    if link:
        first = min(e["ts"] for e in events if e["cat"] in ("model", "device"))
        last = max(e["ts"] + e["dur"] for e in events)
        busy = total([(e["ts"], e["ts"] + e["dur"]) for e in link])  # one FIFO stream: no overlaps
        rows.append(("copy stream busy", busy, f"{100 * busy / ((last - first) / 1e3):.0f}% of the step's "
                     f"{(last - first) / 1e3:.1f} ms (first forward to last event)"))
    for d in ("h2d", "d2h"):  # engines that cannot time copies: issue to the host's seeing them done
        iv = spans(lambda e, d=d: e["cat"] == "copy" and e["name"].startswith(d))
        if iv:
            rows.append((f"{d} copies in flight ({len(iv)})", total(iv),
                         f"{overlap(iv, backward):.3f} ms of it during backward"))
    waits = spans(lambda e: e["cat"] == "wait")
    rows.append((f"host waits for copies ({len(waits)})", total(waits), ""))
    lines = [f"Step breakdown from `{path}`:", "", "| phase | ms | note |", "|---|---:|---|"]
    lines += [f"| {n} | {ms:.3f} | {note} |" for n, ms, note in rows]
    return "\n".join(lines)


def peer_optimizer(doc):
    """torch.optim.AdamW's implementation in a gpt_peer result. JSONs from before gpt_peer.py's
    --optimizer carry none: their FSDP2 runs left AdamW to itself, which takes the for-loop one for CPU
    tensors, and their plain runs asked for fused on CUDA."""
    if "optimizer" in doc:
        return doc["optimizer"]
    return "for-loop" if doc.get("mode") == "fsdp2" or doc.get("device") == "cpu" else "fused"


def peer_table(doc, path):
    t, m = doc["time"], doc["memory"]
    kind = doc["kind"] if "optimizer" in doc else f"{doc['kind']} (AdamW {peer_optimizer(doc)})"
    return "\n".join([
        f"`{path}` — {kind}, commit `{doc['commit']}`, torch {doc['env']['torch']}, "
        f"GPU {doc['env']['gpu_name'] or 'none'}",
        "",
        "| preset | params | batch x seq | step s | fwd s | bwd s | opt s | tokens/s | TFLOPS 6N | start-up s | "
        "host RSS peak GiB | device peak GiB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {doc['model']['preset']} | {doc['model']['params'] / 1e9:.2f}B | {doc['config']['batch']} x "
        f"{doc['config']['seq']} | {t['step_s']:.4f} | {t['forward_s']:.4f} | {t['backward_s']:.4f} | "
        f"{t['optimizer_s']:.4f} | {doc['tokens_per_s']:,.0f} | {doc['tflops_6n']:.0f} | {doc['startup_s']:.1f} | "
        f"{m['host_rss_peak_bytes'] / 2**30:.1f} | {m['device_peak_bytes'] / 2**30:.1f} |"])


def scaling_plot(docs, out):
    """tokens/s against parameters, one line per system (ferry; each peer mode), from gpt and gpt_peer
    results of one machine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines = {}
    for doc in docs:
        if doc.get("benchmark") == "gpt" and "ferry" in doc:
            name = "ferry" + (" (activation checkpointing)" if doc["config"].get("checkpoint_activations") else "")
            lines.setdefault(name, []).append((doc["model"]["params"], doc["ferry"]["tokens_per_s"]))
            if "baseline" in doc:
                lines.setdefault("bench_gpt C++ baseline", []).append((doc["model"]["params"],
                                                                       doc["baseline"]["tokens_per_s"]))
        elif doc.get("benchmark") == "gpt_peer":
            name = {"plain": "plain PyTorch", "fsdp2": "FSDP2 + CPU offload"}.get(doc["mode"], doc["mode"])
            name += f", AdamW {peer_optimizer(doc)}"
            lines.setdefault(name, []).append((doc["model"]["params"], doc["tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p / 1e9 for p, _ in pts], [v for _, v in pts], marker="o", label=name)
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log")
    ax.set_title("GPT training throughput, one GPU, bf16, batch 8 x 1024")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


TABLES = {"cpu_adam": cpu_adam_table, "device_adam": device_adam_table, "chunk_move": chunk_move_table, "gpt": gpt_table, "gpt_peer": peer_table}
PLOTS = {"gpt": gpt_plots}


def main(paths):
    plots = "--plots" in paths
    scaling = [p.split("=", 1)[1] for p in paths if p.startswith("--scaling=")]
    paths = [p for p in paths if p != "--plots" and not p.startswith("--scaling=")]
    if scaling:
        docs = []
        for path in paths:
            with open(path) as f:
                docs.append(json.load(f))
        print(f"![{scaling[0]}]({scaling[0].rsplit('/', 1)[-1]})")
        scaling_plot(docs, scaling[0])
        return 0
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if "traceEvents" in doc:  # a Chrome trace (bench_gpt --trace, train_gpt --trace)
            print(trace_breakdown(path))
            print()
            continue
        make = TABLES.get(doc.get("benchmark"))
        if make is None:
            print(f"{path}: no table for benchmark {doc.get('benchmark')!r}", file=sys.stderr)
            return 1
        print(make(doc, path))
        print()
        if plots and doc.get("benchmark") in PLOTS:
            for png in PLOTS[doc["benchmark"]](doc, path):
                print(f"![{png}]({png.rsplit('/', 1)[-1]})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
