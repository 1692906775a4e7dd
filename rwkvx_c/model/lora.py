"""LoRA adapters as tensors (docs/maths.md §LoRA): their names in a
checkpoint, their targets, and folding them into the weights they adapt.

An adapter on the weight P [in, out] (the arena's orientation, y = x P) is
``P.lora_A`` [r, in] and ``P.lora_B`` [out, r], PEFT's shapes; the model
computes with P + (alpha / r) A^T B^T, which is PEFT's W + (alpha / r) B A
in torch's [out, in]. The RxPtModel binding names its adapter views the
same way (RxPtModel.lora), so a checkpoint stores them under these keys.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c.errors import CheckpointError

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel

__all__ = ["A_SUFFIX", "B_SUFFIX", "TARGETS", "DEFAULT_TARGETS", "target_params",
           "adapters_of", "merge_into", "without_adapters", "ALPHA_OPTION", "run_alpha",
           "adapters_off"]

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
ALPHA_OPTION = "lora_alpha"   # the run option that holds alpha (r is A's first dimension)

# --lora-targets names -> (block kind, parameter name within the block)
TARGETS = {
    "att.receptance": ("R", "tm.receptance_w"), "att.key": ("R", "tm.key_w"),
    "att.value": ("R", "tm.value_w"), "att.output": ("R", "tm.output_w"),
    "ffn.key": ("R", "cm.ffn_key_w"), "ffn.value": ("R", "cm.ffn_value_w"),
    "attn.q": ("A", "receptance_w"), "attn.k": ("A", "key_w"), "attn.v": ("A", "value_w"),
    "attn.o": ("A", "output_w"), "attn.ffn.key": ("A", "cm.ffn_key_w"),
    "attn.ffn.value": ("A", "cm.ffn_value_w"),
}
DEFAULT_TARGETS = tuple(t for t in TARGETS if not t.startswith("attn.ffn."))


def target_params(layers: str, targets: tuple[str, ...]) -> list[str]:
    """The parameter names the targets name in a model of these block kinds
    ("RRA..."): block by block, each block's in TARGETS' order (receptance,
    key, value, output, channel-mix key, value), whatever order targets has."""
    return [f"blocks.{L}.{p}" for L, kind in enumerate(layers)
            for name, (k, p) in TARGETS.items() if k == kind and name in targets]


def adapters_of(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{param: (A, B)} of every adapter among tensors (a checkpoint's)."""
    return {k[:-len(A_SUFFIX)]: (tensors[k], tensors[k[:-len(A_SUFFIX)] + B_SUFFIX])
            for k in tensors if k.endswith(A_SUFFIX) and k[:-len(A_SUFFIX)] + B_SUFFIX in tensors}


def merge_into(params: MutableMapping[str, np.ndarray],
               adapters: Mapping[str, tuple[np.ndarray, np.ndarray]], alpha: float) -> None:
    """params[P] = P + (alpha / r) A^T B^T for every adapter, in float64 then
    rounded once to float32 (in place for arrays that are views)."""
    for name, (A, B) in adapters.items():
        r = A.shape[0]
        w = np.asarray(params[name], dtype=np.float64)
        merged = w + (alpha / r) * (A.astype(np.float64).T @ B.astype(np.float64).T)
        params[name][...] = merged.astype(np.float32)


def without_adapters(tensors: Mapping[str, np.ndarray], alpha: float | None
                     ) -> dict[str, np.ndarray]:
    """A copy of tensors with the adapters folded into their weights and
    dropped (the merged model); unchanged when there are none."""
    ads = adapters_of(tensors)
    out = {k: v for k, v in tensors.items() if not k.endswith((A_SUFFIX, B_SUFFIX))}
    if ads:
        assert alpha is not None, "adapters come with their alpha"
        for name in ads:
            out[name] = np.array(out[name], dtype=np.float32)
        merge_into(out, ads, alpha)
    return out


def run_alpha(state: Mapping[str, Any] | None, path: str) -> float:
    """The adapters' alpha of a LoRA run's checkpoint (its options hold it);
    CheckpointError when its run state does not say."""
    a = ((state or {}).get("options") or {}).get(ALPHA_OPTION)
    if a is None:   # imported adapters (rwkvx-c import --base): their own record
        a = ((state or {}).get("lora") or {}).get("alpha")
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < float("inf"):
        raise CheckpointError(f"checkpoint {path} holds LoRA adapters but no valid "
                              f"{ALPHA_OPTION} in its options ({a!r})")
    return float(a)


@contextmanager
def adapters_off(model: RxPtModel) -> Iterator[None]:
    """model without its LoRA adapters for the span (its base, bit for bit:
    the adapters are applied unmerged), the same adapters on again after."""
    lora = model.lora
    if not lora:
        yield
        return
    r, alpha = model.lora_rank or (0, 0.0)
    names = list(dict.fromkeys(k.rsplit(".lora_", 1)[0] for k in lora))
    model.disable_lora()
    try:
        yield
    finally:
        model.enable_lora(r, alpha, names)
