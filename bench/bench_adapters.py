"""Held-out loss and wall-clock of each fine-tune kind after the same steps
(docs/finetune.md §Adapter kinds): a tiny byte model (--preset tiny
--n-attn-layer 0) pretrained on docs/, then tuned on tests/data/chat.jsonl
(its last 40% held out) by each --adapter kind of --tune lora, --tune
state, full tuning and LISA, each in its own process, one after another.

    python bench/bench_adapters.py --steps 60 --out /tmp/adapters

Prints a Markdown table: the held-out loss after the steps (mean over the
assistant tokens of the held-out conversations) and the wall-clock seconds
of the whole train command (start-up, PiSSA's SVDs and the evaluation
included)."""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = os.path.join(ROOT, "tests", "data", "chat.jsonl")
COMMON = ["--precision", "fp32", "--no-progress", "--seed", "1"]


def train(args, out, threads):
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rwkvx_c", "train", "--out", out, "--threads",
                    str(threads)] + COMMON + args, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    return vals[-1], wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--base-steps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    base = os.path.join(a.out, "base")
    if not os.path.exists(os.path.join(base, "checkpoint.safetensors")):
        train(["--preset", "tiny", "--n-attn-layer", "0", "--data", os.path.join(ROOT, "docs"),
               "--steps", str(a.base_steps), "--batch", "8", "--seq-len", "64"], base, a.threads)
    tune = ["--init-from", base, "--data", CHAT, "--val-fraction", "0.4", "--steps",
            str(a.steps), "--batch", "8", "--seq-len", "64", "--eval-every", str(a.steps)]
    lora = ["--tune", "lora", "--lora-r", "8", "--lora-alpha", "16", "--lr", "3e-3"]
    kinds = {"lora": lora, "rslora": lora + ["--adapter", "rslora"],
             "pissa": lora + ["--adapter", "pissa"], "dora": lora + ["--adapter", "dora"],
             # MiSS's scale is 1: it takes no --lora-alpha
             "miss": ["--tune", "lora", "--lora-r", "8", "--lr", "3e-3", "--adapter", "miss"],
             "state": ["--tune", "state"], "full": ["--lr", "3e-4"],
             "lisa": ["--lr", "3e-4", "--lisa-layers", "1", "--lisa-interval", "10"]}
    print(f"| kind | held-out loss after {a.steps} steps | wall-clock (s) |")
    print("|---|---|---|")
    for name, extra in kinds.items():
        v, wall = train(tune + extra, os.path.join(a.out, name), a.threads)
        print(f"| {name} | {v:.4f} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
