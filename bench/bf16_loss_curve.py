"""The loss curve of a bf16 run beside the fp32 run it mirrors: same preset,
init, data order and schedule, only the projection GEMMs' precision differs.

    python bench/bf16_loss_curve.py [--preset default] [--steps 300] [--threads 2]
                                    [--json out.json]

Prints the training loss every 25 steps for both runs, their mean over the
last 25 steps, and the final validation loss, with the relative gaps
(the issue's bar: within 1% at the end). The runs alternate step by step,
so machine load weighs on both alike; the bf16 run uses the kernel this CPU
picks (rwkvx_c.gemm_kernel("bf16")).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: F401  (in-place build first on sys.path)
import numpy as np

import rwkvx_c as rx
from rwkvx_c.train import Trainer, TrainOptions

TAIL = 25  # steps averaged for the end-of-run training loss


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the two curves here")
    a = ap.parse_args()
    runs = {p: Trainer(TrainOptions(preset=a.preset, steps=a.steps, threads=a.threads,
                                    precision=p))
            for p in ("fp32", "bf16")}
    print(f"preset {a.preset}, {a.steps} steps, bf16 kernel {rx.gemm_kernel('bf16')}, "
          f"fp32 kernel {rx.gemm_kernel()}, {rx.get_num_threads()} threads", flush=True)
    loss = {p: [] for p in runs}
    for s in range(a.steps):
        for p, tr in runs.items():
            loss[p].append(tr.step()["loss"])
        if (s + 1) % TAIL == 0:
            print(f"step {s + 1:4d}  fp32 {loss['fp32'][-1]:.4f}  bf16 {loss['bf16'][-1]:.4f}",
                  flush=True)
    tail = {p: float(np.mean(v[-TAIL:])) for p, v in loss.items()}
    val = {p: tr.evaluate()["val_loss"] for p, tr in runs.items()}
    print(f"mean train loss, last {TAIL} steps: fp32 {tail['fp32']:.4f} bf16 {tail['bf16']:.4f} "
          f"({100 * (tail['bf16'] / tail['fp32'] - 1):+.2f}%)")
    print(f"val loss: fp32 {val['fp32']:.4f} bf16 {val['bf16']:.4f} "
          f"({100 * (val['bf16'] / val['fp32'] - 1):+.2f}%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"loss": loss, "tail": tail, "val": val,
                       "kernel": rx.gemm_kernel("bf16")}, f)


if __name__ == "__main__":
    main()
