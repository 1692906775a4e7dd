"""Preference accuracy on held-out pairs (rwkvx-c eval --preferences FILE):
the policy's and the reference's summed completion log-probabilities of
every pair, and TRL's metrics of the run's objective over them
(docs/finetune.md §Preference tuning).

The policy is the run's model (a LoRA run's adapters applied, a state
run's initial states set); the reference is --ref-from's model when given,
else the run's own base: the policy's model with its adapters off and its
initial states zero for the reference's pass (own_base), so a run on a
frozen base scores both on the one base it holds; a run whose checkpoint
holds its adapters merged, its checkpoint's weights without them
(base_model). A full tune's base is not in its checkpoint: it needs
--ref-from (its --init-from source). SimPO needs no reference.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.preferences import read_pairs
from rwkvx_c.errors import EvalError
from rwkvx_c.model.lora import adapters_of, adapters_off
from rwkvx_c.model.weights import load_params
from rwkvx_c.run.checkpoint import STATE_KEY
from rwkvx_c.train.objectives import REFERENCE_FREE, metrics, pair_logps, pair_loss

if TYPE_CHECKING:
    from rwkvx_c.data.tokenizers import Tokenizer

__all__ = ["score_preferences", "base_model", "OWN_BASE", "tuned"]


def base_model(tensors: Mapping[str, np.ndarray], config: Mapping[str, Any],
               path: str) -> _core.RxPtModel:
    """The base of the LoRA or state run at path, whose checkpoint holds
    tensors and config (every parameter: rwkvx_c.interop.source.read_run):
    its weights without adapters or initial states. EvalError for a run that
    has neither (its base is not in its checkpoint)."""
    if not adapters_of(tensors) and STATE_KEY not in tensors:
        raise EvalError(f"{path} is not a LoRA or state tune: its reference is not in its "
                        "checkpoint; give --ref-from (the run's --init-from source)")
    model = _core.RxPtModel(dict(config))
    base: Mapping[str, np.ndarray] = {k: v for k, v in tensors.items()
                                      if k in model.params}
    load_params(model, base, f"checkpoint {path}")
    return model


# score_preferences' reference: the policy's own base (own_base)
OWN_BASE = "own base"


def tuned(model: _core.RxPtModel) -> bool:
    """model holds what a LoRA or state tune trained apart from its base
    (adapters applied unmerged, or initial states): own_base can undo it."""
    return model.lora_rank is not None or model.state is not None


@contextmanager
def own_base(model: _core.RxPtModel) -> Iterator[None]:
    """model as its tune's base for the span: its adapters off and its
    initial states zero (a fresh state's), both back after."""
    st = model.state
    saved = None if st is None else np.array(st)
    try:
        if st is not None:
            st[...] = 0
        with adapters_off(model):
            yield
    finally:
        if st is not None:
            st[...] = saved


def score_preferences(policy: _core.RxPtModel, reference: _core.RxPtModel | str | None,
                      tok: Tokenizer, path: str, *, seq_len: int, kind: str, beta: float,
                      batch: int = 8) -> dict[str, Any]:
    """TRL's metrics (loss, rewards/*, logps/*) of objective `kind` over
    every pair of the file at path, with n_pairs and logps/accuracies (the
    fraction whose chosen completion the policy finds likelier); reference
    OWN_BASE: the policy's own base (own_base; EvalError for a policy that
    is not tuned), None only for a reference-free objective."""
    if reference is None and kind not in REFERENCE_FREE:
        raise EvalError(f"--objective {kind} needs a reference model")
    if reference == OWN_BASE and not tuned(policy):
        raise EvalError("the policy holds no adapters or initial states: its reference is not "
                        "in its checkpoint; give --ref-from (the run's --init-from source)")
    pairs = read_pairs(path, tok, seq_len)
    pol = pair_logps(policy, pairs, batch)
    if reference == OWN_BASE:
        with own_base(policy):
            ref = pair_logps(policy, pairs, batch)
    elif isinstance(reference, _core.RxPtModel):
        ref = pair_logps(reference, pairs, batch)
    else:
        ref = np.zeros_like(pol)
    res = pair_loss(kind, beta, pol[:, 0], pol[:, 1], ref[:, 0], ref[:, 1],
                    pairs.n_tokens[:, 0], pairs.n_tokens[:, 1])
    # the policy's own preference, which ties never blur (a policy equal to its
    # reference has every reward 0, so rewards/accuracies 0)
    return {"n_pairs": len(pairs), "objective": kind, "beta": beta,
            **metrics(res, pol[:, 0], pol[:, 1]),
            "logps/accuracies": float(np.mean(pol[:, 0] > pol[:, 1]))}
