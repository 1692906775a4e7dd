"""LoRA adapters as tensors (docs/maths.md §LoRA): their names in a
checkpoint, their targets, and folding them into the weights they adapt.

An adapter on the weight P [in, out] (the arena's orientation, y = x P) is
``P.lora_A`` [r, in] and ``P.lora_B`` [out, r], PEFT's shapes; the model
computes with P + (alpha / r) A^T B^T, which is PEFT's W + (alpha / r) B A
in torch's [out, in]. The RxPtModel binding names its adapter views the
same way (RxPtModel.lora), so a checkpoint stores them under these keys.

The adapter kinds (``--adapter``, ADAPTERS: one declaration each) differ in
their scale and their initialisation; each is a plain LoRA of some alpha
to everything after training (merging, exports but PEFT's own), which
``plain_alpha`` gives, except DoRA, whose magnitudes ``P.lora_magnitude``
[out] rescale the columns of the adapted weight (merging applies them).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from threadpoolctl import threadpool_limits

from rwkvx_c.errors import CheckpointError

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel

__all__ = ["A_SUFFIX", "B_SUFFIX", "TARGETS", "DEFAULT_TARGETS", "target_params",
           "adapters_of", "merge_into", "without_adapters", "ALPHA_OPTION", "run_alpha",
           "run_adapter", "AdapterKind", "ADAPTERS", "ADAPTER_KINDS", "scale", "plain_alpha",
           "core_alpha", "principal_parts", "fold_matrix", "A0_SUFFIX", "B0_SUFFIX",
           "adapters_off", "M_SUFFIX", "magnitudes_of", "dora_merged"]

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
# a principal kind's initial adapters, which its base holds subtracted (checkpoints only)
A0_SUFFIX, B0_SUFFIX = ".lora_A0", ".lora_B0"
M_SUFFIX = ".lora_magnitude"   # DoRA's magnitude [out] of P's columns
ALPHA_OPTION = "lora_alpha"   # the run option that holds alpha (r is A's first dimension)
KIND_OPTION = "adapter"       # the run option that holds the kind (absent: "lora")


@dataclass(frozen=True)
class AdapterKind:
    """One adapter kind of --tune lora (docs/finetune.md §Adapter kinds)."""
    name: str
    says: str             # what it is (the --adapter help)
    root_rank: bool       # the scale is alpha / sqrt(r) (rsLoRA), else alpha / r
    principal: bool       # A, B start as the top-r SVD of W, the base holds the rest (PiSSA)
    peft: Mapping[str, Any]   # what its PEFT adapter_config.json sets beside LoRA's keys
    fold: bool = False    # A fixed, x A^T sums x's r-wide slices, B alone trains, scale 1 (MiSS)
    dora: bool = False    # W_eff's columns scaled to trained magnitudes M / ||W_eff|| (DoRA)


# every adapter kind, by name: the one table --adapter, the scale, the
# exports and the tests read
ADAPTERS = {k.name: k for k in (
    AdapterKind("lora", "LoRA: A kaiming-uniform, B zero, scale alpha/r", False, False, {}),
    AdapterKind("rslora", "rank-stabilised LoRA: LoRA's init, scale alpha/sqrt(r) (PEFT's "
                "use_rslora)", True, False, {"use_rslora": True}),
    AdapterKind("pissa", "PiSSA: A, B the principal r singular directions of W, the frozen "
                "base the residual, scale alpha/r (PEFT's init_lora_weights pissa)", False,
                True, {}),
    AdapterKind("miss", "MiSS: x's r-wide slices summed, times a trained [r, out] block "
                "starting at zero (PEFT's MissConfig; --lora-alpha unused)", False, False,
                {"peft_type": "MISS"}, fold=True),
    AdapterKind("dora", "DoRA: LoRA's A, B and scale alpha/r, each output column of W + "
                "s A^T B^T rescaled to a trained magnitude starting at its norm (PEFT's "
                "use_dora)", False, False, {"use_dora": True}, dora=True),
)}
ADAPTER_KINDS = tuple(ADAPTERS)


def scale(kind: str, r: int, alpha: float) -> float:
    """The factor s of W + s B A for adapters of this kind, rank and alpha."""
    k = ADAPTERS[kind]
    return 1.0 if k.fold else alpha / math.sqrt(r) if k.root_rank else alpha / r


def core_alpha(kind: str, r: int, alpha: float) -> float:
    """The alpha whose alpha / r is the kind's scale: what the C core takes
    (RxPtModel.enable_lora) and merging into the weights the model holds."""
    k = ADAPTERS[kind]
    return float(r) if k.fold else alpha * math.sqrt(r) if k.root_rank else alpha


def plain_alpha(kind: str, r: int, alpha: float) -> float:
    """The alpha of the plain LoRA that a checkpoint's adapters of this kind
    (adapters_of) are on the original base: core_alpha, doubled for a
    principal kind, whose adapters come with their initial ones (rank 2r,
    the same scale)."""
    return core_alpha(kind, r, alpha) * (2 if ADAPTERS[kind].principal else 1)


def fold_matrix(r: int, n_in: int) -> np.ndarray:
    """MiSS's A [r, n_in]: A[k, i] = 1 where i % r == k, so x A^T sums x's
    r-wide slices (PEFT's x.reshape(..., n_in / r, r).sum(-2), x padded
    with zeros to a multiple of r)."""
    return (np.arange(n_in)[None, :] % r == np.arange(r)[:, None]).astype(np.float32)


def principal_parts(W: np.ndarray, r: int, s: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PiSSA's split of W [in, out] (PEFT's pissa_init on torch's W^T = U S
    V^T): A0 = sqrt(S_r / s) V_r^T [r, in], B0 = U_r sqrt(S_r / s) [out, r]
    and the residual W - s A0^T B0^T [in, out], each float32; the SVD and
    the residual in float64 on one BLAS thread, so the same W gives the
    same bits in every process (MPI ranks, a resume)."""
    with threadpool_limits(limits=1, user_api="blas"):
        u, sv, vt = np.linalg.svd(np.asarray(W, np.float64).T, full_matrices=False)
        root = np.sqrt(sv[:r] / s)
        A0 = (root[:, None] * vt[:r]).astype(np.float32)
        B0 = (u[:, :r] * root[None, :]).astype(np.float32)
        res = np.asarray(W, np.float64) - s * (A0.astype(np.float64).T @ B0.astype(np.float64).T)
    return A0, B0, res.astype(np.float32)

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
    """{param: (A, B)} of every adapter among tensors (a checkpoint's), as
    plain LoRA on the original base: a principal kind's with its initial
    A0, B0 (the part its base held subtracted) appended as PEFT converts
    PiSSA, A [A; A0] and B [B, -B0] (W + s (B A - B0 A0) at rank 2r)."""
    out = {}
    for k in tensors:
        p = k[:-len(A_SUFFIX)]
        if not k.endswith(A_SUFFIX) or p + B_SUFFIX not in tensors:
            continue
        A, B = tensors[k], tensors[p + B_SUFFIX]
        if p + A0_SUFFIX in tensors:
            A = np.concatenate([A, tensors[p + A0_SUFFIX]], axis=0)
            B = np.concatenate([B, -np.asarray(tensors[p + B0_SUFFIX])], axis=1)
        out[p] = (A, B)
    return out


def magnitudes_of(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{param: M [out]} of every DoRA adapter among tensors."""
    return {k[:-len(M_SUFFIX)]: np.asarray(tensors[k]).reshape(-1) for k in tensors
            if k.endswith(M_SUFFIX)}


def dora_merged(W: np.ndarray, A: np.ndarray, B: np.ndarray, s: float,
                M: np.ndarray | None) -> np.ndarray:
    """W + s A^T B^T [in, out] in float64, each column o then scaled to
    M[o] / its norm over in when M is given (DoRA, docs/maths.md §DoRA)."""
    eff = np.asarray(W, np.float64) + s * (A.astype(np.float64).T @ B.astype(np.float64).T)
    if M is not None:
        eff *= np.asarray(M, np.float64)[None, :] / np.linalg.norm(eff, axis=0)[None, :]
    return eff


def merge_into(params: MutableMapping[str, np.ndarray],
               adapters: Mapping[str, tuple[np.ndarray, np.ndarray]], alpha: float,
               magnitudes: Mapping[str, np.ndarray] | None = None) -> None:
    """params[P] = P + (alpha / r) A^T B^T for every adapter (DoRA's with
    magnitudes: dora_merged), in float64 then rounded once to float32 (in
    place for arrays that are views)."""
    for name, (A, B) in adapters.items():
        M = (magnitudes or {}).get(name)
        params[name][...] = dora_merged(params[name], A, B, alpha / A.shape[0],
                                        M).astype(np.float32)


def without_adapters(tensors: Mapping[str, np.ndarray], alpha: float | None
                     ) -> dict[str, np.ndarray]:
    """A copy of tensors with the adapters folded into their weights and
    dropped (the merged model); unchanged when there are none."""
    ads = adapters_of(tensors)
    out = {k: v for k, v in tensors.items()
           if not k.endswith((A_SUFFIX, B_SUFFIX, A0_SUFFIX, B0_SUFFIX, M_SUFFIX))}
    if ads:
        assert alpha is not None, "adapters come with their alpha"
        for name in ads:
            out[name] = np.array(out[name], dtype=np.float32)
        merge_into(out, ads, alpha, magnitudes_of(tensors))
    return out


def run_alpha(state: Mapping[str, Any] | None, path: str) -> float:
    """The plain alpha (plain_alpha) of a LoRA run's checkpoint."""
    kind, r, alpha = run_adapter(state, path)
    return plain_alpha(kind, r, alpha)


def run_adapter(state: Mapping[str, Any] | None, path: str) -> tuple[str, int, float]:
    """(kind, r, alpha) of a LoRA run's checkpoint (its options hold them;
    imported adapters: their record's kind and alpha); CheckpointError
    when its run state does not say."""
    opts = (state or {}).get("options") or {}
    a, kind, r = opts.get(ALPHA_OPTION), opts.get(KIND_OPTION, "lora"), opts.get("lora_r")
    if a is None:   # imported adapters (rwkvx-c import --base): their own record
        record = (state or {}).get("lora") or {}
        a, kind, r = record.get("alpha"), record.get("kind", "lora"), record.get("r")
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < float("inf"):
        raise CheckpointError(f"checkpoint {path} holds LoRA adapters but no valid "
                              f"{ALPHA_OPTION} in its options ({a!r})")
    if kind not in ADAPTERS:
        raise CheckpointError(f"checkpoint {path} holds adapters of kind {kind!r}; this "
                              f"version knows {', '.join(ADAPTER_KINDS)}")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise CheckpointError(f"checkpoint {path} holds LoRA adapters but no valid rank "
                              f"lora_r ({r!r})")
    return kind, r, float(a)


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
    dora = any(k.endswith(M_SUFFIX) for k in lora)
    model.disable_lora()
    try:
        yield
    finally:
        model.enable_lora(r, alpha, names, dora=dora)
