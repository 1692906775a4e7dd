"""rwkvx-c eval: a trained model's scores -- loss, perplexity and bits per
byte of a corpus, RWKV-LM's LAMBADA, passkey retrieval, lm-eval tasks."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.cli.common import (
    Subparsers,
    add_run_flags,
    checked,
    err,
    nonneg_int,
    pick_checkpoint,
    positive_int,
    unit_float,
)
from rwkvx_c.data.chat import ChatFormat
from rwkvx_c.data.pipeline import load_corpus
from rwkvx_c.data.sampler import conversation_starts, eval_starts
from rwkvx_c.data.templates import ChatTemplate
from rwkvx_c.errors import EvalError
from rwkvx_c.eval import metrics, passkey
from rwkvx_c.eval.preferences import OWN_BASE, base_model, score_preferences, tuned
from rwkvx_c.eval.rewards import score_rewards
from rwkvx_c.interop.source import read_run
from rwkvx_c.model.lora import ADAPTERS
from rwkvx_c.run.checkpoint import read_state
from rwkvx_c.run.rundir import checkpoint_path
from rwkvx_c.sample import is_run, load_any, run_template
from rwkvx_c.train.objectives import PREFERENCES, REFERENCE_FREE
from rwkvx_c.util.progress import make_progress
from rwkvx_c.util.words import counted

__all__ = ["add_parser", "run"]


def _ints(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {s!r}") \
            from None
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return v


def _fractions(s: str) -> list[float]:
    try:
        v = [unit_float(x) for x in s.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1] separated by commas, "
                                         f"got {s!r}") from None
    if not v:
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {s!r}")
    return v


def add_parser(sub: Subparsers) -> None:
    e = sub.add_parser(
        "eval", help="score a trained model: corpus loss, LAMBADA, passkey, lm-eval tasks",
        description="Score the model in DIR. --data: loss, perplexity and bits per byte of a "
        "corpus (every token once, or with --split val the run's own validation windows); "
        "--lambada: RWKV-LM's LAMBADA on a local .jsonl; --passkey: passkey retrieval over "
        "lengths and depths; --tasks: lm-evaluation-harness tasks (rwkvx_c[eval]). "
        "See docs/training.md §Evaluation.")
    e.add_argument("dir", metavar="DIR", nargs="?", help="run folder or checkpoint file, or "
                   "any other source --init-from takes (an x070 / RWKV-X .pth, a Hugging Face "
                   "folder, a .safetensors of x070 or HF names); or --model_args "
                   "pretrained=DIR")
    add_run_flags(e)
    e.add_argument("--data", nargs="+", metavar="PATH", help="corpus to score (files, folders, "
                   ".jsonl, token files; read as the trainer reads them) (default: none)")
    e.add_argument("--split", choices=["all", "val"], default="all",
                   help="all: every token of the corpus once; val: the trainer's validation "
                   "windows of it (of the run's own corpus without --data) (default: all)")
    e.add_argument("--seq-len", type=positive_int, metavar="T",
                   help="tokens per window (default: the run's seq_len)")
    e.add_argument("--eval-tokens", type=positive_int, metavar="N",
                   help="with --split val: validation tokens (default: the run's eval_tokens)")
    e.add_argument("--batch", "--batch_size", "--batch-size", type=_batch, default=8,
                   metavar="B", help="windows per forward call (default: 8; fewer when the "
                   "logits would pass 64 MiB); lm-eval's auto is the default; lm-eval's "
                   "requests, LAMBADA and passkey run in the batched engine")
    e.add_argument("--text-field", metavar="NAME",
                   help="the text field of .jsonl records (default: the run's)")
    e.add_argument("--lambada", metavar="FILE",
                   help="LAMBADA .jsonl ({\"text\": ...} records) (default: none)")
    e.add_argument("--passkey", action="store_true",
                   help="passkey retrieval over a grid (default: off)")
    e.add_argument("--passkey-lengths", type=_ints, metavar="N,N,...",
                   default=list(passkey.DEFAULT_LENGTHS),
                   help="prompt lengths in tokens (default: %s)"
                   % ",".join(map(str, passkey.DEFAULT_LENGTHS)))
    e.add_argument("--passkey-depths", type=_fractions, metavar="D,D,...",
                   default=list(passkey.DEFAULT_DEPTHS),
                   help="key depths in [0, 1] (default: %s)"
                   % ",".join(map(str, passkey.DEFAULT_DEPTHS)))
    e.add_argument("--passkey-trials", type=positive_int, default=5, metavar="N",
                   help="keys per cell (default: 5)")
    e.add_argument("--plot", metavar="FILE.png",
                   help="the passkey heat map (default: passkey.png in DIR)")
    e.add_argument("--tasks", nargs="+", type=_names, metavar="TASK",
                   help="lm-eval tasks (rwkvx_c[eval]), separated by spaces or by commas as "
                   "lm-eval takes them (hellaswag,arc_easy) (default: none)")
    e.add_argument("--model_args", "--model-args", type=_model_args, metavar="K=V,...",
                   default={}, help="lm-eval's model arguments where they apply: "
                   + ", ".join(MODEL_ARGS) + " (default: none)")
    e.add_argument("--include-path", metavar="DIR", help="folder of local lm-eval task YAML; "
                   "only its tasks are indexed (default: lm-eval's own tasks)")
    e.add_argument("--num-fewshot", "--num_fewshot", type=nonneg_int, metavar="K",
                   help="lm-eval few-shot examples (default: each task's)")
    e.add_argument("--limit", type=_limit, metavar="N", help="lm-eval: first N documents per "
                   "task, or (below 1) that fraction of them (default: all)")
    e.add_argument("--preferences", metavar="FILE", help="preference pairs (.jsonl of prompt, "
                   "chosen, rejected): accuracy, margin and loss of the run's objective "
                   "(docs/finetune.md §Preference tuning) (default: none)")
    e.add_argument("--rewards", metavar="FILE", help="prompt records (docs/finetune.md §GRPO): "
                   "the mean reward of one greedy completion of each, by the run's --reward "
                   "functions or --reward's (default: none)")
    e.add_argument("--reward", nargs="+", metavar="SPEC", help="with --rewards, the reward "
                   "functions, as train's --reward (default: the run's)")
    e.add_argument("--ref-from", metavar="SRC", help="with --preferences, the reference model's "
                   "run folder or checkpoint (default: a LoRA or state run's own base)")
    e.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="projection GEMMs; bf16 reproduces a bf16 run's own val figures "
                   "(default: fp32)")
    e.add_argument("--threads", type=positive_int, metavar="N",
                   help="OpenMP threads (default: OMP_NUM_THREADS or the core count)")
    e.add_argument("--json", action="store_true", help="print one JSON line of every result "
                   "instead of text (default: text)")


# lm-eval's --model_args keys that mean something here, and what each does
MODEL_ARGS = {
    "pretrained": "the run folder (DIR)",
    "dtype": "float32 or bfloat16 (--precision)",
    "prefix_token_id": "the token an empty context starts from (default 0)",
    "max_gen_toks": "generate_until's token budget (default 256)",
    "batch_size": "--batch",
    "trust_remote_code": "accepted, nothing to trust",
    "device": "cpu only",
}
_DTYPES = {"float32": "fp32", "fp32": "fp32", "auto": "fp32", "bfloat16": "bf16", "bf16": "bf16"}


def _names(s: str) -> list[str]:
    return [t.strip() for t in s.split(",") if t.strip()]


def _batch(s: str) -> int:
    """--batch: a positive integer, or lm-eval's auto / auto:N (the default)."""
    return 8 if s == "auto" or s.startswith("auto:") else positive_int(s)


def _limit(s: str) -> float:
    """lm-eval's --limit: N documents, or below 1 a fraction of them."""
    v = checked(float, lambda v: v > 0 and (v < 1 or v == int(v)), "a positive integer or a "
                "fraction below 1")(s)
    return v if v < 1 else int(v)


def _model_args(s: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in s.split(","))):
        k, eq, v = part.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {part!r}")
        if k not in MODEL_ARGS:
            raise argparse.ArgumentTypeError(f"{k} is not a model argument rwkvx-c eval takes; "
                                             f"it takes {', '.join(MODEL_ARGS)}")
        out[k] = v
    return out


def _apply_model_args(a: argparse.Namespace) -> str | None:
    """Folds --model_args into the flags they stand for; a one-line reason
    when they contradict each other or the flags."""
    m = a.model_args
    if "pretrained" in m:
        given = getattr(a, "given", None) or a.dir
        if given and os.path.realpath(given) != os.path.realpath(m["pretrained"]):
            return f"DIR {given} and pretrained={m['pretrained']} name different runs"
        if not given:   # the run named here alone: its checkpoint picked as DIR's is
            a.dir = m["pretrained"]
            pick_checkpoint(a)
    if "dtype" in m:
        if m["dtype"] not in _DTYPES:
            return f"dtype={m['dtype']}: rwkvx-c eval computes in float32 or bfloat16"
        a.precision = _DTYPES[m["dtype"]]
    if m.get("device", "cpu") != "cpu":
        return f"device={m['device']}: rwkvx_c runs on the CPU"
    for k in ("prefix_token_id", "max_gen_toks"):
        if k in m and not m[k].isdigit():
            return f"{k}={m[k]}: expected an integer >= 0"
    if "batch_size" in m:
        a.batch = _batch(m["batch_size"])
    return None


def run(a: argparse.Namespace) -> int:
    why = _apply_model_args(a)
    if why:
        return err(why, 2)
    if not a.dir:
        return err("give the run: DIR or --model_args pretrained=DIR", 2)
    a.tasks = [t for group in a.tasks for t in group] if a.tasks else None
    own = a.split == "val" and not a.data   # the run's own corpus and validation windows
    if not (a.data or own or a.lambada or a.passkey or a.tasks or a.preferences or a.rewards):
        return err("nothing to evaluate: give --data, --split val, --lambada, --passkey, "
                   "--tasks, --preferences or --rewards", 2)
    if a.reward and not a.rewards:
        return err("--reward needs --rewards", 2)
    if a.ref_from and not a.preferences:
        return err("--ref-from needs --preferences", 2)
    if a.include_path and not a.tasks:
        return err("--include-path needs --tasks", 2)
    if a.threads:
        _core.set_num_threads(a.threads)
    run = is_run(a.dir)
    if own and not run:
        return err(f"--split val without --data scores a run's own validation data; {a.dir} "
                   "is no run: give --data", 2)
    ckpt = checkpoint_path(a.dir)
    opts = (read_state(ckpt).get("options") or {}) if run else {}
    # a run on a frozen base holds it as it trained (read in place, never float32)
    model, tok = load_any(a.dir, a.base, hold_base=True)
    model.precision = a.precision
    out: dict[str, Any] = {}
    if a.data or own:
        out["data"] = _score_corpus(a, model, tok, opts)
        _say(a, "data", out["data"])
    if a.lambada:
        bar = make_progress(len(metrics.read_lambada(a.lambada)), 0, "doc")
        try:
            out["lambada"] = metrics.lambada(model, tok, a.lambada, progress=bar.update)
        finally:
            bar.close()
        _say(a, "lambada", out["lambada"])
    if a.preferences:
        out["preferences"] = _preferences(a, model, tok, opts)
    if a.rewards:
        out["rewards"] = score_rewards(model, tok, a.rewards, opts, a.reward)
        if not a.json:
            print(f"rewards: mean {out['rewards']['reward']:.4f} over "
                  f"{out['rewards']['n_prompts']:,} prompts (greedy)")
    if a.passkey:
        out["passkey"] = _passkey(a, model, tok, ckpt)
    if a.tasks:
        out["tasks"] = _tasks(a, model, tok)
    if a.json:
        print(json.dumps(out, sort_keys=True))
    return 0


def _score_corpus(a: argparse.Namespace, model: _core.RxPtModel, tok: Any,
                  opts: dict[str, Any]) -> dict[str, Any]:
    T = a.seq_len or int(opts.get("seq_len") or 256)
    own = not a.data   # the run's own corpus, split as it was
    data = opts.get("data") if own else a.data if len(a.data) > 1 else a.data[0]
    kw: dict[str, Any] = dict(seq_len=T, tokenizer=tok, cache_dir=opts.get("cache_dir"),
                              text_field=a.text_field or opts.get("text_field") or "text",
                              progress=sys.stderr.isatty(),
                              # chat records in the run's template, trained as it trained them
                              chat=ChatFormat(run_template(a.dir) if is_run(a.dir)
                                              else ChatTemplate.from_stored(None),
                                              bool(opts.get("train_on_inputs"))))
    if own and opts.get("val_fraction") is not None:
        kw["val_fraction"] = float(opts["val_fraction"])
    val_data = opts.get("val_data") if own and a.split == "val" else None
    if val_data is not None:   # the run validated on every token of its --val-data
        v = load_corpus(val_data, **kw)
        val = np.concatenate([v.train, v.val])
        val_mask = None if v.train_mask is None or v.val_mask is None else \
            np.concatenate([v.train_mask, v.val_mask])
        corpus = dataclasses.replace(v, val=val, val_mask=val_mask,
                                     description=f"validation {v.description}")
    else:
        corpus = load_corpus(data, **kw)
    if corpus.vocab_size > model.config["vocab_size"]:
        raise EvalError(f"the corpus has {corpus.vocab_size} token ids, the model "
                        f"{model.config['vocab_size']}")
    if a.split == "val":
        n = max(1, (a.eval_tokens or int(opts.get("eval_tokens") or 32768)) // T)
        mk = corpus.val_mask   # a state tune's windows start at conversations, as it trained
        conv = conversation_starts(corpus.val, mk, T) \
            if mk is not None and opts.get("tune") == "state" else None
        parts = [(corpus.val, eval_starts(len(corpus.val), T, n, conv), corpus.val_mask)]
    else:
        parts = [(t, metrics.consecutive_starts(len(t), T), mk) for t, mk in
                 ((corpus.train, corpus.train_mask), (corpus.val, corpus.val_mask))]
    bar = make_progress(sum(min(T * len(s), len(t) - 1) for t, s, _ in parts), 0, "tok")
    try:
        res = [metrics.score_windows(model, t, T, s, token_bytes=corpus.token_bytes,
                                     is_bytes=corpus.is_bytes, batch=a.batch,
                                     progress=bar.update, mask=mk) for t, s, mk in parts]
    finally:
        bar.close()
    tokens = sum(r["tokens"] for r in res)
    nats = sum(r["loss"] * r["tokens"] for r in res)
    nbytes = sum(r["bytes"] or 0 for r in res)
    loss = nats / tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)),
            "bpb": nats / (math.log(2) * nbytes) if nbytes else None, "tokens": tokens,
            "bytes": nbytes or None, "windows": sum(r["windows"] for r in res), "seq_len": T,
            "split": a.split, "corpus": corpus.description}


def _preferences(a: argparse.Namespace, model: _core.RxPtModel, tok: Any,
                 opts: dict[str, Any]) -> dict[str, Any]:
    kind = str(opts.get("objective")) if opts.get("objective") in PREFERENCES else "dpo"
    ref: _core.RxPtModel | str | None = None
    if kind not in REFERENCE_FREE:
        if a.ref_from:
            ref = load_any(a.ref_from, hold_base=True)[0]
            ref.precision = a.precision
        elif not is_run(a.dir):   # a source of weights alone: its own reference
            ref = load_any(a.dir)[0]
        elif ADAPTERS[str(opts.get("adapter") or "lora")].principal:
            # its base holds the residual: adapters off is not the model it started from
            raise EvalError(f"{a.dir}'s adapters ({opts['adapter']}) start from its base's "
                            "principal part; give --ref-from (the run's --init-from source)")
        elif tuned(model):   # the policy's own base, the one model held
            ref = OWN_BASE
        else:   # a checkpoint holding its adapters merged: the weights it holds without them
            tensors, config, _ = read_run(checkpoint_path(a.dir), a.base, EvalError)
            ref = base_model(tensors, config, a.dir)
            ref.precision = a.precision
    r = score_preferences(model, ref, tok, a.preferences,
                          seq_len=a.seq_len or int(opts.get("seq_len") or 256), kind=kind,
                          beta=float(opts.get("dpo_beta") or 0.1), batch=a.batch)
    if not a.json:
        print(f"preferences: accuracy {r['rewards/accuracies']:.4f}, margin "
              f"{r['rewards/margins']:.4f}, {kind} loss {r['loss']:.4f}, policy accuracy "
              f"{r['logps/accuracies']:.4f} over {r['n_pairs']:,} pairs")
    return r


def _say(a: argparse.Namespace, what: str, r: dict[str, Any]) -> None:
    if a.json:
        return
    if what == "data":
        bpb = "n/a" if r["bpb"] is None else f"{r['bpb']:.4f}"
        print(f"data: loss {r['loss']:.4f}, ppl {r['ppl']:.3f}, bpb {bpb} over {r['tokens']:,} "
              f"tokens in {counted(r['windows'], 'window')} of {r['seq_len']} ({r['split']})")
    else:
        print(f"lambada: acc {r['acc']:.4f}, ppl {r['ppl']:.3f} over {r['docs']:,} documents")


def _passkey(a: argparse.Namespace, model: _core.RxPtModel, tok: Any, ckpt: str
             ) -> dict[str, Any]:
    cells = len(a.passkey_lengths) * len(a.passkey_depths) * a.passkey_trials
    bar = make_progress(cells, 0, "trial")
    try:
        grid = passkey.passkey_grid(model, tok, a.passkey_lengths, a.passkey_depths,
                               a.passkey_trials, progress=bar.update)
    finally:
        bar.close()
    png = a.plot or os.path.join(os.path.dirname(os.path.abspath(ckpt)), "passkey.png")
    if os.path.realpath(png) == os.path.realpath(ckpt):
        raise EvalError(f"--plot {png} is the checkpoint; choose another file")
    run_name = os.path.basename(os.path.dirname(os.path.abspath(ckpt)))
    passkey.heatmap(grid, png, f"passkey retrieval: {run_name}")
    grid["plot"] = png
    if not a.json:
        print("passkey accuracy (rows: prompt tokens, columns: key depth)")
        print(passkey.format_table(grid))
        print(f"heat map: {png}")
    return grid


def _tasks(a: argparse.Namespace, model: _core.RxPtModel, tok: Any) -> dict[str, Any]:
    from rwkvx_c.eval.harness import DEFAULT_MAX_GEN_TOKS, RwkvxLM, run_tasks
    m = a.model_args
    lm = RwkvxLM(model=model, tokenizer=tok, prefix_token_id=int(m.get("prefix_token_id", 0)),
                 max_gen_toks=int(m.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)))
    res = run_tasks(lm, a.tasks, a.include_path, a.num_fewshot, a.limit)
    scores = {t: {k: v for k, v in r.items() if isinstance(v, (int, float))}
              for t, r in res.get("results", {}).items()}
    if not a.json:
        for t, r in scores.items():
            print(f"{t}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(r.items())))
    return scores
