"""Thread scaling of rwkvx_c's training step: tokens/s of forward+backward
at 1..N threads, presets S and M, batch 8, with a figure.

    python bench/bench_scaling.py [--preset S M] [--threads 1 2 4 8 16]
                                  [--precision fp32 [bf16]] [--batch 8]
                                  [--seq-len 512] [--steps 3] [--rounds 2]
                                  [--breakdown] [--json FILE] [--png FILE]

Every (preset, precision, threads) point runs in its own process (a fresh OpenMP team
of that size), and the points alternate for R rounds, each reporting its
best round: on a shared machine all points then sample the same drift.
Speed-up is tokens/s at n threads over tokens/s at the smallest n measured;
efficiency is speed-up divided by the thread ratio. --png draws both
against threads (matplotlib; skipped with a note where it is missing).
--breakdown adds each kernel's time per step (rwkvx_c.profile(), best of
--steps more steps per point) and its speed-up, which shows the kernel
that stops scaling.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def child(preset, precision, threads, batch, seq_len, steps, breakdown):
    """Best forward+backward time of `steps` steps after one warm-up; with
    breakdown, each kernel's best time over `steps` more, profiled, steps."""
    import numpy as np

    import rwkvx_c as rx
    rx.set_num_threads(threads)
    cfg = {k: v for k, v in common.PRESETS[preset].items() if k != "T"}
    m = rx.RxPtModel(cfg, seed=0, precision=precision)
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, cfg["vocab_size"], size=(batch, seq_len + 1)).astype("int32")
    x, y = np.ascontiguousarray(seqs[:, :-1]), np.ascontiguousarray(seqs[:, 1:])
    m.forward(x, return_logits=False)
    m.backward(y)
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        m.forward(x, return_logits=False)
        m.backward(y)
        best = min(best, time.perf_counter() - t0)
    kernels = {}
    for _ in range(steps if breakdown else 0):
        rx.profile_enable(True)
        m.forward(x, return_logits=False)
        m.backward(y)
        for name, sec in rx.profile().items():
            kernels[name] = min(kernels.get(name, float("inf")), sec)
        rx.profile_enable(False)
    return {"threads": rx.get_num_threads(), "best_s": best,
            "gemm_kernel": rx.gemm_kernel(precision), "kernels": kernels}


def plot(points, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no figure (pip install matplotlib)")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for preset, pts in points.items():
        ns = sorted(pts)
        ax1.plot(ns, [pts[n]["tok_s"] for n in ns], "o-", label=preset)
        ax2.plot(ns, [pts[n]["speedup"] for n in ns], "o-", label=preset)
    top = max(n for pts in points.values() for n in pts)
    ax2.plot([1, top], [1, top], "k:", label="linear")
    ax1.set(xlabel="threads", ylabel="tokens/s (fwd+bwd)", xscale="log", yscale="log")
    ax2.set(xlabel="threads", ylabel="speed-up", xscale="log", yscale="log")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("rwkvx_c thread scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("figure:", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", nargs="+", default=["S", "M"], choices=sorted(common.PRESETS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--breakdown", action="store_true",
                    help="also each kernel's time per step and its speed-up")
    ap.add_argument("--json", help="write the points here")
    ap.add_argument("--png", help="draw the figure here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]), args.batch,
                               args.seq_len, args.steps, args.breakdown)))
        return
    best, kernels, parts = {}, {}, {}
    # a line per preset and precision ("S", or "S bf16" beside "S fp32")
    lines = [(preset, p) for preset in args.preset for p in args.precision]
    label = {line: line[0] if args.precision == ["fp32"] else "%s %s" % line for line in lines}
    for _ in range(args.rounds):
        for preset, prec in lines:
            for n in args.threads:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", preset, prec,
                       str(n), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
                       "--steps", str(args.steps)] + (["--breakdown"] if args.breakdown else [])
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                text=True).stdout.splitlines()[-1])
                kernels[prec] = out["gemm_kernel"]
                key = (preset, prec, n)
                best[key] = min(best.get(key, float("inf")), out["best_s"])
                for name, sec in out["kernels"].items():
                    parts[key + (name,)] = min(parts.get(key + (name,), float("inf")), sec)
    tokens = args.batch * args.seq_len
    points = {}
    print("B=%d, T=%d, GEMM kernel %s, best of %d steps in each of %d alternating rounds"
          % (args.batch, args.seq_len, ", ".join(kernels[p] for p in args.precision),
             args.steps, args.rounds))
    print("%-9s %7s %10s %8s %10s" % ("preset", "threads", "tok/s", "speed-up", "efficiency"))
    for line in lines:
        n0 = min(args.threads)
        base = tokens / best[line + (n0,)]
        points[label[line]] = {}
        for n in sorted(args.threads):
            tok_s = tokens / best[line + (n,)]
            sp = tok_s / base
            points[label[line]][n] = {"tok_s": tok_s, "speedup": sp, "efficiency": sp * n0 / n,
                                      "kernels_s": {key[3]: v for key, v in parts.items()
                                                    if key[:3] == line + (n,)}}
            print("%-9s %7d %10.0f %8.2f %10.2f" % (label[line], n, tok_s, sp, sp * n0 / n))
    if args.breakdown:
        print("per kernel: ms per step at each thread count (speed-up over %d thread(s))"
              % min(args.threads))
        names = sorted({key[3] for key in parts})
        for line in lines:
            for name in names:
                ms = [parts.get(line + (n, name), 0.0) * 1e3 for n in sorted(args.threads)]
                cells = "  ".join("%8.1f (%4.2fx)" % (t, ms[0] / t if t else 0.0) for t in ms)
                print("%-9s %-26s %s" % (label[line], name, cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "seq_len": args.seq_len, "gemm_kernels": kernels,
                       "points": points}, f, indent=1)
    if args.png:
        plot(points, args.png)


if __name__ == "__main__":
    main()
