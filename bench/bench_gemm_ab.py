"""Two builds' projection GEMM, paired call by call in one process.

    python bench/bench_gemm_ab.py OTHER_TREE [--preset S M] [--precision fp32|bf16]
                                  [--pairs 41] [--rows 512] [--min-ms 2]

OTHER_TREE is a source tree with an in-place build (`python3 setup.py
build_ext --inplace`, e.g. a `git worktree` of the base commit); this
tree's build is the other side. Both C libraries (rwkvx_c/lib/
librwkvx_c.so of each tree) are loaded side by side with ctypes, and on
every projection shape of bench_gemm.py their rx_sgemm (or, with
--precision bf16, rx_bgemm) run alternately at 1 thread, timed by thread
CPU time: a pair is one timing of each, taken milliseconds apart, in
alternating order. The verdict per shape is the median and quartiles of
the per-pair time ratios this/other (below 1: this tree is faster). On a
noisy shared machine this resolves differences of a few per cent that
separate runs, or the rounds of bench_gemm.py, cannot.
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

common.clean_blas_env()

import numpy as np  # noqa: E402
from bench_gemm import operands, shapes  # noqa: E402

import rwkvx_c as rx  # noqa: E402

FLOAT_P = ctypes.POINTER(ctypes.c_float)


def load(libdir, name):
    """The GEMM entry point `name` of the library in libdir, thread count 1."""
    lib = ctypes.CDLL(os.path.join(libdir, "lib%s.so" % rx.LIBRARY_NAME))
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
                   ctypes.c_size_t, FLOAT_P, ctypes.c_size_t, FLOAT_P, ctypes.c_size_t,
                   ctypes.c_float, FLOAT_P, ctypes.c_size_t]
    lib.rx_set_num_threads(1)
    return fn


def caller(fn, M, N, K, ta, tb, a, b, c):
    """fn on (a, b) into c as rx_sgemm's arguments; raises on an error code."""
    pa, pb, pc = (x.ctypes.data_as(FLOAT_P) for x in (a, b, c))
    lda, ldb = a.shape[1], b.shape[1]

    def call():
        if fn(int(ta), int(tb), M, N, K, pa, lda, pb, ldb, 0.0, pc, N) != 0:
            raise RuntimeError("the GEMM returned an error")
    return call


def timed(call, inner):
    t0 = time.thread_time()
    for _ in range(inner):
        call()
    return (time.thread_time() - t0) / inner


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other", help="the other source tree (with an in-place build)")
    ap.add_argument("--preset", nargs="+", default=["S", "M"], choices=sorted(common.PRESETS))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--pairs", type=int, default=41)
    ap.add_argument("--rows", type=int, default=512, help="B*T rows of the activations")
    ap.add_argument("--min-ms", type=float, default=2.0,
                    help="each timing repeats the call to last at least this long")
    args = ap.parse_args()
    name = "rx_bgemm" if args.precision == "bf16" else "rx_sgemm"
    other_dir = os.path.join(os.path.abspath(args.other), "rwkvx_c", "lib")
    this_dir = rx.get_library_dir()
    if os.path.realpath(other_dir) == os.path.realpath(this_dir):
        ap.error("OTHER_TREE is this tree")
    fns = {"other": load(other_dir, name), "this": load(this_dir, name)}
    print("%s, 1 thread, thread CPU time, %d pairs per shape; this: %s, other: %s"
          % (name, args.pairs, this_dir, other_dir))
    print("%-22s %5s %5s %5s | %9s %9s | %s" % ("shape", "M", "N", "K", "other us", "this us",
                                               "this/other: median (quartiles)"))
    rng = np.random.default_rng(0)
    for preset in args.preset:
        print("-- preset", preset)
        tot = {"other": 0.0, "this": 0.0}
        for label, M, N, K, ta, tb in shapes(common.PRESETS[preset], args.rows):
            a, b = operands(M, N, K, ta, tb, rng)
            c = np.empty((M, N), dtype=np.float32)
            calls = {s: caller(fn, M, N, K, ta, tb, a, b, c) for s, fn in fns.items()}
            for call in calls.values():
                call()
            once = max(timed(calls["this"], 1), 1e-7)
            inner = max(1, int(args.min_ms * 1e-3 / once))
            times = {"other": [], "this": []}
            for p in range(args.pairs):
                for s in (("other", "this") if p % 2 == 0 else ("this", "other")):
                    times[s].append(timed(calls[s], inner))
            ratios = sorted(t / o for t, o in zip(times["this"], times["other"]))
            q = statistics.quantiles(ratios, n=4)
            med = {s: statistics.median(ts) for s, ts in times.items()}
            for s in tot:
                tot[s] += med[s]
            print("%-22s %5d %5d %5d | %9.1f %9.1f | %.3f (%.3f-%.3f)"
                  % (label, M, N, K, med["other"] * 1e6, med["this"] * 1e6,
                     statistics.median(ratios), q[0], q[2]), flush=True)
        print("preset %s, every shape once: this/other %.3f of the time"
              % (preset, tot["this"] / tot["other"]))


if __name__ == "__main__":
    main()
