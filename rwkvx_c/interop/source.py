"""The weights a fine-tune starts from (``rwkvx-c train --init-from SRC``):
a run folder, a checkpoint file, an x070 / RWKV-X ``.pth``, a Hugging
Face folder, a ``.safetensors`` file of x070 or HF rwkv7 names or an
RWKV-7 ``.gguf`` (rwkvx_c.interop.gguf_in), read
with the rules of ``rwkvx-c import`` (rwkvx_c.interop.rwkv7, hf), or LoRA
adapters on such a base (a PEFT folder or an RWKV-PEFT .pth,
rwkvx_c.interop.adapters), which the tune trains on as they are.

An x070 .pth, an HF rwkv7 folder, such a .safetensors file and a GGUF stream:
Source.weights reads each tensor from the mapped file when the model asks
for it (rwkvx_c.interop.rwkv7.StreamedWeights), never a float32 copy of
the whole model; so does the base of a run whose checkpoint names it
(Layered: the run's own tensors over it), unless the run holds LoRA
adapters, which are merged into it. RWKV-X .pth files, hybrid HF folders
(rwkvx_c's own layout) and other checkpoints are read whole.

read_source returns the model config, the weights by parameter name, the
tokenizer the source was trained with (when it says) and, for a
state-tuned source, its trained initial states (a LoRA-tuned source's
weights come merged); nothing of the source's
optimiser or run state comes along: the fine-tune is a new run.

A state, LoRA or partly frozen run's checkpoint holds what trained and
names its base (rwkvx_c.run.base); read_run fills in the rest from that
base, read again as a source, so every reader (``--init-from``, sample,
export, eval) sees the whole model.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rwkvx_c._core import RxPtModel
from rwkvx_c.data.tokenizers import WORLD_VOCAB_SIZE, run_tokenizer
from rwkvx_c.errors import CheckpointError, InteropError, RwkvxError, TokenizerError
from rwkvx_c.interop.adapters import Adapters, is_adapter, peft_base, read_adapters
from rwkvx_c.interop.gguf_in import GgufWeights
from rwkvx_c.interop.hf import HYBRID_TYPE, HfAsX070, hf_tensors, hf_tokenizer, read_hf_config
from rwkvx_c.interop.hf_hybrid import read_hf_folder
from rwkvx_c.interop.pth import PthTensors, load_pth
from rwkvx_c.interop.rwkv7 import StreamedWeights, from_rwkv7, from_rwkvx, stream_rwkv7
from rwkvx_c.interop.safetensors_file import SafetensorsTensors
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.lora import adapters_of, run_alpha, without_adapters
from rwkvx_c.run.base import BASE_KEY, Record, check_base
from rwkvx_c.run.checkpoint import STATE_KEY, read_checkpoint
from rwkvx_c.run.rundir import RunDir, checkpoint_path
from rwkvx_c.util.files import check_input

__all__ = ["Source", "read_source", "read_run", "base_weights", "Layered", "STATE_KEY"]


@dataclass
class Source:
    """A fine-tune's starting point. tokenizer: a spec for
    rwkvx_c.data.tokenizers.load (byte, world, a tokenizer.json path), None
    when the source names none (a .pth of another vocabulary size)."""
    path: str
    config: dict[str, int]
    weights: Mapping[str, np.ndarray]   # streamed sources': read tensor by tensor when asked
    tokenizer: str | None
    state0: np.ndarray | None
    adapters: Adapters | None = None   # LoRA adapters to train on, under our param names
    dtype: str = "fp32"   # "bf16": every matrix of the source is bf16 (--base-dtype auto)


def read_source(src: str, base: str | None = None, lora_alpha: float | None = None,
                pinned: str | None = None, lora_init: str | None = None) -> Source:
    """The Source at src; InteropError (one line) when it is none of a run
    folder with a checkpoint, a checkpoint file, a .pth or a Hugging Face
    folder. An adapter at src (a PEFT folder, an RWKV-PEFT LoRA .pth) sits on
    base (any of those; for a PEFT folder, the local folder its
    adapter_config.json names by default); for a checkpoint that names its
    base (rwkvx_c.run.base), base is where that base lies now (--base);
    lora_alpha: the alpha of an RWKV-PEFT file that does not record it;
    pinned: the pin of src's checkpoint (rwkvx_c.run.base.pin_source),
    read in its place; lora_init: an RWKV-PEFT PiSSA checkpoint's initial
    adapters (rwkvx_c.interop.adapters.read_adapters)."""
    check_input(src, InteropError, "the source")
    if lora_init is not None and not (os.path.isfile(src) and is_adapter(src)):
        raise InteropError(f"--lora-init belongs to an RWKV-PEFT PiSSA checkpoint; {src} is "
                           "none")
    if os.path.exists(src) and is_adapter(src):
        base = base or (peft_base(src) if os.path.isdir(src) else None)
        if base is None:
            raise InteropError(f"{src} holds LoRA adapters and names no local base; give it "
                               f"one: rwkvx-c import {src} --base BASE --out RUN")
        s = read_source(base)
        if s.adapters is not None:
            raise InteropError(f"the base {base} holds adapters itself")
        model = RxPtModel(s.config)
        s.adapters = read_adapters(src, model, lora_alpha, lora_init)
        s.path = src
        return s
    if os.path.isdir(src):
        run = RunDir(src)
        if not run.has_checkpoint():
            if os.path.isfile(os.path.join(src, "config.json")):
                return _from_hf(src)
            raise InteropError(f"--init-from {src}: the folder holds no checkpoint")
        return _from_checkpoint(src, pinned or checkpoint_path(src), src, base)
    if not os.path.isfile(src):
        raise InteropError(f"--init-from {src}: no such file or folder")
    if src.endswith(".pth"):
        pth = PthTensors(src)
        if not any(k.startswith("rwkv.") for k in pth.names):   # x070: streamed
            return _streamed(src, stream_rwkv7(pth))
        pth.close()
        sd = load_pth(src)
        model = from_rwkvx(sd) if any(k.startswith("rwkv.") for k in sd) else from_rwkv7(sd)
        weights = {n: np.array(model.params[n]) for n in model.param_names}
        tok = "world" if model.config["vocab_size"] == WORLD_VOCAB_SIZE else None
        return Source(src, model.config, weights, tok, None)
    if src.endswith(".gguf"):   # streamed: its blocks go into the base as they are
        g = GgufWeights(src)
        return Source(src, g.config, g, g.tokenizer, None, dtype=g.dtype)
    if src.endswith(".safetensors"):
        streamed = _stream_safetensors(src)
        if streamed is not None:
            return _streamed(src, streamed)
    return _from_checkpoint(src, pinned or src, os.path.dirname(os.path.abspath(src)), base)


def _streamed(src: str, weights: StreamedWeights) -> Source:
    """The Source of a file's streamed weights: World tokens at World's
    vocabulary size, else no tokenizer named."""
    tok = "world" if weights.config["vocab_size"] == WORLD_VOCAB_SIZE else None
    return Source(src, dict(weights.config), weights, tok, None, dtype=weights.dtype)


def _stream_safetensors(path: str) -> StreamedWeights | None:
    """A .safetensors file of x070 names (emb.weight ...) or HF rwkv7 names
    (model.embeddings.weight ..., sizes from the shapes), streamed; None
    for any other file (a checkpoint, or not readable as safetensors: the
    checkpoint reader then says what it is)."""
    try:
        st = SafetensorsTensors(path)
    except InteropError:
        return None
    if "emb.weight" in st.names:
        return stream_rwkv7(st)
    if "model.embeddings.weight" in st.names:
        return stream_rwkv7(HfAsX070(st))
    st.close()
    return None


def _from_hf(folder: str) -> Source:
    """An HF folder: the rwkv7 layout streamed, rwkvx_c's own (hybrid)
    layout read whole."""
    cfg = read_hf_config(folder)
    weights: Mapping[str, np.ndarray]
    if cfg.get("model_type") == HYBRID_TYPE:
        model = read_hf_folder(folder)
        config, weights, dtype = model.config, {n: np.array(model.params[n]) for n in
                                                model.param_names}, "fp32"
    else:
        streamed = stream_rwkv7(HfAsX070(hf_tensors(folder), cfg))
        config, weights, dtype = dict(streamed.config), streamed, streamed.dtype
    tok = hf_tokenizer(folder, config["vocab_size"])
    spec = tok.name if tok.name in ("byte", "world") else os.path.join(folder, "tokenizer.json")
    return Source(folder, config, weights, spec, None, dtype=dtype)


def base_weights(record: object, run: str, override: str | None,
                 error: type[RwkvxError], rehash: bool = False
                 ) -> tuple[Record, Mapping[str, np.ndarray]]:
    """(where the base is now, its weights by parameter name with a
    state-tuned base's states under STATE_KEY) of the run whose checkpoint
    holds record; error (one line) when the base is missing, changed or
    unreadable; rehash: hashed again whatever its files' sizes and mtimes
    (rwkvx_c.run.base.check_base)."""
    now = check_base(record, run, override, error, rehash)
    try:
        src = read_source(now["path"])
    except InteropError as e:
        raise error(f"the base of {run}: {e}") from None
    # as --init-from reads it: a .pth's weights stay in its file until the
    # model reads them, and --base-dtype auto sees the source's dtype
    weights: Mapping[str, np.ndarray] = src.weights
    if src.state0 is not None:
        weights = Layered({STATE_KEY: src.state0}, src.weights)
    return now, weights


class Layered(Mapping[str, np.ndarray]):
    """A checkpoint's own tensors over its base's weights: a name the
    checkpoint holds is its, any other the base's, read from the base only
    when asked for (an x070 .pth or a safetensors base stays in its file),
    so a reader taking one parameter at a time never holds the base twice.
    shape(name) answers without reading; raw_t, raw_blocks, types, compact
    and release pass a base tensor's through (a fine-tune from such a run streams its base as the
    base's own source would, rwkvx_c.train.base); dtype is the base's when
    the checkpoint holds no matrix of its own. hide: names left out of both."""

    def __init__(self, own: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray],
                 hide: Callable[[str], bool] = lambda name: False) -> None:
        self._own, self._base, self._hide = own, base, hide
        self.dtype = "fp32" if any(np.ndim(v) == 2 for k, v in own.items() if not hide(k)) \
            else str(getattr(base, "dtype", "fp32"))

    def __getitem__(self, name: str) -> np.ndarray:
        if self._hide(name):
            raise KeyError(name)
        return self._own[name] if name in self._own else self._base[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and not self._hide(name) and (
            name in self._own or name in self._base)

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self._own if not self._hide(k))
        yield from (k for k in self._base if k not in self._own and not self._hide(k))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def base_dtype(self) -> str:
        """The form of the base's matrices (rwkvx_c.model.weights), whatever
        the checkpoint holds itself."""
        return str(getattr(self._base, "dtype", "fp32"))

    def owns(self, name: str) -> bool:
        """Whether the checkpoint holds name itself (not its base)."""
        return name in self._own

    @property
    def types(self) -> dict[str, str] | None:
        """A GGUF base's tensor types (rwkvx_c.interop.gguf_in) of the names
        the checkpoint does not hold itself; None for any other base (its
        tensors name no form)."""
        types = getattr(self._base, "types", None)
        return None if types is None else {n: t for n, t in types.items() if n not in self._own}

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._own:
            return tuple(self._own[name].shape)
        known = getattr(self._base, "shape", None)
        return tuple(known(name)) if known is not None else tuple(self._base[name].shape)

    def raw_t(self, name: str) -> np.ndarray | None:
        raw = getattr(self._base, "raw_t", None)
        return None if name in self._own or raw is None else raw(name)

    def raw_blocks(self, name: str) -> tuple[str, np.ndarray] | None:
        raw = getattr(self._base, "raw_blocks", None)
        return None if name in self._own or raw is None else raw(name)

    def compact(self, name: str) -> bool:
        small = getattr(self._base, "compact", None)
        return name not in self._own and (small is None or small(name))

    def release(self, name: str) -> None:
        drop = getattr(self._own if name in self._own else self._base, "release", None)
        if drop is not None:
            drop(name)

    def hiding(self, hide: Callable[[str], bool]) -> Layered:
        """The same layers with the names hide picks left out."""
        return Layered(self._own, self._base, hide)


def read_run(path: str, base: str | None = None,
             error: type[RwkvxError] = CheckpointError, rehash: bool = False
             ) -> tuple[Mapping[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """(tensors, config, state) of the checkpoint at path with every
    parameter: a checkpoint that names its base (state[BASE_KEY]) has the
    base's weights under what it holds itself (Layered: each read when
    asked for). base: where that base lies now (--base PATH; error for a
    checkpoint that names none); error, rehash: as base_weights'."""
    tensors, config, state = read_checkpoint(path)
    if state.get(BASE_KEY) is None:
        if base is not None:   # given for nothing: the user thinks it is used
            raise error(f"--base {base}: the checkpoint {path} holds all its weights and names "
                        "no base; leave --base out")
        return tensors, config, state
    _, weights = base_weights(state[BASE_KEY], path, base, error, rehash)
    return Layered(tensors, weights), config, state


def _from_checkpoint(src: str, path: str, folder: str, base: str | None) -> Source:
    try:
        tensors, config, state = read_run(path, base)
    except CheckpointError as e:
        raise InteropError(f"--init-from {src}: {e}") from None
    def run_only(k: str) -> bool:   # the run's optimiser state and states: not weights
        return k.startswith("optim.") or k == STATE_KEY
    weights: Mapping[str, np.ndarray]
    if isinstance(tensors, Layered) and not adapters_of(tensors):
        # its base stays in its file, streamed as that source would be
        weights = tensors.hiding(run_only)
    else:
        weights = {k: np.array(v) for k, v in tensors.items() if not run_only(k)}
    if adapters_of(weights):   # a LoRA run starts the next tune merged
        try:
            weights = without_adapters(weights, run_alpha(state, path))
        except CheckpointError as e:
            raise InteropError(f"--init-from {src}: {e}") from None
    s0 = tensors.get(STATE_KEY)
    ident: Any = state.get("tokenizer")
    try:
        tok = run_tokenizer(folder, ident)
    except TokenizerError as e:
        raise InteropError(f"--init-from {src}: {e}") from None
    spec = tok.name if tok.name in ("byte", "world") else os.path.join(folder, "tokenizer.json")
    return Source(src, ModelConfig.resolve(config), weights, spec,
                  None if s0 is None else np.array(s0),
                  dtype=str(getattr(weights, "dtype", "fp32")))
