"""Time and peak memory of the MoBA attention block, forward + backward, as T grows.

    python bench/bench_attn.py [--T 1024 2048 4096 8192] [--threads N] [--repeat 3]
                               [--top-k 2] [--chunk 64]

Defaults: B = 1, C = 256 (4 heads x 64), chunk_size 64, moba_top_k 2,
ffn_dim 1024 (docs/training.md §Presets config S). Every T runs in a fresh subprocess, so
its peak RSS is its own: "peak MiB" is the process's peak resident set minus
its resident set just before the first call (inputs and parameters already
allocated), i.e. the memory the forward and backward calls themselves
needed, outputs included. Times are best of --repeat after one warm-up.
With a fixed top_k, time and memory should grow linearly in T ("per 1k T"
columns stay flat); --top-k 0 (dense causal) shows the quadratic contrast.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: F401  (puts an in-place build of rwkvx_c first)


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(a):
    import numpy as np

    import rwkvx_c as rx

    if a.threads:
        rx.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    H, N, F, T = 4, 64, 1024, a.child
    C = H * N
    shapes = {"ln1_w": (C,), "ln1_b": (C,), "receptance_w": (C, C), "key_w": (C, C),
              "value_w": (C, C), "output_w": (C, C), "ln2_w": (C,), "ln2_b": (C,),
              "cm.ffn_x_k": (C,), "cm.ffn_key_w": (C, F), "cm.ffn_value_w": (F, C)}
    p = {k: (rng.standard_normal(s) / np.sqrt(s[0]) if len(s) == 2 else
             1.0 + 0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    x = rng.standard_normal((1, T, C), dtype=np.float32)
    dy = rng.standard_normal((1, T, C), dtype=np.float32)
    kw = dict(n_head=H, head_size=N, chunk_size=a.chunk, moba_top_k=a.top_k)
    base = rss_mib()
    rx.attn_forward(p, x, **kw)
    rx.attn_backward(p, x, dy, **kw)
    fwd = bwd = float("inf")
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        rx.attn_forward(p, x, **kw)
        t1 = time.perf_counter()
        rx.attn_backward(p, x, dy, **kw)
        t2 = time.perf_counter()
        fwd, bwd = min(fwd, t1 - t0), min(bwd, t2 - t1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # KiB on Linux
    print(json.dumps(dict(T=T, fwd=fwd, bwd=bwd, peak=peak - base, threads=rx.get_num_threads())))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    ap.add_argument("--threads", type=int, default=0, help="0: the library default")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top-k", dest="top_k", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    print(f"attention block fwd+bwd: B=1, C=256 (4x64), ffn 1024, chunk {a.chunk}, "
          f"top_k {a.top_k}")
    print(f"{'T':>6} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'ms/1k T':>8} "
          f"{'peak MiB':>9} {'MiB/1k T':>9}")
    for T in a.T:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(T), "--threads",
               str(a.threads), "--repeat", str(a.repeat), "--top-k", str(a.top_k),
               "--chunk", str(a.chunk)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1])
        tot = (r["fwd"] + r["bwd"]) * 1e3
        print(f"{T:>6} {r['fwd'] * 1e3:>8.1f} {r['bwd'] * 1e3:>8.1f} {tot:>8.1f} "
              f"{tot / (T / 1024):>8.1f} {r['peak']:>9.1f} {r['peak'] / (T / 1024):>9.1f}")
    print(f"threads: {r['threads']}")


if __name__ == "__main__":
    main()
