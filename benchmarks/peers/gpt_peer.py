#!/usr/bin/env python3
"""The peers bench_gpt is compared with, on the same GPT (examples/gpt, mirrored here op for op) and
the same batch: PyTorch FSDP2 with CPU offload at world size 1, and plain PyTorch. Prints one JSON
document like bench_gpt's (progress on stderr).

  python3 benchmarks/peers/gpt_peer.py --mode=fsdp2 --preset=4b --batch=8 --seq=1024 [--steps=5]
      fully_shard per block + root, CPUOffloadPolicy(pin_memory=True), MixedPrecisionPolicy(bf16
      params, fp32 reduce), torch.optim.AdamW over the sharded fp32 parameters (on the CPU), fused
      (--optimizer, below).
  python3 benchmarks/peers/gpt_peer.py --mode=plain --preset=1b ...
      the model on the GPU in fp32, bf16 autocast, torch.optim.AdamW (fused: --optimizer, below).
  --checkpoint-activations: torch.utils.checkpoint around each block (as ferry::checkpoint).
  --optimizer=fused|foreach|for-loop: torch.optim.AdamW's implementation (default fused, the fastest torch
      has on the CPU as on the GPU). Left to itself AdamW takes the for-loop one for CPU tensors, FSDP2's
      offloaded shards among them: 7.7x slower than fused on a 2-core CPU (64 x 1M fp32 parameters,
      benchmarks/results/adamw-impls-cpu2-20261126-180333.txt), and
      the FSDP2 runs of 2026-11-26 on the H100 spent 6.2 of their 7.4 s at 4b in it. Those runs predate
      this option; their JSONs carry no "optimizer" field.
  --device=cpu runs either mode on the CPU (gloo; a smoke test of this script, not a measurement).

Memory: process RSS peak (getrusage), CUDA allocator peak, and start-up (process start to the end of
the first step). Numbers are measured; nothing here is typed in.
"""
import argparse
import json
import math
import os
import resource
import socket
import sys
import time

T_START = time.time()

import torch  # noqa: E402  (start-up includes importing torch)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PRESETS = {  # name: (hidden, layers, heads, seq) -- examples/gpt/gpt.cpp
    "tiny": (128, 4, 4, 128), "small": (256, 6, 8, 256), "medium": (768, 12, 12, 1024),
    "1b": (2048, 20, 16, 1024), "2b": (2560, 26, 16, 1024), "4b": (2304, 64, 16, 1024),
    "6b": (3072, 53, 16, 1024), "8b": (3072, 72, 16, 1024), "10b": (4096, 50, 16, 1024),
    "12b": (4096, 60, 16, 1024), "15b": (4096, 78, 16, 1024), "20b": (8192, 25, 16, 1024),
    "30b": (8192, 37, 16, 1024),
}
VOCAB = 256


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.out = nn.Linear(4 * h, h)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        h = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return h + self.out(F.gelu(self.fc(self.ln2(h)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, hidden, layers, heads, seq, checkpoint=False):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.checkpoint = checkpoint
        with torch.no_grad():  # GPT-2 initialization, as gpt.cpp
            for name, p in self.named_parameters():
                if "ln" in name:
                    continue
                if name.endswith("bias"):
                    p.zero_()
                else:
                    residual = "proj.weight" in name or "out.weight" in name
                    p.normal_(0.0, 0.02 / math.sqrt(2.0 * layers) if residual else 0.02)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for b in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()


def rss_peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["fsdp2", "plain"], required=True)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--checkpoint-activations", action="store_true")
    ap.add_argument("--optimizer", choices=["fused", "foreach", "for-loop"], default="fused",
                    help="torch.optim.AdamW's implementation (default fused)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--profile", default="", help="torch profiler over one more step after the measured ones into "
                    "FILE.json (benchmarks/profile_compare.py compares it with bench_gpt --profile)")
    a = ap.parse_args()
    hidden, layers, heads, seq = PRESETS[a.preset]
    if a.seq > seq:
        sys.exit(f"gpt_peer: --seq={a.seq} exceeds preset {a.preset}'s {seq}")
    cuda = a.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(1)
    # for-loop: foreach=False and fused=False, so that AdamW cannot pick another one by itself.
    adamw_impl = {"fused": {"fused": True}, "foreach": {"foreach": True},
                  "for-loop": {"foreach": False, "fused": False}}[a.optimizer]
    t_build = time.time()
    if a.mode == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            if "MASTER_PORT" not in os.environ:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    os.environ["MASTER_PORT"] = str(s.getsockname()[1])
            dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
        if cuda:
            torch.cuda.set_device(dev)
        model = Gpt(hidden, layers, heads, seq, a.checkpoint_activations)  # fp32 on the CPU, as LibTorch builds
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy(pin_memory=cuda)
        # The mesh names the device type: left to FSDP it is CUDA wherever a GPU exists, --device=cpu too.
        mesh = init_device_mesh(a.device, (1,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **adamw_impl)
        autocast = False
    else:
        model = Gpt(hidden, layers, heads, seq, a.checkpoint_activations).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **adamw_impl)
        autocast = cuda
    construction_s = time.time() - t_build
    rss_after_construction = rss_peak_bytes()
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(7)
    times = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0, "step_s": 0.0}
    startup_s = None
    loss_first = loss_last = None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # A profiled step is one more, after the measured ones (as in bench_gpt): the profiler's cost is in no mean.
    for s in range(a.warmup_steps + a.steps + (1 if a.profile else 0)):
        x = torch.randint(VOCAB, (a.batch, a.seq), generator=g)
        y = torch.roll(x, -1, 1)
        x, y = x.to(dev), y.to(dev)
        profiled = bool(a.profile) and s == a.warmup_steps + a.steps
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] +
                                      ([torch.profiler.ProfilerActivity.CUDA] if cuda else []),
                                      record_shapes=True) if profiled else None
        if prof:
            prof.__enter__()
        sync()
        t0 = time.time()
        # Each phase in a scope that ends after its sync, as in bench_gpt: the profile attributes kernels by time.
        with torch.profiler.record_function("phase.forward"):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
            sync()
        t1 = time.time()
        with torch.profiler.record_function("phase.backward"):
            loss.backward()
            sync()
        t2 = time.time()
        with torch.profiler.record_function("phase.optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
        t3 = time.time()
        if prof:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(a.profile)
            print(f"gpt_peer: wrote the profile of step {s} to {a.profile}", file=sys.stderr)
        if startup_s is None:
            startup_s = t3 - T_START
        lv = loss.item()
        what = " (profiled)" if profiled else " (warm-up)" if s < a.warmup_steps else ""
        print(f"gpt_peer: {a.mode} step {s}{what}: fwd {t1 - t0:.3f} s, "
              f"bwd {t2 - t1:.3f} s, opt {t3 - t2:.3f} s, loss {lv:.4f}", file=sys.stderr)
        if s < a.warmup_steps or profiled:
            continue
        loss_first = lv if loss_first is None else loss_first
        loss_last = lv
        for k, v in (("forward_s", t1 - t0), ("backward_s", t2 - t1), ("optimizer_s", t3 - t2), ("step_s", t3 - t0)):
            times[k] += v / a.steps
    tokens = a.batch * a.seq
    doc = {
        "benchmark": "gpt_peer", "commit": a.commit, "mode": a.mode,
        "kind": ("FSDP2 fully_shard per block + root, CPUOffloadPolicy(pin_memory), bf16 MixedPrecisionPolicy, "
                 f"torch.optim.AdamW ({a.optimizer}), world size 1") if a.mode == "fsdp2" else
                f"fp32 model, bf16 autocast, AdamW ({a.optimizer})",
        "optimizer": a.optimizer,
        "env": {"torch": torch.__version__, "cuda": torch.version.cuda,
                "gpu_name": torch.cuda.get_device_name(0) if cuda else "", "cpu_count": os.cpu_count()},
        "device": a.device,
        "config": {"batch": a.batch, "seq": a.seq, "steps": a.steps, "checkpoint_activations": a.checkpoint_activations},
        "model": {"preset": a.preset, "params": n_params, "hidden": hidden, "layers": layers},
        "time": times, "tokens_per_s": tokens / times["step_s"],
        "tflops_6n": 6 * n_params * tokens / times["step_s"] / 1e12,
        "startup_s": startup_s, "construction_s": construction_s,
        "memory": {"host_rss_peak_bytes": rss_peak_bytes(), "host_rss_peak_after_construction_bytes": rss_after_construction,
                   "device_peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0},
        "loss_first": loss_first, "loss_last": loss_last,
    }
    print(json.dumps(doc, indent=2), flush=True)
    sys.stderr.flush()
    if a.mode == "fsdp2":
        import torch.distributed as dist
        dist.destroy_process_group()
        # The JSON is out: skip the interpreter's teardown of a host RSS of over 100 GiB (at 6b on the
        # H100 it outlasted the stage's time limit after the JSON was written).
        os._exit(0)


if __name__ == "__main__":
    main()
