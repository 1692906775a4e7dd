"""A/B of two rwkvx_c builds on one training step, paired round by round.

    python bench/bench_ab.py DIR_A DIR_B [--preset S|M] [--threads N]
                             [--rounds R] [--steps K] [--precision fp32|bf16]
                             [--clock wall|cpu] [--env-a NAME=VALUE ...]
                             [--env-b NAME=VALUE ...]

DIR_A and DIR_B are source trees with in-place builds (`python3 setup.py
build_ext --inplace`), e.g. a `git worktree` of the base commit and the
working tree. One worker process per build imports rwkvx_c from its tree and
keeps its model; the two take turns running K forward+backward steps (T of
the preset, B=1), for R rounds, alternating which goes first. Each round
pairs the two sides' best steps, taken seconds apart, so the ratio B/A per
round cancels most of a cloud machine's drift; its median and quartiles are
the verdict (below 1: B is faster). Half the rounds run with A's worker
started first, half (fresh workers) with B's, and the verdict is the
geometric mean of the two halves' medians: in A/A runs (one tree on both
sides) the worker started second ran 1.5-4% faster, a bias as large as
the effects measured, which the two orders cancel. --clock cpu (with
--threads 1) times each worker's CPU time, which a busy shared machine
inflates far less than the wall clock. --env-a / --env-b set variables for one side's worker
only: with DIR_A = DIR_B that compares settings, e.g. OpenMP's waiting.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def worker(tree, preset, threads, precision, clock):
    """Reads a step count per line from stdin; answers with the step times."""
    sys.path.insert(0, os.path.abspath(tree))
    import numpy as np

    import rwkvx_c as rx
    rx.set_num_threads(threads)
    cfg = dict(common.PRESETS[preset])
    T = cfg.pop("T")
    m = rx.RxPtModel(cfg, seed=1)
    if precision != "fp32":  # a build from before precisions existed runs fp32 only
        m.precision = precision
    now = time.thread_time if clock == "cpu" else time.perf_counter
    seq = np.random.default_rng(0).integers(0, cfg["vocab_size"], size=T + 1).astype(np.int32)
    tok, tgt = np.ascontiguousarray(seq[:T]), np.ascontiguousarray(seq[1:])
    m.forward(tok)
    m.backward(tgt)
    print(json.dumps({"from": os.path.dirname(rx.__file__)}), flush=True)
    for line in sys.stdin:
        ts = []
        for _ in range(int(line)):
            t0 = now()
            m.forward(tok)
            m.backward(tgt)
            ts.append(now() - t0)
        print(json.dumps(ts), flush=True)


def quartiles(xs):
    xs = sorted(xs)
    return xs[len(xs) // 4], statistics.median(xs), xs[(3 * len(xs)) // 4]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--preset", default="S", choices=sorted(common.PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--env-a", nargs="*", default=[], metavar="NAME=VALUE",
                    help="environment of A's worker only (e.g. GOMP_SPINCOUNT=1000)")
    ap.add_argument("--env-b", nargs="*", default=[], metavar="NAME=VALUE",
                    help="environment of B's worker only")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures one thread: add --threads 1")
    if args.worker:
        worker(args.worker, args.preset, args.threads, args.precision, args.clock)
        return
    common.clean_blas_env()
    # launch order biases the ratio (module docstring): both orders, half
    # the rounds each
    half = (args.rounds + 1) // 2
    times, pairs = ([], []), []
    for order in ((0, 1), (1, 0)):
        t, p = session(args, order, half)
        for i in (0, 1):
            times[i].extend(t[i])
        pairs.append(p)
    print("preset %s, %s, %d threads, %s clock, %d rounds x %d steps each"
          % (args.preset, args.precision, args.threads, args.clock, 2 * half, args.steps))
    for name, ts in zip("AB", times):
        q1, med, _ = quartiles(ts)
        print("%s: best %.1f ms  25%% %.1f ms  median %.1f ms per step"
              % (name, 1e3 * min(ts), 1e3 * q1, 1e3 * med))
    meds = []
    for label, p in (("A started first", pairs[0]), ("B started first", pairs[1])):
        q1, med, q3 = quartiles(p)
        meds.append(med)
        print("  %s: B/A per round median %.3f (quartiles %.3f-%.3f)" % (label, med, q1, q3))
    # the launch-order bias enters the two medians with opposite signs
    print("B/A, both launch orders: %.3f (geometric mean of the two medians)"
          % math.sqrt(meds[0] * meds[1]))


def session(args, order, rounds):
    """Workers for trees A and B, started in `order`, run `rounds` rounds;
    each side's step times and the per-round ratios of the best steps, B/A."""
    trees = (args.a, args.b)
    envs = [dict(os.environ, **dict(kv.split("=", 1) for kv in extra))
            for extra in (args.env_a, args.env_b)]
    procs = [None, None]
    for i in order:
        procs[i] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", trees[i], "x", "x",
             "--preset", args.preset, "--threads", str(args.threads), "--precision",
             args.precision, "--clock", args.clock],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=envs[i])
        line = procs[i].stdout.readline()
        if not line:
            sys.exit("worker for %s failed to start" % trees[i])
        print("%s: rwkvx_c from %s" % ("AB"[i], json.loads(line)["from"]))
    times, pairs = ([], []), []
    for r in range(rounds):
        best = [0.0, 0.0]
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            procs[i].stdin.write("%d\n" % args.steps)
            procs[i].stdin.flush()
            ts = json.loads(procs[i].stdout.readline())
            times[i].extend(ts)
            best[i] = min(ts)
        pairs.append(best[1] / best[0])
    for p in procs:
        p.stdin.close()
        p.wait()
    return times, pairs


if __name__ == "__main__":
    main()
