"""Held-out loss of the same LoRA tune over each frozen-base dtype
(docs/finetune.md §Which base dtype): a byte model pretrained on docs/,
then tuned on tests/data/chat.jsonl (its last 40% held out) with --tune
lora over a base held in bf16, q8_0 and q4_0, each in its own process, one
after another, the same seed and steps.

    python bench/bench_base_quality.py --out /tmp/basequality

Prints a Markdown table: each dtype's held-out loss after the steps, its
difference from the bf16 base's, the base's bytes per weight, and the
wall-clock of the whole train command."""
import argparse
import os

from bench_adapters import CHAT, ROOT, train  # one train command, its held-out loss, its time

DTYPES = {"bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}   # bytes per weight


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--base-steps", type=int, default=600)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    base = os.path.join(a.out, "base")
    if not os.path.exists(os.path.join(base, "checkpoint.safetensors")):
        train(["--preset", "tiny", "--n-attn-layer", "0", "--n-embd", str(a.n_embd),
               "--data", os.path.join(ROOT, "docs"), "--steps", str(a.base_steps),
               "--batch", "8", "--seq-len", "128", "--lr", "2e-3"], base, a.threads)
    tune = ["--init-from", base, "--data", CHAT, "--val-fraction", "0.4", "--steps",
            str(a.steps), "--batch", "8", "--seq-len", "64", "--eval-every", str(a.steps),
            "--tune", "lora", "--lora-r", "8", "--lora-alpha", "16", "--lr", "3e-3"]
    print(f"| base dtype | bytes / weight | held-out loss after {a.steps} steps | "
          "against bf16 | wall-clock (s) |")
    print("|---|---|---|---|---|")
    ref = None
    for dtype, per in DTYPES.items():
        v, wall = train(tune + ["--base-dtype", dtype], os.path.join(a.out, dtype), a.threads)
        ref = v if ref is None else ref
        print(f"| {dtype} | {per:.3f} | {v:.4f} | {100 * (v - ref) / ref:+.2f}% | {wall:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
