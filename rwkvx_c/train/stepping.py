"""The Trainer's step: its clock and schedule, one optimiser step, the
evaluation, and when the next evaluation and save fall.

Stepper holds the run state every part of rwkvx_c.train.trainer.Trainer
reads (declared once, here); Saver (rwkvx_c.train.saving) adds the
checkpoint, and Trainer the set-up, the log and the loop.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.sampler import IGNORE, BatchSampler, count_targets
from rwkvx_c.generation import Sampling, generate
from rwkvx_c.train import schedule
from rwkvx_c.train.accumulate import GradAccumulator
from rwkvx_c.train.finetune import PartsAdamW, lisa_due, unfreeze_due
from rwkvx_c.train.grpo import GRPOStep
from rwkvx_c.train.guard import DivergenceGuard
from rwkvx_c.train.keep import Keeper
from rwkvx_c.train.objectives import PreferenceStep
from rwkvx_c.train.optim import AdamW
from rwkvx_c.train.validate import validation_loss

if TYPE_CHECKING:
    from rwkvx_c.data.pipeline import Corpus
    from rwkvx_c.data.templates import ChatTemplate
    from rwkvx_c.data.tokenizers import Tokenizer
    from rwkvx_c.run.base import Record
    from rwkvx_c.run.lock import RunLock
    from rwkvx_c.run.rundir import Row, RunDir
    from rwkvx_c.train.distributed import ProcessGroup
    from rwkvx_c.train.options import ResolvedOptions
    from rwkvx_c.train.trackers import Trackers

__all__ = ["Stepper", "SAMPLE_TOKENS"]

SAMPLE_TOKENS = 64   # new tokens of each --sample-every generation


class Stepper:
    """The run state of a Trainer (set up by Trainer._setup and its helpers,
    on every rank) and its step, clock and evaluation."""

    group: ProcessGroup
    opts: ResolvedOptions
    out_dir: str | None           # None on ranks other than 0: they write nothing
    run_dir: RunDir | None        # the same folder's files
    tokenizer: Tokenizer
    chat_template: ChatTemplate   # how chat records are rendered (stored in checkpoints)
    corpus: Corpus
    model: _core.RxPtModel
    optim: AdamW | PartsAdamW
    guard: DivergenceGuard
    sampler: BatchSampler
    pref: PreferenceStep | GRPOStep | None   # a preference objective's or GRPO's step
    base: Record | None           # the base the checkpoints name (None: they hold it all)
    _base_names: frozenset[str]
    val_x: np.ndarray
    val_y: np.ndarray
    val_bytes: int | None
    _rows: tuple[int, int]        # this rank's rows of a batch
    step_count: int
    elapsed: float                # training seconds of earlier sessions of this run
    tokens_seen: int
    lr_scale: float               # lowered by each rollback after a divergence
    rollbacks: int
    keeper: Keeper
    last_eval: Row | None
    saved_step: int | None
    _session_start: float
    _eval_seconds: float | None
    _save_seconds: float | None
    _warm_end: float | None
    _next_eval_at: float | None
    _last_batch: tuple[np.ndarray, np.ndarray] | None
    _accum: GradAccumulator | None
    trackers: Trackers | None = None   # --log-to, on rank 0
    _lock: RunLock | None

    def train_seconds(self) -> float:
        """Wall-clock seconds this run has trained, earlier sessions included."""
        return self.elapsed + (time.perf_counter() - self._session_start)

    def _budget_s(self) -> float | None:
        return None if self.opts.time_budget is None else self.opts.time_budget * 60.0

    def _time_budget_s(self) -> float:
        """The budget of a run without a step count (resolved() gives it one)."""
        budget = self._budget_s()
        assert budget is not None, "a run without steps has a time budget"
        return budget

    def _reserve_s(self) -> float:
        """Seconds kept back from a time budget for the final evaluation and save."""
        tps = self.tokens_seen / max(self.train_seconds(), 1e-9) if self.tokens_seen else 0.0
        return schedule.reserve_seconds(self._eval_seconds, self._save_seconds, self.val_x.size,
                                        tps)

    def progress(self) -> float:
        """Fraction of the run done, in [0, 1]: by steps when steps are set,
        else by the time budget."""
        if self.opts.steps is not None:
            return min(1.0, self.step_count / self.opts.steps)
        budget = self._time_budget_s()
        return min(1.0, self.train_seconds() / max(budget - self._reserve_s(), 1e-9))

    def lr(self) -> float:
        """Learning rate of the next step."""
        o = self.opts
        s = self.step_count + 1
        if o.steps is not None:
            p = schedule.step_progress(s, o.steps, o.warmup_steps)
        else:
            p = schedule.time_progress(self.train_seconds(), self._warm_end,
                                       self._time_budget_s() - self._reserve_s())
        return self.lr_scale * schedule.lr_at(s, p, lr=o.lr, warmup_steps=o.warmup_steps,
                                              min_lr_frac=o.min_lr_frac, kind=o.schedule)

    def done(self) -> bool:
        """True once the step count or the time budget is used up (a run
        takes at least one step). Rank 0's clock decides for every rank."""
        return self.group.root_value(self._done())

    def _done(self) -> bool:
        if self.step_count == 0:
            return False
        if self.keeper.stop():
            return True
        if self.opts.steps is not None and self.step_count >= self.opts.steps:
            return True
        budget = self._budget_s()
        if budget is not None:
            per_step = self.train_seconds() / max(self.step_count, 1) if self.step_count else 0
            wall = self.train_seconds()
            return wall + per_step + self._reserve_s() >= budget
        return False

    def step(self) -> Row:
        """One optimiser step. Returns {'step', 'loss', 'lr', 'tokens_per_s',
        'grad_norm', 'elapsed'}."""
        t = time.perf_counter()
        lr = self.group.root_value(self.lr())
        self.optim = unfreeze_due(self.model, self.optim, self.opts, self.step_count)
        self.optim = lisa_due(self.model, self.optim, self.opts, self.step_count)
        extra: Row = {}
        share = None
        if isinstance(self.pref, GRPOStep):
            if self.opts.grad_accum > 1 and (self._accum is None
                                             or self._accum.optim is not self.optim):
                self._accum = GradAccumulator(self.optim)   # once, and again past an unfreeze
            loss, extra, n_tokens = self.pref.step(self.model, self._accum)
        elif self.pref is not None:
            loss, extra, n_tokens = self.pref.step(self.model)
        else:
            x, y = self.sampler.next()   # the step's batch: batch * grad_accum sequences
            self._last_batch = (x, y)
            loss = self._backward(x, y)
            n_tokens = x.size
            if self.corpus.train_mask is not None:
                share = self._share(y)
        loss = self.group.average_grads(self.optim.grad_buffers(), loss, share)
        norm = self.optim.grad_norm()   # of what trains, judged before the update
        self.guard.check_loss(loss, self.step_count + 1, norm)
        self.optim.step(lr, norm)
        self.step_count += 1
        self.tokens_seen += n_tokens
        if self.step_count == self.opts.warmup_steps:
            self._warm_end = self.train_seconds()
        dt = time.perf_counter() - t
        return {"step": self.step_count, "loss": float(loss), "lr": lr,
                "tokens_per_s": n_tokens / dt, "grad_norm": norm,
                "elapsed": round(self.train_seconds(), 3), **extra}

    def _backward(self, x: np.ndarray, y: np.ndarray) -> float:
        """Forward and backward of this rank's rows of the step's batch: the
        mean loss, its grads in the optimiser's buffers. With grad_accum N,
        over N micro-batches of `batch` sequences, each split over the ranks
        as one batch is (rwkvx_c.train.accumulate)."""
        lo, hi = self._rows
        if self.opts.grad_accum == 1:
            self.model.forward(x[lo:hi], return_logits=False)
            return self.model.backward(y[lo:hi], IGNORE)
        if self._accum is None or self._accum.optim is not self.optim:
            self._accum = GradAccumulator(self.optim)   # once, and again past an unfreeze
        return self._accum.backward(self.model, x, y, self._rows, self.opts.batch,
                                    self.corpus.train_mask is not None)

    def _share(self, y: np.ndarray) -> float:
        """This rank's share of the step's counted targets (a chat corpus's
        ranks count different numbers: their grads are weighted by it)."""
        lo, hi, b = *self._rows, self.opts.batch
        mine = sum(count_targets(y[k * b + lo:k * b + hi]) for k in range(len(y) // b))
        return mine / max(count_targets(y), 1)

    def evaluate(self) -> Row:
        """Mean validation loss over the fixed validation windows (up to
        eval_tokens tokens), and bits per byte of text: the loss summed in
        nats over every target token / (ln 2 * the UTF-8 bytes those tokens
        decode to), comparable across tokenizers (None for token files of
        unknown vocabulary).
        Touches neither the parameters nor the training data stream."""
        t = time.perf_counter()
        if self.pref is not None:
            row = self.pref.evaluate(self.model)   # no val_bpb: pairs have no bytes to count
            self._eval_seconds = max(self._eval_seconds or 0.0, time.perf_counter() - t)
            self.last_eval = {"step": self.step_count, "val_loss": row["val_loss"],
                              "val_bpb": None}
            return row
        val, bpb = validation_loss(self.model, self.val_x, self.val_y, self._rows, self.group,
                                   self.val_bytes)
        # the slowest evaluation so far: on a shared machine the next can be as slow
        self._eval_seconds = max(self._eval_seconds or 0.0, time.perf_counter() - t)
        self.last_eval = {"step": self.step_count, "val_loss": val, "val_bpb": bpb}
        return {"val_loss": val, "val_bpb": bpb}

    def samples(self) -> Row:
        """--sample-every: the model's greedy continuation of each
        --sample-prompt as it is now (rwkvx_c.generation.generate, the
        batched engine), as a log row {'step', 'samples': [{'prompt',
        'text'}]}; the training state is untouched."""
        prompts = self.opts.sample_prompt or []
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        outs = generate(self.model, prompts, max_new_tokens=SAMPLE_TOKENS,
                        sampling=Sampling(temperature=0.0), tokenizer=self.tokenizer)
        return {"step": self.step_count,
                "samples": [{"prompt": p, "text": c.text} for p, c in zip(prompts, outs)]}

    def sample_due(self) -> bool:
        """True when --sample-every falls on the step just taken (or step 0)."""
        k = self.opts.sample_every
        return k is not None and self.step_count % k == 0

    def eval_due(self) -> bool:
        """True when the periodic evaluation falls on the step just taken
        (rank 0's clock decides for every rank)."""
        return self.group.root_value(self._eval_due())

    def _eval_due(self) -> bool:
        o = self.opts
        by_steps = schedule.eval_due_by_steps(self.step_count, o.eval_every, o.steps)
        if by_steps is not None:
            return by_steps
        due, self._next_eval_at = schedule.eval_due_by_time(
            self.train_seconds(), self._next_eval_at, self._time_budget_s())
        return due

    def save_due(self, evaluated: bool) -> bool:
        if self.opts.save_every is not None:
            return self.step_count % self.opts.save_every == 0
        return evaluated
