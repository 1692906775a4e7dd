"""The rwkvx-c command (also ``python -m rwkvx_c``).

    rwkvx-c train [--data PATH] [--preset tiny|S|M|default] [--steps N]
                  [--time-budget MIN] [--batch B] [--seq-len T] [--lr X]
                  [--threads N] [--seed S] [--out DIR] [--resume]
                  [--eval-every K] [...]
    rwkvx-c sample DIR --prompt TEXT [--max-new-tokens N] [--temperature X]
                  [--top-p P] [--seed S]

Bad input is one line on stderr naming the problem and a non-zero exit
status (2 for bad flags, 1 otherwise); no traceback, and an existing
checkpoint is never touched by a run that fails to start. Only a bug (an
exception of no expected kind) shows its traceback. A diverged run stops
with status 1 (or rolls back, with --on-divergence rollback); Ctrl-C ends a
run after its checkpoint (status 130), a second Ctrl-C at once.
"""
import argparse
import datetime
import math
import os
import signal
import sys

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _checked(conv, ok, what):
    """An argparse type: conv(s), which must satisfy ok, else "expected <what>"."""
    def parse(s):
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


def build_parser():
    from rwkvx_c.train import PRESETS
    from rwkvx_c.init import SCHEMES
    p = _Parser(prog="rwkvx-c", description="CPU pretraining of RWKV-X language models.")
    sub = p.add_subparsers(dest="cmd", metavar="{train,sample}", parser_class=_Parser)
    sub.required = True

    t = sub.add_parser("train", help="train a model (no arguments: the default job)",
                       description="Train a byte-level RWKV-X model. With no arguments: the "
                       "default preset on the Python standard library's .py files, for at "
                       "most 9.5 minutes, into a new folder under ./runs/.")
    t.add_argument("--data", metavar="PATH", help="text file, folder of text files, or "
                   ".bin token file (default: the Python standard library's .py files)")
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
    return p


def _err(msg, code=1):
    sys.stderr.write(f"rwkvx-c: error: {msg}\n")
    return code


def _new_run_dir():
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join("runs", stamp)
    d, i = base, 1
    while os.path.exists(d):
        i += 1
        d = f"{base}-{i}"
    return d


def _latest_run():
    from rwkvx_c.train import CHECKPOINT
    if not os.path.isdir("runs"):
        return None
    cands = [os.path.join("runs", d) for d in os.listdir("runs")
             if os.path.exists(os.path.join("runs", d, CHECKPOINT))]
    return max(cands, key=os.path.getmtime) if cands else None


def plot_log(rows, path):
    """DIR/loss.png: training loss and validation loss against steps.
    Returns False (and writes nothing) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if tr:
        s, l = zip(*tr)
        ax.plot(s, l, lw=0.6, alpha=0.35, color="tab:blue")
        k = max(1, len(l) // 50)
        if k > 1:
            import numpy as np
            sm = np.convolve(l, np.ones(k) / k, mode="valid")
            ax.plot(s[k - 1:], sm, color="tab:blue", label="train loss")
        else:
            ax.lines[-1].set_label("train loss")
    if va:
        s, l = zip(*va)
        ax.plot(s, l, "o-", color="tab:orange", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def _train(a):
    from rwkvx_c import get_num_threads
    from rwkvx_c.checkpoint import CheckpointError
    from rwkvx_c.data import DataError
    from rwkvx_c.train import LOG, TrainError, TrainOptions, Trainer

    opts = dict(data=a.data, preset=a.preset, steps=a.steps, time_budget=a.time_budget,
                batch=a.batch, seq_len=a.seq_len, lr=a.lr, warmup_steps=a.warmup,
                weight_decay=a.weight_decay, grad_clip=a.grad_clip, threads=a.threads,
                seed=a.seed, init=a.init, eval_every=a.eval_every,
                eval_tokens=a.eval_tokens, save_every=a.save_every, cache_dir=a.cache_dir,
                on_divergence=a.on_divergence)
    try:
        if a.resume:
            out = a.out or _latest_run()
            if out is None:
                return _err("--resume found no run under ./runs/; name one with --out DIR")
            if not os.path.isdir(out):
                return _err(f"--resume: run folder {out} does not exist")
            if a.data is not None:
                opts["data"] = a.data
            tr = Trainer.resume(out, **opts)
        else:
            out = a.out or _new_run_dir()
            kw = {k: v for k, v in opts.items() if v is not None}
            tr = Trainer(TrainOptions(**kw), out)
    except (TrainError, DataError, CheckpointError) as e:
        return _err(str(e))
    except OSError as e:
        return _err(f"{e.strerror}: {e.filename}" if e.filename else str(e))

    o = tr.opts
    m = tr.model
    stop_by = (f"{o.steps} steps" if o.steps is not None else "") + \
        (" or " if o.steps is not None and o.time_budget else "") + \
        (f"{o.time_budget:g} min" if o.time_budget else "")
    print(f"rwkvx-c train: {out}\n"
          f"  data   {tr.corpus.description}\n"
          f"  model  preset {o.preset}, layers {m.layers}, {m.n_params:,} params, "
          f"init {o.init}\n"
          f"  train  batch {o.batch} x seq_len {o.seq_len}, lr {o.lr:g}, stop after {stop_by}, "
          f"{get_num_threads()} threads"
          + (f", resumed at step {tr.step_count}" if a.resume else ""), flush=True)

    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(1)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    old = signal.signal(signal.SIGINT, on_sigint)
    bar = None
    if not a.no_progress:
        from rwkvx_c.progress import make_progress
        if o.steps is not None:
            bar = make_progress(o.steps, tr.step_count, "step")
        else:
            bar = make_progress(round(o.time_budget * 60), round(tr.train_seconds()), "s",
                                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s "
                                "[{elapsed}<{remaining}{postfix}]")
    post = {}

    def on_step(row):
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
        if o.steps is not None:
            bar.update(row["step"] - bar.n)
        else:
            bar.update(min(bar.total, tr.train_seconds()) - bar.n)

    try:
        final = tr.run(on_step=on_step, stop=lambda: bool(interrupted))
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
    rows = tr.read_log()
    plot = os.path.join(out, "loss.png")
    plotted = plot_log(rows, plot)
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
    return 130 if interrupted else 0


def _sample(a):
    import rwkvx_c
    from rwkvx_c.checkpoint import CheckpointError
    from rwkvx_c.sample import generate, load_model
    if a.threads:
        if a.threads > rwkvx_c.MAX_THREADS:
            return _err(f"--threads must be at most {rwkvx_c.MAX_THREADS}, got {a.threads}")
        rwkvx_c.set_num_threads(a.threads)
    try:
        model = load_model(a.dir)
    except CheckpointError as e:
        return _err(str(e))
    if model.config["vocab_size"] < 256:
        return _err(f"the model in {a.dir} is not byte-level (vocab {model.config['vocab_size']})")
    # the prompt's own bytes, also when they are not UTF-8 (argv decodes
    # them with surrogateescape); the output is written as UTF-8 bytes
    prompt = os.fsencode(a.prompt)
    out = sys.stdout.buffer
    out.write(prompt)
    for text in generate(model, prompt, a.max_new_tokens, a.temperature, a.top_p, a.seed):
        out.write(text.encode("utf-8", "surrogateescape"))
        out.flush()
    out.write(b"\n")
    out.flush()
    return 0


def _expected_errors():
    """Exception classes that mean bad input or a bad environment, not a bug."""
    from rwkvx_c.checkpoint import CheckpointError
    from rwkvx_c.data import DataError
    from rwkvx_c.train import TrainError
    return (TrainError, DataError, CheckpointError, MemoryError, OSError)


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return _train(args) if args.cmd == "train" else _sample(args)
    except BrokenPipeError:
        # the reader went away (`| head`): silence the flush at exit too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\nrwkvx-c: interrupted\n")
        return 130
    except _expected_errors() as e:
        if isinstance(e, OSError) and e.filename:
            return _err(f"{e.strerror}: {e.filename}")
        return _err(f"out of memory: {e}" if isinstance(e, MemoryError) else str(e))


if __name__ == "__main__":
    sys.exit(main())
