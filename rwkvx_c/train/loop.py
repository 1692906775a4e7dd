"""The training loop of a Trainer: steps with their periodic evaluations,
log rows and checkpoints, a final evaluation and checkpoint, and what a
divergence does (stop with one line, or roll back to the last checkpoint
at a lower learning rate). Trainer.run calls run_loop; the functions take
the Trainer whose step, evaluate, save and log they compose."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from rwkvx_c.errors import Divergence
from rwkvx_c.train.guard import MAX_ROLLBACKS, ROLLBACK_LR_FACTOR
from rwkvx_c.train.keep import save_best

if TYPE_CHECKING:
    import numpy as np

    from rwkvx_c.run.rundir import Row, RunDir
    from rwkvx_c.train.distributed import ProcessGroup
    from rwkvx_c.train.guard import DivergenceGuard
    from rwkvx_c.train.keep import Keeper
    from rwkvx_c.train.options import ResolvedOptions

__all__ = ["run_loop", "train_step", "before_first_step", "diverged"]



class Trainer(Protocol):
    """What the loop uses of a rwkvx_c.train.trainer.Trainer (which imports this)."""
    opts: ResolvedOptions
    group: ProcessGroup
    guard: DivergenceGuard
    keeper: Keeper
    out_dir: str | None
    run_dir: RunDir | None
    step_count: int
    saved_step: int | None
    last_eval: Row | None
    rollbacks: int
    lr_scale: float
    elapsed: float
    _session_start: float

    def step(self) -> Row: ...
    def evaluate(self) -> Row: ...
    def samples(self) -> Row: ...
    def sample_due(self) -> bool: ...
    def done(self) -> bool: ...
    def eval_due(self) -> bool: ...
    def save_due(self, evaluated: bool) -> bool: ...
    def save(self, path: str | None = None) -> str | None: ...
    def log(self, row: Row) -> None: ...
    def train_seconds(self) -> float: ...
    def _restore(self, state: dict[str, Any], tensors: Mapping[str, np.ndarray]) -> None: ...


def diverged(self: Trainer, e: Divergence) -> None:
    """Rolls back after Divergence e when allowed, else re-raises it with
    the checkpoint's fate in its message."""
    rd = self.run_dir
    have = rd is not None and self.saved_step is not None and rd.has_checkpoint()
    # under MPI only rank 0 holds the checkpoint: every rank stops instead
    if self.opts.on_divergence == "rollback" and rd is not None and have \
            and self.rollbacks < MAX_ROLLBACKS and self.group.size == 1:
        # the checkpoint's own count and scale are older than this session's
        elapsed, start = self.elapsed, self._session_start
        rollbacks, lr_scale = self.rollbacks, self.lr_scale
        tensors, _, state = rd.read_checkpoint()
        self._restore(state, tensors)
        self.elapsed, self._session_start = elapsed, start  # the lost time was spent
        self.rollbacks = rollbacks + 1
        self.lr_scale = lr_scale * ROLLBACK_LR_FACTOR
        self.guard.reset()
        self.log({"step": self.step_count, "rollback": self.rollbacks, "reason": e.reason,
                  "lr_scale": self.lr_scale})
        return
    if have:
        fate = f"the checkpoint of step {self.saved_step} in {self.out_dir} is kept"
    elif self.out_dir:
        fate = f"no checkpoint was saved in {self.out_dir}"
    else:
        fate = "nothing was saved"
    if self.opts.on_divergence == "rollback" and have:
        fate += f" ({self.rollbacks} rollbacks did not help)"
    hint = "" if self.opts.on_divergence == "rollback" or not have else \
        " or --on-divergence rollback"
    raise Divergence(e.step, f"{e.reason}; {fate}; try a lower --lr{hint}") from None

def run_loop(self: Trainer, on_step: Callable[[Row], object] | None,
         stop: Callable[[], bool] | None) -> Row:
    if self.step_count == 0 and self.last_eval is None:
        before_first_step(self, on_step)
    while not self.done():
        if stop is not None and stop():
            break
        train_step(self, on_step)
    if self.last_eval is None or self.last_eval["step"] != self.step_count:
        final = self.evaluate()
        try:
            self.guard.check_eval(final["val_loss"], self.step_count)
        except Divergence as e:
            diverged(self, e)
            return run_loop(self, on_step, stop)
        row = {"step": self.step_count, **final, "elapsed": round(self.train_seconds(), 3),
               "final": True}
        self.log(row)
        if on_step:
            on_step(row)
        best = self.keeper.evaluated(self.step_count, final["val_loss"])
    else:
        final = {k: self.last_eval[k] for k in ("val_loss", "val_bpb")}
        best = False
    if self.out_dir:
        self.save()
        if best:
            save_best_step(self)
    return final

def before_first_step(self: Trainer, on_step: Callable[[Row], object] | None) -> None:
    """A fine-tune's (--init-from) baseline: the evaluation of its source
    as step 0, logged and plotted as any (not a checkpoint: --keep-best and
    --early-stop judge the trained steps); and --sample-every's
    generations from the model as it starts."""
    if self.opts.init_from:
        row = {"step": 0, **self.evaluate(), "elapsed": round(self.train_seconds(), 3)}
        self.log(row)
        if on_step:
            on_step(row)
    if self.sample_due():
        self.log(self.samples())


def train_step(self: Trainer, on_step: Callable[[Row], object] | None) -> None:
    """One step of the loop: the step, its periodic evaluation, its log
    row and its checkpoint; a divergence rolls back or raises (_diverged)."""
    try:
        row = self.step()
        evaluated = False
        if self.eval_due() and not self.done():
            row.update(self.evaluate())
            self.guard.check_eval(row["val_loss"], self.step_count)
            evaluated = True
    except Divergence as e:
        diverged(self, e)
        return
    self.log(row)
    if on_step:
        on_step(row)
    best = evaluated and self.keeper.evaluated(self.step_count, row["val_loss"])
    if self.out_dir and self.save_due(evaluated) and not self.guard.suspect():
        try:
            self.save()
        except Divergence as e:
            diverged(self, e)
            return
    if best and not self.guard.suspect():
        save_best_step(self)
    if self.sample_due():
        self.log(self.samples())

def save_best_step(self: Trainer) -> None:
    """--keep-best: this step's model, the best so far (rwkvx_c.train.keep)."""
    try:
        save_best(self.run_dir if self.opts.keep_best else None,
                  self.saved_step == self.step_count, self.save)
    except Divergence as e:
        diverged(self, e)
