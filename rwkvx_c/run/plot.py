"""The run folder's loss.png: training loss and validation against steps
(a preference objective's: its loss and rewards/accuracies; GRPO's: its
loss, reward and eval_reward), with the
elapsed training time on a second axis above."""
from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rwkvx_c.util.atomic import replacing

__all__ = ["plot_log", "plot_png", "draw"]

SMOOTH_POINTS = 50   # the smoothed training curve has about this many windows
FIGSIZE = (7.5, 4.6)
DPI = 110
LEGEND_SPACE = 0.07   # the figure's bottom fraction kept for the legend


def plot_log(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> bool:
    """Draw loss.png from a run's log rows (draw()). Returns False (and
    writes nothing) when matplotlib is missing."""
    png = plot_png(rows, title)
    if png is None:
        return False
    with replacing(path) as f:
        f.write(png)
    return True


def plot_png(rows: Sequence[dict[str, Any]], title: str = "") -> bytes | None:
    """loss.png's bytes (for a tracker), None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = draw(rows, title)
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def draw(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """The figure of a run's log rows. The validation curve is in bits per
    byte when the run reports it (as the console does), on its own axis;
    else validation loss beside the training loss. The legend sits below
    the axes, where it can cover no curve."""
    import matplotlib.pyplot as plt
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r and "step" in r]
    bpb = [(r["step"], r["val_bpb"]) for r in rows if r.get("val_bpb") is not None]
    vl = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    rew = [(r["step"], r["reward"]) for r in rows if "reward" in r]
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    handles = []
    if tr:
        ts = np.array([r[0] for r in tr], dtype=np.float64)
        loss = np.array([r[1] for r in tr], dtype=np.float64)
        ax.plot(ts, loss, lw=0.6, alpha=0.35, color="tab:blue")
        k = max(1, len(loss) // SMOOTH_POINTS)
        sm = np.convolve(loss, np.ones(k) / k, mode="valid") if k > 1 else loss
        handles += ax.plot(ts[k - 1:], sm, color="tab:blue",
                           label="train loss" if rew else "train loss (nats/token)")
    acc = [(r["step"], r["rewards/accuracies"]) for r in rows if "rewards/accuracies" in r]
    if acc:   # a preference objective: its accuracy on the right, the loss in nats/pair
        right = ax.twinx()
        handles += right.plot([r[0] for r in acc], [r[1] for r in acc], lw=0.6, alpha=0.6,
                              color="tab:green", label="rewards/accuracies")
        right.set_ylabel("preference accuracy")
        right.set_ylim(-0.02, 1.02)
    elif rew:
        # GRPO: the mean reward of the step's completions (TRL's "reward") and the
        # held-out greedy one ("eval_reward") on the right
        right = ax.twinx()
        handles += right.plot([r[0] for r in rew], [r[1] for r in rew], lw=0.6, alpha=0.6,
                              color="tab:green", label="reward")
        ev = [(r["step"], r["eval_reward"]) for r in rows if "eval_reward" in r]
        if ev:
            handles += right.plot([r[0] for r in ev], [r[1] for r in ev], "o-",
                                  color="tab:orange", label="eval_reward")
        right.set_ylabel("reward")
    elif bpb:
        right = ax.twinx()
        handles += right.plot([r[0] for r in bpb], [r[1] for r in bpb], "o-",
                              color="tab:orange", label="validation (bits/byte)")
        right.set_ylabel("validation bits per byte")
    elif vl:
        handles += ax.plot([r[0] for r in vl], [r[1] for r in vl], "o-", color="tab:orange",
                           label="validation loss (nats/token)")
    _time_axis(ax, rows)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / pair)" if acc else "loss" if rew else "loss (nats / token)")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout(rect=(0.0, LEGEND_SPACE if handles else 0.0, 1.0, 1.0))
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False,
                   fontsize=9)
    return fig


def _time_axis(ax: Any, rows: Sequence[dict[str, Any]]) -> None:
    """Elapsed training time on the top axis: at each step tick of the bottom
    axis, the time the log says the run had trained by then (interpolated
    between rows; a resumed run's log continues its clock). Ticks follow the
    steps, so an evaluation that takes long never crowds the labels."""
    pts = sorted({(r["step"], r["elapsed"]) for r in rows
                  if isinstance(r.get("elapsed"), (int, float)) and "step" in r
                  and math.isfinite(r["elapsed"])})
    if len(pts) < 2:
        return
    steps = np.array([p[0] for p in pts], dtype=np.float64)
    secs = np.maximum.accumulate(np.array([p[1] for p in pts], dtype=np.float64))
    if secs[-1] <= secs[0]:
        return
    unit, scale = ("min", 60.0) if secs[-1] >= 120 else ("s", 1.0)
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi and steps[0] <= t <= steps[-1]]
    top = ax.twiny()
    top.set_xlim(lo, hi)
    top.set_xticks(ticks)
    times = [float(np.interp(t, steps, secs)) / scale for t in ticks]
    top.set_xticklabels([f"{v:.0f}" if v >= 10 else f"{v:.1f}" for v in times])
    top.set_xlabel(f"training time ({unit})")
