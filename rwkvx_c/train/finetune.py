"""Fine-tuning: a run that starts from another model's weights
(``--init-from``, read by rwkvx_c.interop.source) and what of the model
trains (``--tune``).

    full   every parameter trains (the default; a plain run)
    state  only one initial WKV state [H, N, N] per RWKV block trains,
           zero to start (or the source's trained states); the base is
           frozen: AdamW holds moments for the states alone and the base
           weights are never written (docs/finetune.md)
    lora   only LoRA adapters A [r, in], B [out, r] on the projections
           train (A PEFT's kaiming-uniform, B zero; --adapter picks the
           kind, rwkvx_c.model.lora.ADAPTERS); the base is frozen as in
           state (merge_adapters folds them in)

The shape comes from the source: a shape option that disagrees is one
TrainError (shape_conflicts is the one place that judges it).

``--lisa-layers N`` (LISA, a schedule of a full tune): N blocks drawn
every ``--lisa-interval`` steps train fully beside the embedding, head and
final norms (lisa_due).

``--unfreeze-at STEP`` (the base-unfreeze): from run step STEP on, every
parameter trains; ``unfreeze`` is the one switch (see its doc), and
``switched`` puts a run on the side of the switch its step or checkpoint
says.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.errors import TrainError
from rwkvx_c.model.lora import (
    A0_SUFFIX,
    A_SUFFIX,
    ADAPTERS,
    B0_SUFFIX,
    B_SUFFIX,
    DEFAULT_TARGETS,
    M_SUFFIX,
    TARGETS,
    adapters_of,
    core_alpha,
    fold_matrix,
    magnitudes_of,
    merge_into,
    principal_parts,
    target_params,
)
from rwkvx_c.model.parts import PARTS, STATES, part_of
from rwkvx_c.model.weights import load_states
from rwkvx_c.run.checkpoint import STATE_KEY
from rwkvx_c.train.expand import ATTN_FIELDS, expanded_config
from rwkvx_c.train.optim import AdamW, decay_ranges
from rwkvx_c.train.options import TUNE_MODES, TrainOptions

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel

__all__ = ["TUNE_MODES", "PARTS", "part_of", "parse_parts", "trained_names", "PartsAdamW",
           "STATE_KEY", "base_frozen", "saved_params", "held_names", "shape_conflicts",
           "from_source", "make_optimizer", "trained_tensors", "restore_trained",
           "adapter_options", "unfreeze", "unfreeze_due", "is_unfrozen", "switched",
           "parse_targets", "init_adapters", "merge_adapters", "lisa_blocks", "lisa_due"]


def shape_conflicts(src_config: Mapping[str, int], asked: Mapping[str, int]) -> list[str]:
    """'field: asked X, the source has Y' for every asked shape value the
    source's config does not have (adding attention blocks to a pure RWKV-7
    source is an expansion, rwkvx_c.train.expand, judged before this). A
    model-context field the source's config leaves out (a .pth records no
    eps) has the C core's default, which a run's saved config spells out."""
    have = {**_core.OPTION_FIELDS, **src_config}
    return [f"{k}: asked {v}, the source has {have.get(k)}"
            for k, v in asked.items() if have.get(k) != v]


def from_source(options: TrainOptions, config: Mapping[str, int], tokenizer: str | None,
                path: str) -> TrainOptions:
    """options for a run starting from a source of this config and
    tokenizer: the model shape is the source's (options.model, the shape
    values asked for, must agree with it) and so is the tokenizer when the
    source names one."""
    asked = dict(options.model or {})
    hybrid = expanded_config(config, asked)   # --n-attn-layer K on a pure RWKV-7 source
    if hybrid is not None:
        config = hybrid
        asked = {k: v for k, v in asked.items() if k not in ATTN_FIELDS}
    bad = shape_conflicts(config, asked)
    if bad:
        raise TrainError(f"--init-from {path} fixes the model shape; drop the shape flags "
                         f"({'; '.join(bad)})")
    if tokenizer is not None and options.tokenizer not in ("byte", tokenizer):
        raise TrainError(f"--init-from {path} was trained with tokenizer {tokenizer}; drop "
                         f"--tokenizer {options.tokenizer}")
    kw: dict[str, Any] = {f.name: getattr(options, f.name) for f in fields(options)}
    kw.update(model=dict(config), init_from=path)
    if tokenizer is not None:
        kw["tokenizer"] = tokenizer
    return TrainOptions(**kw)


def adapter_options(asked: Mapping[str, Any], lora: Mapping[str, Any], what: str
                    ) -> dict[str, Any]:
    """The options of a tune that trains on given adapters (a PEFT folder, an
    RWKV-PEFT file: rwkvx_c.interop.adapters): --tune lora with their kind,
    rank, alpha and targets, which they fix as a source fixes the model
    shape, and --train-parts the groups an RWKV-PEFT file trained beside
    them unless asked otherwise (asked: the options given, None where not;
    a different one is refused)."""
    if asked.get("tune") not in (None, "lora"):
        raise TrainError(f"{what} holds LoRA adapters, which train on as --tune lora; drop "
                         f"--tune {asked['tune']}")
    kind = str(lora.get("kind") or "lora")
    if asked.get("adapter") not in (None, kind):   # their scale is folded into their alpha
        raise TrainError(f"{what} holds adapters that train on as {kind} of their own "
                         f"scale; drop --adapter {asked['adapter']}")
    r, alpha, targets = int(lora["r"]), float(lora["alpha"]), str(lora["targets"])
    fold = kind in ADAPTERS and ADAPTERS[kind].fold   # MiSS: scale 1, no alpha
    fixed = {"lora_r": r} if fold else {"lora_r": r, "lora_alpha": alpha}
    for k, v in fixed.items():
        if asked.get(k) is not None and asked[k] != v:
            raise TrainError(f"{what} fixes {k} at {v:g}; drop --{k.replace('_', '-')} "
                             f"{asked[k]:g}")
    t = asked.get("lora_targets")
    if t is not None and set(parse_targets(t)) != set(targets.split(",")):
        raise TrainError(f"{what} adapts {targets}; drop --lora-targets {t}")
    parts, asked_parts = lora.get("parts") or None, asked.get("train_parts")
    if parts and asked_parts is not None and \
            not set(parts.split(",")) <= set(parse_parts(asked_parts, "--train-parts")):
        # a part left frozen would be named by the run's base and lost
        raise TrainError(f"{what} trained {parts} beside its adapters, which train on with "
                         f"them; --train-parts {asked_parts} leaves some out")
    return {"tune": "lora", **fixed, "lora_targets": targets,
            **({"adapter": kind} if kind != "lora" else {}),
            **({"train_parts": parts} if parts and asked_parts is None else {})}


def parse_parts(spec: str | None, flag: str) -> tuple[str, ...]:
    """"ln,time" -> ("ln", "time"); TrainError naming the flag on an unknown group."""
    parts = tuple(p for p in (spec or "").replace(" ", "").split(",") if p)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise TrainError(f"{flag}: unknown group {bad[0]!r}; choose from {', '.join(PARTS)}")
    return parts


def parse_targets(spec: str | None) -> tuple[str, ...]:
    """--lora-targets "att.key,ffn.value" -> its names (None: the default
    set); TrainError naming an unknown one."""
    if spec is None:
        return DEFAULT_TARGETS
    names = tuple(p for p in spec.replace(" ", "").split(",") if p)
    bad = [p for p in names if p not in TARGETS]
    if bad or not names:
        raise TrainError(f"--lora-targets: unknown target {bad[0] if bad else spec!r}; "
                         f"choose from {', '.join(TARGETS)}")
    return names


def base_frozen(opts: TrainOptions) -> bool:
    """True when part of the model starts frozen (--tune state or lora,
    --freeze, --train-parts): a fine-tune's checkpoint then names its base
    instead of holding it, until --unfreeze-at."""
    return opts.tune != "full" or bool(opts.freeze) or bool(opts.train_parts)


def trained_names(model: RxPtModel, opts: TrainOptions) -> list[str]:
    """The parameters that train: all but --freeze's groups, or only
    --train-parts' groups (full); --train-parts' groups beside the states
    or the adapters (state, lora)."""
    if opts.tune == "full" and not opts.train_parts:
        frozen = parse_parts(opts.freeze, "--freeze")
        return [n for n in model.param_names if part_of(n, model.layers) not in frozen]
    parts = parse_parts(opts.train_parts, "--train-parts")
    return [n for n in model.param_names if part_of(n, model.layers) in parts]


# a PartsAdamW piece: (parameters, their grads, weight decay: all, none, or
# (R, 2) [begin, end) element ranges of the piece)
Piece = tuple[np.ndarray, np.ndarray, "bool | np.ndarray"]


class PartsAdamW:
    """AdamW over several pieces of the model (views into its arenas, the
    states), clipped by their one global grad norm; m and v are flat over
    the pieces in order, so moments exist only for what trains. starts:
    the run step each piece began training at (default 0), so a piece that
    joins later counts its own AdamW steps from 1 (the bias correction of
    fresh moments); t is the steps of the pieces trained from the start.
    unfrozen: the optimiser after the base-unfreeze."""

    def __init__(self, pieces: list[Piece], opts: TrainOptions,
                 starts: list[int] | None = None, unfrozen: bool = False) -> None:
        n = sum(p.size for p, _, _ in pieces)
        self.pieces = list(pieces)
        self.starts = list(starts) if starts is not None else [0] * len(pieces)
        self.unfrozen = unfrozen
        # a principal kind's initial adapters (init_principal): checkpoints hold them
        self.initial: dict[str, np.ndarray] = {}
        self.lisa_period = -1   # the LISA period it trains (_lisa_optimizer), else -1
        self.adapter_pieces = 0   # the leading pieces that are a LoRA tune's adapters
        self.m, self.v = np.zeros(n, np.float32), np.zeros(n, np.float32)
        self.subs: list[AdamW] = []
        off = 0
        for p, g, decay in pieces:
            ranges = decay if isinstance(decay, np.ndarray) else \
                np.array([[0, p.size]] if decay else [], np.int64).reshape(-1, 2)
            a = AdamW(p.reshape(-1), g.reshape(-1), ranges, betas=(opts.beta1, opts.beta2),
                      eps=opts.adam_eps, weight_decay=opts.weight_decay, grad_clip=opts.grad_clip)
            a.m, a.v = self.m[off:off + p.size], self.v[off:off + p.size]
            off += p.size
            self.subs.append(a)

    @property
    def t(self) -> int:
        return self.subs[0].t + self.starts[0]

    @t.setter
    def t(self, value: int) -> None:
        for a, start in zip(self.subs, self.starts):
            a.t = max(value - start, 0)

    def grad_norm(self) -> float:
        """The global L2 norm over every piece's gradients."""
        return math.sqrt(sum(a.grad_norm() ** 2 for a in self.subs))

    def grad_buffers(self) -> list[np.ndarray]:
        """The flat gradients of what trains, piece by piece (what MPI ranks
        average: nothing of the frozen base)."""
        return [a.grads for a in self.subs]

    def step(self, lr: float, norm: float | None = None) -> float:
        if norm is None:
            norm = self.grad_norm()
        if not math.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm}: the loss diverged "
                                     "(try a lower --lr)")
        for a in self.subs:
            a.step(lr, norm)
        return norm


def make_optimizer(model: RxPtModel, opts: TrainOptions) -> AdamW | PartsAdamW:
    """The AdamW over what trains, the rest frozen in C (no weight-gradient
    GEMMs): every parameter (full, the plain run), all but --freeze's groups,
    the initial states with --train-parts' groups (state), or the LoRA
    adapters, made and initialised here, with --train-parts' groups (lora).
    Matrices (adapters too) get weight decay, vectors and states none."""
    if opts.lisa_layers:
        return _lisa_optimizer(model, opts, 0)
    names = trained_names(model, opts)
    if opts.tune == "full" and len(names) == len(model.param_names):
        model.freeze_ranges(np.zeros((0, 2), np.int64))
        return AdamW(model.param_buffer, model.grad_buffer, decay_ranges(model),
                     betas=(opts.beta1, opts.beta2), eps=opts.adam_eps,
                     weight_decay=opts.weight_decay, grad_clip=opts.grad_clip)
    model.freeze_ranges(_frozen_ranges(model, names))
    pieces: list[Piece] = [(model.params[n], model.grads[n], model.params[n].ndim == 2)
                           for n in names]
    if opts.tune == "state" or STATES in parse_parts(opts.train_parts, "--train-parts"):
        model.enable_state()
        assert model.state is not None and model.state_grad is not None
        pieces.insert(0, (model.state, model.state_grad, False))
    initial: dict[str, np.ndarray] = {}
    if opts.tune == "lora":
        initial = _enable_lora(model, opts, set(names))
        assert model.lora_buffer is not None and model.lora_grad_buffer is not None
        assert model.lora is not None and model.lora_grads is not None
        # the adapters are matrices: the run's weight decay applies to them
        # (not to DoRA's magnitude vectors); a fold kind's A is fixed: its Bs train alone
        ads = [(model.lora_buffer, model.lora_grad_buffer, _matrix_ranges(model))] \
            if not ADAPTERS[opts.adapter].fold else \
            [(model.lora[k], model.lora_grads[k], True) for k in model.lora if k.endswith(B_SUFFIX)]
        pieces[:0] = ads
    if not pieces:
        raise TrainError("nothing trains: every group is frozen")
    out = PartsAdamW(pieces, opts)
    out.initial = initial
    out.adapter_pieces = len(ads) if opts.tune == "lora" else 0
    return out


def _matrix_ranges(model: RxPtModel) -> bool | np.ndarray:
    """The weight-decayed part of the adapters' arena: all of it (True), or
    for DoRA the (R, 2) [begin, end) ranges of its A and B matrices."""
    assert model.lora is not None and model.lora_buffer is not None
    if not any(k.endswith(M_SUFFIX) for k in model.lora):
        return True
    return np.array([[_offset(v, model.lora_buffer), _offset(v, model.lora_buffer) + v.size]
                     for k, v in model.lora.items() if not k.endswith(M_SUFFIX)], np.int64)


def _frozen_ranges(model: RxPtModel, trained: list[str]) -> np.ndarray:
    """(R, 2) [begin, end) arena ranges of the parameters not in trained,
    neighbours merged."""
    keep = set(trained)
    frozen: list[list[int]] = []
    for n in model.param_names:   # in arena order: neighbours merge into one range
        if n in keep:
            continue
        b = _offset(model.params[n], model.param_buffer)
        if frozen and frozen[-1][1] == b:
            frozen[-1][1] = b + model.params[n].size
        else:
            frozen.append([b, b + model.params[n].size])
    return np.array(frozen, np.int64).reshape(-1, 2)


def unfreeze(model: RxPtModel, optim: AdamW | PartsAdamW,
             opts: TrainOptions) -> AdamW | PartsAdamW:
    """The base-unfreeze: from now on every parameter trains, beside what
    trained already (a state tune's states keep training). The frozen
    ranges are cleared in C; what trained keeps its AdamW moments and step
    count; the parameters that were frozen join as pieces (the arena's
    frozen ranges, matrices decayed as in a full run) with zero moments
    and their own step count from opts.unfreeze_at - 1, so their first
    update is a fresh AdamW's. A LoRA tune's adapters are merged into the
    base first (merge_adapters) and leave the optimiser with their moments:
    from the switch on the merged weights train themselves. Returns the
    optimiser to use from now on (optim itself when nothing was frozen)."""
    if isinstance(optim, AdamW) or optim.unfrozen:
        return optim
    assert opts.unfreeze_at is not None
    drop = 0   # a LoRA tune's adapters: the pieces make_optimizer put first
    if model.base_dtype is not None:   # float32 again: a quantised base's values
        model.release_base()
    if model.lora is not None:
        merge_adapters(model)
        drop = optim.adapter_pieces
    skip = sum(p.size for p, _, _ in optim.pieces[:drop])
    frozen = _frozen_ranges(model, trained_names(model, opts))
    model.freeze_ranges(np.zeros((0, 2), np.int64))
    decay = decay_ranges(model)
    new: list[Piece] = []
    for b, e in frozen.tolist():
        r = np.clip(decay, b, e) - b
        new.append((model.param_buffer[b:e], model.grad_buffer[b:e], r[r[:, 1] > r[:, 0]]))
    out = PartsAdamW(optim.pieces[drop:] + new, opts,
                     optim.starts[drop:] + [opts.unfreeze_at - 1] * len(new), unfrozen=True)
    n = optim.m.size - skip
    out.m[:n], out.v[:n] = optim.m[skip:], optim.v[skip:]
    out.t = optim.t
    return out


def lisa_blocks(opts: TrainOptions, n_blocks: int, period: int) -> list[int]:
    """The blocks LISA trains fully in period `period` (run steps period * K
    + 1 to (period + 1) * K, K = --lisa-interval): --lisa-layers of the
    n_blocks drawn uniformly without replacement from a generator of the
    run's seed and the period, so every MPI rank and a resume draw the same."""
    assert opts.lisa_layers is not None
    rng = np.random.default_rng([opts.seed, 0x115A, period])
    return sorted(int(i) for i in rng.choice(n_blocks, opts.lisa_layers, replace=False))


def _lisa_optimizer(model: RxPtModel, opts: TrainOptions, steps: int,
                    old: PartsAdamW | None = None) -> PartsAdamW:
    """LISA's AdamW for the period of run step steps + 1: the embedding, head
    and every parameter outside the blocks (pieces first) keep old's moments
    and step count; the period's blocks join with zero moments and their own
    step count, and every other block is frozen in C (no weight grads), as
    LMFlow's LISATrainer keeps the optimiser state of the always-trained
    groups and re-creates the rest at each switch."""
    assert opts.lisa_layers is not None
    n = len(model.layers)
    if opts.lisa_layers >= n:
        raise TrainError(f"--lisa-layers {opts.lisa_layers}: the model has {n} blocks; LISA "
                         f"trains fewer (all of them is a plain full tune)")
    period = steps // opts.lisa_interval
    chosen = tuple(f"blocks.{i}." for i in lisa_blocks(opts, n, period))
    always = [k for k in model.param_names if not k.startswith("blocks.")]
    active = [k for k in model.param_names if k.startswith(chosen)]
    model.freeze_ranges(_frozen_ranges(model, always + active))
    pieces: list[Piece] = [(model.params[k], model.grads[k], model.params[k].ndim == 2)
                           for k in always + active]
    out = PartsAdamW(pieces, opts, [0] * len(always) + [period * opts.lisa_interval] * len(active))
    out.lisa_period = period
    if old is not None:
        kept = sum(model.params[k].size for k in always)
        out.m[:kept], out.v[:kept] = old.m[:kept], old.v[:kept]
        out.t = old.t
    return out


def lisa_due(model: RxPtModel, optim: AdamW | PartsAdamW, opts: TrainOptions,
             steps: int) -> AdamW | PartsAdamW:
    """The optimiser for run step steps + 1 of a LISA run: a new one
    (_lisa_optimizer) when that step begins another period, else optim;
    optim itself without LISA."""
    if not opts.lisa_layers or not isinstance(optim, PartsAdamW) or \
            optim.lisa_period == steps // opts.lisa_interval:
        return optim
    return _lisa_optimizer(model, opts, steps, optim)


def is_unfrozen(optim: AdamW | PartsAdamW) -> bool:
    """True once the base-unfreeze has run (what a checkpoint records)."""
    return isinstance(optim, PartsAdamW) and optim.unfrozen


def unfreeze_due(model: RxPtModel, optim: AdamW | PartsAdamW, opts: TrainOptions,
                 steps: int) -> AdamW | PartsAdamW:
    """The optimiser for the next step, run step steps + 1: unfreeze()'s
    from step opts.unfreeze_at on."""
    if opts.unfreeze_at is not None and steps + 1 >= opts.unfreeze_at:
        return switched(model, optim, opts, True)
    return optim


def switched(model: RxPtModel, optim: AdamW | PartsAdamW, opts: TrainOptions,
             unfrozen: bool) -> AdamW | PartsAdamW:
    """The optimiser on the given side of the base-unfreeze: unfreeze()
    when the run must be past it, a frozen one again (make_optimizer,
    moments zero, to be overwritten by a checkpoint's) when it must be
    before it (a rollback across the switch)."""
    if unfrozen and not is_unfrozen(optim):
        return unfreeze(model, optim, opts)
    if not unfrozen and is_unfrozen(optim):
        return make_optimizer(model, opts)
    return optim


def _offset(view: np.ndarray, base: np.ndarray) -> int:
    return (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // 4


def _enable_lora(model: RxPtModel, opts: TrainOptions, trained: set[str]
                 ) -> dict[str, np.ndarray]:
    """The adapters of --lora-targets on model, initialised as their kind
    does (from the run's seed); returns a principal kind's initial adapters."""
    names = target_params(model.layers, parse_targets(opts.lora_targets))
    if not names:
        raise TrainError(f"--lora-targets {opts.lora_targets} names no projection of this "
                         f"model (its blocks are {model.layers}: R RWKV, A attention)")
    both = [n for n in names if n in trained]
    if both:
        raise TrainError(f"{both[0]} would train twice, under --train-parts and as a LoRA "
                         "target; drop one")
    kind = ADAPTERS[opts.adapter]
    model.enable_lora(opts.lora_r, core_alpha(opts.adapter, opts.lora_r, opts.lora_alpha), names,
                      dora=kind.dora)
    if kind.principal:
        return init_principal(model)
    if not kind.fold:
        init_adapters(model, opts.seed)
        if kind.dora:   # M = ||W||'s columns (B is zero): the tune starts as the base
            assert model.lora is not None
            for k, v in model.lora.items():
                if k.endswith(M_SUFFIX):
                    v[...] = model.lora_norms(k[:-len(M_SUFFIX)])
                    if not np.all(v > 0):
                        raise TrainError(f"--adapter dora: {k[:-len(M_SUFFIX)]} has a zero "
                                         f"column (output {int(np.argmin(v))}), which has no "
                                         "direction to scale; train the base first or choose "
                                         "another --adapter")
        return {}
    assert model.lora is not None   # A the fixed fold, B zero: the tune starts as the base
    for k, v in model.lora.items():
        v[...] = fold_matrix(*v.shape) if k.endswith(A_SUFFIX) else 0.0
    return {}


def init_principal(model: RxPtModel) -> dict[str, np.ndarray]:
    """PiSSA's init (principal_parts) of every adapter from the weight it
    sits on as the model holds it (a frozen base's decoded values), the
    weight replaced by the residual (re-encoded in the base's dtype).
    Returns the initial adapters under A0_SUFFIX / B0_SUFFIX keys."""
    assert model.lora is not None and model.lora_rank is not None
    r, alpha = model.lora_rank
    base, out = set(model.base_names), {}
    for p in adapters_of(model.lora):
        W = model.base_tensor(p) if p in base else model.params[p]
        A0, B0, res = principal_parts(W, r, alpha / r)
        model.lora[p + A_SUFFIX][...], model.lora[p + B_SUFFIX][...] = A0, B0
        out[p + A0_SUFFIX], out[p + B0_SUFFIX] = A0, B0
        if p in base:
            model.base_fill(p, res)
        else:
            model.params[p][...] = res
    return out


def init_adapters(model: RxPtModel, seed: int) -> None:
    """PEFT's init: every A kaiming-uniform with a = sqrt(5), U(-1/sqrt(in),
    1/sqrt(in)), drawn adapter by adapter from one generator of seed; B zero,
    so the tuned model starts as the base."""
    assert model.lora is not None
    rng = np.random.default_rng([seed, 0x10A])
    for k, v in model.lora.items():
        if k.endswith(A_SUFFIX):
            bound = 1.0 / math.sqrt(v.shape[1])
            v[...] = rng.uniform(-bound, bound, v.shape).astype(np.float32)
        else:
            v[...] = 0.0


def merge_adapters(model: RxPtModel) -> None:
    """Fold the adapters into the weights they sit on (W + (alpha/r) A^T B^T,
    rounded once to float32) and stop applying them: the model then is the
    merged one, with no adapters. No-op without adapters."""
    if model.lora is None or model.lora_rank is None:
        return
    merge_into(model.params, adapters_of(model.lora), model.lora_rank[1],
               magnitudes_of(model.lora))
    model.disable_lora()


def trained_tensors(model: RxPtModel, optim: AdamW | PartsAdamW | None = None
                    ) -> dict[str, np.ndarray]:
    """What a checkpoint stores beside the parameters: the initial states
    and the LoRA adapters when the model has them (with a principal kind's
    initial ones, optim's, while the adapters are on)."""
    out = {} if model.state is None else {STATE_KEY: model.state}
    out.update(model.lora or {})
    if model.lora is not None and isinstance(optim, PartsAdamW):
        out.update(optim.initial)
    return out


def saved_params(model: RxPtModel, opts: TrainOptions,
                 base_names: frozenset[str] | None) -> dict[str, np.ndarray]:
    """The parameters a checkpoint holds: every one (base_names None), or,
    while a run that names its base has part of the model frozen, the ones
    that train and any the base lacks (an expansion's new blocks)."""
    if base_names is None:
        return dict(model.params)
    keep = set(trained_names(model, opts))
    return {n: p for n, p in model.params.items() if n in keep or n not in base_names}


def held_names(model: RxPtModel, opts: TrainOptions,
               tensors: Mapping[str, np.ndarray]) -> list[str]:
    """The parameters to load from a checkpoint that names its base: those it
    holds and (so that a missing one is refused) every one that trains."""
    trained = set(trained_names(model, opts))
    return [n for n in model.param_names if n in tensors or n in trained]


def restore_trained(model: RxPtModel, tensors: Mapping[str, np.ndarray], what: str) -> None:
    """The initial states and the adapters of a checkpoint (or an init
    source) into model."""
    for k, v in (model.lora or {}).items():
        t = tensors.get(k)
        if t is None or t.shape != v.shape:
            raise TrainError(f"{what} lacks the adapter {k} of shape {v.shape}"
                             + ("" if t is None else f" (it has {t.shape})"))
        v[...] = t
    load_states(model, tensors.get(STATE_KEY), what, TrainError)
