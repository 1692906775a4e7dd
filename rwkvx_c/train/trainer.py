"""The Trainer: set-up, resume, the log and the loop; its step and
evaluation are rwkvx_c.train.stepping's, its checkpoints and rollback
rwkvx_c.train.saving's.

    tr = Trainer(TrainOptions(preset="tiny", steps=200), out_dir="runs/demo")
    while not tr.done():
        tr.log(row := tr.step())     # {'step', 'loss', 'lr', ...} into DIR/log.jsonl
    print(tr.evaluate())             # {'val_loss', 'val_bpb'}
    tr.save()                        # DIR/checkpoint.safetensors
    tr = Trainer.resume("runs/demo", steps=400)   # continue exactly

One step: B windows of T+1 tokens from the seeded sampler -> model.forward
-> model.backward (mean loss over the B*T targets, a chat corpus's assistant
ones alone; all in C) -> global grad-norm clipping -> AdamW in place on the
parameter arena; nothing is copied. Under
MPI every rank trains on its B/P rows of the same global batch and the
gradients are averaged in place before the optimiser (rwkvx_c.train.distributed);
only rank 0 writes the run folder. A resumed run repeats the uninterrupted
run's losses bit for bit, on any thread count, when its schedule is by steps.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.sampler import BatchSampler, eval_windows, target_bytes
from rwkvx_c.data.templates import builtin
from rwkvx_c.errors import (
    RunLocked,
    TrainError,
)
from rwkvx_c.run.base import pin_source
from rwkvx_c.run.lock import RunLock
from rwkvx_c.run.rundir import Row, RunDir
from rwkvx_c.train.assemble import (
    build_model,
    load_data,
    load_pairs,
    load_prompts,
    name_base,
    start_from_source,
)
from rwkvx_c.train.config_file import save_config
from rwkvx_c.train.distributed import world
from rwkvx_c.train.grpo import GRPOStep
from rwkvx_c.train.guard import DivergenceGuard
from rwkvx_c.train.keep import Keeper
from rwkvx_c.train.loop import run_loop
from rwkvx_c.train.objectives import PreferenceStep
from rwkvx_c.train.options import TrainOptions
from rwkvx_c.train.progress import run_title, watch
from rwkvx_c.train.resume import read_saved
from rwkvx_c.train.saving import Saver
from rwkvx_c.train.trackers import open_trackers
from rwkvx_c.train.validate import check_pair_validation, check_validation

if TYPE_CHECKING:
    from rwkvx_c.train.distributed import ProcessGroup

__all__ = ["Trainer"]


class Trainer(Saver):
    """A training run in out_dir: model, optimiser, data, schedule, log.

    Trainer(options, out_dir) starts a new run (out_dir must not hold a
    checkpoint yet); Trainer.resume(out_dir, **changes) continues one.
    Methods: step(), evaluate(), save(), done(), run(), close().

    group: the data-parallel process group (default:
    rwkvx_c.train.distributed.world(), a no-op in a plain run). Under MPI each
    rank computes its rows of every batch and only rank 0 touches out_dir;
    see docs/distributed.md. While it lives (until close() or the end of
    run()) rank 0 holds the run folder's lock (rwkvx_c.run.lock).
    """

    def __init__(self, options: TrainOptions | None = None, out_dir: str | None = None, *,
                 group: ProcessGroup | None = None, progress: bool = False,
                 _state: dict[str, Any] | None = None,
                 _tensors: Mapping[str, np.ndarray] | None = None,
                 _weights: Mapping[str, np.ndarray] | None = None,
                 _lock: RunLock | None = None) -> None:
        self.group = world() if group is None else group
        self._lock = _lock
        # a run that fails before its first step leaves no folder it made behind
        made = out_dir is not None and self.group.is_root and not os.path.lexists(out_dir)
        try:
            # an error on any rank raises on every rank: none is left waiting
            self.group.agree(self._setup, options, out_dir, _state, _tensors, _weights,
                             progress and self.group.is_root)
            self.group.broadcast_(self.model.param_buffer)
        except BaseException:
            self.close()
            if made and out_dir is not None:
                shutil.rmtree(out_dir, ignore_errors=True)
            raise

    def _setup(self, options: TrainOptions | None, run_dir: str | None,
               _state: dict[str, Any] | None, _tensors: Mapping[str, np.ndarray] | None,
               _weights: Mapping[str, np.ndarray] | None, progress: bool) -> None:
        options = options or TrainOptions()
        # every rank reads the run folder (its tokenizer); only rank 0 writes it
        self.out_dir = run_dir if self.group.is_root else None
        self.run_dir = RunDir(self.out_dir) if self.out_dir is not None else None
        self._t0 = time.perf_counter()
        self._prepare_out_dir(_state is None, _weights is not None and not options.init_from)
        self._pin = None   # a fine-tune's pin of its source run (rwkvx_c.run.base)
        if options.init_from and _state is None and _weights is None:
            options, _weights, self._pin = start_from_source(options, self.group, run_dir)
        self.opts = options.resolved()
        threads = self.opts.threads if self.opts.threads is not None \
            else self.group.default_threads()
        if threads is not None:
            _core.set_num_threads(threads)
        self._load_data(run_dir, _state, progress)
        self._steps_of_epochs(_state is None)
        self._build_model(_tensors, _weights)
        self._name_base(_state, _weights)
        self._prepare_batches()
        self._reset_counters()
        ref = self.opts.ref_from
        if isinstance(self.pref, GRPOStep):   # its pin made now or read again
            saved = None if _state is None else _state["sampler"]
            self.pref.set_reference(self.model, self.opts.tune, self.pref.pin_reference(
                None if self.run_dir is None and _state is None else run_dir, saved))
        elif self.pref is not None:
            if ref and _state is None and self.run_dir is not None:
                # --ref-from's run as pinned now (rwkvx_c.run.base)
                pinned = pin_source(ref, self.run_dir.path)
                ref = pinned["path"] if pinned is not None else ref
            # the reference's log-probabilities: made now (the weights of step 0) or read back
            self.pref.set_reference(self.model, self.opts.tune, self.run_dir, _state is not None,
                                    ref)
        if _state is not None:
            self._restore(_state, _tensors or {})
        if self.run_dir is not None:   # rank 0 alone tracks and saves the options
            save_config(self.run_dir.config, self.opts)
            self.trackers = open_trackers(self.opts.log_to, self.out_dir, self.opts.to_dict())
        # the budget counts this session's set-up (corpus, model) too
        self._session_start = self._t0

    def _prepare_out_dir(self, new: bool, imported: bool) -> None:
        """Lock the run folder (rank 0), refuse to start over a saved run
        (unless it is the imported model itself), drop a log never saved."""
        rd = self.run_dir
        if rd is None:
            return
        if self._lock is None:
            self._lock = _take_lock(rd.path)
        if new and not imported and rd.has_checkpoint():
            raise TrainError(f"{rd} already holds a run; use resume (--resume) "
                             "or another output folder")
        rd.create()
        if new:
            rd.remove_log()   # rows of a run that never saved

    def _load_data(self, run_dir: str | None, _state: dict[str, Any] | None,
                   progress: bool) -> None:
        self.pref = None
        self.chat_template = builtin()   # a preference run renders pairs in RWKV's
        if self.opts.objective == "lm":
            self.tokenizer, self.corpus, chat = load_data(self.opts, run_dir, self.out_dir,
                                                          _state, progress)
            self.chat_template = chat.template or self.chat_template
            return
        o = self.opts   # the reference comes once the model is there (set_reference)
        if o.objective == "grpo":
            self.tokenizer, self.corpus, prompts, held = load_prompts(o, run_dir, self.out_dir,
                                                                      _state)
            self.pref = GRPOStep(o, self.tokenizer, prompts, held, self.group)
            return
        if self.group.size > 1:
            raise TrainError(f"--objective {self.opts.objective} runs in one process")
        self.tokenizer, self.corpus, train, val = load_pairs(self.opts, run_dir, self.out_dir,
                                                             _state)
        self.pref = PreferenceStep(o.objective, o.dpo_beta, o.dpo_label_smoothing, train, val,
                                   o.batch, o.seed)

    def epoch_steps(self) -> float:
        """The steps one pass over the training split takes: its tokens over
        a step's (batch x grad_accum x seq_len), or its pairs over a
        preference step's (batch / 2)."""
        o = self.opts
        if self.pref is not None:
            return len(self.pref.train) / (o.batch // 2)
        return self.corpus.train.size / (o.batch * o.grad_accum * o.seq_len)

    def _steps_of_epochs(self, new: bool) -> None:
        """--epochs N: the run's steps, N passes over the training split
        (a --steps given beside it must be that count)."""
        o = self.opts
        if o.epochs is None or not new:
            return
        steps = max(1, math.ceil(o.epochs * self.epoch_steps()))
        if o.steps is not None and o.steps != steps:
            raise TrainError(f"--epochs {o.epochs:g} is {steps} steps of this data; give "
                             f"--epochs or --steps, not both")
        o.steps = steps

    def _build_model(self, _tensors: Mapping[str, np.ndarray] | None,
                     _weights: Mapping[str, np.ndarray] | None) -> None:
        # a GRPO update's sequences are a prompt and its completion, whatever --seq-len
        step_len = self.pref.step_len() if isinstance(self.pref, GRPOStep) else None
        self.model, self.optim = build_model(self.opts, self.tokenizer, self.corpus, _tensors,
                                             _weights, step_len)
        self.guard = DivergenceGuard(self.opts.model["vocab_size"], self.pref is None)

    def _name_base(self, _state: dict[str, Any] | None,
                   _weights: Mapping[str, np.ndarray] | None) -> None:
        """The base this run's checkpoints name instead of holding it (None:
        they hold every parameter), and the parameter names it has."""
        self.base = name_base(self.opts, _state, _weights, self.group.is_root, self._pin)
        self._base_names = frozenset(_weights or ())

    def _prepare_batches(self) -> None:
        """The training batch sampler, this rank's rows, and the validation windows."""
        opts = self.opts
        if isinstance(self.pref, GRPOStep):   # no windows: the prompts' own batches
            self.val_x = self.val_y = np.zeros((len(self.pref.val), 1), np.int32)
            self.val_bytes = None
            return
        if self.pref is not None:   # no windows: the pairs' own batches
            self.val_x = self.val_y = self.pref.val.x
            self.val_bytes = None
            if self.group.is_root:
                check_pair_validation(len(self.pref.val), len(self.pref.val) +
                                      len(self.pref.train))
            return
        # every rank draws the global batch and trains on its rows of it
        c = self.corpus   # a chat corpus's masks make its untrained targets IGNORE
        aligned = opts.tune == "state"   # its windows start where conversations do
        self.sampler = BatchSampler(c.train, opts.batch * opts.grad_accum, opts.seq_len,
                                    opts.seed, c.train_mask, aligned)
        self._rows = self.group.rows(opts.batch)
        self.val_x, self.val_y = eval_windows(c.val, opts.seq_len,
                                              max(1, opts.eval_tokens // opts.seq_len), c.val_mask,
                                              aligned)
        # val_bpb divides by the text bytes the validation targets decode to
        self.val_bytes = target_bytes(self.val_y, c.token_bytes, c.is_bytes)
        if self.group.is_root:
            check_validation(len(self.val_x), opts.eval_tokens, opts.seq_len,
                             opts.val_data is not None, aligned and c.val_mask is not None)

    def _reset_counters(self) -> None:
        """The run state of step 0 (a resume then restores the saved one)."""
        self.step_count = 0
        self.elapsed = 0.0          # training seconds of earlier sessions of this run
        self.tokens_seen = 0
        self.last_eval = None
        self._eval_seconds = None
        self._save_seconds = None
        self._warm_end = None       # elapsed training time when warmup ended
        self._next_eval_at = None
        self.lr_scale = 1.0         # lowered by each rollback after a divergence
        self.rollbacks = 0
        self.saved_step = None      # step of the checkpoint in out_dir, None before one
        self._last_batch = None
        self._accum = None          # the grad sum of --grad-accum, made at its first step
        self.keeper = Keeper(self.opts.keep_last, self.opts.early_stop)

    def close(self) -> None:
        """End the trackers (with the loss plot) and release the run folder's lock (idempotent)."""
        trackers, self.trackers = getattr(self, "trackers", None), None
        if trackers is not None and self.run_dir is not None:
            trackers.close(self.read_log(), run_title(self.opts, self.run_dir.path))
        lock = getattr(self, "_lock", None)   # None too when __init__ failed before setting it
        if lock is not None:
            lock.release()
            self._lock = None

    # ------------------------------------------------------------------ state
    @classmethod
    def resume(cls, out_dir: str, *, group: ProcessGroup | None = None, progress: bool = False,
               **changes: Any) -> Trainer:
        """Continue the run saved in out_dir; changes may set the RESUMABLE
        options (steps, time_budget, eval_every, save_every, threads,
        cache_dir, on_divergence). Any other option that differs from the
        saved run is a TrainError; so is another precision (the run would
        change arithmetic mid-way and lose bit-exact resume), while precision
        "auto" keeps the saved one. Under MPI rank 0 reads the checkpoint and
        sends it to the others, and holds the run folder's lock."""
        group = world() if group is None else group
        lock = group.agree(lambda: _take_lock(out_dir)
                           if group.is_root and os.path.isdir(out_dir) else None)
        try:
            saved = read_saved(out_dir, group, changes)
            return cls(saved.options, out_dir, group=group, progress=progress,
                       _state=saved.state, _tensors=saved.tensors, _weights=saved.weights,
                       _lock=lock)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    # ------------------------------------------------------------------- log
    def log(self, row: Row) -> None:
        """Append one JSON row to out_dir/log.jsonl."""
        if self.run_dir is not None:
            self.run_dir.append_log([{**row, "world_size": self.group.size}])
        if self.trackers is not None:
            self.trackers.log(row)
            if "samples" in row:
                self.trackers.text(row["step"], row["samples"])

    def read_log(self) -> list[Row]:
        """The rows of out_dir/log.jsonl."""
        return self.run_dir.read_log() if self.run_dir is not None else []

    # ------------------------------------------------------------------- loop
    def run(self, on_step: Callable[[Row], object] | None = None,
            stop: Callable[[], bool] | None = None, *, progress: bool = False,
            plot: bool = False) -> Row:
        """Train until done(): periodic evaluations, checkpoints and log rows,
        then a final one of each; on_step(row) sees every row, stop() returning
        True ends the run early, progress shows the command line's bar on
        stderr and plot draws out_dir/loss.png at the end. Returns the final evaluation.

        A divergence (rwkvx_c.train.guard) stops the run with Divergence, whose
        message says what happened to the checkpoint; with on_divergence
        "rollback" the run instead reloads its last checkpoint, multiplies
        the learning rate by ROLLBACK_LR_FACTOR and goes on, up to
        MAX_ROLLBACKS times. The run folder's lock is released on return."""
        try:
            with watch(self, on_step, progress and self.group.is_root, plot) as seen:
                return run_loop(self, seen, stop)
        finally:
            self.close()


def _take_lock(out_dir: str) -> RunLock:
    try:
        return RunDir(out_dir).lock()
    except RunLocked as e:
        raise TrainError(str(e)) from None
