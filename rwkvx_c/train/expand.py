"""RWKV-X's long-context recipe, first step: a pure RWKV-7 model becomes a
hybrid by inserting MoBA attention blocks (``--init-from RWKV7 --n-attn-layer
K``), and at step 0 the hybrid computes exactly the RWKV-7 model's logits.

Placement is the model's own layer rule (docs/maths.md §Whole model): one
attention block after each group of n_rwkv_layer / K RWKV blocks, the
order RWKV-X's get_block_exe_order gives when K divides n_rwkv_layer.

Initialisation follows RWKV-X's repository (init_moba_from_rwkv) where it
can and its paper where it must: an attention block starts from the RWKV
block right before it -- its receptance/key/value become the query/key/
value projections, and its LayerNorms and channel-mix key and lerp are
copied -- but the attention output projection and the channel-mix value
projection start at zero (the paper's zero output projection; the
repository copies the RWKV block's output weights too, which would change
the logits at step 0). Both residual branches of a new block then add
exactly zero, so the hybrid is the RWKV-7 model until it trains; train the
new blocks alone first with ``--freeze`` of everything else, as RWKV-X's
--only_train_moba does, then everything at long T.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from rwkvx_c.errors import ConfigError, TrainError
from rwkvx_c.model.config import ModelConfig

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel

__all__ = ["ATTN_FIELDS", "expanded_config", "place_weights"]

# the config fields an expansion sets; every other must match the source
ATTN_FIELDS = ("n_attn_layer", "chunk_size", "moba_top_k")
# attention block field <- the RWKV block's field it starts from (None: zero)
_FROM_RWKV = {"ln1_w": "ln1_w", "ln1_b": "ln1_b", "ln2_w": "ln2_w", "ln2_b": "ln2_b",
              "receptance_w": "tm.receptance_w", "key_w": "tm.key_w", "value_w": "tm.value_w",
              "output_w": None, "cm.ffn_x_k": "cm.ffn_x_k", "cm.ffn_key_w": "cm.ffn_key_w",
              "cm.ffn_value_w": None}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def expanded_config(source: Mapping[str, int], asked: Mapping[str, int]) -> dict[str, int] | None:
    """The hybrid config when `asked` adds attention blocks to a source that
    has none (chunk_size and moba_top_k as asked, else the source's), else
    None. TrainError when the hybrid cannot be built."""
    k = asked.get("n_attn_layer")
    if not k or source.get("n_attn_layer", 0):
        return None
    cfg = dict(source)
    cfg.update({f: asked[f] for f in ATTN_FIELDS if f in asked})
    try:
        return ModelConfig.from_dict(cfg).to_dict()
    except ConfigError as e:
        raise TrainError(f"cannot add {k} attention blocks to the source: {e}") from None


def place_weights(model: RxPtModel,
                  weights: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """weights (a source's, by its parameter names) under `model`'s names.
    The same names pass through; when the model has attention blocks the
    source lacks, RWKV block i of the source is the model's i-th RWKV block
    and each attention block starts as the module doc says."""
    if all(n in weights for n in model.param_names):
        return weights   # as it is: a streamed source stays unread
    rwkv = [L for L, kind in enumerate(model.layers) if kind == "R"]
    src_of = {L: i for i, L in enumerate(rwkv)}   # model block -> source RWKV block
    out: dict[str, np.ndarray] = {}
    for n in model.param_names:   # a name the source lacks is load_params' to refuse
        m = _BLOCK.match(n)
        if m is None or int(m.group(1)) in src_of:
            theirs = n if m is None else f"blocks.{src_of[int(m.group(1))]}.{m.group(2)}"
            if theirs in weights:
                out[n] = weights[theirs]
            continue
        L, field = int(m.group(1)), m.group(2)
        before = f"blocks.{src_of[max(r for r in rwkv if r < L)]}."
        start = _FROM_RWKV[field]
        out[n] = np.zeros_like(model.params[n]) if start is None else weights[before + start]
    return out
