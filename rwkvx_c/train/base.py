"""The frozen base of a fine-tune (docs/finetune.md §The frozen base).

A matrix that does not train (every projection of a state or LoRA tune,
the frozen groups of --freeze / --train-parts) is held only in the format
its GEMM reads: bf16, GGUF Q8_0, Q4_0 or Q4_K, QLoRA's NF4 (RxPtModel.set_base), with no float32
copy, no gradient and no AdamW moments. --base-dtype picks the format;
"auto" is the source's own form when a base holds it: bf16 for a source
whose matrices are bf16 (an official .pth), a GGUF's bf16, q8_0, q4_0 or q4_k
(its blocks copied in as they are; rwkvx_c.interop.gguf_in); fp32 (the
arena, as a full run) otherwise. A GGUF matrix in another form is
converted once into the base, with one line saying so, and one the file
holds in float32 stays float32. A frozen embedding is held the
same way, by its rows (decoded as they are gathered); every vector stays
float32.

``model_from_source(opts, weights)`` is the one place a fine-tune's model
is made from its source: the run's options (resolved, the model shape the
source's) and the source's weights by parameter name, a Mapping read one
tensor at a time (an x070 .pth is read from its file as it is asked for,
rwkvx_c.interop.rwkv7.StreamedWeights). It checks that the tune fits in
memory (what this mode keeps, tune_bytes) before it reads a tensor.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from rwkvx_c import _core
from rwkvx_c.errors import ConfigError, MemoryTooSmall, RwkvxWarning, TrainError
from rwkvx_c.model import memory
from rwkvx_c.model.lora import ADAPTERS, target_params
from rwkvx_c.model.weights import auto_base_dtype, fill_base, load_params
from rwkvx_c.train.expand import place_weights
from rwkvx_c.train.finetune import parse_targets, trained_names

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel
    from rwkvx_c.train.options import ResolvedOptions

__all__ = ["resolve_base_dtype", "base_names", "base_bytes", "tune_bytes", "model_from_source",
           "Decoded"]

def resolve_base_dtype(opts: ResolvedOptions, source_dtype: str) -> str:
    """--base-dtype with "auto" decided: the source's form (bf16, q8_0,
    q4_0) when a base holds it and something is frozen, else fp32."""
    if opts.base_dtype != "auto":
        return opts.base_dtype
    frozen = opts.tune != "full" or bool(opts.freeze) or bool(opts.train_parts)
    return auto_base_dtype(source_dtype) if frozen else "fp32"


def base_names(model: RxPtModel, opts: ResolvedOptions, dtype: str,
               weights: Mapping[str, np.ndarray] | None = None) -> list[str]:
    """The matrices a base of dtype holds: every frozen 2-D parameter, the
    embedding included (held by its rows, which are gathered), whose rows
    (W^T's, the embedding's own) are whole blocks of the dtype (q8_0's and q4_0's: 32
    values, nf4's 64, q4_k's 256; the rest stay float32), and that the source (weights) holds in
    less than float32 where it says (a GGUF's compact)."""
    if dtype == "fp32":
        return []
    per, _ = _core.base_dtype_block(dtype)
    keep = set(trained_names(model, opts))
    p = model.params
    compact = getattr(weights, "compact", lambda name: True)
    return [n for n in model.param_names if n not in keep and p[n].ndim == 2
            and p[n].shape[n == "emb"] % per == 0 and compact(n)]


def base_bytes(model: RxPtModel, names: list[str], dtype: str) -> int:
    """Bytes of a base of dtype holding names."""
    if dtype == "fp32":   # no base
        return 0
    p = model.params
    per, nbytes = _core.base_dtype_block(dtype)
    return sum(p[n].size // per * nbytes for n in names)


def tune_bytes(model: RxPtModel, opts: ResolvedOptions, names: list[str], dtype: str,
               raw: frozenset[str] = frozenset()) -> tuple[int, int]:
    """(held, loading): the bytes of a fine-tune's weights, the activations
    aside: the base, every other parameter once in float32, and for what
    trains its grads and AdamW's two moments (the states, the adapters,
    the trained groups); and those held only while loading, the largest
    tensor converted twice (read and converted; raw: the base tensors the
    source holds in the base's own blocks, copied as they are), gone
    before the first step."""
    p = model.params
    trained = sum(p[n].size for n in trained_names(model, opts))
    c = model.config
    if opts.tune == "state":
        trained += c["n_rwkv_layer"] * c["n_head"] * c["head_size"] ** 2
    if opts.tune == "lora":
        trained += sum(opts.lora_r * (p[n].shape[0] + p[n].shape[1])
                       for n in target_params(model.layers, parse_targets(opts.lora_targets)))
    in_base = sum(p[n].size for n in names)
    largest = max((a.size for n, a in p.items() if n not in raw), default=0)
    # what trains is held once more (the states and adapters live outside
    # the arena); the largest tensor is read and converted while loading
    return (memory.weight_bytes(model.n_params - in_base + trained, trained, 0,
                                base_bytes(model, names, dtype)),
            memory.weight_bytes(0, 0, 2 * largest))


def adapters_alone(opts: ResolvedOptions) -> bool:
    """Whether the tune trains LoRA adapters (not DoRA) and nothing else:
    what RxPtModel.groups_exact will say once make_optimizer has enabled
    them (the memory check runs before)."""
    return opts.tune == "lora" and not ADAPTERS[opts.adapter].dora and not opts.train_parts \
        and not opts.lisa_layers


def model_from_source(opts: ResolvedOptions, weights: Mapping[str, np.ndarray],
                      step_len: int | None = None) -> RxPtModel:
    """The model of a fine-tune (opts resolved, opts.model the source's
    shape) holding the source's weights (by parameter name; see the module
    doc), its frozen matrices in a base of --base-dtype. TrainError when the
    tune does not fit in memory, or on a missing or misshapen tensor."""
    try:
        model = _core.RxPtModel(dict(opts.model), seed=opts.seed, precision=opts.precision,
                                recompute=bool(opts.grad_cp), l2wrap=opts.l2wrap, init=False)
        model.row_group = opts.row_group
        dtype = resolve_base_dtype(opts, str(getattr(weights, "dtype", "fp32")))
        names = base_names(model, opts, dtype, weights)
        # frozen while the step may be measured: no weight grad is written
        # (make_optimizer sets what trains)
        model.frozen = True
        # a GGUF's blocks of the base's own dtype are copied in, never converted
        types = getattr(weights, "types", None) or {}
        raw = frozenset(n for n in names if types.get(n) == dtype)
        held, loading = tune_bytes(model, opts, names, dtype, raw)
        memory.check_step(model, opts.batch, step_len or opts.seq_len, held, loading,
                          auto_recompute=opts.grad_cp is None, groups_exact=adapters_alone(opts))
    except (ConfigError, MemoryTooSmall, ValueError) as e:
        raise TrainError(str(e)) from None
    placed = place_weights(model, weights)
    if not hasattr(weights, "raw_t"):   # in memory: every shape checked before a write
        rest = [n for n in model.param_names if n not in names]
        load_params(model, {n: placed[n] for n in rest}, "the source", TrainError, names=rest)
    if names:
        model.set_base(dtype, names)
        _say_converted(weights, names, dtype)
    for n in model.param_names:
        if n in names:
            fill_base(model, placed, n)
        elif hasattr(weights, "raw_t"):
            a = placed[n]
            if a.shape != model.params[n].shape:
                raise TrainError(f"the source: tensor {n} has shape {a.shape}, the model "
                                 f"expects {model.params[n].shape}")
            model.params[n][...] = a
        if hasattr(placed, "release"):
            placed.release(n)
    return model


def _say_converted(weights: Mapping[str, np.ndarray], names: list[str], dtype: str) -> None:
    """One line when a source that names its matrices' forms (a GGUF)
    holds some of the base's in another form: each is decoded exactly and
    encoded once into the base."""
    types: dict[str, str] | None = getattr(weights, "types", None)
    if types is None:
        return
    other = sorted({types[n] for n in names if types[n] != dtype})
    count = sum(types[n] != dtype for n in names)
    if count:
        warnings.warn(RwkvxWarning(
            f"{getattr(weights, 'path', 'the source')}: {count} of its {len(names)} base "
            f"matrices are {', '.join(other)}, not {dtype}: each converted once into the "
            f"{dtype} base"), stacklevel=2)


class Decoded(Mapping[str, np.ndarray]):
    """tensors, with a frozen base's matrices decoded (float32) each time
    one is asked for."""

    def __init__(self, model: _core.RxPtModel, tensors: dict[str, np.ndarray]) -> None:
        self._model, self._tensors = model, tensors
        self._base = set(model.base_names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._base:
            return self._model.base_tensor(name)
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
