"""WKV7 recurrence (csrc/wkv7.c) speed: forward, backward and both, in
tokens/s (one token = B*T rows of all H heads), at 1 and 2 threads.

    python bench/bench_wkv7.py [--B 1] [--T 512] [--H 8] [--N 64] [--threads 1 2]

Each call is timed alone, from Python, on inputs no kernel has just
written: between calls the OpenMP workers wait (GOMP_SPINCOUNT) or sleep,
and the inputs come from memory. Both show more here than in a model step
(on the 2-vCPU Sapphire Rapids VM, H = 8: the forward 344k -> 643k tok/s
from 1 to 2 threads, 1.87x; WKV7 within an S bf16 step 14.1 -> 7.7 ms,
1.83x, by rx.profile).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import numpy as np

import rwkvx_c as rx


def inputs(B, T, H, N, seed=0):
    """Realistic ranges: decay in (e^-0.6065, 1), kk-style a/b of unit scale."""
    rng = np.random.default_rng(seed)
    sh = (B, T, H, N)
    f = lambda x: x.astype(np.float32)  # noqa: E731
    r, k, v = (f(rng.standard_normal(sh) * 0.5) for _ in range(3))
    w = f(np.exp(-0.6065306597126334 / (1 + np.exp(-rng.standard_normal(sh)))))
    kk = rng.standard_normal(sh)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    a = f(-kk)
    b = f(kk / (1 + np.exp(-rng.standard_normal(sh))))
    dy = f(rng.standard_normal(sh))
    return r, w, k, v, a, b, dy


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    r, w, k, v, a, b, dy = inputs(args.B, args.T, args.H, args.N)
    ntok = args.B * args.T
    print("WKV7 B=%d T=%d H=%d N=%d (%s)" % (args.B, args.T, args.H, args.N,
                                              "OpenMP" if rx.has_openmp() else "no OpenMP"))
    res = {}
    for n in args.threads:
        rx.set_num_threads(n)
        tf = common.best_time(lambda: rx.wkv7_forward(r, w, k, v, a, b), repeat=args.repeat)
        tb = common.best_time(lambda: rx.wkv7_backward(r, w, k, v, a, b, dy), repeat=args.repeat)
        res[n] = tf + tb
        print("threads %d: forward %8.0f tok/s  backward %8.0f tok/s  fwd+bwd %8.0f tok/s"
              "  (bwd/fwd %.2f)" % (n, ntok / tf, ntok / tb, ntok / (tf + tb), tb / tf))
    if 1 in res and len(res) > 1:
        for n in res:
            if n != 1:
                print("scaling %d threads: %.2fx" % (n, res[1] / res[n]))
    rx.set_num_threads(0)


if __name__ == "__main__":
    main()
