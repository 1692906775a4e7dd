"""Reading a saved run back: what a run folder's checkpoint says to resume
with (options, run state, tensors), checked before any of it is used.

A checkpoint of a trained run holds its options and run state; a folder
made by ``rwkvx-c import`` holds weights only, from which a new run starts
(step 0, fresh optimiser). A state, LoRA or partly frozen fine-tune's
checkpoint holds what trains and names its base (rwkvx_c.run.base): the
base is checked and read again as the source ``--init-from`` read, and
the model is rebuilt from it as the run began, then the checkpoint's
tensors go over it. Every value of the run state is checked for its
type and range, so a tampered or truncated state is one TrainError.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c.errors import CheckpointError, RwkvxWarning, TrainError
from rwkvx_c.interop.source import base_weights
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.run.base import BASE_KEY, pinned_by
from rwkvx_c.run.rundir import RunDir
from rwkvx_c.train.finetune import adapter_options
from rwkvx_c.train.options import TrainOptions, apply_changes, saved_options

if TYPE_CHECKING:
    from rwkvx_c.train.distributed import ProcessGroup

__all__ = ["Saved", "read_saved", "saved_counters"]


@dataclass
class Saved:
    """What resuming out_dir starts from: options, and either the run state
    with the tensors it was saved with (and, when the checkpoint names its
    base, that base's weights), or (an imported model) weights only."""
    options: TrainOptions
    state: dict[str, Any] | None
    tensors: Mapping[str, np.ndarray] | None
    weights: Mapping[str, np.ndarray] | None


def read_saved(out_dir: str, group: ProcessGroup, changes: dict[str, Any]) -> Saved:
    """The saved run in out_dir with `changes` applied (the RESUMABLE
    options; any other difference is a TrainError). Rank 0 reads the file
    and sends it to the other ranks."""
    run = RunDir(out_dir)
    path = run.checkpoint
    try:
        tensors, config, state = group.on_root(run.read_checkpoint)
    except CheckpointError as e:
        raise TrainError(str(e)) from None
    saved = state.get("options")
    if not isinstance(saved, dict) and state.get("imported_from"):
        # weights only (rwkvx-c import): a new run starts from them
        kw = {k: v for k, v in changes.items() if v is not None}
        if state.get("tokenizer") and "tokenizer" not in kw:
            kw["tokenizer"] = state["tokenizer"]["name"]   # an imported World model
        lora = state.get("lora")
        if isinstance(lora, dict):   # imported adapters (rwkvx-c import --base): they train on
            kw.update(adapter_options(kw, lora, path))
        return Saved(TrainOptions(**{**kw, "model": ModelConfig.resolve(config)}), None, None,
                     tensors)
    opts = saved_options(saved, path)
    pins = pinned_by(out_dir) if group.is_root else 0
    if pins:
        warnings.warn(RwkvxWarning(
            f"{pins} fine-tune(s) pin the checkpoint of step {state.get('step')} of {out_dir}: "
            "they keep that version, and this run goes on from it"), stacklevel=2)
    config = ModelConfig.resolve(config)   # as saved_options resolves opts.model
    apply_changes(opts, changes, state.get("tokenizer"), out_dir)
    if config != opts.model:
        raise TrainError(f"checkpoint {path} is inconsistent: its model config differs "
                         "from its saved options")
    if state.get(BASE_KEY) is None:
        if changes.get("base"):
            raise TrainError(f"--base: the run in {out_dir} holds its whole model and names "
                             "no base; leave --base out")
        return Saved(opts, state, tensors, None)
    # where the base is now (its record updated when --base moved it), and its
    # weights; a --base of an earlier session is in the record already
    # hashed again: one pass over the base is cheap beside the training it resumes
    record, weights = group.on_root(base_weights, state[BASE_KEY], out_dir,
                                    changes.get("base"), TrainError, True)
    return Saved(opts, {**state, BASE_KEY: record}, tensors, weights)


def saved_counters(state: Mapping[str, Any]) -> dict[str, Any]:
    """The run's counters from a checkpoint's state, each checked:
    step, optim_t, elapsed, tokens_seen, warm_end, next_eval_at, last_eval,
    eval_seconds, lr_scale, rollbacks. TrainError on any bad value."""
    try:
        last = state.get("last_eval")
        if last is not None:
            last = {"step": _count(last["step"], "last_eval.step"),
                    "val_loss": float(last["val_loss"]),
                    "val_bpb": None if last.get("val_bpb") is None else float(last["val_bpb"])}
        lr_scale = float(state.get("lr_scale", 1.0))
        if not 0.0 < lr_scale <= 1.0:
            raise TrainError(f"the checkpoint's lr_scale {lr_scale!r} is not in (0, 1]")
        return {"step": _count(state["step"], "step"),
                "optim_t": _count(state["optim_t"], "optim_t"),
                "elapsed": _seconds(state["elapsed"], "elapsed"),
                "tokens_seen": _count(state["tokens_seen"], "tokens_seen"),
                "warm_end": _maybe_seconds(state.get("warm_end"), "warm_end"),
                "next_eval_at": _maybe_seconds(state.get("next_eval_at"), "next_eval_at"),
                "last_eval": last,
                "eval_seconds": _maybe_seconds(state.get("eval_seconds"), "eval_seconds"),
                "lr_scale": lr_scale,
                "rollbacks": _count(state.get("rollbacks", 0), "rollbacks")}
    except TrainError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise TrainError(f"the checkpoint holds a bad run state ({type(e).__name__}: "
                         f"{e})") from None


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
