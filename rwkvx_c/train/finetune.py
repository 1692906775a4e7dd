"""Fine-tuning: a run that starts from another model's weights
(``--init-from``, read by rwkvx_c.interop.source) and what of the model
trains (``--tune``).

    full   every parameter trains (the default; a plain run)
    state  only one initial WKV state [H, N, N] per RWKV block trains,
           zero to start (or the source's trained states); the base is
           frozen: AdamW holds moments for the states alone and the base
           weights are never written (docs/finetune.md)

The shape comes from the source: a shape option that disagrees is one
TrainError (shape_conflicts is the one place that judges it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c.errors import TrainError
from rwkvx_c.run.checkpoint import STATE_KEY
from rwkvx_c.train.optim import AdamW, decay_ranges
from rwkvx_c.train.options import TUNE_MODES, TrainOptions

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel

__all__ = ["TUNE_MODES", "STATE_KEY", "shape_conflicts", "from_source", "make_optimizer",
           "trained_tensors", "restore_trained"]


def shape_conflicts(src_config: Mapping[str, int], asked: Mapping[str, int]) -> list[str]:
    """'field: asked X, the source has Y' for every asked shape value the
    source's config does not have."""
    return [f"{k}: asked {v}, the source has {src_config.get(k)}"
            for k, v in asked.items() if src_config.get(k) != v]


def from_source(options: TrainOptions, config: Mapping[str, int], tokenizer: str | None,
                path: str) -> TrainOptions:
    """options for a run starting from a source of this config and
    tokenizer: the model shape is the source's (options.model, the shape
    values asked for, must agree with it) and so is the tokenizer when the
    source names one."""
    bad = shape_conflicts(config, options.model or {})
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


def make_optimizer(model: RxPtModel, opts: TrainOptions) -> AdamW:
    """The AdamW over what trains: the whole arena (full), or the initial
    states alone (state: moments of their size only, no weight decay, as
    RWKV-PEFT's state tuning)."""
    if opts.tune == "state":
        model.enable_state()
        model.frozen = True    # no weight-gradient GEMMs: the base does not train
        s, g = model.state, model.state_grad
        assert s is not None and g is not None
        params, grads, ranges = s.reshape(-1), g.reshape(-1), np.zeros((0, 2), np.int64)
    else:
        params, grads, ranges = model.param_buffer, model.grad_buffer, decay_ranges(model)
    return AdamW(params, grads, ranges, betas=(opts.beta1, opts.beta2), eps=opts.adam_eps,
                 weight_decay=opts.weight_decay, grad_clip=opts.grad_clip)


def trained_tensors(model: RxPtModel) -> dict[str, np.ndarray]:
    """What a checkpoint stores beside the parameters: the initial states
    when the model has them."""
    return {} if model.state is None else {STATE_KEY: model.state}


def restore_trained(model: RxPtModel, tensors: Mapping[str, np.ndarray], what: str) -> None:
    """The initial states of a checkpoint (or an init source) into model."""
    t = tensors.get(STATE_KEY)
    if t is None:
        return
    model.enable_state()
    assert model.state is not None
    if t.shape != model.state.shape:
        raise TrainError(f"{what}: {STATE_KEY} has shape {t.shape}, the model's initial "
                         f"states are {model.state.shape}")
    model.state[...] = t
