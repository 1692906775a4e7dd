"""The Trainer: set-up, the step, evaluation, the loop, checkpoints and rollback.

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

import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.sampler import IGNORE, BatchSampler, count_targets, eval_windows, target_bytes
from rwkvx_c.errors import (
    RunLocked,
    TrainError,
)
from rwkvx_c.interop.source import base_weights
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.run.base import BASE_KEY
from rwkvx_c.run.checkpoint import save_checkpoint
from rwkvx_c.run.lock import RunLock
from rwkvx_c.run.rundir import RunDir
from rwkvx_c.train import schedule
from rwkvx_c.train.accumulate import GradAccumulator
from rwkvx_c.train.assemble import (
    build_model,
    load_data,
    load_pairs,
    load_source,
    load_weights,
    name_base,
    start_from_source,
)
from rwkvx_c.train.base import Decoded
from rwkvx_c.train.config_file import save_config
from rwkvx_c.train.distributed import world
from rwkvx_c.train.finetune import (
    PartsAdamW,
    held_names,
    is_unfrozen,
    saved_params,
    switched,
    trained_tensors,
    unfreeze_due,
)
from rwkvx_c.train.guard import DivergenceGuard
from rwkvx_c.train.keep import Keeper
from rwkvx_c.train.loop import run_loop
from rwkvx_c.train.objectives import PreferenceStep
from rwkvx_c.train.optim import AdamW
from rwkvx_c.train.options import TrainOptions, new_run_hint
from rwkvx_c.train.progress import run_title, watch
from rwkvx_c.train.resume import read_saved, saved_counters
from rwkvx_c.train.trackers import Trackers, open_trackers
from rwkvx_c.train.validate import check_validation, validation_loss

if TYPE_CHECKING:
    from rwkvx_c.data.pipeline import Corpus
    from rwkvx_c.data.tokenizers import Tokenizer
    from rwkvx_c.train.distributed import ProcessGroup
    from rwkvx_c.train.options import ResolvedOptions

# one log row, or one evaluation: JSON values by name
Row = dict[str, Any]

__all__ = ["Trainer"]


class Trainer:
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

    # set up by _setup and its helpers (on every rank)
    opts: ResolvedOptions
    out_dir: str | None           # None on ranks other than 0: they write nothing
    run_dir: RunDir | None        # the same folder's files
    tokenizer: Tokenizer
    corpus: Corpus
    model: _core.RxPtModel
    optim: AdamW | PartsAdamW
    guard: DivergenceGuard
    sampler: BatchSampler
    pref: PreferenceStep | None   # a preference objective's step (rwkvx_c.train.objectives)
    val_x: np.ndarray
    val_y: np.ndarray
    val_bytes: int | None
    last_eval: Row | None
    saved_step: int | None
    _eval_seconds: float | None
    _save_seconds: float | None
    _warm_end: float | None
    _next_eval_at: float | None
    _last_batch: tuple[np.ndarray, np.ndarray] | None
    _accum: GradAccumulator | None
    trackers: Trackers | None = None   # --log-to, on rank 0
    _lock: RunLock | None

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
        if options.init_from and _state is None and _weights is None:
            options, _weights = start_from_source(options, self.group)
        self.opts = options.resolved()
        # every rank reads the run folder (its tokenizer); only rank 0 writes it
        self.out_dir = run_dir if self.group.is_root else None
        self.run_dir = RunDir(self.out_dir) if self.out_dir is not None else None
        self._t0 = time.perf_counter()
        self._prepare_out_dir(_state is None, _weights is not None and not self.opts.init_from)
        threads = self.opts.threads if self.opts.threads is not None \
            else self.group.default_threads()
        if threads is not None:
            _core.set_num_threads(threads)
        self._load_data(run_dir, _state, progress)
        self._build_model(_tensors, _weights)
        self._name_base(_state, _weights)
        self._prepare_batches()
        self._reset_counters()
        if self.pref is not None:
            # the reference's log-probabilities: made now (the weights of step 0) or read back
            self.pref.set_reference(self.model, self.opts.tune, self.run_dir, _state is not None,
                                    self.opts.ref_from)
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
        if self.opts.objective == "lm":
            self.tokenizer, self.corpus = load_data(self.opts, run_dir, self.out_dir, _state,
                                                    progress)
            return
        if self.group.size > 1:
            raise TrainError(f"--objective {self.opts.objective} runs in one process")
        self.tokenizer, self.corpus, train, val = load_pairs(self.opts, run_dir, self.out_dir,
                                                             _state)
        o = self.opts   # the reference comes once the model is there (set_reference)
        self.pref = PreferenceStep(o.objective, o.dpo_beta, o.dpo_label_smoothing, train, val,
                                   o.batch, o.seed)

    def _build_model(self, _tensors: Mapping[str, np.ndarray] | None,
                     _weights: Mapping[str, np.ndarray] | None) -> None:
        self.model, self.optim = build_model(self.opts, self.tokenizer, self.corpus, _tensors,
                                             _weights)
        self.guard = DivergenceGuard(self.opts.model["vocab_size"], self.pref is None)

    def _name_base(self, _state: dict[str, Any] | None,
                   _weights: Mapping[str, np.ndarray] | None) -> None:
        """The base this run's checkpoints name instead of holding it (None:
        they hold every parameter), and the parameter names it has."""
        self.base = name_base(self.opts, _state, _weights, self.group.is_root)
        self._base_names = frozenset(_weights or ())

    def _prepare_batches(self) -> None:
        """The training batch sampler, this rank's rows, and the validation windows."""
        opts = self.opts
        if self.pref is not None:   # no windows: the pairs' own batches
            self.val_x = self.val_y = self.pref.val.x
            self.val_bytes = None
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
            check_validation(len(self.val_x), opts.eval_tokens, opts.seq_len)

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

    def _restore(self, state: dict[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        # a different number of ranks sums the gradients in another order: not the same run
        ranks = state.get("world_size", 1)
        if ranks != self.group.size:
            raise TrainError(f"the run was trained on {ranks} process(es) and this is "
                             f"{self.group.size}; resume it with the same number "
                             f"(mpiexec -n {ranks}), or {new_run_hint(self.out_dir or 'RUN')}")
        if not self.corpus.described_as(state.get("corpus")):
            raise TrainError(f"the corpus changed since the checkpoint: it was "
                             f"{state.get('corpus')}, it is now {self.corpus.description}; "
                             f"{new_run_hint(self.out_dir or 'RUN')}")
        c = saved_counters(state)
        self.keeper.restore(state.get("keeper"))
        # the side of the base-unfreeze first: past it a LoRA run's checkpoint
        # holds the merged base and no adapters, before it both
        partial = state.get(BASE_KEY) is not None
        if partial and is_unfrozen(self.optim) and not state.get("unfrozen"):
            self._reload_base()   # a rollback to before the switch: the base as it began
        self.optim = switched(self.model, self.optim, self.opts, bool(state.get("unfrozen")))
        self._load_params(tensors, partial)
        n = self.optim.m.size
        for key, buf in (("optim.m", self.optim.m), ("optim.v", self.optim.v)):
            if key not in tensors or tensors[key].shape != (n,):
                raise TrainError(f"checkpoint lacks the optimiser state {key}")
            buf[...] = tensors[key]
        try:
            (self.pref or self.sampler).set_state(state["sampler"])
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            raise TrainError(f"the checkpoint holds a bad sampler state ({type(e).__name__}: "
                             f"{e})") from None
        self.optim.t, self.step_count = c["optim_t"], c["step"]
        self.elapsed, self.tokens_seen = c["elapsed"], c["tokens_seen"]
        self._warm_end, self._next_eval_at = c["warm_end"], c["next_eval_at"]
        self.last_eval, self._eval_seconds = c["last_eval"], c["eval_seconds"]
        self.lr_scale, self.rollbacks = c["lr_scale"], c["rollbacks"]
        self.saved_step = self.step_count
        if self.run_dir is not None:
            self.run_dir.truncate_log(self.step_count)

    def _load_params(self, tensors: Mapping[str, np.ndarray], partial: bool = False) -> None:
        """The checkpoint's parameters into the model: every one, or (partial:
        a checkpoint naming its base, which the model was built from) the
        ones it holds, which must include every one that trains."""
        load_weights(self.model, tensors,
                     held_names(self.model, self.opts, tensors) if partial else None)

    def _reload_base(self) -> None:
        """The base's weights into the model again, as the run began."""
        assert self.base is not None
        _, weights = base_weights(self.base, str(self.out_dir), None, TrainError)
        load_source(self.model, weights)

    def _names_base(self) -> bool:
        """True when the next checkpoint names the base instead of holding it."""
        return self.base is not None and not is_unfrozen(self.optim)

    def state(self) -> dict[str, Any]:
        """The JSON-serialisable run state a checkpoint stores."""
        return {"step": self.step_count, "optim_t": self.optim.t,
                "elapsed": self.train_seconds(), "tokens_seen": self.tokens_seen,
                "sampler": (self.pref or self.sampler).state(), "warm_end": self._warm_end,
                "next_eval_at": self._next_eval_at, "last_eval": self.last_eval,
                "eval_seconds": self._eval_seconds, "options": self.opts.stored(),
                "corpus": self.corpus.description, "tokenizer": self.tokenizer.identity(),
                "world_size": self.group.size, "unfrozen": is_unfrozen(self.optim),
                "lr_scale": self.lr_scale, "rollbacks": self.rollbacks,
                BASE_KEY: self.base if self._names_base() else None,
                "keeper": self.keeper.state()}

    def save(self, path: str | None = None) -> str | None:
        """Write the checkpoint (params, AdamW moments, run state) atomically.

        Defaults to out_dir/checkpoint.safetensors; returns the path (None on
        ranks other than 0, which write nothing). A model with a non-finite
        parameter or a loss above the uniform-guess bound (rwkvx_c.train.guard) is
        never written: Divergence instead."""
        if not self.group.is_root:
            return None
        if path is None:
            if self.run_dir is None:
                raise TrainError("save() needs a path when the trainer has no out_dir")
            path = self.run_dir.checkpoint
        t = time.perf_counter()
        self._check_saveable()
        tensors = saved_params(self.model, self.opts,
                               self._base_names if self._names_base() else None)
        tensors["optim.m"] = self.optim.m
        tensors["optim.v"] = self.optim.v
        tensors.update(trained_tensors(self.model))
        # a frozen base's matrices are not in the arena: decoded for the
        # file one at a time, as it is written
        save_checkpoint(path, Decoded(self.model, tensors),
                        ModelConfig.stored(self.model.config), self.state())
        if self.run_dir is not None and path == self.run_dir.checkpoint:
            self.saved_step = self.step_count
            self.keeper.snapshot(self.run_dir, self.step_count)
        self._save_seconds = max(self._save_seconds or 0.0, time.perf_counter() - t)
        return path

    def _check_saveable(self) -> None:
        """Divergence unless the model as it is now (after its last update)
        is finite and not worse than the uniform guess: on the validation
        loss of this step when there is one, else on the loss of the last
        training batch, recomputed (one forward)."""
        self.guard.check_params(self.model.param_buffer, self.step_count)
        if self.last_eval is not None and self.last_eval["step"] == self.step_count:
            self.guard.check_eval(self.last_eval["val_loss"], self.step_count)
        elif self._last_batch is not None:
            x, y = self._last_batch   # its first micro-batch: the model's acts fit it
            B = self.opts.batch
            self.model.forward(x[:B], return_logits=False)
            self.guard.check_eval(self.model.loss(y[:B], IGNORE), self.step_count)

    # --------------------------------------------------------------- training
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
        extra: Row = {}
        share = None
        if self.pref is not None:
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
            row = self.pref.evaluate(self.model)
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

    # ------------------------------------------------------------------- log
    def log(self, row: Row) -> None:
        """Append one JSON row to out_dir/log.jsonl."""
        if self.run_dir is not None:
            self.run_dir.append_log([{**row, "world_size": self.group.size}])
        if self.trackers is not None:
            self.trackers.log(row)

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
