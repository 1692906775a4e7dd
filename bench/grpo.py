"""GRPO measured (docs/finetune.md §GRPO): a verifiable task taught
imperfectly by SFT, then GRPO with an exact-match reward.

    python bench/grpo.py [WORKDIR] [--digits 2] [--sft-steps 2500] [--steps 300]
                         [--lr 1e-4] [--generations 16] [--batch 64] [--threads 2]
                         [--name rl]

The task: "a+b=" answered with the sum, a and b of --digits digits, as
chat records (prompt, response). A tiny byte model (`--preset tiny
--n-attn-layer 0`) learns it by SFT from scratch for --sft-steps steps
(imperfectly; an SFT run already in WORKDIR is reused, so --name gives
a second GRPO setting its own folder); GRPO then trains every parameter
from that run for
--steps steps with the built-in exact reward, --generations completions
per prompt, --batch completions a step. The exact-match rate of one
greedy completion of each of 200 held-out sums (none in either training
set) is measured before and after. Prints the rates, the wall-clock of
each phase and the share of the GRPO steps spent in rollouts, and one
JSON line.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from rwkvx_c.data.prompts import read_prompts  # noqa: E402
from rwkvx_c.generation import Request, Sampling, run_requests  # noqa: E402
from rwkvx_c.sample import load_run  # noqa: E402
from rwkvx_c.train import Trainer, TrainOptions  # noqa: E402

HELD = 200


def sums(n, digits, seed, avoid=frozenset()):
    """n distinct (a, b) pairs of `digits` digits, none in avoid."""
    rng = np.random.default_rng(seed)
    hi = 10 ** digits
    out: dict = {}
    while len(out) < n:
        a, b = (int(v) for v in rng.integers(0, hi, 2))
        if (a, b) not in avoid:
            out[(a, b)] = None
    return list(out)


def write(path, recs):
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return path


def exact_rate(run, prompts_file, threads):
    """The share of held-out prompts whose greedy completion is the answer."""
    model, tok = load_run(run)
    p = read_prompts(prompts_file, tok)
    s = Sampling(temperature=0.0, token_stop=(0,), stop=("\n\n",))
    outs = run_requests(model, [Request(ids, 1) for ids in p.ids], s, 8, tokenizer=tok)
    return float(np.mean([o[0].text.strip() == c["answer"] for o, c in zip(outs, p.columns)]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", nargs="?", default=None)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--sft-steps", type=int, default=2500)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--generations", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="rl", help="the GRPO run's folder in WORKDIR")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="grpo_bench_")
    os.makedirs(work, exist_ok=True)
    held = sums(HELD, a.digits, 1)
    train = sums(3000, a.digits, 0, frozenset(held))
    write(os.path.join(work, "sft.jsonl"),
          [{"prompt": f"{x}+{y}=", "response": str(x + y)} for x, y in train[:2000]])
    write(os.path.join(work, "rl.jsonl"),
          [{"prompt": f"{x}+{y}=", "answer": str(x + y)} for x, y in train[2000:]])
    test = write(os.path.join(work, "held.jsonl"),
                 [{"prompt": f"{x}+{y}=", "answer": str(x + y)} for x, y in held])
    sft, rl = os.path.join(work, "sft"), os.path.join(work, a.name)
    tiny = {"n_attn_layer": 0}
    t0 = time.perf_counter()
    if os.path.exists(os.path.join(sft, "checkpoint.safetensors")):
        print(f"reusing the SFT run {sft}", flush=True)   # a second GRPO setting
    else:
        Trainer(TrainOptions(preset="tiny", model=tiny, data=os.path.join(work, "sft.jsonl"),
                             steps=a.sft_steps, batch=16, seq_len=64, lr=3e-3, warmup_steps=20,
                             threads=a.threads, precision="fp32", eval_every=a.sft_steps),
                sft).run()
    t_sft = time.perf_counter() - t0
    before = exact_rate(sft, test, a.threads)
    print(f"SFT: held-out exact match {before:.3f}", flush=True)
    t0 = time.perf_counter()
    tr = Trainer(TrainOptions(init_from=sft, objective="grpo", data=os.path.join(work,
                 "rl.jsonl"), reward=["exact"], num_generations=a.generations,
                 batch=a.batch, max_completion_length=6, steps=a.steps, lr=a.lr,
                 warmup_steps=0, threads=a.threads, precision="fp32", eval_every=a.steps),
                 rl)
    tr.run()
    t_rl = time.perf_counter() - t0
    rows = [r for r in tr.read_log() if "rollout_s" in r]
    roll = sum(r["rollout_s"] for r in rows)
    upd = sum(r["update_s"] for r in rows)
    after = exact_rate(rl, test, a.threads)
    print(f"GRPO {a.steps} steps, {t_rl:.0f} s (rollouts {roll / (roll + upd):.0%} of the "
          f"steps): held-out exact match {after:.3f}; train reward "
          f"{np.mean([r['reward'] for r in rows[:10]]):.3f} -> "
          f"{np.mean([r['reward'] for r in rows[-10:]]):.3f}")
    print(json.dumps({"digits": a.digits, "sft_steps": a.sft_steps, "grpo_steps": a.steps,
                      "before": before, "after": after, "sft_s": round(t_sft, 1),
                      "grpo_s": round(t_rl, 1), "rollout_share": round(roll / (roll + upd), 3),
                      "work": work}))


if __name__ == "__main__":
    main()
