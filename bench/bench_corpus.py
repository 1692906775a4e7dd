"""Tokenise a generated corpus of --gb GB and report MB/s and peak memory.

    python bench/bench_corpus.py --dir /tmp/big --gb 1.0 --tokenizer world [--keep]

The corpus is a folder of .jsonl files (one standard-library file per
record) plus two large plain-text files (read in pieces), so both batching
and streaming paths run. The folder and its token cache are deleted
afterwards unless --keep. Peak memory is the process's maximum resident set
size (ru_maxrss), the corpus being far larger than the peak.
"""
import argparse
import json
import os
import resource
import shutil
import time

from rwkvx_c.data import load_corpus, stdlib_files
from rwkvx_c.data import tokenizers as tkz


def generate(folder, nbytes):
    os.makedirs(folder, exist_ok=True)
    _, files = stdlib_files()
    texts = []
    for _, p in files:
        with open(p, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    written, k = 0, 0
    big = [os.path.join(folder, f"big{i}.txt") for i in range(2)]
    for p in big:                      # two plain-text files of 10% each
        with open(p, "w") as f:
            while f.tell() < nbytes // 10:
                f.write(texts[k % len(texts)])
                k += 1
            written += f.tell()
    i = 0
    while written < nbytes:
        with open(os.path.join(folder, f"part{i:03d}.jsonl"), "w") as f:
            while f.tell() < 32 << 20 and written + f.tell() < nbytes:
                f.write(json.dumps({"text": texts[k % len(texts)], "n": k}) + "\n")
                k += 1
            written += f.tell()
        i += 1
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tokenizer", default="world")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    src, cache = os.path.join(a.dir, "corpus"), os.path.join(a.dir, "cache")
    try:
        t0 = time.perf_counter()
        n = generate(src, int(a.gb * 1e9))
        print(f"generated {n / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
        tok = tkz.load(a.tokenizer)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0, c0 = time.perf_counter(), time.process_time()
        c = load_corpus(src, tokenizer=tok, cache_dir=cache, progress=True)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(c.description)
        print(f"tokenised {n / 1e6:.0f} MB in {dt:.0f} s wall ({n / 1e6 / dt:.1f} MB/s), "
              f"{cpu:.0f} s CPU; peak RSS {rss / 1024:.0f} MiB "
              f"(before tokenising {rss0 / 1024:.0f} MiB)")
        t0 = time.perf_counter()
        load_corpus(src, tokenizer=tok, cache_dir=cache)
        print(f"second load (cache reused): {time.perf_counter() - t0:.1f} s")
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
