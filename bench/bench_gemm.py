"""rx_sgemm (csrc/gemm.c) against NumPy's float32 matmul on the projection
shapes of the docs/training.md §Presets configurations S and M, forward and backward.

    python bench/bench_gemm.py [--preset S M] [--threads 1 2] [--rows 512] [--cold]
                               [--kernel generic|avx2-fma|avx512f]

Each shape is M x N x K of C[M,N] = op(A)[M,K] . op(B)[K,N]; "dx" rows are
grads through a weight (B transposed), "dW" rows weight grads (A transposed,
K = the T*B rows). GFLOP/s are best-of-rounds, each library timed on its own (interleaved
calls would make the two thread pools spin against each other).

--cold evicts the caches (writes a --flush-mib buffer) before every timed
call, so A, B and C come from DRAM as in a training step, where the kernels
between two projections push their operands out of L2 and often L3; each
call is then timed alone (best of --repeat).

--kernel forces one of rx_sgemm's micro-kernels (default: the one picked
for this CPU), so two runs compare kernels on the same shapes.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.clean_blas_env()

import numpy as np  # noqa: E402

import rwkvx_c as rx  # noqa: E402


def shapes(cfg, rows):
    """(label, M, N, K, ta, tb) of every distinct projection GEMM of a config."""
    C, F, V = cfg["n_embd"], cfg["ffn_dim"], cfg["vocab_size"]
    mats = [("CxC", C, C), ("ffn_key", C, F), ("ffn_value", F, C), ("head", C, V)]
    for d in sorted({cfg["Dw"], cfg["Da"], cfg["Dg"], cfg["Dv"]}):
        mats += [("lora1 D=%d" % d, C, d), ("lora2 D=%d" % d, d, C)]
    out = []
    for name, kin, kout in mats:
        out.append((name + " fwd", rows, kout, kin, False, False))
        out.append((name + " dx", rows, kin, kout, False, True))
        out.append((name + " dW", kin, kout, rows, True, False))
    return out


def operands(M, N, K, ta, tb, rng):
    a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
    return a, b


def cold_time(fn, flush, repeat, clock):
    """Best time of one call of fn, each after writing all of flush (which
    evicts every cached line of the operands)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        flush += 1.0
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", nargs="+", default=["S", "M"], choices=sorted(common.PRESETS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rows", type=int, default=512, help="B*T rows of the activations")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time 1-thread runs by thread CPU time (steadier on a busy machine)")
    ap.add_argument("--cold", action="store_true",
                    help="flush the caches before every call (operands come from memory)")
    ap.add_argument("--flush-mib", type=int, default=64,
                    help="size of the buffer written to flush the caches with --cold")
    ap.add_argument("--kernel", help="force this rx_sgemm micro-kernel")
    args = ap.parse_args()
    if args.kernel:
        rx._core._sgemm_use_kernel(args.kernel)   # ValueError if this CPU lacks it
    print(common.blas_info(), "| rx kernel:", args.kernel or rx.gemm_kernel(),
          "| cold (%d MiB flush)" % args.flush_mib if args.cold else "| hot caches")
    flush = np.zeros(args.flush_mib << 18, dtype=np.float32) if args.cold else None
    rng = np.random.default_rng(0)
    seen, rows = set(), []
    for preset in args.preset:
        rows.append(("-- preset " + preset,))
        for label, M, N, K, ta, tb in shapes(common.PRESETS[preset], args.rows):
            if (M, N, K, ta, tb) not in seen:
                seen.add((M, N, K, ta, tb))
                a, b = operands(M, N, K, ta, tb, rng)
                rows.append((label, M, N, K, ta, tb, a, b))
    # One library at a time: alternating calls would leave one library's idle
    # threads spinning while the other's run, and slow both.
    rate = {}
    for n in args.threads:
        clock = time.thread_time if args.cpu_time and n == 1 else time.perf_counter
        rx.set_num_threads(n)
        with common.blas_threads(n):
            for lib in ("rx", "numpy"):
                for row in rows:
                    if len(row) == 1:
                        continue
                    label, M, N, K, ta, tb, a, b = row
                    out = np.empty((M, N), dtype=np.float32)
                    if lib == "rx":
                        fn = lambda: rx._core._sgemm(a, b, ta, tb, out=out)  # noqa: E731
                    else:
                        aa, bb = (a.T if ta else a), (b.T if tb else b)
                        fn = lambda: np.matmul(aa, bb, out=out)  # noqa: E731
                    if args.cold:
                        t = cold_time(fn, flush, args.repeat, clock)
                    else:
                        t = common.best_time(fn, repeat=args.repeat, min_time=0.05, clock=clock)
                    rate[(lib, n, M, N, K, ta, tb)] = t
    tot = {n: [0.0, 0.0, 0.0] for n in args.threads}   # flops, our time, numpy time
    hdr = "%-22s %5s %5s %5s" % ("shape", "M", "N", "K")
    for n in args.threads:
        hdr += " | %4s %7s %7s %5s" % ("thr", "rx", "numpy", "ratio")
    print(hdr)
    for row in rows:
        if len(row) == 1:
            print(row[0])
            continue
        label, M, N, K, ta, tb = row[:6]
        line = "%-22s %5d %5d %5d" % (label, M, N, K)
        fl = 2.0 * M * N * K
        for n in args.threads:
            t_rx, t_np = rate[("rx", n, M, N, K, ta, tb)], rate[("numpy", n, M, N, K, ta, tb)]
            tot[n][0] += fl
            tot[n][1] += t_rx
            tot[n][2] += t_np
            line += " | %4d %7.1f %7.1f %5.2f" % (n, fl / t_rx / 1e9, fl / t_np / 1e9, t_np / t_rx)
        print(line, flush=True)
    for n in args.threads:
        f, trx, tnp = tot[n]
        print("all shapes, %d thread(s): rx %.1f GFLOP/s, numpy %.1f GFLOP/s, ratio %.2f"
              % (n, f / trx / 1e9, f / tnp / 1e9, tnp / trx))
    rx.set_num_threads(0)


if __name__ == "__main__":
    main()
