#!/usr/bin/env python3
"""ferry's LLaMA example against the reference no one here wrote: Hugging Face transformers.

    test_llama_transformers.py --case=NAME --bin=DIR --work=DIR

Each case builds a small LlamaForCausalLM with random weights in transformers, saves it with
save_pretrained, runs ferry's llama_logits on the folder and compares with transformers' own logits
for the same tokens (fp32: max |difference| <= 1e-5 x the largest |logit|; bf16: within the bf16
rounding bound written below). The `train` case fine-tunes through train_llama (its tokens written by
tokenize.py with a tokenizer trained here), then loads the saved folder in transformers and compares
its logits with llama_logits' on that folder. The `convert` case writes the tiny preset's random weights
(train_llama --steps=0, config.json by ferry) and converts that folder to bf16 shards.

Exits 77 (ctest: skipped, by name) when transformers cannot be imported; never passes silently.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

CASES = {
    # name: (config overrides, save options, precision)
    "gqa": (dict(num_attention_heads=4, num_key_value_heads=2), {}, "fp32"),
    "mqa": (dict(num_attention_heads=4, num_key_value_heads=1), {}, "fp32"),
    "tied": (dict(tie_word_embeddings=True), {}, "fp32"),
    "sharded": (dict(), dict(max_shard_size="20KB"), "fp32"),
    # Sizes nothing divides nicely, a head_dim that is not hidden / heads, fp16 weights in the files.
    "odd": (dict(vocab_size=101, hidden_size=48, intermediate_size=77, num_hidden_layers=3,
                 num_attention_heads=3, num_key_value_heads=1, head_dim=10), dict(dtype="float16"), "fp32"),
    "llama3_rope": (dict(rope_theta=500000.0, max_position_embeddings=128,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=16)), {}, "fp32"),
    "bf16": (dict(num_attention_heads=4, num_key_value_heads=2), dict(dtype="bfloat16"), "bf16"),
}
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
TOKENS = [1, 17, 250, 3, 99, 42, 0, 7, 64, 31, 5, 88, 12]


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def make_model(transformers, torch, overrides, seed):
    cfg = dict(BASE, **overrides)
    rope_scaling = cfg.pop("rope_scaling", None)
    rope_theta = cfg.pop("rope_theta", 10000.0)
    if int(transformers.__version__.split(".")[0]) >= 5:  # rope_parameters; 4: rope_theta + rope_scaling
        cfg["rope_parameters"] = dict(dict(rope_type="default", rope_theta=rope_theta), **(rope_scaling or {}))
    else:
        cfg.update(rope_theta=rope_theta, rope_scaling=rope_scaling)
    config = transformers.LlamaConfig(**cfg)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # a larger spread than the 0.02 init, so the logits are not all near 0
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            else:
                p.uniform_(0.5, 1.5)
    return model.eval()


def reference_logits(transformers, torch, folder, tokens, dtype):
    """transformers' logits for `tokens` from the saved folder, loaded as a user loads it, computed in
    `dtype` (the in-memory model is not used: casting it rounds its rotary buffers too)."""
    kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}
    m = transformers.LlamaForCausalLM.from_pretrained(folder, **kw).eval()
    with torch.no_grad():
        return m(torch.tensor([tokens])).logits[0].float()


def ferry_logits(torch, bin_dir, folder, tokens, precision):
    cmd = [os.path.join(bin_dir, "llama_logits"), f"--model={folder}", "--tokens=" + ",".join(map(str, tokens)),
           f"--precision={precision}", "--log-level=warn"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr}")
    return torch.tensor(json.loads(r.stdout)["logits"], dtype=torch.float32)


def compare(torch, got, want, tolerance, what):
    if got.shape != want.shape:
        fail(f"{what}: ferry's logits have shape {tuple(got.shape)}, transformers' {tuple(want.shape)}")
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    print(f"{what}: max |ferry - transformers| = {err:.3g}, largest |logit| = {scale:.3g}, "
          f"relative {err / scale:.3g} (allowed {tolerance:.3g})")
    if not err <= tolerance * scale:
        fail(f"{what}: relative difference {err / scale:.3g} > {tolerance:.3g}")


def run_logits_case(transformers, torch, name, bin_dir, work):
    overrides, save, precision = CASES[name]
    model = make_model(transformers, torch, overrides, seed=len(name))
    folder = os.path.join(work, name)
    shutil.rmtree(folder, ignore_errors=True)
    save = dict(save)
    dtype = getattr(torch, save.pop("dtype", "float32"))
    model.to(dtype).save_pretrained(folder, **save)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    print(f"{name}: saved {len(files)} safetensors file(s) in {dtype}")
    if name == "sharded" and len(files) < 5:
        fail(f"sharded: expected many shards, got {files}")
    tokens = [t % BASE["vocab_size"] if "vocab_size" not in overrides else t % overrides["vocab_size"] for t in TOKENS]
    if precision == "fp32":
        want = reference_logits(transformers, torch, folder, tokens, torch.float32)  # the file's values, in fp32
        compare(torch, ferry_logits(torch, bin_dir, folder, tokens, "fp32"), want, 1e-5, name)
    else:
        # bf16 both sides: every matmul output rounded to 8 significant bits, in a different order (the
        # attention kernels differ). Bound: 4 bf16 ulps (2^-8 each) of the largest logit; the fp32
        # computation of the same weights is also checked to sit within the same distance of both.
        want = reference_logits(transformers, torch, folder, tokens, torch.bfloat16)
        got = ferry_logits(torch, bin_dir, folder, tokens, "bf16")
        compare(torch, got, want, 4 * 2.0 ** -8, name + " (bf16)")
        exact = reference_logits(transformers, torch, folder, tokens, torch.float32)
        compare(torch, got, exact, 4 * 2.0 ** -8, name + " (ferry bf16 vs transformers fp32)")


def run_train_case(transformers, torch, bin_dir, work, source_dir):
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers, decoders

    folder = os.path.join(work, "train_in")
    out = os.path.join(work, "train_out")
    for d in (folder, out):
        shutil.rmtree(d, ignore_errors=True)
    model = make_model(transformers, torch, dict(num_attention_heads=4, num_key_value_heads=2), seed=5)
    model.save_pretrained(folder)
    # A byte-level BPE tokenizer trained here on a text the machine has, saved into the folder as
    # tokenizer.json: tokenize.py reads it as it reads a published model's.
    corpus = os.path.join(source_dir, "docs", "ARCHITECTURE.md")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([corpus], trainers.BpeTrainer(vocab_size=BASE["vocab_size"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(folder, "tokenizer.json"))
    tokens_file = os.path.join(work, "train.tokens")
    r = subprocess.run([sys.executable, os.path.join(source_dir, "examples", "llama", "tokenize.py"),
                        f"--model={folder}", f"--text={corpus}", f"--out={tokens_file}"], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"tokenize.py failed:\n{r.stderr}")
    info = json.loads(r.stdout)
    ids = tok.encode(open(corpus, encoding="utf-8").read(), add_special_tokens=False).ids
    if info["tokens"] != len(ids) or open(tokens_file, "rb").read(8) != b"".join(i.to_bytes(4, "little") for i in ids[:2]):
        fail(f"tokenize.py wrote {info}, the tokenizer gives {len(ids)} tokens starting {ids[:2]}")
    cmd = [os.path.join(bin_dir, "train_llama"), f"--model={folder}", f"--data={tokens_file}", f"--save={out}",
           "--steps=12", "--batch=4", "--seq=32", "--lr=3e-3", "--warmup=2", "--log-every=4",
           "--max-shard-size=40KB", "--log-level=warn"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(r.stdout)
    if r.returncode != 0:
        fail(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr}")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    if not summary["last_loss"] < summary["first_loss"]:
        fail(f"train_llama did not learn: loss {summary['first_loss']} -> {summary['last_loss']}")
    shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    if len(shards) < 2 or not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
        fail(f"train_llama --max-shard-size=40KB wrote {sorted(os.listdir(out))}, expected shards and an index")
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        fail("train_llama did not copy tokenizer.json into the saved folder")
    trained = transformers.LlamaForCausalLM.from_pretrained(out).float().eval()  # the file's dtype, up-cast
    # The weights moved (a save of the input would also "match").
    before = dict(model.named_parameters())
    moved = max((p - before[n]).abs().max().item() for n, p in trained.named_parameters())
    if not moved > 1e-4:
        fail(f"the saved weights equal the input's (largest change {moved})")
    tokens = TOKENS
    want = reference_logits(transformers, torch, out, tokens, torch.float32)
    compare(torch, ferry_logits(torch, bin_dir, out, tokens, "fp32"), want, 1e-5, "train (saved folder)")


def run_convert_case(transformers, torch, bin_dir, work):
    """train_llama --steps=0: the tiny preset's random weights written as a folder (config.json from
    LlamaConfig::to_json), then that folder converted to bf16 in shards; transformers loads both and
    gives ferry's logits."""
    rand, conv = os.path.join(work, "preset"), os.path.join(work, "converted")
    for d in (rand, conv):
        shutil.rmtree(d, ignore_errors=True)
    train = os.path.join(bin_dir, "train_llama")
    for cmd in ([train, "--preset=tiny", "--steps=0", f"--save={rand}", "--save-dtype=fp32", "--log-level=warn"],
                [train, f"--model={rand}", "--steps=0", f"--save={conv}", "--save-dtype=bf16", "--max-shard-size=100KB",
                 "--log-level=warn"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr}")
    shards = [f for f in os.listdir(conv) if f.endswith(".safetensors")]
    if len(shards) < 2:
        fail(f"--max-shard-size=100KB wrote {sorted(os.listdir(conv))}")
    tokens = [t % 256 for t in TOKENS]
    want = reference_logits(transformers, torch, rand, tokens, torch.float32)
    compare(torch, ferry_logits(torch, bin_dir, rand, tokens, "fp32"), want, 1e-5, "convert (preset, fp32)")
    want = reference_logits(transformers, torch, conv, tokens, torch.bfloat16)
    compare(torch, ferry_logits(torch, bin_dir, conv, tokens, "bf16"), want, 4 * 2.0 ** -8, "convert (bf16 shards)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=sorted(CASES) + ["train", "convert"])
    ap.add_argument("--bin", required=True, help="the directory of llama_logits and train_llama")
    ap.add_argument("--work", required=True)
    ap.add_argument("--source", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
    a = ap.parse_args()
    try:
        import torch
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError as e:
        print(f"SKIPPED: {a.case}: transformers cannot be imported here ({e}); scripts/setup.sh installs it")
        sys.exit(77)
    os.makedirs(a.work, exist_ok=True)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    if a.case == "train":
        run_train_case(transformers, torch, a.bin, a.work, os.path.abspath(a.source))
    elif a.case == "convert":
        run_convert_case(transformers, torch, a.bin, a.work)
    else:
        run_logits_case(transformers, torch, a.case, a.bin, a.work)
    print("PASS")


if __name__ == "__main__":
    main()
