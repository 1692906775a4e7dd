"""GRPO measured (docs/finetune.md §GRPO): a verifiable task taught
imperfectly by SFT, then GRPO with an exact-match reward.

    python bench/grpo.py [WORKDIR] [--task reverse] [--digits 4] [--copy-share 0.6]
                         [--sft-steps 1500] [--sft-lr 2e-3] [--steps 100] [--lr 3e-4]
                         [--generations 8] [--batch 64] [--temperature 1]
                         [--loss-type dapo] [--threads 2] [--seed 0] [--name rl]

The task (--task reverse): "abcd=" answered with the string reversed,
"dcba", strings of --digits letters of a-h. The SFT records are noisy: a
--copy-share of them answer with the string as it is instead, so the SFT
model hesitates between the two answers and its greedy completion is
often the copy; an exact-match reward tells them apart. (--task add:
"a+b=" answered with the sum, a and b of --digits digits.) A tiny byte
model (`--preset tiny --n-attn-layer 0`) learns it by SFT from scratch
over 2,000 records for --sft-steps steps (an SFT run already in WORKDIR
is reused, so --name gives a second GRPO setting its own folder); GRPO
then trains every parameter from that run for --steps steps over 1,000
other prompts with the built-in exact reward, --generations completions
per prompt, --batch completions a step. The exact-match rate of one
greedy completion of each of 200 held-out prompts (in neither training
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


LETTERS = "abcdefgh"


def strings(n, length, seed, avoid=frozenset()):
    """n distinct strings of `length` of LETTERS, none in avoid."""
    rng = np.random.default_rng(seed)
    out: dict = {}
    while len(out) < n:
        s = "".join(LETTERS[int(v)] for v in rng.integers(0, len(LETTERS), length))
        if s not in avoid:
            out[s] = None
    return list(out)


def task_records(a):
    """(sft, rl, held) records of the task: (prompt, answer, sft response)."""
    if a.task == "add":
        held = sums(HELD, a.digits, [a.seed, 1])
        train = sums(3000, a.digits, [a.seed, 0], frozenset(held))
        rec = [(f"{x}+{y}=", str(x + y)) for x, y in held + train]
    else:
        held = strings(HELD, a.digits, [a.seed, 1])
        train = strings(3000, a.digits, [a.seed, 0], frozenset(held))
        rec = [(f"{s}=", s[::-1]) for s in held + train]
    held_r, train_r = rec[:HELD], rec[HELD:]
    rng = np.random.default_rng([a.seed, 2])
    copy = rng.random(2000) < a.copy_share
    # a noisy SFT set: a share of its records answered with the prompt's own string
    sft = [{"prompt": p, "response": p[:-1] if c else ans}
           for (p, ans), c in zip(train_r[:2000], copy)]
    rl = [{"prompt": p, "answer": ans} for p, ans in train_r[2000:]]
    held = [{"prompt": p, "answer": ans} for p, ans in held_r]
    return sft, rl, held


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", nargs="?", default=None)
    ap.add_argument("--task", choices=("reverse", "add"), default="reverse")
    ap.add_argument("--digits", type=int, default=4)
    ap.add_argument("--copy-share", type=float, default=0.6)
    ap.add_argument("--sft-steps", type=int, default=1500)
    ap.add_argument("--sft-lr", type=float, default=2e-3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="of the data and both runs")
    ap.add_argument("--name", default="rl", help="the GRPO run's folder in WORKDIR")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="grpo_bench_")
    os.makedirs(work, exist_ok=True)
    sft_recs, rl_recs, held_recs = task_records(a)
    write(os.path.join(work, "sft.jsonl"), sft_recs)
    write(os.path.join(work, "rl.jsonl"), rl_recs)
    test = write(os.path.join(work, "held.jsonl"), held_recs)
    sft, rl = os.path.join(work, "sft"), os.path.join(work, a.name)
    tiny = {"n_attn_layer": 0}
    t0 = time.perf_counter()
    if os.path.exists(os.path.join(sft, "checkpoint.safetensors")):
        print(f"reusing the SFT run {sft}", flush=True)   # a second GRPO setting
    else:
        Trainer(TrainOptions(preset="tiny", model=tiny, data=os.path.join(work, "sft.jsonl"),
                             steps=a.sft_steps, batch=16, seq_len=64, lr=a.sft_lr, warmup_steps=50,
                             threads=a.threads, precision="fp32", eval_every=a.sft_steps,
                             seed=a.seed),
                sft).run()
    t_sft = time.perf_counter() - t0
    before = exact_rate(sft, test, a.threads)
    print(f"SFT ({t_sft:.0f} s): held-out exact match {before:.3f}", flush=True)
    # the answer and the blank line that ends it (a sum has a digit more)
    longest = a.digits + (3 if a.task == "add" else 2)
    t0 = time.perf_counter()
    tr = Trainer(TrainOptions(init_from=sft, objective="grpo", data=os.path.join(work,
                 "rl.jsonl"), reward=["exact"], num_generations=a.generations,
                 batch=a.batch, max_completion_length=longest, steps=a.steps, lr=a.lr,
                 temperature=a.temperature, loss_type=a.loss_type,
                 warmup_steps=0, threads=a.threads, precision="fp32", eval_every=a.steps,
                 seed=a.seed),
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
    print(json.dumps({"task": a.task, "seed": a.seed, "digits": a.digits,
                      "copy_share": a.copy_share,
                      "sft_steps": a.sft_steps, "grpo_steps": a.steps, "before": before,
                      "after": after, "sft_s": round(t_sft, 1), "grpo_s": round(t_rl, 1),
                      "total_s": round(t_sft + t_rl, 1),
                      "rollout_share": round(roll / (roll + upd), 3), "work": work}))


if __name__ == "__main__":
    main()
