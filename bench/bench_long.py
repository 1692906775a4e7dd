"""Long contexts in bounded memory: training-step tokens/s and peak RSS of a
preset at growing T (batch 1) with activation recompute, and the step-time
overhead of recompute against none at a T where both fit.

    python bench/bench_long.py [--preset M] [--T 2048 8192 16384 65536]
                               [--overhead-T 2048] [--pairs 3] [--precision auto]
    python bench/bench_long.py --preset tiny --vocab 65536 --batch 8 --T 512

Each T runs in a fresh process (peak RSS is a process's high-water mark):
one warm-up step, then --steps timed steps of forward + backward (the
chunked head: no [B*T, vocab] logits) + AdamW; prints tokens/s, the peak RSS
and each T's tokens/s over the first T's. --rounds R runs the list of T R
times in alternation (T1, T2, ..., T1, T2, ...) and takes each T's median,
so that a change in the load of other jobs falls on every T alike;
--interleave K also times every T in one process, a step of each in turn
for K rounds (closer still in time: the steadiest tokens/s ratios). The
overhead runs recompute and plain steps in alternation in one process,
--pairs of each after a warm-up of both, and prints the ratio of the
medians. The last lines give the figures of docs/performance.md §Long
contexts against their goals: peak RSS at 16,384 (< 2.5e9 bytes), tokens/s
at 16,384 over 2,048 (>= 0.8) and the overhead (<= 1.35x). A shared machine
moves absolute figures from run to run: compare the ratios.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import common  # noqa: F401  (puts an in-place build first on sys.path)
import numpy as np


def _model(args, recompute):
    import rwkvx_c as rx
    from rwkvx_c.model.presets import PRESETS
    from rwkvx_c.train.options import auto_precision
    cfg = dict(PRESETS[args.preset]["model"])
    if args.vocab:
        cfg["vocab_size"] = args.vocab
    prec = auto_precision() if args.precision == "auto" else args.precision
    m = rx.RxPtModel(cfg, seed=0, precision=prec, recompute=recompute)
    return m, cfg, prec


def _stepper(m, cfg, B, T):
    import rwkvx_c as rx
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg["vocab_size"], (B, T)).astype(np.int32)
    y = rng.integers(0, cfg["vocab_size"], (B, T)).astype(np.int32)
    mom, vel = np.zeros_like(m.param_buffer), np.zeros_like(m.param_buffer)
    count = [0]

    def step():
        t = time.perf_counter()
        m.forward(x, return_logits=False)
        m.backward(y)
        count[0] += 1
        rx.adamw_step(m.param_buffer, m.grad_buffer, mom, vel, lr=1e-5, step=count[0])
        return time.perf_counter() - t
    return step


def one_T(args):
    m, cfg, prec = _model(args, not args.no_recompute)
    step = _stepper(m, cfg, args.batch, args.one)
    step()
    times = [step() for _ in range(args.steps)]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(dict(T=args.one, tokens_per_s=args.batch * args.one / min(times),
                          peak_rss=rss, precision=prec, n_params=m.n_params)))


def overhead(args):
    plain, cfg, prec = _model(args, False)
    rec, _, _ = _model(args, True)
    steps = {False: _stepper(plain, cfg, args.batch, args.overhead_T),
             True: _stepper(rec, cfg, args.batch, args.overhead_T)}
    steps[False]()
    steps[True]()
    times = {False: [], True: []}
    for i in range(args.pairs):   # alternate, and swap which goes first
        for mode in ((False, True) if i % 2 == 0 else (True, False)):
            times[mode].append(steps[mode]())
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"overhead at T = {args.overhead_T} (batch {args.batch}, {prec}): recompute step "
          f"{statistics.median(times[True]):.3f} s / plain {statistics.median(times[False]):.3f}"
          f" s = {ratio:.3f}x ({args.pairs} alternating pairs)")
    return ratio


def interleaved(args):
    """tokens/s of every T (batch 1 each, recompute as set) in one process,
    a step of each in turn for --interleave rounds after a warm-up: the load
    of other jobs falls on all of them alike. Returns {T: median tokens/s}."""
    steps = {}
    for T in args.T:
        m, cfg, _ = _model(args, not args.no_recompute)
        steps[T] = _stepper(m, cfg, args.batch, T)
        steps[T]()
    times = {T: [] for T in args.T}
    for i in range(args.interleave):
        for T in (args.T if i % 2 == 0 else args.T[::-1]):
            times[T].append(steps[T]())
    med = {T: args.batch * T / statistics.median(v) for T, v in times.items()}
    print("interleaved in one process (" + str(args.interleave) + " rounds): " +
          ", ".join(f"T = {T}: {r:.1f} tokens/s ({r / med[args.T[0]]:.2f}x)"
                    for T, r in med.items()), flush=True)
    return med


def _one_run(T):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(T)] + sys.argv[1:]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"T = {T}: failed: {r.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="M")
    ap.add_argument("--vocab", type=int, default=0, help="override the vocabulary size")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 16384, 65536])
    ap.add_argument("--steps", type=int, default=2, help="timed steps per T (best is kept)")
    ap.add_argument("--overhead-T", type=int, default=2048, help="0: skip the overhead pairs")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the list of T this many times in alternation, median per T")
    ap.add_argument("--interleave", type=int, default=0,
                    help="also time every T in one process, a step of each in turn, this many "
                         "rounds (the tokens/s ratios least moved by other jobs)")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--no-recompute", action="store_true", help="time plain steps instead")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one_T(args)
    import rwkvx_c as rx
    print(f"# preset {args.preset}, vocab {args.vocab or 'preset'}, batch {args.batch}, "
          f"threads {rx.get_num_threads()}, recompute {not args.no_recompute}")
    rates, rss = {T: [] for T in args.T}, {}
    for k in range(args.rounds):
        for T in args.T:
            row = _one_run(T)
            if row is None:
                continue
            rates[T].append(row["tokens_per_s"])
            rss[T] = max(rss.get(T, 0), row["peak_rss"])
            if args.rounds > 1:
                print(f"  round {k + 1}, T = {T}: {row['tokens_per_s']:.1f} tokens/s", flush=True)
    med = {T: statistics.median(v) for T, v in rates.items() if v}
    base = med.get(args.T[0])
    for T in args.T:
        if T not in med:
            continue
        rel = f" ({med[T] / base:.2f}x the first)" if base else ""
        print(f"T = {T:6d}: {med[T]:8.1f} tokens/s{rel}, peak RSS {rss[T] / 2**30:.2f} GiB "
              f"= {rss[T] / 1e9:.2f} GB ({len(rates[T])} run(s), median)", flush=True)
    inter = interleaved(args) if args.interleave else {}
    ratio = overhead(args) if args.overhead_T else None
    print("# goals (docs/performance.md §Long contexts):")
    if 16384 in rss:
        print(f"#   peak RSS at T = 16384: {rss[16384] / 1e9:.2f} GB (goal < 2.5 GB)")
    if 16384 in med and 2048 in med:
        print(f"#   tokens/s at 16384 / at 2048: {med[16384] / med[2048]:.2f} (goal >= 0.8)")
    if 16384 in inter and 2048 in inter:
        print(f"#   tokens/s at 16384 / at 2048, interleaved: {inter[16384] / inter[2048]:.2f}"
              " (goal >= 0.8)")
    if ratio is not None:
        print(f"#   recompute overhead at T = {args.overhead_T}: {ratio:.3f}x (goal <= 1.35x)")


if __name__ == "__main__":
    main()
