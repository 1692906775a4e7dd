"""What a run shows while it trains: the progress bar over its steps (or its
time budget) with the latest losses, and the loss plot drawn at its end.
The command line and ``Trainer.run(progress=True, plot=True)`` use the same."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from rwkvx_c.run.plot import plot_log
from rwkvx_c.run.rundir import Row, RunDir
from rwkvx_c.util.progress import make_progress

__all__ = ["progress_bar", "progress_update", "watch", "origin", "what_trains", "run_title"]



class Trainer(Protocol):
    """What these read of a rwkvx_c.train.trainer.Trainer (which imports this
    module, so it is named by its shape here)."""
    opts: Any
    step_count: int
    run_dir: RunDir | None

    def train_seconds(self) -> float: ...
    def read_log(self) -> list[Row]: ...


def progress_bar(tr: Trainer) -> Any:
    """A bar over the run's steps, or over its time budget in seconds."""
    o = tr.opts
    if o.steps is not None:
        return make_progress(o.steps, tr.step_count, "step")
    assert o.time_budget is not None   # resolved(): a run without steps has a time budget
    return make_progress(round(o.time_budget * 60), round(tr.train_seconds()), "s",
                         bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s "
                         "[{elapsed}<{remaining}{postfix}]")


def progress_update(bar: Any, tr: Trainer) -> Callable[[Row], None]:
    """The run's on_step: moves the bar and shows the latest losses on it."""
    post: dict[str, str] = {}

    def on_step(row: Row) -> None:
        if bar is None:
            return
        if "loss" in row:
            post["loss"] = f"{row['loss']:.3f}"
            post["tok/s"] = f"{row['tokens_per_s']:.0f}"
        if "rewards/accuracies" in row:   # a preference objective's (TRL's names)
            post["acc"] = f"{row['rewards/accuracies']:.2f}"
            post["margin"] = f"{row['rewards/margins']:.3f}"
        if "reward" in row:   # GRPO's (TRL's names)
            post["reward"] = f"{row['reward']:.3f}"
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


@contextlib.contextmanager
def watch(tr: Trainer, on_step: Callable[[Row], object] | None, progress: bool,
          plot: bool) -> Iterator[Callable[[Row], object] | None]:
    """The on_step a run calls: the caller's, and the bar's when progress;
    at the end the bar is closed and, when plot, out_dir/loss.png drawn
    from the log (also after an error: the plot shows how it went)."""
    bar = progress_bar(tr) if progress else None
    show = progress_update(bar, tr)

    def both(row: Row) -> None:
        show(row)
        if on_step is not None:
            on_step(row)
    try:
        yield both if bar is not None else on_step
    finally:
        if bar is not None:
            bar.close()
        if plot and tr.run_dir is not None:
            plot_log(tr.read_log(), tr.run_dir.plot_path, title=run_title(tr.opts, tr.run_dir.path))


def origin(o: Any) -> str:
    """Where a run's weights come from: its preset and init, or its
    --init-from source and tune mode."""
    if not o.init_from:
        return f"preset {o.preset}, init {o.init}"
    return f"tune {o.tune} of {o.init_from}"


def what_trains(o: Any) -> str:
    """What of the model trains (--tune, --train-parts, --freeze, --unfreeze-at)."""
    what = {"full": "every parameter", "state": "the initial WKV states",
            "lora": f"LoRA adapters (r {o.lora_r}, alpha {o.lora_alpha:g})"}[o.tune]
    if o.tune == "full" and o.train_parts:
        what = f"only {o.train_parts}"
    elif o.train_parts:
        what += f" and {o.train_parts}"
    if o.freeze:
        what += f" but {o.freeze}"
    if o.unfreeze_at:
        what += f", everything from step {o.unfreeze_at}"
    return what


def run_title(o: Any, out: str) -> str:
    """The loss plot's title: the run folder, and a fine-tune's mode and source."""
    return f"rwkvx-c train: {out}" + (f"\n{origin(o)}" if o.init_from else "")
