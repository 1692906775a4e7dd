"""Pretraining driver: presets, the Trainer API and its run loop.

A script drives training step by step::

    from rwkvx_c.train import Trainer, TrainOptions
    tr = Trainer(TrainOptions(preset="tiny", steps=200), out_dir="runs/demo")
    while not tr.done():
        row = tr.step()              # {'step', 'loss', 'lr', 'tokens_per_s', ...}
    print(tr.evaluate())             # {'val_loss', 'val_bpb'}
    tr.save()                        # DIR/checkpoint.safetensors
    tr = Trainer.resume("runs/demo", steps=400)   # continue exactly

One step: B windows of T+1 tokens from the seeded sampler -> model.forward
(B, T) -> model.backward (mean loss over B*T tokens, grads summed over the
batch, all in C) -> global grad-norm clipping -> AdamW in place on the
parameter arena. Nothing is copied on this path.

Under MPI (``mpiexec -n P``; rwkvx_c/distributed.py) every rank trains on
its B/P rows of the same global batch and the gradients are averaged in place
before the optimiser, so P ranks train the one-process model; only rank 0
writes the run folder.

Determinism: a resumed run repeats the uninterrupted run's losses bit for
bit, on any thread count, when its schedule is by steps (--steps). A
wall-clock budget (--time-budget) schedules the learning rate by elapsed
time, which no run can repeat exactly; it still resumes where it stopped,
with the time already spent counted.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from rwkvx_c import _core, memcheck
from rwkvx_c.atomic import replacing
from rwkvx_c.checkpoint import CheckpointError, read_checkpoint, save_checkpoint
from rwkvx_c.data import BatchSampler, eval_windows, load_corpus
from rwkvx_c.distributed import world
from rwkvx_c.guard import (
    MAX_ROLLBACKS,
    ON_DIVERGENCE,
    ROLLBACK_LR_FACTOR,
    Divergence,
    DivergenceGuard,
)
from rwkvx_c.init import SCHEMES, init_model
from rwkvx_c.optim import AdamW, decay_ranges, lr_at
from rwkvx_c.presets import PRESETS
from rwkvx_c.runlock import RunLock, RunLocked
from rwkvx_c.tokenizer import TokenizerError, check_identity, run_tokenizer
from rwkvx_c.tokenizer import load as load_tokenizer

if TYPE_CHECKING:
    from rwkvx_c.data import Corpus
    from rwkvx_c.distributed import ProcessGroup
    from rwkvx_c.tokenizer import Tokenizer

# one log row, or one evaluation: JSON values by name
Row = dict[str, Any]

__all__ = ["PRESETS", "TrainOptions", "Trainer", "TrainError", "CHECKPOINT", "LOG"]

CHECKPOINT = "checkpoint.safetensors"
LOG = "log.jsonl"


def auto_precision() -> str:
    """What --precision auto means on this CPU: bf16 where the bf16 GEMM runs
    on AMX tiles, fp32 elsewhere. Measured on a Sapphire Rapids: the AMX
    kernel makes a training step 2-2.7x faster at 1 thread, while this
    library's AVX512-BF16 kernel runs at 0.6-0.7x of its fp32 AVX-512 GEMM,
    so bf16 there would only lose precision and time (README, bf16)."""
    return "bf16" if _core.gemm_kernel("bf16") == "amx-bf16" else "fp32"


class TrainError(ValueError):
    """A training setup that cannot run (bad option, data, checkpoint or resume)."""


def rwkv7_lora_sizes(n_embd: int) -> tuple[int, int, int, int]:
    """(Dw, Da, Dv, Dg): the LoRA sizes RWKV-LM's x070 suggests for a width,
    max(32, round(f * sqrt(C) / 32) * 32) with f = 2.5, 2.5, 1.7, 5."""
    def size(f: float) -> int:
        return max(32, int(round(f * n_embd ** 0.5 / 32) * 32))
    return size(2.5), size(2.5), size(1.7), size(5.0)


def shape_overrides(preset: str = "default", *, n_embd: int | None = None,
                    head_size: int | None = None, n_layer: int | None = None,
                    n_attn_layer: int | None = None, ffn_dim: int | None = None,
                    chunk_size: int | None = None, moba_top_k: int | None = None,
                    d_decay: int | None = None, d_aaa: int | None = None,
                    d_mv: int | None = None, d_gate: int | None = None) -> dict[str, int]:
    """The model-config overrides of the model-shape options (None: the
    preset's value). A new width brings its own defaults: ffn_dim 4*n_embd
    and the RWKV-7 LoRA sizes of rwkv7_lora_sizes. TrainError on a shape
    that cannot be built."""
    if preset not in PRESETS:
        raise TrainError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[preset]["model"]
    out: dict[str, int] = {}
    C = base["n_embd"] if n_embd is None else n_embd
    N = base["head_size"] if head_size is None else head_size
    for name, v, least in (("n_embd", n_embd, 1), ("head_size", head_size, 1),
                           ("n_layer", n_layer, 1), ("n_attn_layer", n_attn_layer, 0),
                           ("ffn_dim", ffn_dim, 1), ("chunk_size", chunk_size, 1),
                           ("moba_top_k", moba_top_k, 0), ("d_decay", d_decay, 1),
                           ("d_aaa", d_aaa, 1), ("d_mv", d_mv, 1), ("d_gate", d_gate, 1)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):
            raise TrainError(f"{name} must be an integer >= {least}, got {v!r}")
    if C % N:
        raise TrainError(f"n_embd {C} is not a multiple of head_size {N}")
    if n_embd is not None or head_size is not None:
        out.update(n_embd=C, head_size=N, n_head=C // N)
    if n_embd is not None:
        Dw, Da, Dv, Dg = rwkv7_lora_sizes(C)
        out.update(ffn_dim=4 * C, Dw=Dw, Da=Da, Dv=Dv, Dg=Dg)
    n_r = base["n_rwkv_layer"] if n_layer is None else n_layer
    n_a = base["n_attn_layer"] if n_attn_layer is None else n_attn_layer
    if n_a > n_r:
        raise TrainError(f"n_attn_layer {n_a} exceeds n_layer {n_r} (one attention block "
                         "follows each group of RWKV blocks)")
    for key, v in (("n_rwkv_layer", n_layer), ("n_attn_layer", n_attn_layer),
                   ("ffn_dim", ffn_dim), ("chunk_size", chunk_size), ("moba_top_k", moba_top_k),
                   ("Dw", d_decay), ("Da", d_aaa), ("Dv", d_mv), ("Dg", d_gate)):
        if v is not None:
            out[key] = v
    return out


@dataclass
class TrainOptions:
    """Everything that defines a run. None means "the preset's value".

    steps / time_budget: stop after this many optimiser steps / this many
    minutes of wall-clock for the whole run, final evaluation and checkpoint
    included (whichever comes first). With steps the learning-rate schedule
    runs over steps; with only a time budget it runs over elapsed time.
    """
    preset: str = "default"
    data: str | list[str] | None = None  # None: the standard library; a list: several paths
    tokenizer: str = "byte"       # "byte", "world" or a tokenizer.json path (rwkvx_c.tokenizer)
    text_field: str = "text"      # the text of a .jsonl record
    steps: int | None = None
    time_budget: float | None = None     # minutes
    batch: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    adam_eps: float = 1e-8
    threads: int | None = None           # None: OMP_NUM_THREADS or every core
    seed: int = 0
    eval_every: int | None = None        # steps; None: 10 evaluations over the run
    eval_tokens: int = 32768
    save_every: int | None = None        # steps; None: at every evaluation
    init: str = "rwkv7"
    model: dict[str, int] | None = field(default=None)  # overrides of the preset's model config
    cache_dir: str | None = None
    precision: str = "fp32"       # "fp32", "bf16", or "auto": bf16 on bf16 hardware
    on_divergence: str = "stop"   # or "rollback" (rwkvx_c.guard)

    # options a resumed run may change without changing what it computes
    RESUMABLE = ("steps", "time_budget", "eval_every", "save_every", "threads", "cache_dir",
                 "on_divergence")

    def resolved(self) -> ResolvedOptions:
        """A copy with every preset default filled in and every value checked."""
        if self.preset not in PRESETS:
            raise TrainError(f"unknown preset {self.preset!r}; choose one of "
                             f"{', '.join(PRESETS)}")
        p = PRESETS[self.preset]
        o = TrainOptions(**{f.name: getattr(self, f.name) for f in fields(self)})
        for k in ("batch", "seq_len", "lr", "warmup_steps"):
            if getattr(o, k) is None:
                setattr(o, k, p[k])
        if o.steps is None and o.time_budget is None:
            o.time_budget = p.get("time_budget")
            if o.time_budget is None:
                o.steps = 1000
        model = dict(p["model"])
        if o.model:
            unknown = set(o.model) - set(model)
            if unknown:
                raise TrainError(f"unknown model config keys: {', '.join(sorted(unknown))}")
            model.update(o.model)
        o.model = model
        if o.precision == "auto":
            o.precision = auto_precision()
        o._check()
        return cast("ResolvedOptions", o)

    def _check(self) -> None:
        def pos(name: str, v: Any, integer: bool = True, allow_zero: bool = False) -> None:
            ok = isinstance(v, (int, np.integer)) and not isinstance(v, bool) if integer \
                else isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)
            if not ok or v < 0 or (v == 0 and not allow_zero):
                kind = "an integer" if integer else "a number"
                raise TrainError(f"{name} must be {kind} {'>= 0' if allow_zero else '> 0'}, "
                                 f"got {v!r}")
        if self.steps is not None:
            pos("steps", self.steps)
        if self.time_budget is not None:
            pos("time_budget", self.time_budget, integer=False)
        pos("batch", self.batch)
        pos("seq_len", self.seq_len)
        pos("lr", self.lr, integer=False)
        pos("warmup_steps", self.warmup_steps, allow_zero=True)
        pos("eval_tokens", self.eval_tokens)
        pos("weight_decay", self.weight_decay, integer=False, allow_zero=True)
        pos("grad_clip", self.grad_clip, integer=False, allow_zero=True)
        pos("adam_eps", self.adam_eps, integer=False, allow_zero=True)
        def real(v: object) -> bool:
            return isinstance(v, (int, float, np.floating)) and not isinstance(v, bool)
        if not (real(self.min_lr_frac) and 0.0 <= self.min_lr_frac <= 1.0):
            raise TrainError(f"min_lr_frac must lie in [0, 1], got {self.min_lr_frac!r}")
        for b in ("beta1", "beta2"):
            if not (real(getattr(self, b)) and 0.0 <= getattr(self, b) < 1.0):
                raise TrainError(f"{b} must lie in [0, 1), got {getattr(self, b)!r}")
        for k in ("eval_every", "save_every", "threads"):
            if getattr(self, k) is not None:
                pos(k, getattr(self, k))
        if not isinstance(self.seed, int) or self.seed < 0:
            raise TrainError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.precision not in ("fp32", "bf16"):
            raise TrainError(f"precision must be fp32, bf16 or auto, got {self.precision!r}")
        paths = self.data if isinstance(self.data, (list, tuple)) else [self.data]
        for k, v in [("data", p) for p in paths] + [("cache_dir", self.cache_dir)]:
            if v is not None and not isinstance(v, str):
                raise TrainError(f"{k} must be a path, got {v!r}")
        if self.on_divergence is None:
            self.on_divergence = "stop"
        if self.on_divergence not in ON_DIVERGENCE:
            raise TrainError(f"unknown on_divergence {self.on_divergence!r}; choose one of "
                             f"{', '.join(ON_DIVERGENCE)}")
        if self.threads is not None and self.threads > _core.MAX_THREADS:
            raise TrainError(f"threads must be at most {_core.MAX_THREADS}, got {self.threads}")
        if self.init not in SCHEMES:
            raise TrainError(f"unknown init {self.init!r}; choose one of {', '.join(SCHEMES)}")
        assert self.batch is not None and self.seq_len is not None   # pos() checked them
        if self.batch * self.seq_len > 2 ** 31 - 1:
            raise TrainError("batch * seq_len exceeds 2**31 - 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


if TYPE_CHECKING:
    class ResolvedOptions(TrainOptions):
        """The type of TrainOptions.resolved(): the preset's values filled in."""
        batch: int
        seq_len: int
        lr: float
        warmup_steps: int
        model: dict[str, int]


def _cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean cross-entropy of (B, T, V) logits against (B, T) targets, in C."""
    V = logits.shape[-1]
    return _core.cross_entropy_forward(logits.reshape(-1, V), targets.reshape(-1))


class Trainer:
    """A training run in out_dir: model, optimiser, data, schedule, log.

    Trainer(options, out_dir) starts a new run (out_dir must not hold a
    checkpoint yet); Trainer.resume(out_dir, **changes) continues one.
    Methods: step(), evaluate(), save(), done(), run(), close().

    group: the data-parallel process group (default: rwkvx_c.distributed.world(),
    a no-op in a plain run). Under MPI each rank computes its rows of every
    batch and only rank 0 touches out_dir; see docs/distributed.md.
    While it lives (until close() or the end of run()) rank 0 holds the run
    folder's lock (rwkvx_c.runlock).
    """

    # set up by _setup and its helpers (on every rank)
    opts: ResolvedOptions
    out_dir: str | None           # None on ranks other than 0: they write nothing
    tokenizer: Tokenizer
    corpus: Corpus
    model: _core.RxPtModel
    optim: AdamW
    guard: DivergenceGuard
    sampler: BatchSampler
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
    _lock: RunLock | None

    def __init__(self, options: TrainOptions | None = None, out_dir: str | None = None, *,
                 group: ProcessGroup | None = None, progress: bool = False,
                 _state: dict[str, Any] | None = None,
                 _tensors: Mapping[str, np.ndarray] | None = None,
                 _weights: Mapping[str, np.ndarray] | None = None,
                 _lock: RunLock | None = None) -> None:
        self.group = world() if group is None else group
        self._lock = _lock
        try:
            # an error on any rank raises on every rank: none is left waiting
            self.group.agree(self._setup, options, out_dir, _state, _tensors, _weights,
                             progress and self.group.is_root)
            self.group.broadcast_(self.model.param_buffer)
        except BaseException:
            self.close()
            raise

    def _setup(self, options: TrainOptions | None, run_dir: str | None,
               _state: dict[str, Any] | None, _tensors: Mapping[str, np.ndarray] | None,
               _weights: Mapping[str, np.ndarray] | None, progress: bool) -> None:
        self.opts = (options or TrainOptions()).resolved()
        # every rank reads the run folder (its tokenizer); only rank 0 writes it
        self.out_dir = run_dir if self.group.is_root else None
        self._t0 = time.perf_counter()
        self._prepare_out_dir(new=_state is None, imported=_weights is not None)
        threads = self.opts.threads if self.opts.threads is not None \
            else self.group.default_threads()
        if threads is not None:
            _core.set_num_threads(threads)
        self._load_data(run_dir, _state, progress)
        self._build_model(_tensors, _weights)
        self._prepare_batches()
        self._reset_counters()
        if _state is not None:
            self._restore(_state, _tensors or {})
        # the budget counts this session's set-up (corpus, model) too
        self._session_start = self._t0

    def _prepare_out_dir(self, new: bool, imported: bool) -> None:
        """Lock the run folder (rank 0), refuse to start over a saved run,
        and drop the log of a run that never saved."""
        out_dir = self.out_dir
        if out_dir is None:
            return
        if self._lock is None:
            self._lock = _take_lock(out_dir)
        if new and not imported and os.path.exists(os.path.join(out_dir, CHECKPOINT)):
            raise TrainError(f"{out_dir} already holds a run; use resume (--resume) "
                             "or another output folder")
        os.makedirs(out_dir, exist_ok=True)
        if new and os.path.exists(os.path.join(out_dir, LOG)):
            os.unlink(os.path.join(out_dir, LOG))  # rows of a run that never saved

    def _load_data(self, run_dir: str | None, _state: dict[str, Any] | None,
                   progress: bool) -> None:
        """The tokenizer (a resumed run's own) and the corpus it reads."""
        opts = self.opts
        try:
            self.tokenizer = (run_tokenizer(run_dir, _state.get("tokenizer"))
                              if _state is not None and run_dir is not None
                              else load_tokenizer(opts.tokenizer))
        except TokenizerError as e:
            raise TrainError(str(e)) from None
        if self.out_dir is not None and _state is None:
            self.tokenizer.save(self.out_dir)   # a tokenizer.json travels with the run
        try:
            self.corpus = load_corpus(opts.data, seq_len=opts.seq_len, cache_dir=opts.cache_dir,
                                      tokenizer=self.tokenizer, text_field=opts.text_field,
                                      progress=progress)
        except OSError as e:
            raise TrainError(f"cannot prepare the corpus: {e}") from None

    def _build_model(self, _tensors: Mapping[str, np.ndarray] | None,
                     _weights: Mapping[str, np.ndarray] | None) -> None:
        """The model (checked to fit in memory), its first weights and the optimiser."""
        opts = self.opts
        if self.tokenizer.name != "byte":  # the model's vocabulary is the tokenizer's
            opts.model["vocab_size"] = self.tokenizer.vocab_size
        cfg = dict(opts.model)
        if self.corpus.vocab_size > cfg["vocab_size"]:
            raise TrainError(f"the corpus has {self.corpus.vocab_size} token ids but the model's "
                             f"vocab_size is {cfg['vocab_size']}")
        try:
            _core.check_config(cfg)
            memcheck.check(memcheck.param_bytes(memcheck.estimate_params(cfg)),
                           "the model with its optimiser state", "choose a smaller --preset")
            self.model = _core.RxPtModel(cfg, seed=opts.seed, precision=opts.precision)
        except memcheck.MemoryTooSmall as e:
            raise TrainError(str(e)) from None
        except (TypeError, ValueError) as e:
            raise TrainError(f"bad model config: {e}") from None
        self._check_memory()
        if _weights is not None:   # an imported model: its weights, a fresh optimiser
            self._load_params(_weights)
        elif _tensors is None:
            init_model(self.model, opts.init, seed=opts.seed)
        self.optim = AdamW(self.model.param_buffer, self.model.grad_buffer,
                           decay_ranges(self.model), betas=(opts.beta1, opts.beta2),
                           eps=opts.adam_eps, weight_decay=opts.weight_decay,
                           grad_clip=opts.grad_clip)
        self.guard = DivergenceGuard(cfg["vocab_size"])

    def _prepare_batches(self) -> None:
        """The training batch sampler, this rank's rows, and the validation windows."""
        opts = self.opts
        # every rank draws the global batch and trains on its rows of it
        self.sampler = BatchSampler(self.corpus.train, opts.batch, opts.seq_len, opts.seed)
        self._rows = self.group.rows(opts.batch)
        self.val_x, self.val_y = eval_windows(self.corpus.val, opts.seq_len,
                                              max(1, opts.eval_tokens // opts.seq_len))
        # val_bpb divides by the text bytes the validation targets decode to
        tb = self.corpus.token_bytes
        self.val_bytes = int(tb[self.val_y].sum()) if tb is not None else \
            self.val_y.size if self.corpus.is_bytes else None

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

    def _check_memory(self) -> None:
        """Refuses (TrainError) a batch whose step would not fit in memory."""
        o = self.opts
        params = memcheck.param_bytes(self.model.n_params)
        rough = memcheck.ROUGH_MARGIN * memcheck.rough_bytes_per_token(o.model)
        if memcheck.fits(params + rough * o.batch * o.seq_len):
            return   # far from the limit: not worth the measuring steps
        per_tok = memcheck.acts_bytes_per_token(self.model)
        need = params + per_tok * o.batch * o.seq_len
        try:
            memcheck.check(need, f"a step of batch {o.batch} x seq_len {o.seq_len} "
                           f"({per_tok:,} bytes of activations per token)",
                           "lower --batch or --seq-len")
        except memcheck.MemoryTooSmall as e:
            raise TrainError(str(e)) from None

    def close(self) -> None:
        """Release the run folder's lock (idempotent)."""
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
            return cls._resume(out_dir, lock, group, progress, changes)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    @classmethod
    def _resume(cls, out_dir: str, lock: RunLock | None, group: ProcessGroup, progress: bool,
                changes: dict[str, Any]) -> Trainer:
        path = os.path.join(out_dir, CHECKPOINT)
        try:
            tensors, config, state = group.on_root(read_checkpoint, path)
        except CheckpointError as e:
            raise TrainError(str(e)) from None
        saved = state.get("options")
        if not isinstance(saved, dict) and state.get("imported_from"):
            # weights only (rwkvx-c import): a new run starts from them
            kw = {k: v for k, v in changes.items() if v is not None}
            if state.get("tokenizer") and "tokenizer" not in kw:
                kw["tokenizer"] = state["tokenizer"]["name"]   # an imported World model
            return cls(TrainOptions(**{**kw, "model": dict(config)}), out_dir, group=group,
                       progress=progress, _weights=tensors, _lock=lock)
        opts = _saved_options(saved, path)
        config = {"ln0": 0, **config}   # as in _saved_options
        _apply_changes(opts, changes, state.get("tokenizer"), out_dir)
        if config != opts.model:
            raise TrainError(f"checkpoint {path} is inconsistent: its model config differs "
                             "from its saved options")
        return cls(opts, out_dir, group=group, progress=progress, _state=state, _tensors=tensors,
                   _lock=lock)

    def _restore(self, state: dict[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        # a different number of ranks sums the gradients in another order: not the same run
        ranks = state.get("world_size", 1)
        if ranks != self.group.size:
            raise TrainError(f"the run was trained on {ranks} process(es) and this is "
                             f"{self.group.size}; resume it with the same number "
                             f"(mpiexec -n {ranks}), or start a new run")
        try:
            self._restore_state(state, tensors)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            if isinstance(e, TrainError):
                raise
            raise TrainError(f"the checkpoint holds a bad run state ({type(e).__name__}: "
                             f"{e})") from None

    def _restore_state(self, state: dict[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        if state.get("corpus") != self.corpus.description:
            raise TrainError(f"the corpus changed since the checkpoint: it was "
                             f"{state.get('corpus')}, it is now {self.corpus.description}")
        self._load_params(tensors)
        n = self.model.n_params
        for key, buf in (("optim.m", self.optim.m), ("optim.v", self.optim.v)):
            if key not in tensors or tensors[key].shape != (n,):
                raise TrainError(f"checkpoint lacks the optimiser state {key}")
            buf[...] = tensors[key]
        self.optim.t = _count(state["optim_t"], "optim_t")
        self.step_count = _count(state["step"], "step")
        self.elapsed = _seconds(state["elapsed"], "elapsed")
        self.tokens_seen = _count(state["tokens_seen"], "tokens_seen")
        self.sampler.set_state(state["sampler"])
        self._warm_end = _maybe_seconds(state.get("warm_end"), "warm_end")
        self._next_eval_at = _maybe_seconds(state.get("next_eval_at"), "next_eval_at")
        last = state.get("last_eval")
        if last is not None:
            last = {"step": _count(last["step"], "last_eval.step"),
                    "val_loss": float(last["val_loss"]),
                    "val_bpb": None if last.get("val_bpb") is None else float(last["val_bpb"])}
        self.last_eval = last
        self._eval_seconds = _maybe_seconds(state.get("eval_seconds"), "eval_seconds")
        self.lr_scale = float(state.get("lr_scale", 1.0))
        if not 0.0 < self.lr_scale <= 1.0:
            raise TrainError(f"the checkpoint's lr_scale {self.lr_scale!r} is not in (0, 1]")
        self.rollbacks = _count(state.get("rollbacks", 0), "rollbacks")
        self.saved_step = self.step_count
        if self.out_dir:
            self._truncate_log(self.step_count)

    def _load_params(self, tensors: Mapping[str, np.ndarray]) -> None:
        names = self.model.param_names
        missing = [n for n in names if n not in tensors]
        if missing:
            raise TrainError(f"checkpoint lacks tensor {missing[0]}")
        for n in names:
            view = self.model.params[n]
            if tensors[n].shape != view.shape:
                raise TrainError(f"checkpoint tensor {n} has shape {tensors[n].shape}, the model "
                                 f"expects {view.shape}")
            view[...] = tensors[n]

    def state(self) -> dict[str, Any]:
        """The JSON-serialisable run state a checkpoint stores."""
        return {"step": self.step_count, "optim_t": self.optim.t,
                "elapsed": self.train_seconds(), "tokens_seen": self.tokens_seen,
                "sampler": self.sampler.state(), "warm_end": self._warm_end,
                "next_eval_at": self._next_eval_at, "last_eval": self.last_eval,
                "eval_seconds": self._eval_seconds, "options": self.opts.to_dict(),
                "corpus": self.corpus.description, "tokenizer": self.tokenizer.identity(),
                "world_size": self.group.size,
                "lr_scale": self.lr_scale, "rollbacks": self.rollbacks}

    def save(self, path: str | None = None) -> str | None:
        """Write the checkpoint (params, AdamW moments, run state) atomically.

        Defaults to out_dir/checkpoint.safetensors; returns the path (None on
        ranks other than 0, which write nothing). A model with a non-finite
        parameter or a loss above the uniform-guess bound (rwkvx_c.guard) is
        never written: Divergence instead."""
        if not self.group.is_root:
            return None
        if path is None:
            if self.out_dir is None:
                raise TrainError("save() needs a path when the trainer has no out_dir")
            path = os.path.join(self.out_dir, CHECKPOINT)
        t = time.perf_counter()
        self._check_saveable()
        tensors = dict(self.model.params)
        tensors["optim.m"] = self.optim.m
        tensors["optim.v"] = self.optim.v
        save_checkpoint(path, tensors, self.model.config, self.state())
        if self.out_dir is not None and path == os.path.join(self.out_dir, CHECKPOINT):
            self.saved_step = self.step_count
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
            x, y = self._last_batch
            loss = _cross_entropy(self.model.forward(x), y)
            self.guard.check_eval(loss, self.step_count)

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
        ev = self._eval_seconds
        if ev is None:  # no evaluation yet: assume the forward runs 3x a train step's speed
            tps = self.tokens_seen / max(self.train_seconds(), 1e-9) if self.tokens_seen else 0
            ev = 3.0 if not tps else self.val_x.size / (3.0 * tps)
        sv = self._save_seconds if self._save_seconds is not None else 0.5
        return 1.25 * (ev + sv) + 1.0

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
            p = (s - o.warmup_steps) / max(o.steps - o.warmup_steps, 1)
        else:
            t = self.train_seconds()
            t0 = self._warm_end or 0.0
            end = self._time_budget_s() - self._reserve_s()
            p = (t - t0) / max(end - t0, 1e-9)
        return self.lr_scale * lr_at(s, p, lr=o.lr, warmup_steps=o.warmup_steps,
                                     min_lr_frac=o.min_lr_frac)

    def done(self) -> bool:
        """True once the step count or the time budget is used up (a run
        takes at least one step). Rank 0's clock decides for every rank."""
        return self.group.root_value(self._done())

    def _done(self) -> bool:
        if self.step_count == 0:
            return False
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
        x, y = self.sampler.next()
        self._last_batch = (x, y)
        lo, hi = self._rows
        self.model.forward(x[lo:hi], return_logits=False)
        loss = self.model.backward(y[lo:hi])
        loss = self.group.average_grads(self.model.grad_buffer, loss)
        self.guard.check_loss(loss, self.step_count + 1)
        try:
            norm = self.optim.step(lr)
        except FloatingPointError:
            raise Divergence(self.step_count + 1, "the gradient norm is not finite") from None
        self.step_count += 1
        self.tokens_seen += x.size
        if self.step_count == self.opts.warmup_steps:
            self._warm_end = self.train_seconds()
        dt = time.perf_counter() - t
        return {"step": self.step_count, "loss": float(loss), "lr": lr,
                "tokens_per_s": x.size / dt, "grad_norm": norm,
                "elapsed": round(self.train_seconds(), 3)}

    def evaluate(self) -> Row:
        """Mean validation loss over the fixed validation windows (up to
        eval_tokens tokens), and bits per byte of text: the loss summed in
        nats over every target token / (ln 2 * the UTF-8 bytes those tokens
        decode to), comparable across tokenizers (None for token files of
        unknown vocabulary).
        Touches neither the parameters nor the training data stream."""
        t = time.perf_counter()
        lo, hi = self._rows
        B = hi - lo
        first, last = self.group.split(len(self.val_x))
        total, n = 0.0, 0.0
        for i in range(first, last, B):
            x = np.ascontiguousarray(self.val_x[i:min(i + B, last)])
            y = np.ascontiguousarray(self.val_y[i:min(i + B, last)])
            logits = self.model.forward(x)
            total += _cross_entropy(logits, y) * y.size
            n += y.size
        total, n = self.group.sum_values(total, n)
        val = total / n
        bpb = total / (math.log(2) * self.val_bytes) if self.val_bytes else None
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
        if o.eval_every is not None:
            return self.step_count % o.eval_every == 0
        if o.steps is not None:
            return self.step_count % max(1, o.steps // 10) == 0
        budget = self._time_budget_s()
        if self._next_eval_at is None:
            self._next_eval_at = budget / 10.0
        if self.train_seconds() >= self._next_eval_at:
            while self._next_eval_at <= self.train_seconds():
                self._next_eval_at += budget / 10.0
            return True
        return False

    def save_due(self, evaluated: bool) -> bool:
        if self.opts.save_every is not None:
            return self.step_count % self.opts.save_every == 0
        return evaluated

    # ------------------------------------------------------------------- log
    def _log_path(self) -> str | None:
        return os.path.join(self.out_dir, LOG) if self.out_dir else None

    def log(self, row: Row) -> None:
        """Append one JSON row to out_dir/log.jsonl."""
        p = self._log_path()
        if p:
            with open(p, "a") as f:
                f.write(json.dumps({**row, "world_size": self.group.size}) + "\n")

    def _truncate_log(self, step: int) -> None:
        """Drop log rows past `step` (work after the checkpoint that is redone)."""
        p = self._log_path()
        if not p or not os.path.exists(p):
            return
        keep = []
        with open(p) as f:
            for line in f:
                try:
                    if json.loads(line).get("step", 0) <= step:
                        keep.append(line if line.endswith("\n") else line + "\n")
                except ValueError:
                    continue
        with replacing(p, "w") as f:
            f.writelines(keep)

    def read_log(self) -> list[Row]:
        """The rows of out_dir/log.jsonl."""
        p = self._log_path()
        if not p or not os.path.exists(p):
            return []
        with open(p) as f:
            return [json.loads(line) for line in f if line.strip()]

    # ------------------------------------------------------------------- loop
    def run(self, on_step: Callable[[Row], object] | None = None,
            stop: Callable[[], bool] | None = None) -> Row:
        """Train until done(): periodic evaluation, checkpoints and log rows,
        then a final evaluation, checkpoint and log row. on_step(row) sees
        every row; stop() returning True ends the run early (with the final
        evaluation and checkpoint). Returns the final evaluation.

        A divergence (rwkvx_c.guard) stops the run with Divergence, whose
        message says what happened to the checkpoint; with on_divergence
        "rollback" the run instead reloads its last checkpoint, multiplies
        the learning rate by ROLLBACK_LR_FACTOR and goes on, up to
        MAX_ROLLBACKS times. The run folder's lock is released on return."""
        try:
            return self._run(on_step, stop)
        finally:
            self.close()

    def _diverged(self, e: Divergence) -> None:
        """Rolls back after Divergence e when allowed, else re-raises it with
        the checkpoint's fate in its message."""
        path = os.path.join(self.out_dir, CHECKPOINT) if self.out_dir else None
        have = path is not None and self.saved_step is not None and os.path.exists(path)
        # under MPI only rank 0 holds the checkpoint: every rank stops instead
        if self.opts.on_divergence == "rollback" and path is not None and have \
                and self.rollbacks < MAX_ROLLBACKS and self.group.size == 1:
            # the checkpoint's own count and scale are older than this session's
            elapsed, start = self.elapsed, self._session_start
            rollbacks, lr_scale = self.rollbacks, self.lr_scale
            tensors, _, state = read_checkpoint(path)
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

    def _run(self, on_step: Callable[[Row], object] | None,
             stop: Callable[[], bool] | None) -> Row:
        while not self.done():
            if stop is not None and stop():
                break
            self._train_step(on_step)
        if self.last_eval is None or self.last_eval["step"] != self.step_count:
            final = self.evaluate()
            try:
                self.guard.check_eval(final["val_loss"], self.step_count)
            except Divergence as e:
                self._diverged(e)
                return self._run(on_step, stop)
            row = {"step": self.step_count, **final, "elapsed": round(self.train_seconds(), 3),
                   "final": True}
            self.log(row)
            if on_step:
                on_step(row)
        else:
            final = {k: self.last_eval[k] for k in ("val_loss", "val_bpb")}
        if self.out_dir:
            self.save()
        return final

    def _train_step(self, on_step: Callable[[Row], object] | None) -> None:
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
            self._diverged(e)
            return
        self.log(row)
        if on_step:
            on_step(row)
        if self.out_dir and self.save_due(evaluated):
            try:
                self.save()
            except Divergence as e:
                self._diverged(e)


def _saved_options(saved: object, path: str) -> TrainOptions:
    """The TrainOptions a checkpoint's state holds (TrainError if it holds none or bad ones)."""
    if not isinstance(saved, dict):
        raise TrainError(f"checkpoint {path} holds no training state")
    # options added since the checkpoint was written take their defaults
    opts = TrainOptions(**{f.name: saved.get(f.name, f.default) for f in fields(TrainOptions)})
    try:
        opts.resolved()
    except TrainError as e:
        raise TrainError(f"checkpoint {path} holds bad options: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise TrainError(f"checkpoint {path} holds bad options ({e})") from None
    # runs saved before the ln0 key existed had none: ln0 = 0, not the preset's
    opts.model = {"ln0": 0, **(opts.model or {})}
    return opts


def _apply_changes(opts: TrainOptions, changes: dict[str, Any], tokenizer: dict | None,
                   out_dir: str) -> None:
    """Sets the RESUMABLE options of `changes` on a resumed run's opts; any
    other option that differs from the saved run is a TrainError, as is a
    tokenizer with another vocabulary than the run's (`tokenizer`, its identity)."""
    if changes.get("precision") == "auto":   # "auto" keeps the saved precision
        changes = dict(changes, precision=None)
    names = {f.name for f in fields(TrainOptions)}
    diff = []
    for k, v in changes.items():
        if k not in names:
            raise TrainError(f"unknown option {k!r}")
        if v is None:
            continue
        if k in TrainOptions.RESUMABLE:
            setattr(opts, k, v)
        elif k == "tokenizer":  # judged by the vocabulary's hash, not the spelling
            try:
                check_identity(load_tokenizer(v), tokenizer, f"the run in {out_dir}")
            except TokenizerError as e:
                raise TrainError(f"cannot resume: {e}") from None
        elif k == "model":
            model = opts.model or {}
            for mk, mv in v.items():
                if model.get(mk) != mv:
                    diff.append(f"model.{mk} {model.get(mk)!r} -> {mv!r}")
        elif getattr(opts, k) != v:
            diff.append(f"{k} {getattr(opts, k)!r} -> {v!r}")
    if diff:
        raise TrainError("cannot resume with a different configuration: " + "; ".join(diff))


def _take_lock(out_dir: str) -> RunLock:
    try:
        return RunLock(out_dir)
    except RunLocked as e:
        raise TrainError(str(e)) from None


def _count(v: object, name: str) -> int:
    """A saved integer >= 0 (a checkpoint's run state), else TrainError."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TrainError(f"the checkpoint's {name} {v!r} is not an integer >= 0")
    return v


def _maybe_seconds(v: object, name: str) -> float | None:
    """None, or a saved finite number >= 0; else TrainError."""
    return None if v is None else _seconds(v, name)


def _seconds(v: object, name: str) -> float:
    """A saved finite number >= 0 (a checkpoint's run state), else TrainError."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
        raise TrainError(f"the checkpoint's {name} {v!r} is not a number >= 0")
    return float(v)


def _finite(v: float) -> bool:
    """math.isfinite, False (not OverflowError) for an int beyond float range."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False
