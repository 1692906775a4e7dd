"""rwkvx-c train: flags from TrainOptions and the model-shape options, the
run with its progress bar, Ctrl-C handling and summary."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from types import FrameType
from typing import Any

from rwkvx_c import _core
from rwkvx_c.cli.common import (
    ARG_TYPES,
    EXIT_INTERRUPTED,
    Subparsers,
    err,
)
from rwkvx_c.errors import TrainError
from rwkvx_c.model.config import SHAPE_OPTIONS, ModelConfig
from rwkvx_c.run.plot import plot_log
from rwkvx_c.run.rundir import RunDir, describe_entries
from rwkvx_c.train.config_file import load_config
from rwkvx_c.train.distributed import ProcessGroup, world
from rwkvx_c.train.finetune import is_unfrozen
from rwkvx_c.train.options import TrainOptions
from rwkvx_c.train.progress import origin, progress_bar, progress_update, run_title, what_trains
from rwkvx_c.train.trainer import Trainer
from rwkvx_c.util.registry import Entry, entries

__all__ = ["add_parser", "run"]

SAMPLE_PROMPT = "def "
CHAT_PROMPT = "$'User: Hi\\n\\nAssistant:'"   # bash quoting: the newlines of RWKV's chat format


def _help(e: Entry) -> str:
    """An option's help, with its default unless the help already says it; a
    % escaped, as argparse formats help strings with %."""
    h = e.help.replace("%", "%%")
    if "default" in h or e.required:
        return h
    return f"{h} (default: {e.default})"


def add_parser(sub: Subparsers) -> None:
    t = sub.add_parser("train", help="train a model (no arguments: the default job)",
                       description="Train an RWKV-X model (bytes by default, or --tokenizer). "
                       "With no arguments: the default preset on the Python standard library's "
                       ".py files, for at most 9.5 minutes, into a new folder under ./runs/.")
    for e in entries(TrainOptions):
        if e.flag is None:
            continue
        if e.kind == "flag":   # absent: None, so a resumed run keeps its own
            t.add_argument(e.flag, *e.aliases, dest=e.key, help=_help(e), action="store_true",
                           default=None)
            continue
        kw: dict[str, Any] = dict(dest=e.key, help=_help(e), metavar=e.metavar)
        if e.choices:
            kw.update(choices=list(e.choices), metavar=None)
        else:
            kw["type"] = ARG_TYPES[e.kind]
        if e.kind == "paths":
            kw["nargs"] = "+"
        elif e.kind == "texts":   # repeatable: --sample-prompt A --sample-prompt B
            kw["action"] = "append"
        t.add_argument(e.flag, *e.aliases, **kw)
    t.add_argument("--config", metavar="FILE", help="options from a TOML file (keys: the "
                   "options' names, the model's shape in a [model] table; every run saves its "
                   "own as RUN/config.toml); any flag overrides the file (default: none)")
    t.add_argument("--out", metavar="DIR", help="run folder (default: a new folder under "
                   "./runs/)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out (or "
                   "the newest run under ./runs/) from its checkpoint (default: a new run)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (default: a "
                   "bar on a terminal, else a plain line every few seconds)")
    g = t.add_argument_group("model shape (each overrides the preset; stored in the checkpoint)")
    for o in SHAPE_OPTIONS:
        g.add_argument("--" + o.name.replace("_", "-"), dest=o.name, metavar=o.metavar,
                       type=ARG_TYPES[o.kind],
                       help=o.help + ("" if "default" in o.help else " (default: the preset's)"))


def train_options(a: argparse.Namespace) -> dict[str, Any]:
    """The TrainOptions fields the flags and --config set (None: not given),
    the shape flags folded into `model`; TrainError for shape flags or
    --config with --resume."""
    opts = {e.key: getattr(a, e.key) for e in entries(TrainOptions) if e.flag is not None}
    file: dict[str, Any] = {}
    if a.config:
        if a.resume:
            raise TrainError("--resume continues with the run's own options; --config starts "
                             "a new run (give RESUME's changes as flags)")
        file = load_config(a.config, [k for k, v in opts.items() if v is not None])
        opts = {**file, **{k: v for k, v in opts.items() if v is not None}}
    for k in ("data", "val_data"):   # one path as a string, as TrainOptions takes it
        if getattr(a, k) and len(getattr(a, k)) == 1:
            opts[k] = getattr(a, k)[0]
    shape = {o.name: getattr(a, o.name) for o in SHAPE_OPTIONS}
    if any(v is not None for v in shape.values()):
        if a.resume:
            raise TrainError("the model shape of a run is fixed; drop the shape flags with "
                             "--resume")
        preset = opts.get("preset") or "default"
        base = ModelConfig.from_dict({**ModelConfig.preset(preset).to_dict(),
                                      **file.get("model", {})})
        opts["model"] = base.with_shape(**shape).to_dict()
        if opts.get("init_from"):   # only the values asked for, each judged against the source's
            opts["model"] = {o.field: v for o in SHAPE_OPTIONS
                             if (v := getattr(a, o.name)) is not None}
    return opts


def _resume_dir(out: str | None) -> str:
    if out is None:
        latest = RunDir.latest()
        if latest is None:
            raise TrainError("--resume found no run under ./runs/; name one with --out DIR")
        return latest.path
    if not os.path.isdir(out):
        raise TrainError(f"--resume: run folder {out} does not exist")
    return out


def _check_new_dir(out: str) -> None:
    """A new run goes into a new or empty folder, or one that holds a run
    (which the trainer then refuses unless it never saved); never silently
    among someone else's files."""
    rd = RunDir(out)
    foreign = rd.foreign_entries()
    if foreign and not rd.holds_run():
        raise TrainError(f"--out {out} already holds {describe_entries(foreign)} and no run; "
                         "choose a new folder")


def _start_run(a: argparse.Namespace, group: ProcessGroup) -> tuple[Trainer, str]:
    """(Trainer, run folder) of a new or resumed run."""
    opts = train_options(a)
    if a.resume:
        out = group.on_root(_resume_dir, a.out)
        return Trainer.resume(out, progress=not a.no_progress, **opts), out
    out = group.root_value(a.out or RunDir.new().path)
    group.on_root(_check_new_dir, out)
    kw = {k: v for k, v in opts.items() if v is not None}
    # a fine-tune (--init-from) takes the source's shape, tokenizer and weights in the Trainer
    return Trainer(TrainOptions(**kw), out, progress=not a.no_progress), out


def _end_now() -> None:
    """The second Ctrl-C: the process ends here, with 130. Not by raising
    KeyboardInterrupt: Python runs a signal's handler in whatever code is
    running, a finalizer (__del__) included, and there it prints the
    exception and drops it, and the run goes on. Nothing is lost by not
    unwinding: every file is written atomically (a write cut short leaves a
    temporary that the next run's lock removes) and log rows are closed as
    they are appended."""
    with contextlib.suppress(Exception):   # a flush cut into (reentrant) may refuse
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write("\nrwkvx-c: interrupted\n")
        sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def run(a: argparse.Namespace) -> int:
    group = world()
    if not group.is_root:  # rank 0 speaks for the job; a failing rank still reports (abort)
        # stays open for the whole process: the silenced streams are never restored
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
        a.no_progress = True
    tr, out = _start_run(a, group)
    _print_header(tr, out, group, a.resume)

    interrupted: list[int] = []

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if interrupted:
            _end_now()
        interrupted.append(1)

    old = signal.signal(signal.SIGINT, on_sigint)
    bar = None if a.no_progress else progress_bar(tr)
    try:
        final = tr.run(on_step=progress_update(bar, tr), stop=lambda: group.any(interrupted))
    except OSError as e:
        if bar:
            bar.close()   # its last line before the error's
        return err(f"cannot write to {out}: {e.strerror or e}; its previous checkpoint, "
                   "if any, is kept")
    except BaseException:
        if bar:
            bar.close()
        raise
    finally:
        signal.signal(signal.SIGINT, old)
    if bar:
        bar.close()
    if group.is_root:
        _print_summary(tr, out, final, bool(interrupted))
    return EXIT_INTERRUPTED if interrupted else 0


def _print_header(tr: Trainer, out: str, group: ProcessGroup, resumed: bool) -> None:
    """What the run is: data, tokens, model, what of it trains, training set-up."""
    o = tr.opts
    m = tr.model
    stop_by = (f"{o.steps} steps ({o.steps / tr.epoch_steps():.3g} epochs)"
               if o.steps is not None else "") + \
        (" or " if o.steps is not None and o.time_budget else "") + \
        (f"{o.time_budget:g} min" if o.time_budget else "")
    threads = _core.get_num_threads()
    batch = f"batch {o.batch} x seq_len {o.seq_len}" if o.grad_accum == 1 else \
        (f"batch {o.batch} x {o.grad_accum} accumulated = {o.batch * o.grad_accum} x seq_len "
         f"{o.seq_len}")
    if o.objective == "grpo":   # completions of at most max_completion_length, not windows
        n = o.batch * o.grad_accum
        batch = (f"{n // o.num_generations} prompts x {o.num_generations} completions of at "
                 f"most {o.max_completion_length} tokens ({o.loss_type} loss)")
    print(f"rwkvx-c train: {out}\n"
          f"  data   {tr.corpus.description}\n"
          f"  tokens {tr.tokenizer.identity()['name']}, vocab {tr.model.config['vocab_size']:,}\n"
          f"  model  {origin(o)}, layers {m.layers}, {m.n_params:,} params\n"
          f"  trains {what_trains(o)}: {tr.optim.m.size:,} params{_frozen(tr)}", flush=True)
    pins = RunDir(out).pins()
    if pins:
        print(f"  pins   {len(pins)} source run checkpoint(s) as they were when the tune "
              f"started: {describe_entries([os.path.basename(p) for p in pins])}")
    if o.objective == "grpo":   # its own beta (the KL's weight), TRL's clipping range
        print(f"  loss   grpo, beta {o.beta:g}, epsilon {o.epsilon:g}"
              + (f", epsilon_high {o.epsilon_high:g}" if o.epsilon_high is not None else "")
              + (f", reference {o.ref_from}" if o.ref_from else ""))
    elif o.objective != "lm":
        print(f"  loss   {o.objective}, beta {o.dpo_beta:g}"
              + (f", label smoothing {o.dpo_label_smoothing:g}" if o.dpo_label_smoothing else "")
              + (f", reference {o.ref_from}" if o.ref_from else ""))
    print(f"  train  {batch}, lr {o.lr:g}, stop after {stop_by}, "
          + (f"{threads} threads" if group.size == 1 else
             f"{group.size} ranks x {threads} threads per rank")
          + f", {m.precision} ({_core.gemm_kernel(m.precision)})"
          + (f", resumed at step {tr.step_count}" if resumed else ""), flush=True)


def _frozen(tr: Trainer) -> str:
    """What the header says of the frozen base: its dtype and size when it
    is held apart from the parameters (bf16, q8_0, q4_0), 'fp32' when it
    is frozen in place, nothing when everything trains."""
    m = tr.model
    if m.base_dtype:
        return (f"; frozen base {m.base_dtype}, {len(m.base_names)} matrices in "
                f"{m.base_bytes / 2**20:,.0f} MiB")
    return "; the rest frozen, fp32" if tr.optim.m.size < m.n_params and \
        not is_unfrozen(tr.optim) else ""


def _print_summary(tr: Trainer, out: str, final: dict[str, Any], interrupted: bool) -> None:
    """The final evaluation, where the run's files are (the loss plot drawn
    now) and how to sample from it."""
    run = RunDir(out)
    plotted = plot_log(tr.read_log(), run.plot_path, title=run_title(tr.opts, out))
    bpb = final.get("val_bpb")
    print(f"step {tr.step_count}: val_loss {final['val_loss']:.4f}"
          + (f", val_bpb {bpb:.4f}" if bpb is not None else "")
          + f", {tr.tokens_seen:,} tokens in {tr.train_seconds():.0f} s"
          + (" (interrupted)" if interrupted else ""))
    last = tr.last_eval
    print(f"  checkpoint {run.checkpoint}"
          + (f" (step {last['step']}, val_loss {last['val_loss']:.4f})" if last else ""))
    k = tr.keeper
    if tr.opts.keep_best and k.best_loss is not None and os.path.isfile(run.best):
        print(f"  best       {run.best} (step {k.best_step}, val_loss {k.best_loss:.4f}): "
              "sample, chat, export, eval and --init-from take it; --checkpoint last the other")
    print(f"  log        {run.log_path}")
    if plotted:
        print(f"  plot       {run.plot_path}")
    else:
        print('  plot       skipped: matplotlib is not installed (pip install "rwkvx_c[train]")')
    print(f"  sample     rwkvx-c sample {out}{_sample_prompt(tr)}")


def _sample_prompt(tr: Trainer) -> str:
    """The summary's sample command's --prompt, as the run's data reads: a
    chat turn after chat or preference data, 'def ' after the default
    Python corpus, none (sample's empty prompt) after any other text."""
    if tr.corpus.train_mask is not None or tr.pref is not None:
        return f" --prompt {CHAT_PROMPT}"
    return f" --prompt '{SAMPLE_PROMPT}'" if tr.opts.data is None else ""
