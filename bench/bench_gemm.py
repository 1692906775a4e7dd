"""rx_sgemm (csrc/gemm.c) against NumPy's float32 matmul on the projection
shapes of the docs/training.md §Presets configurations S and M, forward and backward.

    python bench/bench_gemm.py [--preset S M] [--threads 1 2] [--rows 512] [--cold]
                               [--kernel NAME [NAME ...]] [--rounds R] [--square 2048]
                               [--precision fp32|bf16]
    python bench/bench_gemm.py --decode [--decode-c 768 2048] [--threads 1 2] [--rounds R]

Each shape is M x N x K of C[M,N] = op(A)[M,K] . op(B)[K,N]; "dx" rows are
grads through a weight (B transposed), "dW" rows weight grads (A transposed,
K = the T*B rows). GFLOP/s are best-of-rounds, each library timed on its own (interleaved
calls would make the two thread pools spin against each other).

--cold evicts the caches (writes a --flush-mib buffer) before every timed
call, so A, B and C come from DRAM as in a training step, where the kernels
between two projections push their operands out of L2 and often L3; each
call is then timed alone (best of --repeat).

--kernel forces one of rx_sgemm's micro-kernels (default: the one picked
for this CPU: rwkvx_c.gemm_kernel()); several names compare those kernels
in one process. --rounds R repeats the whole sweep R times and reports
the median round of each: at 1 thread every library and kernel runs on
each shape in turn, so on a shared machine all sample the same load. --square S
adds an S x S x S product.

--precision bf16 times rx_bgemm (the bf16 projection GEMM: operands rounded
to bf16 while packing, fp32 accumulation) in the rx column instead, still
against NumPy's float32 matmul; --kernel then names a bf16 kernel
(amx-bf16, avx512-bf16, generic-bf16). --peer torch compares with PyTorch's
bf16 matmul (oneDNN; AMX where the CPU has it) on the same fp32 operands,
their conversion to bf16 included as rx_bgemm's is (its result stays bf16,
which spares it the widening rx_bgemm's fp32 result pays).

--decode times the decode shapes instead (docs/performance.md §Decode
GEMM): M = 1..64 rows (one per decoding sequence) by each weight of a
model of C = 768 (0.19B-like: C x C, C x 4C, 4C x C and the C x 65536
head) and of C = 2048 (1.5B-like), rx_sgemm as it runs (the small-M path
up to its bound of rows, 8) and forced onto its packed path (the same
bits) beside NumPy (sgemv at M = 1, sgemm above). Every
call reads B from memory, as a decode step does: each shape cycles through
enough copies of B to overflow the L3. GB/s (of rx) count B's bytes once per call,
beside a streaming read of a 512 MiB buffer on the same threads (torch's
sum); the last lines give the 0.19B model's per-token ceiling, its
streamed weight bytes over that bandwidth, in fp32 and bf16.

Each preset's total also says what share of the machine's peak it reached:
one core's fp32 FMA (or, with --precision bf16, its fastest bf16
instruction) peak measured by bench_peak.py in the same run, times the
threads.
"""
import argparse
import functools
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peak
import common

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


DECODE_M = (1, 2, 4, 8, 16, 64)
DECODE_C = (768, 2048)
DECODE_V = 65536
MODEL_019B = {"C": 768, "L": 12, "V": 65536, "lora": (64, 64, 32, 128)}
L3_BYTES = 64 << 20   # B copies cycled per shape: past any L3 this runs on


def stream_gbs(n, mib=512, repeat=5):
    """GB/s of a streaming read of a mib MiB float32 buffer on n threads."""
    import torch
    torch.set_num_threads(n)
    buf = torch.ones(mib << 18, dtype=torch.float32)
    t = common.best_time(buf.sum, repeat=repeat, min_time=0.2)
    return buf.numel() * 4 / t / 1e9


def weight_bytes_019b(width):
    """Bytes of weights one token streams through the 0.19B-like model:
    per block r, k, v, o (C x C), the channel-mix (C x 4C, 4C x C) and the
    time-mix LoRAs (C x D, D x C); the head (C x V)."""
    m = MODEL_019B
    C = m["C"]
    per_block = 4 * C * C + 8 * C * C + sum(2 * C * d for d in m["lora"])
    return width * (m["L"] * per_block + C * m["V"])


def _decode_fn(lib, a, bs, out):
    """One call of lib ("rx": rx_sgemm as it runs, "packed": rx_sgemm with
    the small-M path off, "numpy": sgemv at one row, else sgemm) on the
    next copy of B in turn."""
    it = itertools.count()
    x, y = (a[0], out[0]) if a.shape[0] == 1 else (a, out)

    def call():
        b = bs[next(it) % len(bs)]
        if lib == "numpy":
            np.matmul(x, b, out=y)
        else:
            rx._core._sgemm(a, b, out=out)
    return call


def decode_main(args):
    """GFLOP/s and B's GB/s of the decode shapes, rx as dispatched / rx
    packed / NumPy, at each thread count, beside the streaming read."""
    rng = np.random.default_rng(0)
    print(common.blas_info(), "| rx kernel", rx.gemm_kernel("fp32"),
          "| median of %d rounds" % args.rounds)
    bw = {}
    for n in args.threads:
        bw[n] = statistics.median(stream_gbs(n) for _ in range(args.rounds))
        print("streaming read, %d thread(s): %.1f GB/s" % (n, bw[n]))
    hdr = "%-6s %5s %6s %3s" % ("shape", "K", "N", "M")
    for _ in args.threads:
        hdr += " | %3s %7s %7s %7s %6s %6s" % ("thr", "rx", "packed", "numpy", "GB/s", "of bw")
    print(hdr + "   (GFLOP/s)")
    small = rx._core._sgemm_small_m(0)
    rx._core._sgemm_small_m(small)
    for C in args.decode_c:
        for name, K, N in (("CxC", C, C), ("Cx4C", C, 4 * C), ("4CxC", 4 * C, C),
                           ("head", C, DECODE_V)):
            copies = max(1, -(-L3_BYTES // (K * N * 4)))
            bs = [rng.standard_normal((K, N), dtype=np.float32) for _ in range(copies)]
            for M in DECODE_M:
                a = rng.standard_normal((M, K), dtype=np.float32)
                out = np.empty((M, N), dtype=np.float32)
                line = "%-6s %5d %6d %3d" % (name, K, N, M)
                for n in args.threads:
                    rx.set_num_threads(n)
                    t = {}
                    for lib in ("rx", "packed", "numpy"):
                        call = _decode_fn(lib, a, bs, out)
                        rx._core._sgemm_small_m(small if lib == "rx" else 0)
                        with common.blas_threads(n):
                            t[lib] = statistics.median(
                                common.best_time(call, repeat=3, min_time=0.05)
                                for _ in range(args.rounds))
                    rx._core._sgemm_small_m(small)
                    fl = 2.0 * M * N * K / 1e9
                    gbs = K * N * 4 / t["rx"] / 1e9
                    line += " | %3d %7.1f %7.1f %7.1f %6.1f %5.0f%%" % (
                        n, fl / t["rx"], fl / t["packed"], fl / t["numpy"], gbs,
                        100 * gbs / bw[n])
                print(line, flush=True)
    for n in args.threads:
        print("0.19B-like model (C 768, 12 blocks, V 65536), %d thread(s): per-token ceiling "
              "%.1f tokens/s fp32 (%.0f MB), %.1f bf16 (%.0f MB)"
              % (n, bw[n] * 1e9 / weight_bytes_019b(4), weight_bytes_019b(4) / 1e6,
                 bw[n] * 1e9 / weight_bytes_019b(2), weight_bytes_019b(2) / 1e6))
    rx.set_num_threads(0)


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
    ap.add_argument("--kernel", nargs="+", help="force these rx_sgemm (or, with --precision "
                    "bf16, rx_bgemm) micro-kernels in turn")
    ap.add_argument("--rounds", type=int, default=1, help="sweeps; the median is reported")
    ap.add_argument("--square", type=int, nargs="*", default=[], help="add S x S x S products")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="bf16: time rx_bgemm in the rx columns")
    ap.add_argument("--peer", default="numpy", choices=["numpy", "torch"],
                    help="the library beside rx: NumPy's float32 matmul, or (with "
                    "--precision bf16) PyTorch's bf16 matmul")
    ap.add_argument("--decode", action="store_true",
                    help="the decode shapes (M = 1..64 rows by each weight) instead")
    ap.add_argument("--decode-c", nargs="+", type=int, default=list(DECODE_C),
                    help="model widths C of --decode")
    args = ap.parse_args()
    if args.decode:
        decode_main(args)
        return
    if args.peer == "torch" and args.precision != "bf16":
        ap.error("--peer torch compares bf16 matmuls: add --precision bf16")
    bf16 = args.precision == "bf16"
    use_kernel = rx._core._bgemm_use_kernel if bf16 else rx._core._sgemm_use_kernel
    rx_gemm = rx._core._bgemm if bf16 else rx._core._sgemm
    kernels = args.kernel or [rx.gemm_kernel(args.precision)]
    for k in kernels:
        use_kernel(k)   # ValueError if this CPU lacks it
    use_kernel(None)
    libs = ["rx " + k for k in kernels] + [args.peer]
    if args.peer == "torch":
        import torch
    print(common.blas_info() if args.peer == "numpy" else "torch " + torch.__version__,
          "| rx kernels:", ", ".join(kernels),
          "| cold (%d MiB flush)" % args.flush_mib if args.cold else "| hot caches",
          "| median of %d rounds" % args.rounds)
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
    if args.square:
        rows.append(("-- square",))
    for S in args.square:
        a, b = operands(S, S, S, False, False, rng)
        rows.append(("square %d" % S, S, S, S, False, False, a, b))
    # Several threads: one library at a time, since alternating calls would
    # leave one library's idle threads spinning while the other's run. One
    # thread: every library on each shape in turn, so a burst of load from
    # elsewhere hits all of them on that shape rather than one library.
    times = {}
    for _ in range(args.rounds):
        for n in args.threads:
            clock = time.thread_time if args.cpu_time and n == 1 else time.perf_counter
            rx.set_num_threads(n)
            if args.peer == "torch":
                torch.set_num_threads(n)
            shaped = [r for r in rows if len(r) > 1]
            order = ([(lib, r) for r in shaped for lib in libs] if n == 1
                     else [(lib, r) for lib in libs for r in shaped])
            with common.blas_threads(n):
                for lib, row in order:
                    label, M, N, K, ta, tb, a, b = row
                    out = np.empty((M, N), dtype=np.float32)
                    if lib.startswith("rx "):
                        use_kernel(lib[3:])
                        fn = functools.partial(rx_gemm, a, b, ta, tb, out=out)
                    elif lib == "torch":
                        ta_ = torch.from_numpy(a).t() if ta else torch.from_numpy(a)
                        tb_ = torch.from_numpy(b).t() if tb else torch.from_numpy(b)
                        fn = functools.partial(_torch_bf16, ta_, tb_)
                    else:
                        aa, bb = (a.T if ta else a), (b.T if tb else b)
                        fn = functools.partial(np.matmul, aa, bb, out=out)
                    if args.cold:
                        t = cold_time(fn, flush, args.repeat, clock)
                    else:
                        t = common.best_time(fn, repeat=args.repeat, min_time=0.05, clock=clock)
                    times.setdefault((lib, n, M, N, K, ta, tb), []).append(t)
            rx._core._sgemm_use_kernel(None)
    rate = {key: statistics.median(ts) for key, ts in times.items()}
    core = bench_peak.peaks(bench_peak.measure())[1 if bf16 else 0]
    print("one core's %s peak (bench_peak.py): %.1f GFLOP/s"
          % ("bf16 instruction" if bf16 else "fp32 FMA", core))
    for k in kernels:
        report(rows, rate, args.threads, "rx " + k, args.peer, core)
    rx.set_num_threads(0)


def _torch_bf16(a, b):
    return a.bfloat16() @ b.bfloat16()


def report(rows, rate, threads, lib, peer, core):
    """GFLOP/s of one rx kernel and of the peer per shape, their ratio, and
    each preset's total (its distinct shapes, each called once) beside the
    peak: `core` GFLOP/s per thread."""
    print("== rx kernel", lib[3:], "beside", peer)
    tot = {}   # (section, threads): [flops, our time, numpy time]
    hdr = "%-22s %5s %5s %5s" % ("shape", "M", "N", "K")
    for _ in threads:
        hdr += " | %4s %7s %7s %5s" % ("thr", "rx", peer, "ratio")
    print(hdr)
    section = None
    for row in rows:
        if len(row) == 1:
            print(row[0])
            section = row[0][3:]
            continue
        label, M, N, K, ta, tb = row[:6]
        line = "%-22s %5d %5d %5d" % (label, M, N, K)
        fl = 2.0 * M * N * K
        for n in threads:
            t_rx, t_np = rate[(lib, n, M, N, K, ta, tb)], rate[(peer, n, M, N, K, ta, tb)]
            t = tot.setdefault((section, n), [0.0, 0.0, 0.0])
            t[0] += fl
            t[1] += t_rx
            t[2] += t_np
            line += " | %4d %7.1f %7.1f %5.2f" % (n, fl / t_rx / 1e9, fl / t_np / 1e9, t_np / t_rx)
        print(line, flush=True)
    for (section, n), (f, trx, tnp) in tot.items():
        if section.startswith("preset"):
            print("%s, %d thread(s): rx %.1f GFLOP/s (%.0f%% of peak), %s %.1f GFLOP/s, "
                  "ratio %.2f" % (section, n, f / trx / 1e9, 100 * f / trx / 1e9 / (core * n),
                                  peer, f / tnp / 1e9, tnp / trx))


if __name__ == "__main__":
    main()
