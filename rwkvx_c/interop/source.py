"""The weights a fine-tune starts from (``rwkvx-c train --init-from SRC``):
a run folder, a checkpoint file, or an x070 / RWKV-X ``.pth`` read with the
rules of ``rwkvx-c import`` (rwkvx_c.interop.rwkv7).

read_source returns the model config, the weights by parameter name, the
tokenizer the source was trained with (when it says) and, for a
state-tuned source, its trained initial states (a LoRA-tuned source's
weights come merged); nothing of the source's
optimiser or run state comes along: the fine-tune is a new run.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rwkvx_c.data.tokenizers import WORLD_VOCAB_SIZE, run_tokenizer
from rwkvx_c.errors import CheckpointError, InteropError, TokenizerError
from rwkvx_c.interop.pth import PthTensors, load_pth
from rwkvx_c.interop.rwkv7 import from_rwkv7, from_rwkvx, stream_rwkv7
from rwkvx_c.model.lora import adapters_of, run_alpha, without_adapters
from rwkvx_c.run.checkpoint import STATE_KEY, read_checkpoint
from rwkvx_c.run.rundir import RunDir

__all__ = ["Source", "read_source", "STATE_KEY"]


@dataclass
class Source:
    """A fine-tune's starting point. tokenizer: a spec for
    rwkvx_c.data.tokenizers.load (byte, world, a tokenizer.json path), None
    when the source names none (a .pth of another vocabulary size)."""
    path: str
    config: dict[str, int]
    weights: Mapping[str, np.ndarray]   # an x070 .pth's: read tensor by tensor when asked
    tokenizer: str | None
    state0: np.ndarray | None
    dtype: str = "fp32"   # "bf16": every matrix of the source is bf16 (--base-dtype auto)


def read_source(src: str) -> Source:
    """The Source at src; InteropError (one line) when it is none of a run
    folder with a checkpoint, a checkpoint file or a .pth."""
    if os.path.isdir(src):
        run = RunDir(src)
        if not run.has_checkpoint():
            raise InteropError(f"--init-from {src}: the folder holds no checkpoint")
        return _from_checkpoint(src, run.checkpoint, src)
    if not os.path.isfile(src):
        raise InteropError(f"--init-from {src}: no such file or folder")
    if src.endswith(".pth"):
        pth = PthTensors(src)
        if not any(k.startswith("rwkv.") for k in pth.names):   # x070: streamed
            streamed = stream_rwkv7(pth)
            tok = "world" if streamed.config["vocab_size"] == WORLD_VOCAB_SIZE else None
            return Source(src, dict(streamed.config), streamed, tok, None, streamed.dtype)
        pth.close()
        sd = load_pth(src)
        model = from_rwkvx(sd) if any(k.startswith("rwkv.") for k in sd) else from_rwkv7(sd)
        weights = {n: np.array(model.params[n]) for n in model.param_names}
        tok = "world" if model.config["vocab_size"] == WORLD_VOCAB_SIZE else None
        return Source(src, model.config, weights, tok, None)
    return _from_checkpoint(src, src, os.path.dirname(os.path.abspath(src)))


def _from_checkpoint(src: str, path: str, folder: str) -> Source:
    try:
        tensors, config, state = read_checkpoint(path)
    except CheckpointError as e:
        raise InteropError(f"--init-from {src}: {e}") from None
    weights = {k: np.array(v) for k, v in tensors.items()
               if not k.startswith("optim.") and k != STATE_KEY}
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
    return Source(src, {"ln0": 0, **dict(config)}, weights, spec,
                  None if s0 is None else np.array(s0))
