"""What a run keeps beside its last checkpoint, and when its validation
stops it: --keep-best (best.safetensors, the checkpoint of the lowest
validation loss), --keep-last K (the K newest checkpoints as step
snapshots) and --early-stop K (K evaluations without a lower validation
loss end the run). The Keeper's counters travel in the checkpoint, so a
resumed run goes on judging from where it stopped."""
from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from typing import Any

from rwkvx_c.errors import TrainError
from rwkvx_c.run.rundir import RunDir
from rwkvx_c.util.atomic import publish

__all__ = ["Keeper", "save_best"]

def save_best(run: RunDir | None, saved_now: bool, save: Callable[[str], object]) -> None:
    """best.safetensors of a run folder (None: not kept) from the model as
    it is: the checkpoint itself when it was saved_now, else save(path)."""
    if run is None:
        return
    if saved_now:
        publish(run.checkpoint, run.best)
    else:
        save(run.best)


class Keeper:
    """The lowest validation loss so far, its step, and the evaluations since."""

    def __init__(self, keep_last: int | None, early_stop: int | None) -> None:
        self.keep_last, self.early_stop = keep_last, early_stop
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.stale = 0   # evaluations since the best one

    def evaluated(self, step: int, val_loss: float) -> bool:
        """Counts an evaluation; True when it is the lowest so far."""
        if self.best_loss is None or val_loss < self.best_loss:
            self.best_loss, self.best_step, self.stale = float(val_loss), step, 0
            return True
        self.stale += 1
        return False

    def stop(self) -> bool:
        """True once --early-stop's evaluations have passed without a new best."""
        return self.early_stop is not None and self.stale >= self.early_stop

    def snapshot(self, run: RunDir, step: int) -> None:
        """With --keep-last K: the checkpoint just written as the snapshot of
        `step`, and only the K newest snapshots kept."""
        if self.keep_last is None:
            return
        publish(run.checkpoint, run.snapshot(step))
        for old in run.snapshots()[:-self.keep_last]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)

    def state(self) -> dict[str, Any]:
        return {"best_loss": self.best_loss, "best_step": self.best_step, "stale": self.stale}

    def restore(self, state: object) -> None:
        """The counters of a checkpoint's state (absent in runs saved before them)."""
        if state is None:
            return
        try:
            assert isinstance(state, dict)
            loss, step, stale = state["best_loss"], state["best_step"], state["stale"]
            ok = (loss is None) == (step is None) and isinstance(stale, int) and stale >= 0 \
                and (loss is None or (isinstance(loss, (int, float)) and math.isfinite(loss)
                                      and isinstance(step, int) and step >= 0))
        except (AssertionError, KeyError):
            ok = False
        if not ok:
            raise TrainError(f"the checkpoint holds a bad keeper state {state!r}")
        self.best_loss = None if loss is None else float(loss)
        self.best_step, self.stale = step, stale
