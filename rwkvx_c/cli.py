"""The rwkvx-c command (also ``python -m rwkvx_c``).

    rwkvx-c train [--data PATH] [--preset tiny|S|M|default] [--steps N]
                  [--time-budget MIN] [--batch B] [--seq-len T] [--lr X]
                  [--threads N] [--seed S] [--out DIR] [--resume]
                  [--eval-every K] [...]
    rwkvx-c sample DIR --prompt TEXT [--max-new-tokens N] [--temperature X]
                  [--top-p P] [--seed S]
    rwkvx-c export DIR --format rwkv7|rwkvx|gguf --out FILE [--dtype fp32|bf16|fp16]
    rwkvx-c import FILE.pth --out DIR
    rwkvx-c tokenizer train [DATA ...] --vocab-size N --out tok.json

Bad input is one line on stderr naming the problem and a non-zero exit
status (2 for bad flags, 1 otherwise); no traceback, and an existing
checkpoint is never touched by a run that fails to start. Only a bug (an
exception of no expected kind) shows its traceback. A diverged run stops
with status 1 (or rolls back, with --on-divergence rollback); Ctrl-C ends a
run after its checkpoint (status 130), a second Ctrl-C at once.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    from rwkvx_c.distributed import ProcessGroup
    from rwkvx_c.train import Trainer

T = TypeVar("T")

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _checked(conv: Callable[[str], T], ok: Callable[[T], bool],
             what: str) -> Callable[[str], T]:
    """An argparse type: conv(s), which must satisfy ok, else "expected <what>"."""
    def parse(s: str) -> T:
        try:
            v = conv(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return parse


_positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
_nonneg_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
_nonneg_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0")
_unit_float = _checked(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rwkvx-c", description="CPU pretraining of RWKV-X language models.")
    sub = p.add_subparsers(dest="cmd", metavar="{train,sample,export,import,tokenizer}",
                           parser_class=_Parser)
    sub.required = True
    _add_train(sub)
    _add_sample(sub)
    _add_export(sub)
    _add_import(sub)
    _add_tokenizer(sub)
    return p


def _add_train(sub: argparse._SubParsersAction[_Parser]) -> None:
    from rwkvx_c.init import SCHEMES
    from rwkvx_c.train import PRESETS
    t = sub.add_parser("train", help="train a model (no arguments: the default job)",
                       description="Train an RWKV-X model (bytes by default, or --tokenizer). With "
                       "no arguments: the "
                       "default preset on the Python standard library's .py files, for at "
                       "most 9.5 minutes, into a new folder under ./runs/.")
    t.add_argument("--data", metavar="PATH", nargs="+", help="text file, folder, .jsonl / "
                   ".jsonl.gz, RWKV-LM binidx (.bin + .idx) or .bin token file; several "
                   "paths are read in order (default: the Python standard library's .py files)")
    t.add_argument("--tokenizer", metavar="byte|world|PATH", help="byte (default), world "
                   "(the RWKV World vocabulary; needs rwkvx_c[world]) or a tokenizer.json "
                   "(needs rwkvx_c[hf]); a resumed run keeps its own")
    t.add_argument("--text-field", metavar="NAME", help="the text field of .jsonl records "
                   "(default: text)")
    t.add_argument("--preset", choices=list(PRESETS), help="model size and training "
                   "defaults (default: 'default')")
    t.add_argument("--steps", type=_positive_int, metavar="N", help="stop after N steps "
                   "(learning-rate schedule by steps)")
    t.add_argument("--time-budget", type=_positive_float, metavar="MIN", help="stop so that "
                   "the whole run, final evaluation and checkpoint included, takes at most "
                   "MIN minutes (the default job: 9.5)")
    t.add_argument("--batch", type=_positive_int, metavar="B", help="sequences per step")
    t.add_argument("--seq-len", type=_positive_int, metavar="T", help="tokens per sequence")
    t.add_argument("--lr", type=_positive_float, metavar="X", help="peak learning rate")
    t.add_argument("--warmup", type=_nonneg_int, metavar="N", help="linear warmup steps")
    t.add_argument("--weight-decay", type=_nonneg_float, metavar="X", help="AdamW weight "
                   "decay on matrices (default 0.1)")
    t.add_argument("--grad-clip", type=_nonneg_float, metavar="X", help="clip the global "
                   "grad norm to X, 0 disables (default 1.0)")
    t.add_argument("--threads", type=_positive_int, metavar="N", help="OpenMP threads "
                   "(default: OMP_NUM_THREADS or every core)")
    t.add_argument("--seed", type=_nonneg_int, metavar="S", help="seed of the init and "
                   "the data order (default 0)")
    t.add_argument("--init", choices=list(SCHEMES), help="parameter init (default rwkv7)")
    t.add_argument("--out", metavar="DIR", help="run folder (default: a new folder under "
                   "./runs/)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out (or "
                   "the newest run under ./runs/) from its checkpoint")
    t.add_argument("--eval-every", type=_positive_int, metavar="K", help="evaluate every K "
                   "steps (default: 10 evaluations over the run)")
    t.add_argument("--eval-tokens", type=_positive_int, metavar="N", help="validation tokens "
                   "per evaluation (default 32768)")
    t.add_argument("--save-every", type=_positive_int, metavar="K", help="checkpoint every K "
                   "steps (default: at every evaluation) and always at the end")
    t.add_argument("--cache-dir", metavar="DIR", help="where corpora are cached as token "
                   "files (default $RWKVX_CACHE or ~/.cache/rwkvx_c)")
    t.add_argument("--on-divergence", choices=["stop", "rollback"], help="when the loss "
                   "blows up: stop (default), or reload the last checkpoint and halve the "
                   "learning rate (at most 3 times)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (without a "
                   "terminal the progress is a plain line every few seconds)")
    t.add_argument("--precision", choices=["fp32", "bf16", "auto"], default="auto",
                   help="projection GEMMs in fp32, or bf16 with fp32 accumulation; auto "
                   "(default): bf16 where the CPU has AMX-BF16, where it is measured faster. "
                   "A resumed run keeps its precision")
    g = t.add_argument_group("model shape (each overrides the preset; stored in the checkpoint)")
    g.add_argument("--n-embd", type=_positive_int, metavar="C", help="width; a new width "
                   "also sets ffn_dim 4*C and RWKV-7's LoRA sizes for C unless given")
    g.add_argument("--head-size", type=_positive_int, metavar="N", help="head size "
                   "(n_embd must be a multiple; 64 for llama.cpp and rwkv-x)")
    g.add_argument("--n-layer", type=_positive_int, metavar="L", help="RWKV-7 blocks")
    g.add_argument("--n-attn-layer", type=_nonneg_int, metavar="A", help="MoBA attention "
                   "blocks (0: pure RWKV-7)")
    g.add_argument("--ffn-dim", type=_positive_int, metavar="F", help="channel-mix hidden size")
    g.add_argument("--chunk-size", type=_positive_int, metavar="K", help="MoBA chunk size")
    g.add_argument("--moba-top-k", type=_nonneg_int, metavar="K", help="MoBA chunks each "
                   "query selects (0: all, dense causal attention)")
    for flag, what in (("--d-decay", "decay"), ("--d-aaa", "in-context learning rate"),
                       ("--d-mv", "value-residual"), ("--d-gate", "output gate")):
        g.add_argument(flag, type=_positive_int, metavar="D", help=f"{what} LoRA size "
                       "(default: RWKV-7's max(32, round(f*sqrt(C)/32)*32))")


def _add_sample(sub: argparse._SubParsersAction[_Parser]) -> None:
    s = sub.add_parser("sample", help="generate text from a trained run",
                       description="Generate text from the checkpoint in DIR: the prompt is "
                       "run once, then one recurrent step per new token.")
    s.add_argument("dir", metavar="DIR", help="run folder (or checkpoint file)")
    s.add_argument("--prompt", default="", help="text to continue (default: empty)")
    s.add_argument("--max-new-tokens", type=_positive_int, default=200, metavar="N")
    s.add_argument("--temperature", type=_nonneg_float, default=1.0, metavar="X",
                   help="0 is greedy (default 1.0)")
    s.add_argument("--top-p", type=_unit_float, default=0.9, metavar="P",
                   help="nucleus sampling mass (default 0.9)")
    s.add_argument("--seed", type=_nonneg_int, default=0, metavar="S")
    s.add_argument("--threads", type=_positive_int, metavar="N")


def _add_export(sub: argparse._SubParsersAction[_Parser]) -> None:
    from rwkvx_c.interop import DTYPES, FORMATS
    e = sub.add_parser("export", help="write a trained model for another tool",
                       description="Write the model in DIR as an RWKV-LM x070 .pth (rwkv7: "
                       "the rwkv package), an RWKV-X .pth (rwkvx: the rwkv-x package) or a "
                       "GGUF file (gguf: llama.cpp). See docs/interop.md.")
    e.add_argument("dir", metavar="DIR", help="run folder (or checkpoint file)")
    e.add_argument("--format", required=True, choices=list(FORMATS))
    e.add_argument("--out", required=True, metavar="FILE")
    e.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                   help="tensor type in the file (default fp32)")


def _add_import(sub: argparse._SubParsersAction[_Parser]) -> None:
    i = sub.add_parser("import", help="make a run folder from an RWKV-7 .pth",
                       description="Read an RWKV-LM x070 .pth (bf16, fp16 or fp32), or an "
                       "RWKV-X one, into a new run folder that rwkvx-c sample runs and "
                       "rwkvx-c train --resume continues training from.")
    i.add_argument("file", metavar="FILE", help="x070 state dict or RWKV-X checkpoint (.pth)")
    i.add_argument("--out", required=True, metavar="DIR")


def _add_tokenizer(sub: argparse._SubParsersAction[_Parser]) -> None:
    k = sub.add_parser("tokenizer", help="fit a tokenizer on a corpus")
    ksub = k.add_subparsers(dest="tok_cmd", metavar="{train}", parser_class=_Parser)
    ksub.required = True
    kt = ksub.add_parser("train", help="fit a byte-level BPE (needs rwkvx_c[hf])",
                         description="Fit a byte-level BPE tokenizer with the tokenizers "
                         "library on the training files of DATA (same formats as train "
                         "--data; default: the Python standard library's .py files) and write "
                         "its tokenizer.json.")
    kt.add_argument("data", metavar="DATA", nargs="*")
    kt.add_argument("--vocab-size", type=_checked(int, lambda v: v > 256, "an integer > 256"),
                    required=True, metavar="N")
    kt.add_argument("--out", required=True, metavar="FILE")
    kt.add_argument("--text-field", default="text", metavar="NAME")
    kt.add_argument("--no-progress", action="store_true")


def _err(msg: str, code: int = 1) -> int:
    sys.stderr.write(f"rwkvx-c: error: {msg}\n")
    return code


def _new_run_dir() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join("runs", stamp)
    d, i = base, 1
    while os.path.exists(d):
        i += 1
        d = f"{base}-{i}"
    return d


def _latest_run() -> str | None:
    from rwkvx_c.train import CHECKPOINT
    if not os.path.isdir("runs"):
        return None
    cands = [os.path.join("runs", d) for d in os.listdir("runs")
             if os.path.exists(os.path.join("runs", d, CHECKPOINT))]
    return max(cands, key=os.path.getmtime) if cands else None


def plot_log(rows: Sequence[dict[str, Any]], path: str) -> bool:
    """DIR/loss.png: training loss and validation loss against steps.
    Returns False (and writes nothing) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from rwkvx_c.atomic import replace_with
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if tr:
        s, loss = zip(*tr)
        ax.plot(s, loss, lw=0.6, alpha=0.35, color="tab:blue")
        k = max(1, len(loss) // 50)
        if k > 1:
            import numpy as np
            sm = np.convolve(loss, np.ones(k) / k, mode="valid")
            ax.plot(s[k - 1:], sm, color="tab:blue", label="train loss")
        else:
            ax.lines[-1].set_label("train loss")
    if va:
        s, loss = zip(*va)
        ax.plot(s, loss, "o-", color="tab:orange", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        replace_with(path, fig.savefig, keep_ext=True)
    finally:
        plt.close(fig)
    return True


def _resume_dir(out: str | None) -> str:
    from rwkvx_c.train import TrainError
    out = out or _latest_run()
    if out is None:
        raise TrainError("--resume found no run under ./runs/; name one with --out DIR")
    if not os.path.isdir(out):
        raise TrainError(f"--resume: run folder {out} does not exist")
    return out


def _train(a: argparse.Namespace) -> int:
    from rwkvx_c.distributed import DistributedError, world

    try:
        group = world()
    except DistributedError as e:
        return _err(str(e))
    if not group.is_root:  # rank 0 speaks for the job; a failing rank still reports (abort)
        # stays open for the whole process: the silenced streams are never restored
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
        a.no_progress = True
    started = _start_run(a, group)
    if isinstance(started, int):
        return started
    tr, out = started
    _print_header(tr, out, group, a.resume)

    interrupted: list[int] = []

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        interrupted.append(1)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    old = signal.signal(signal.SIGINT, on_sigint)
    bar = None if a.no_progress else _progress_bar(tr)
    try:
        final = tr.run(on_step=_progress_update(bar, tr),
                       stop=lambda: group.any(interrupted))
    except (FloatingPointError, MemoryError) as e:
        # the Divergence message says what became of the checkpoint
        if bar:
            bar.close()
        return _err(str(e) if isinstance(e, FloatingPointError) else f"out of memory: {e}")
    except OSError as e:
        if bar:
            bar.close()
        return _err(f"cannot write to {out}: {e.strerror or e}; its previous checkpoint, "
                    "if any, is kept")
    finally:
        signal.signal(signal.SIGINT, old)
    if bar:
        bar.close()
    if group.is_root:
        _print_summary(tr, out, final, bool(interrupted))
    return 130 if interrupted else 0


def _train_options(a: argparse.Namespace) -> dict[str, Any]:
    """The TrainOptions fields the flags set (None: not given), shape flags
    folded into `model`; TrainError for shape flags with --resume."""
    from rwkvx_c.train import TrainError, shape_overrides
    data = a.data[0] if a.data and len(a.data) == 1 else a.data
    opts = dict(data=data, preset=a.preset, steps=a.steps, time_budget=a.time_budget,
                batch=a.batch, seq_len=a.seq_len, lr=a.lr, warmup_steps=a.warmup,
                weight_decay=a.weight_decay, grad_clip=a.grad_clip, threads=a.threads,
                seed=a.seed, init=a.init, eval_every=a.eval_every,
                eval_tokens=a.eval_tokens, save_every=a.save_every, cache_dir=a.cache_dir,
                tokenizer=a.tokenizer, text_field=a.text_field,
                precision=a.precision, on_divergence=a.on_divergence)
    shape = {k: getattr(a, k) for k in ("n_embd", "head_size", "n_layer", "n_attn_layer",
                                        "ffn_dim", "chunk_size", "moba_top_k", "d_decay",
                                        "d_aaa", "d_mv", "d_gate")}
    if any(v is not None for v in shape.values()):
        if a.resume:
            raise TrainError("the model shape of a run is fixed; drop the shape flags with "
                             "--resume")
        opts["model"] = shape_overrides(a.preset or "default", **shape)
    return opts


def _start_run(a: argparse.Namespace, group: ProcessGroup) -> tuple[Trainer, str] | int:
    """(Trainer, run folder) of a new or resumed run, or the exit status of
    a one-line error."""
    from rwkvx_c.checkpoint import CheckpointError
    from rwkvx_c.data import DataError
    from rwkvx_c.distributed import DistributedError
    from rwkvx_c.train import Trainer, TrainError, TrainOptions
    try:
        opts = _train_options(a)
        if a.resume:
            out = group.on_root(_resume_dir, a.out)
            tr = Trainer.resume(out, progress=not a.no_progress, **opts)
        else:
            out = group.root_value(a.out or _new_run_dir())
            kw = {k: v for k, v in opts.items() if v is not None}
            tr = Trainer(TrainOptions(**kw), out, progress=not a.no_progress)
    except (TrainError, DataError, CheckpointError, DistributedError) as e:
        rank = getattr(e, "rank", 0)   # set by distributed.py on an error from another rank
        return _err(str(e) + (f" (on rank {rank})" if rank else ""))
    except OSError as e:
        return _err(f"{e.strerror}: {e.filename}" if e.filename else str(e))
    return tr, out


def _print_header(tr: Trainer, out: str, group: ProcessGroup, resumed: bool) -> None:
    """What the run is: data, tokens, model, training set-up."""
    from rwkvx_c import gemm_kernel, get_num_threads
    o = tr.opts
    m = tr.model
    stop_by = (f"{o.steps} steps" if o.steps is not None else "") + \
        (" or " if o.steps is not None and o.time_budget else "") + \
        (f"{o.time_budget:g} min" if o.time_budget else "")
    print(f"rwkvx-c train: {out}\n"
          f"  data   {tr.corpus.description}\n"
          f"  tokens {tr.tokenizer.identity()['name']}, vocab {tr.tokenizer.vocab_size:,}\n"
          f"  model  preset {o.preset}, layers {m.layers}, {m.n_params:,} params, "
          f"init {o.init}\n"
          f"  train  batch {o.batch} x seq_len {o.seq_len}, lr {o.lr:g}, stop after {stop_by}, "
          + (f"{get_num_threads()} threads" if group.size == 1 else
             f"{group.size} ranks x {get_num_threads()} threads per rank")
          + f", {m.precision} ({gemm_kernel(m.precision)})"
          + (f", resumed at step {tr.step_count}" if resumed else ""), flush=True)


def _progress_bar(tr: Trainer) -> Any:
    """A bar over the run's steps, or over its time budget in seconds."""
    from rwkvx_c.progress import make_progress
    o = tr.opts
    if o.steps is not None:
        return make_progress(o.steps, tr.step_count, "step")
    assert o.time_budget is not None   # resolved(): a run without steps has a time budget
    return make_progress(round(o.time_budget * 60), round(tr.train_seconds()), "s",
                         bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s "
                         "[{elapsed}<{remaining}{postfix}]")


def _progress_update(bar: Any, tr: Trainer) -> Callable[[dict[str, Any]], None]:
    """The run's on_step: moves the bar and shows the latest losses on it."""
    post: dict[str, str] = {}

    def on_step(row: dict[str, Any]) -> None:
        if bar is None:
            return
        if "loss" in row:
            post["loss"] = f"{row['loss']:.3f}"
            post["tok/s"] = f"{row['tokens_per_s']:.0f}"
        if row.get("val_bpb") is not None:
            post["val_bpb"] = f"{row['val_bpb']:.3f}"
        elif "val_loss" in row:
            post["val_loss"] = f"{row['val_loss']:.3f}"
        bar.set_postfix(post, refresh=False)
        if tr.opts.steps is not None:
            bar.update(row["step"] - bar.n)
        else:
            bar.update(min(bar.total, tr.train_seconds()) - bar.n)
    return on_step


def _print_summary(tr: Trainer, out: str, final: dict[str, Any], interrupted: bool) -> None:
    """The final evaluation, where the run's files are (the loss plot drawn
    now) and how to sample from it."""
    from rwkvx_c.train import LOG
    plot = os.path.join(out, "loss.png")
    plotted = plot_log(tr.read_log(), plot)
    bpb = final.get("val_bpb")
    print(f"step {tr.step_count}: val_loss {final['val_loss']:.4f}"
          + (f", val_bpb {bpb:.4f}" if bpb is not None else "")
          + f", {tr.tokens_seen:,} tokens in {tr.train_seconds():.0f} s"
          + (" (interrupted)" if interrupted else ""))
    print(f"  checkpoint {os.path.join(out, 'checkpoint.safetensors')}\n"
          f"  log        {os.path.join(out, LOG)}")
    if plotted:
        print(f"  plot       {plot}")
    else:
        print("  plot       skipped: matplotlib is not installed (pip install 'rwkvx_c[train]')")
    print(f"  sample     rwkvx-c sample {out} --prompt 'def '")


def _sample(a: argparse.Namespace) -> int:
    import rwkvx_c
    from rwkvx_c.checkpoint import CheckpointError
    from rwkvx_c.sample import generate, load_run
    if a.threads:
        if a.threads > rwkvx_c.MAX_THREADS:
            return _err(f"--threads must be at most {rwkvx_c.MAX_THREADS}, got {a.threads}")
        rwkvx_c.set_num_threads(a.threads)
    try:
        model, tok = load_run(a.dir)
    except CheckpointError as e:
        return _err(str(e))
    if model.config["vocab_size"] < 256:
        return _err(f"the model in {a.dir} is not byte-level (vocab {model.config['vocab_size']})")
    # the prompt's own bytes, also when they are not UTF-8 (argv decodes
    # them with surrogateescape); the output is written as UTF-8 bytes
    prompt = os.fsencode(a.prompt)
    out = sys.stdout.buffer
    out.write(prompt)
    for text in generate(model, prompt, a.max_new_tokens, a.temperature, a.top_p, a.seed,
                         tokenizer=tok):
        out.write(text.encode("utf-8", "surrogateescape"))
        out.flush()
    out.write(b"\n")
    out.flush()
    return 0


def _export(a: argparse.Namespace) -> int:
    from rwkvx_c.checkpoint import CheckpointError
    from rwkvx_c.interop import InteropError, export_model
    from rwkvx_c.sample import load_run
    try:
        model, tok = load_run(a.dir)
        if a.format == "gguf" and tok.name not in ("byte", "world"):
            # the GGUF holds its vocabulary, and llama.cpp's rwkv7 knows byte and World only
            return _err(f"the run in {a.dir} uses a {tok.name} tokenizer; a GGUF export needs "
                        "the byte or the World tokenizer")
        export_model(model, a.format, a.out, a.dtype)
    except (CheckpointError, InteropError) as e:
        return _err(str(e))
    except OSError as e:
        return _err(f"{e.strerror}: {e.filename}" if e.filename else str(e))
    print(f"rwkvx-c export: {a.out} ({a.format}, {a.dtype})")
    return 0


def _import(a: argparse.Namespace) -> int:
    from rwkvx_c.interop import InteropError, import_pth
    try:
        ckpt = import_pth(a.file, a.out)
    except InteropError as e:
        return _err(str(e))
    except OSError as e:
        return _err(f"{e.strerror}: {e.filename}" if e.filename else str(e))
    print(f"rwkvx-c import: {ckpt}\n  sample     rwkvx-c sample {a.out} --prompt 'Hello'\n"
          f"  train      rwkvx-c train --resume --out {a.out}")
    return 0


def _tokenizer_train(a: argparse.Namespace) -> int:
    from rwkvx_c.corpora import iter_documents, source_files
    from rwkvx_c.data import DataError, _is_val_file
    from rwkvx_c.tokenizer import TokenizerError, train_bpe
    try:
        files = [f for f in source_files(a.data or None) if not _is_val_file(f[0])]
        docs = (d for d, _ in iter_documents(files, a.text_field))
        tok = train_bpe(docs, a.vocab_size, a.out, progress=not a.no_progress)
    except (DataError, TokenizerError) as e:
        return _err(str(e))
    except OSError as e:
        return _err(f"{e.strerror}: {e.filename}" if e.filename else str(e))
    print(f"wrote {a.out}: byte-level BPE, {tok.vocab_size:,} ids, fitted on {len(files)} files")
    return 0


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Exception classes that mean bad input or a bad environment, not a bug."""
    from rwkvx_c.checkpoint import CheckpointError
    from rwkvx_c.data import DataError
    from rwkvx_c.train import TrainError
    return (TrainError, DataError, CheckpointError, MemoryError, OSError)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmds: dict[str, Callable[[argparse.Namespace], int]] = {
        "train": _train, "sample": _sample, "export": _export, "import": _import,
        "tokenizer": _tokenizer_train}
    try:
        return cmds[args.cmd](args)
    except BrokenPipeError:
        # the reader went away (`| head`): silence the flush at exit too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\nrwkvx-c: interrupted\n")
        return 130
    except _expected_errors() as e:
        from rwkvx_c.distributed import abort_job
        abort_job(e)  # under MPI the other ranks must not wait for this one
        if isinstance(e, OSError) and e.filename:
            return _err(f"{e.strerror}: {e.filename}")
        return _err(f"out of memory: {e}" if isinstance(e, MemoryError) else str(e))
    except BaseException as e:
        from rwkvx_c.distributed import abort_job
        abort_job(e)  # under MPI: report this rank's failure and end every rank
        raise
    finally:
        if argv is None:
            # the command is over: a late Ctrl-C (a second one arriving as the
            # first one's clean stop finishes) must not kill the exiting process
            _ignore_sigint()


def _ignore_sigint() -> None:
    """SIG_IGN for SIGINT. A Ctrl-C landing while it is being set (before
    the handler is swapped, KeyboardInterrupt is raised inside signal.signal)
    only means setting it again; once it is set, pending ones are dropped."""
    while True:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            return
        except KeyboardInterrupt:
            continue


if __name__ == "__main__":
    sys.exit(main())
