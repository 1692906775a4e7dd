"""Whole-model training step (forward + backward of RxPtModel) in tokens/s
on the docs/training.md §Presets reference configurations, docs/layout.md §Init, random tokens.

    python bench/bench_model.py [--preset S M] [--threads 1 2] [--T 512] [--B 1]
                                [--precision fp32|bf16] [--vocab V] [--logits]

Each row is the best of --repeat timed steps after one warm-up step; model
GFLOP/s counts 6 x the forward multiply-adds per token (bench/common.py).
--vocab replaces the preset's vocabulary (65536: the RWKV World tokenizer's);
--logits also times the step with forward returning its logits (a copy of
B*T*V floats into a new array), beside the trainer's step without them.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import numpy as np

import rwkvx_c as rx


def step_time(m, tokens, targets, repeat, logits=False):
    """Best wall time of forward + backward over `repeat` steps, after a warm-up."""
    m.forward(tokens, return_logits=logits)
    m.backward(targets)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        m.forward(tokens, return_logits=logits)
        m.backward(targets)
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", nargs="+", default=["S", "M"], choices=sorted(common.PRESETS))
    ap.add_argument("--threads", nargs="+", type=int, default=[2, 1])
    ap.add_argument("--T", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--B", type=int, default=1, help="sequences per step")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the preset's)")
    ap.add_argument("--logits", action="store_true",
                    help="also time steps whose forward returns the logits")
    args = ap.parse_args()
    print("rx gemm kernel: %s, OpenMP: %s" % (rx.gemm_kernel(args.precision), rx.has_openmp()))
    print("%-6s %4s %5s %3s %6s %10s %9s %9s %9s %s" % ("preset", "thr", "T", "B", "vocab",
                                                        "params", "ms/step", "tok/s", "GFLOP/s",
                                                        "forward"))
    rng = np.random.default_rng(0)
    for preset in args.preset:
        spec = dict(common.PRESETS[preset])
        T = spec.pop("T")
        T = args.T or T
        spec["vocab_size"] = args.vocab or spec["vocab_size"]
        m = rx.RxPtModel(spec, seed=0, precision=args.precision)
        tokens = rng.integers(0, spec["vocab_size"], (args.B, T)).astype(np.int32)
        targets = rng.integers(0, spec["vocab_size"], (args.B, T)).astype(np.int32)
        if args.B == 1:
            tokens, targets = tokens[0].copy(), targets[0].copy()
        flops = common.model_flops_per_token(spec, T)
        for n in args.threads:
            rx.set_num_threads(n)
            for logits in (False, True) if args.logits else (False,):
                t = step_time(m, tokens, targets, args.repeat, logits)
                tps = args.B * T / t
                print("%-6s %4d %5d %3d %6d %10d %9.1f %9.0f %9.2f %s" % (
                    preset, n, T, args.B, spec["vocab_size"], m.n_params, t * 1e3, tps,
                    tps * flops / 1e9, "logits returned" if logits else "return_logits=False"))
                sys.stdout.flush()
        rx.set_num_threads(0)
    print("peak RSS %.0f MiB" % common.peak_rss_mib())


if __name__ == "__main__":
    main()
