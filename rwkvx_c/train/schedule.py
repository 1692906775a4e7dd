"""The run's clock: learning rate, evaluation cadence and the time budget's
reserve, as pure functions of the step count and the elapsed time
(docs/training.md §Schedule). The Trainer keeps the state they read.

A run stops after ``steps`` optimiser steps or when its wall-clock budget
is used up, whichever comes first. With steps the learning rate runs over
steps; with only a time budget it runs over elapsed training time, from the
end of the warmup to the budget less a reserve kept for the final
evaluation and checkpoint.
"""
from __future__ import annotations

import math

__all__ = ["lr_at", "step_progress", "time_progress", "reserve_seconds", "eval_due_by_steps",
           "eval_due_by_time",
           "EVALS_PER_RUN", "SCHEDULES", "WSD_DECAY_FRAC"]

SCHEDULES = ("cosine", "wsd")
WSD_DECAY_FRAC = 0.2         # wsd decays over the last fifth of the run
EVALS_PER_RUN = 10           # evaluations over a run when no cadence is given
RESERVE_FACTOR = 1.25        # the slowest evaluation + save so far, with a margin
RESERVE_FLOOR_S = 1.0
FIRST_EVAL_GUESS_S = 3.0     # before any step: what the first evaluation may take
EVAL_SPEEDUP = 3.0           # a forward runs ~3x a training step's tokens/s
FIRST_SAVE_GUESS_S = 0.5


def lr_at(step: int, progress: float, *, lr: float, warmup_steps: int,
          min_lr_frac: float = 0.1, kind: str = "cosine") -> float:
    """Learning rate for 1-based `step`.

    Linear warmup over the first `warmup_steps` steps (step s gets
    lr*s/warmup_steps), then, as `progress` -- the fraction of the
    post-warmup run done, in [0, 1], by steps or by wall-clock -- goes from
    0 to 1: kind "cosine", a cosine from lr down to min_lr_frac*lr; kind
    "wsd" (warmup-stable-decay), lr until the last WSD_DECAY_FRAC of the
    run, then a straight line down to min_lr_frac*lr. A cosine's lr at a
    step depends on the run's length, so a resumed run given more steps
    jumps to the longer cosine's value; in wsd's stable phase it does not.
    """
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    p = min(max(progress, 0.0), 1.0)
    lo = lr * min_lr_frac
    if kind == "wsd":
        d = (p - (1.0 - WSD_DECAY_FRAC)) / WSD_DECAY_FRAC
        return lr if d <= 0 else lr - (lr - lo) * d
    return lo + 0.5 * (lr - lo) * (1.0 + math.cos(math.pi * p))


def step_progress(step: int, steps: int, warmup_steps: int) -> float:
    """The post-warmup progress of 1-based `step` in a run of `steps` steps."""
    return (step - warmup_steps) / max(steps - warmup_steps, 1)


def time_progress(t: float, warm_end: float | None, end: float) -> float:
    """The post-warmup progress at training time t of a run whose warmup
    ended at warm_end (None: not yet) and whose schedule ends at `end`."""
    t0 = warm_end or 0.0
    return (t - t0) / max(end - t0, 1e-9)


def reserve_seconds(eval_seconds: float | None, save_seconds: float | None,
                    val_tokens: int, tokens_per_s: float) -> float:
    """Seconds kept back from a time budget for the final evaluation and
    save: the slowest of each so far, or a guess from the training speed
    before there is one."""
    ev = eval_seconds
    if ev is None:
        ev = FIRST_EVAL_GUESS_S if not tokens_per_s else val_tokens / (EVAL_SPEEDUP *
                                                                       tokens_per_s)
    sv = save_seconds if save_seconds is not None else FIRST_SAVE_GUESS_S
    return RESERVE_FACTOR * (ev + sv) + RESERVE_FLOOR_S


def eval_due_by_steps(step: int, eval_every: int | None, steps: int | None) -> bool | None:
    """Whether the evaluation falls on `step` when the cadence is by steps
    (eval_every, else EVALS_PER_RUN over `steps`); None when it is by time."""
    if eval_every is not None:
        return step % eval_every == 0
    if steps is not None:
        return step % max(1, steps // EVALS_PER_RUN) == 0
    return None


def eval_due_by_time(now: float, next_at: float | None, budget_s: float) -> tuple[bool, float]:
    """Whether an evaluation by time falls at training time `now`, and when
    the next one is: EVALS_PER_RUN over the budget (next_at None: the
    first is yet to come)."""
    # at most one evaluation a millisecond: a budget of 1e-320 minutes
    # must give a finite count below, not inf
    every = max(budget_s / EVALS_PER_RUN, 1e-3)
    if next_at is None:
        next_at = every
    if now < next_at:
        return False, next_at
    # the next evaluation time after now, counted, not looped to: a tiny
    # budget must not spin
    return True, next_at + every * (math.floor((now - next_at) / every) + 1)
