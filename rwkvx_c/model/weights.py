"""Copying tensors into a model, by name and shape, once.

Every door that fills a model from outside -- a checkpoint (resume,
sample), an imported ``.pth`` (after its names are translated) -- goes
through ``load_params``: it checks every parameter's presence and shape
before it writes any, so a refused file leaves the model as it was.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rwkvx_c.errors import CheckpointError, RwkvxError

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel

__all__ = ["load_params", "copy_tensor", "load_states", "auto_base_dtype", "fill_base"]


def load_params(model: RxPtModel, tensors: Mapping[str, np.ndarray], what: str,
                error: type[RwkvxError] = CheckpointError,
                names: Sequence[str] | None = None) -> None:
    """model.params[name][...] = tensors[name] for every parameter name
    (names: these alone, the rest left as they are).

    what names the source in messages ("checkpoint runs/x/checkpoint.safetensors");
    error is the class raised for a missing tensor or a shape mismatch
    (tensors the model has no parameter for are the caller's to judge).
    """
    names = model.param_names if names is None else names
    # a mapping that reads its tensors when asked (a fine-tune's base) says
    # their shapes without reading them
    shape_of = getattr(tensors, "shape", None)
    for name in names:
        want = model.params[name].shape
        if name not in tensors:
            raise error(f"{what} lacks tensor {name} of shape {want}")
        got = tuple(shape_of(name)) if shape_of is not None else tensors[name].shape
        if got != want:
            raise error(f"{what}: tensor {name} has shape {got}, the model expects {want}")
    for name in names:
        copy_tensor(tensors, name, model.params[name])


def copy_tensor(tensors: Mapping[str, np.ndarray], name: str, out: np.ndarray) -> None:
    """out[...] = tensors[name], the source never held whole beside out: a
    mapping that copies a span at a time does so (a checkpoint's,
    rwkvx_c.run.checkpoint.CheckpointTensors.copy_into), one that can drop
    a copied tensor's pages (a mapped file) drops them."""
    copy = getattr(tensors, "copy_into", None)
    if copy is not None:
        copy(name, out)
        return
    out[...] = tensors[name]
    drop = getattr(tensors, "release", None)
    if drop is not None:
        drop(name)


def load_states(model: RxPtModel, states: np.ndarray | None, what: str,
                error: type[RwkvxError] = CheckpointError) -> None:
    """A state-tuned model's trained initial WKV states (a checkpoint's
    state0, [n_rwkv, H, N, N]) into model, which from then on starts every
    sequence from them; nothing when states is None. error as load_params'."""
    if states is None:
        return
    model.enable_state()
    assert model.state is not None
    if states.shape != model.state.shape:
        raise error(f"{what}: the initial states have shape {states.shape}, the model's are "
                    f"{model.state.shape}")
    model.state[...] = states


def auto_base_dtype(source_dtype: str) -> str:
    """--base-dtype auto's base for a source whose matrices are of
    source_dtype: that form when a base holds it (bf16, q8_0, q4_0, q4_k), else
    fp32 (no base)."""
    from rwkvx_c._core import BASE_DTYPES
    return source_dtype if source_dtype in BASE_DTYPES else "fp32"


def fill_base(model: RxPtModel, tensors: Mapping[str, np.ndarray], name: str) -> None:
    """Base tensor name of model from tensors: a GGUF's blocks of the base's
    own dtype (tensors.raw_blocks) or bf16 bits (tensors.raw_t), [out, in]
    as the file holds them, copied in as they are; else its float32 values,
    encoded once."""
    blocks = getattr(tensors, "raw_blocks", None)
    own = blocks(name) if blocks is not None else None
    if own is not None and own[0] == model.base_dtype:
        model.base_fill(name, own[1], transposed=True)
        return
    raw = getattr(tensors, "raw_t", None)
    bits = raw(name) if raw is not None else None
    if bits is not None:
        model.base_fill(name, bits, transposed=True)
    else:
        model.base_fill(name, np.ascontiguousarray(tensors[name], np.float32))
