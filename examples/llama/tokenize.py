#!/usr/bin/env python3
"""Tokenises text with a Hugging Face folder's own tokenizer, for train_llama --data.

    tokenize.py --model=DIR --text=FILE_OR_DIR [--text=...] --out=FILE.tokens [--eos]

Reads DIR/tokenizer.json with the `tokenizers` package (PyPI; the library transformers' fast tokenizers
are), encodes each text file (a directory: its files, sorted, recursively), optionally ends each with
the end-of-sequence token, and writes every id as a little-endian uint32. Prints one JSON line: files,
tokens, the vocabulary size and the largest id.
"""
import argparse
import json
import os
import struct
import sys


def files_of(path):
    if os.path.isdir(path):
        for root, dirs, names in os.walk(path):
            dirs.sort()
            for n in sorted(names):
                yield os.path.join(root, n)
    else:
        yield path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face folder with tokenizer.json")
    ap.add_argument("--text", required=True, action="append", help="a text file or a directory of them")
    ap.add_argument("--out", required=True, help="the .tokens file to write")
    ap.add_argument("--eos", action="store_true", help="end each file with the end-of-sequence token")
    a = ap.parse_args()
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("tokenize.py: needs the `tokenizers` package (pip install tokenizers)")
    path = os.path.join(a.model, "tokenizer.json")
    if not os.path.exists(path):
        sys.exit(f"tokenize.py: {path} does not exist (a folder with only tokenizer.model needs converting "
                 "with transformers first)")
    tok = Tokenizer.from_file(path)
    eos = None
    if a.eos:
        cfg = os.path.join(a.model, "config.json")
        eos = json.load(open(cfg)).get("eos_token_id") if os.path.exists(cfg) else None
        if isinstance(eos, list):
            eos = eos[0]
        if eos is None:
            sys.exit(f"tokenize.py: --eos but {cfg} names no eos_token_id")
    n_files = n_tokens = top = 0
    with open(a.out + ".tmp", "wb") as out:
        for t in a.text:
            for f in files_of(t):
                try:
                    text = open(f, encoding="utf-8").read()
                except UnicodeDecodeError:
                    print(f"tokenize.py: skipping {f} (not UTF-8)", file=sys.stderr)
                    continue
                ids = tok.encode(text, add_special_tokens=False).ids + ([eos] if eos is not None else [])
                out.write(struct.pack(f"<{len(ids)}I", *ids))
                n_files += 1
                n_tokens += len(ids)
                top = max([top] + ids)
    os.replace(a.out + ".tmp", a.out)
    print(json.dumps({"files": n_files, "tokens": n_tokens, "vocab": tok.get_vocab_size(), "max_id": top}))


if __name__ == "__main__":
    main()
