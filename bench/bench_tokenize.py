"""Tokenising speed on the standard-library corpus (the default training data).

    python bench/bench_tokenize.py [--ref-mb 2] [--repeat 3]

World vocabulary: rwkvx_c's C trie (whole corpus as one text, and file by
file) at 1 and 2 threads, against the rwkv package's pure-Python
TRIE_TOKENIZER on the first --ref-mb MB (its speed does not depend on the
size). Optionally a byte-level BPE tokenizer.json (--hf PATH) through
`tokenizers`. Runs are interleaved and the best of --repeat is kept, so a
loaded machine disturbs the ratios less than the absolute numbers; MB per
CPU-second (all threads) shows the work done regardless of the machine's load.
"""
import argparse
import time

from rwkvx_c.data import stdlib_files
from rwkvx_c.data import tokenizers as tkz


def best(fn, repeat):
    """(best wall seconds, CPU seconds of that run, all threads)."""
    t, c = float("inf"), 0.0
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        dt = time.perf_counter() - t0
        if dt < t:
            t, c = dt, time.process_time() - c0
    return t, c


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-mb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hf", metavar="PATH", help="also time this tokenizer.json")
    a = ap.parse_args()
    _, files = stdlib_files()
    docs = []
    for _, p in files:
        with open(p, "rb") as f:
            docs.append(f.read())
    text = b"".join(docs)
    mb = len(text) / 1e6
    print(f"stdlib corpus: {len(docs)} files, {mb:.1f} MB")
    w = tkz.load("world")
    rows = []
    for th in (1, 2):
        w.threads = th
        rows.append((f"C trie, one text, {th} thread(s)", mb,
                     best(lambda: w.encode(text), a.repeat)))
        rows.append((f"C trie, per file, {th} thread(s)", mb,
                     best(lambda: w.encode_docs(docs), a.repeat)))
    try:
        from rwkv.rwkv_tokenizer import TRIE_TOKENIZER
    except ImportError:
        TRIE_TOKENIZER = None
    if TRIE_TOKENIZER is not None:
        ref = TRIE_TOKENIZER(w.path)
        sub = text[: int(a.ref_mb * 1e6)]
        rows.append(("rwkv TRIE_TOKENIZER (Python)", len(sub) / 1e6,
                     best(lambda: ref.encodeBytes(sub), 1)))
    if a.hf:
        h = tkz.load(a.hf)
        rows.append(("tokenizers BPE, per file (its own threads)", mb,
                     best(lambda: h.encode_docs(docs), a.repeat)))
    base = rows[0][1] / rows[0][2][0]
    print(f"{'':45s} {'wall MB/s':>10s} {'vs C 1 thr':>10s} {'MB/CPU-s':>9s}")
    for name, size, (t, cpu) in rows:
        print(f"{name:45s} {size / t:10.2f} {size / t / base:9.2f}x {size / max(cpu, 1e-9):9.2f}")


if __name__ == "__main__":
    main()
