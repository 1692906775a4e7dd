"""Held-out loss of the same LoRA tune over each frozen-base dtype
(docs/finetune.md §The frozen base, "Which 4-bit form"): a byte model pretrained on docs/,
then tuned on tests/data/chat.jsonl (its last 40% held out) with --tune
lora over a base held in bf16, q8_0, q4_0, nf4 and q4_k, each in its own process,
one after another, the same seed (--seed: the tune's, the pretraining's
stays 1) and steps (--dtypes: some of them).

    python bench/bench_base_quality.py --out /tmp/basequality
    python bench/bench_base_quality.py --weight-error /work/big/official-1.5B-Q8_0.gguf

Prints a Markdown table: each dtype's held-out loss after the steps, its
difference from the bf16 base's, the base's bytes per weight, and the
wall-clock of the whole train command; then the held-out loss of the
quantized base itself (step 0, before the adapters move: no seed in it)
and the relative error ||W' - W|| / ||W|| of its decoded matrices, over the
matrices every dtype holds (input sizes a multiple of 256: Q4_K's super-block).
--weight-error SOURCE prints that error alone for any --init-from source (an
official GGUF), over every --every-th such matrix."""
import argparse
import json
import os

import numpy as np
from bench_adapters import CHAT, ROOT, train  # one train command, its held-out loss, its time

import rwkvx_c as rx
from rwkvx_c.interop import read_source

DTYPES = {"bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "nf4": 36 / 64,   # bytes per weight
          "q4_k": 144 / 256}
BLOCK = 256   # the largest block of DTYPES: the matrices every dtype holds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--base-steps", type=int, default=600)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1, help="the tune's seed (LoRA init, batches)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--out")
    ap.add_argument("--weight-error", metavar="SOURCE")
    ap.add_argument("--every", type=int, default=1)
    a = ap.parse_args()
    dtypes = a.dtypes.split(",")
    if a.weight_error:
        src = read_source(a.weight_error)
        print("| base dtype | relative weight error |\n|---|---|")
        for dtype in dtypes:
            print(f"| {dtype} | {weight_error(src, dtype, a.every):.4f} |", flush=True)
        return
    if not a.out:
        ap.error("--out is needed for the tune")
    base = os.path.join(a.out, "base")
    if not os.path.exists(os.path.join(base, "checkpoint.safetensors")):
        train(["--preset", "tiny", "--n-attn-layer", "0", "--n-embd", str(a.n_embd),
               "--data", os.path.join(ROOT, "docs"), "--steps", str(a.base_steps),
               "--batch", "8", "--seq-len", "128", "--lr", "2e-3"], base, a.threads)
    tune = ["--init-from", base, "--data", CHAT, "--val-fraction", "0.4", "--steps",
            str(a.steps), "--batch", "8", "--seq-len", "64", "--eval-every", str(a.steps),
            "--tune", "lora", "--lora-r", "8", "--lora-alpha", "16", "--lr", "3e-3",
            "--seed", str(a.seed)]
    print(f"| base dtype | bytes / weight | held-out loss after {a.steps} steps | "
          "against bf16 | wall-clock (s) |")
    print("|---|---|---|---|---|")
    ref = None
    for dtype in dtypes:
        per = DTYPES[dtype]
        run = dtype if a.seed == 1 else f"{dtype}-seed{a.seed}"
        v, wall = train(tune + ["--base-dtype", dtype], os.path.join(a.out, run), a.threads)
        ref = v if ref is None else ref
        print(f"| {dtype} | {per:.3f} | {v:.4f} | {100 * (v - ref) / ref:+.2f}% | {wall:.1f} |",
              flush=True)
    print("\n| base dtype | held-out loss at step 0 | relative weight error |\n|---|---|---|")
    src = read_source(base)
    for dtype in dtypes:
        run = dtype if a.seed == 1 else f"{dtype}-seed{a.seed}"
        with open(os.path.join(a.out, run, "log.jsonl")) as f:
            v0 = next(r["val_loss"] for r in map(json.loads, f) if r.get("step") == 0)
        print(f"| {dtype} | {v0:.4f} | {weight_error(src, dtype):.4f} |", flush=True)


def weight_error(src, dtype, every=1):
    """||W' - W|| / ||W|| over every every-th of the source's matrices whose
    rows are whole blocks of BLOCK, W' as a base of dtype decodes them"""
    m = rx.RxPtModel(src.config, init=False)
    names = [n for n in m.param_names if m.params[n].ndim == 2
             and m.params[n].shape[n == "emb"] % BLOCK == 0][::every]
    m.set_base(dtype, names)
    err = tot = 0.0
    for n in names:
        w = np.asarray(src.weights[n], np.float32)
        m.base_fill(n, w)
        err += float(np.sum((m.base_tensor(n).astype(np.float64) - w) ** 2))
        tot += float(np.sum(w.astype(np.float64) ** 2))
    return (err / tot) ** 0.5


if __name__ == "__main__":
    main()
