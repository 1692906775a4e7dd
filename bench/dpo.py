"""Preference tuning measured (docs/finetune.md §Preference tuning).

    python bench/dpo.py rule [WORKDIR] [--pretrain 150] [--steps 150] [--lr 3e-3] [--beta 0.5]
    python bench/dpo.py ratio [WORKDIR] [--rounds 8] [--batch 8] [--seq-len 64] [--tokenizer world]

rule: a synthetic preference set whose chosen answers follow a rule (the
prompt "Say cat" is answered "cat cat", the rejected answer repeats another
word: both the same length). A tiny byte model is pretrained for
--pretrain steps on the repository's docs/, then LoRA-tuned with DPO on
600 pairs; `rwkvx-c eval --preferences` scores 100 held-out pairs (other
word combinations) before (the base, which is its own reference) and
after. Prints the held-out accuracies and one JSON line.

ratio: the cost of a DPO step against an SFT step over the same tokens
(batch x seq_len), both LoRA tunes of the same base in one process, their
steps alternating for --rounds rounds after one warm-up step each (the
median of the per-round ratios, and the median times). The SFT data is
the chosen answers rendered as chat records.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORDS = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box", "car", "bus", "egg", "fox",
         "jam", "key", "owl", "pig"]


def rule_pairs(n, seed, combos):
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        a, b = rng.choice(WORDS, 2, replace=False)
        if (a, b) in combos:
            out.append({"prompt": f"Say {a}", "chosen": f"{a} {a}", "rejected": f"{b} {b}"})
    return out


def write(path, recs):
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return path


def cli(*args):
    cmd = [sys.executable, "-m", "rwkvx_c", *map(str, args)]
    print("$ rwkvx-c " + " ".join(map(str, args)), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr)
    return r.stdout


def split_combos():
    """(train, held-out) word pairs: every eighth combination is held out."""
    combos = [(a, b) for a in WORDS for b in WORDS if a != b]
    held = set(combos[::8])
    return set(combos) - held, held


def base_run(work, steps, threads, tokenizer="byte"):
    base = os.path.join(work, "base" if tokenizer == "byte" else f"base_{tokenizer}")
    if not os.path.exists(os.path.join(base, "checkpoint.safetensors")):
        cli("train", "--preset", "tiny", "--n-attn-layer", "0", "--data",
            os.path.join(ROOT, "docs"), "--steps", steps, "--seq-len", "64", "--batch", "8",
            "--threads", threads, "--precision", "fp32", "--tokenizer", tokenizer,
            "--out", base)
    return base


def prefs(run, held, threads, *ref):
    out = cli("eval", run, "--preferences", held, "--seq-len", "48", "--threads", threads,
              "--json", *ref)
    return json.loads(out.strip().splitlines()[-1])["preferences"]


def rule(a):
    train_c, held_c = split_combos()
    train = write(os.path.join(a.work, "pairs_train.jsonl"), rule_pairs(600, 0, train_c))
    held = write(os.path.join(a.work, "pairs_heldout.jsonl"), rule_pairs(100, 1, held_c))
    base = base_run(a.work, a.pretrain, a.threads)
    before = prefs(base, held, a.threads, "--ref-from", base)   # the base is its own reference
    run = os.path.join(a.work, "dpo")
    t = time.perf_counter()
    cli("train", "--init-from", base, "--tune", "lora", "--lora-r", "8", "--objective", "dpo",
        "--dpo-beta", a.beta, "--data", train, "--batch", "8", "--seq-len", "48", "--steps",
        a.steps, "--lr", a.lr, "--warmup", "10", "--threads", a.threads, "--precision",
        "fp32", "--out", run)
    secs = time.perf_counter() - t
    after = prefs(run, held, a.threads)
    print(f"held-out policy accuracy (logp chosen > logp rejected): before "
          f"{before['logps/accuracies']:.3f}, after {after['logps/accuracies']:.3f}; "
          f"rewards/accuracies after {after['rewards/accuracies']:.3f}, margin "
          f"{after['rewards/margins']:.3f}; DPO run {secs:.0f} s")
    print(json.dumps({"before": before, "after": after, "dpo_seconds": secs}))


def ratio(a):
    from rwkvx_c.interop.source import read_source
    from rwkvx_c.train import Trainer, TrainOptions
    from rwkvx_c.train.finetune import from_source
    train_c, _ = split_combos()
    recs = rule_pairs(400, 0, train_c)
    pairs = write(os.path.join(a.work, "pairs_train.jsonl"), recs)
    chat = write(os.path.join(a.work, "chat.jsonl"),
                 [{"prompt": r["prompt"], "response": r["chosen"]} for r in recs] * 4)
    base = base_run(a.work, a.pretrain, a.threads, a.tokenizer)
    s = read_source(base)

    def trainer(out, **kw):
        o = TrainOptions(tune="lora", lora_r=8, batch=a.batch, seq_len=a.seq_len, steps=10 ** 6,
                         lr=1e-3, threads=int(a.threads), precision="fp32", eval_every=10 ** 6,
                         cache_dir=os.path.join(a.work, "cache"), **kw)
        return Trainer(from_source(o, s.config, s.tokenizer, base), os.path.join(a.work, out),
                       _weights=s.weights)
    dpo, sft = trainer("r_dpo", objective="dpo", data=pairs), trainer("r_sft", data=chat)
    dpo.step(), sft.step()
    td, ts = [], []
    for _ in range(a.rounds):
        for tr, acc in ((sft, ts), (dpo, td)):
            t = time.perf_counter()
            tr.step()
            acc.append(time.perf_counter() - t)
    rs = [d / s_ for d, s_ in zip(td, ts)]
    print(f"{a.tokenizer} vocabulary, batch {a.batch} x seq_len {a.seq_len}, {a.rounds} rounds: "
          "SFT step "
          f"{statistics.median(ts) * 1e3:.1f} ms, DPO step {statistics.median(td) * 1e3:.1f} ms, "
          f"ratio median {statistics.median(rs):.2f} (min {min(rs):.2f}, max {max(rs):.2f})")
    print(json.dumps({"sft_s": ts, "dpo_s": td, "ratio_median": statistics.median(rs)}))
    dpo.close(), sft.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["rule", "ratio"])
    p.add_argument("work", nargs="?", default=None)
    p.add_argument("--pretrain", default="150")
    p.add_argument("--steps", default="150")
    p.add_argument("--threads", default="2")
    p.add_argument("--lr", default="3e-3")
    p.add_argument("--beta", default="0.5")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--tokenizer", default="byte", help="ratio: the base's tokenizer (world: "
                   "the 65,536-id vocabulary, where the head costs most)")
    a = p.parse_args()
    a.work = a.work or tempfile.mkdtemp(prefix="rwkvx_dpo_")
    os.makedirs(a.work, exist_ok=True)
    (rule if a.what == "rule" else ratio)(a)


if __name__ == "__main__":
    main()
