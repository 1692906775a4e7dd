"""One RxPtModel's forward+backward in fp32 and in bf16, alternating in one
process (both sample the same machine drift), with the per-kernel breakdown
of one more step of each.

    python bench/bench_precision.py [--preset S] [--batch 1] [--threads N] [--rounds 4]
                                    [--clock wall|cpu]

Prints each precision's best time and the bf16 speed-up. --clock cpu times
the calling thread's CPU time instead of the wall clock: at --threads 1
every kernel runs on that thread, so a busy shared machine (whose other
jobs take the core away now and then) no longer inflates the times.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import numpy as np

import rwkvx_c as rx


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="S", choices=sorted(common.PRESETS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = ap.parse_args()
    if a.clock == "cpu" and a.threads != 1:
        ap.error("--clock cpu measures one thread: add --threads 1")
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    if a.threads:
        rx.set_num_threads(a.threads)
    cfg = {k: v for k, v in common.PRESETS[a.preset].items() if k != "T"}
    T = common.PRESETS[a.preset]["T"]
    m = rx.RxPtModel(cfg, seed=0)
    x = np.random.default_rng(0).integers(0, cfg["vocab_size"], (a.batch, T)).astype(np.int32)

    def run():
        t = clock()
        m.forward(x, return_logits=False)
        m.backward(x)
        return clock() - t

    best = {}
    for _ in range(a.rounds):
        for p in ("fp32", "bf16"):
            m.precision = p
            run()  # the first step after a switch warms that precision's buffers
            best[p] = min(best.get(p, float("inf")), run(), run())
    print(f"preset {a.preset} B={a.batch} T={T}, {rx.get_num_threads()} threads, "
          f"{a.clock} clock, kernels {rx.gemm_kernel()} / {rx.gemm_kernel('bf16')}")
    for p in ("fp32", "bf16"):
        m.precision = p
        rx.profile_enable(True)
        run()
        prof = rx.profile()
        rx.profile_enable(False)
        parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in prof.items())
        print(f"{p}: best {best[p] * 1e3:.0f} ms; one step by kernel (ms): {parts}")
    print(f"bf16 / fp32 speed-up: {best['fp32'] / best['bf16']:.2f}x")


if __name__ == "__main__":
    main()
