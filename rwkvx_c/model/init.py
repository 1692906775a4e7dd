"""Parameter initialisation for training, selectable by name.

``init_model(model, scheme, seed)`` writes through ``model.params`` (zero-copy
views of the parameter arena), so it works on any model that uses the docs/layout.md §Parameters
names. Schemes:

``"spec"``
    Leave the parameters as the C model drew them: the docs/layout.md §Init splitmix64
    test init (uniform, every element O(0.1)). It exists for gradient checks;
    it trains, but slowly.

``"rwkv7"`` (the trainer's default)
    The RWKV-7 ("x070") training init of BlinkDL's RWKV-LM, restated for
    this model's [in,out] matrices, plus the same choices for the MoBA
    attention blocks. With C channels, head size N, channel index i, a
    block's depth d = L / (n_blocks - 1) (0 at the first block, 1 at the
    last) and r1 = 1 - L / n_blocks (1 at the first block, 1/n at the last):

    - ``emb``: uniform(-1e-4, 1e-4). A tiny embedding lets the first
      LayerNorm see pure direction; Adam grows it within a few steps.
    - token-shift lerps ``x_@ = 1 - (i/C)^(p_@ * r1)`` with p = 0.2 (r, g),
      0.7 (k, v), 0.9 (w, a); channel-mix ``ffn_x_k = 1 - (i/C)^(r1^4)``.
      Every channel gets a different mix of the previous token, from 1 at
      i = 0 down towards 0; deeper blocks lean on the current token more.
    - decay offsets ``w0 = -6 + 6 (i/(C-1))^(1 + d^0.3) + 0.5 + 2.5 z``
      with z the per-head zigzag ``z = s |s|``, ``s = (i mod N - (N-1)/2) /
      ((N-1)/2)``: a spread of decay speeds across channels and within each
      head, so the state holds both short and long memories. The effective
      decay is exp(-e^-0.5 sigmoid(w0 + ...)) (docs/maths.md §Time-mix).
    - ``a0 = -0.19 + 0.3 z + 0.4 l`` (in-context learning rate ~0.45),
      ``v0 = 0.73 - 0.4 l`` (value-residual gate), ``k_k = 0.71 - 0.1 l``,
      ``k_a = 1.02``, ``r_k = -0.04``, with ``l = i/(C-1) - 0.5``.
    - LoRAs: ``w1, a1, v1, g1 = 0``; ``w2, a2, v2, g2`` orthogonal with
      gain 0.1 (times sqrt(rows/cols) when taller than wide), so every gate
      starts at its offset and learns its input dependence.
    - projections orthogonal: receptance and value gain 1, key gain 0.1,
      ``output_w = 0``; channel-mix ``ffn_key_w`` orthogonal gain 1,
      ``ffn_value_w = 0``. Every block starts as the identity on the
      residual stream.
    - group norm ``ln_x_w = ((1 + L) / n_blocks)^0.7``, ``ln_x_b = 0``;
      every LayerNorm gain 1, bias 0 (``ln0`` included, when the model has it).
    - ``head``: orthogonal with gain 0.5 (0.5 sqrt(vocab/C) when vocab > C).
    - attention blocks: query, key, value orthogonal gain 1, ``output_w``
      zero, LayerNorms 1/0, their channel-mix as above.

    The random parts (orthogonal matrices, emb) come from a NumPy PCG64
    generator seeded with `seed`, tensors in docs/layout.md §Parameters order.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from threadpoolctl import threadpool_limits

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel

__all__ = ["SCHEMES", "init_model"]

SCHEMES = ("rwkv7", "spec")

_LERP_POWER = {"x_r": 0.2, "x_g": 0.2, "x_k": 0.7, "x_v": 0.7, "x_w": 0.9, "x_a": 0.9}
_LORA_UP = ("w2", "a2", "v2", "g2")
_LORA_DOWN = ("w1", "a1", "v1", "g1")
_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _orthogonal(rng: np.random.Generator, rows: int, cols: int, gain: float) -> np.ndarray:
    """A rows x cols matrix with orthonormal rows or columns (whichever fit), times gain."""
    big, small = max(rows, cols), min(rows, cols)
    q, r = np.linalg.qr(rng.standard_normal((big, small)))
    q *= np.sign(np.diag(r))  # Haar-uniform, not biased by the QR sign convention
    return gain * (q if rows >= cols else q.T)


def _block_kinds(names: Iterable[str]) -> dict[int, str]:
    """{block index: 'rwkv' | 'attn'} from the parameter names."""
    kinds: dict[int, str] = {}
    for n in names:
        m = _NAME.match(n)
        if m:
            L, rest = int(m.group(1)), m.group(2)
            if rest.startswith("tm."):
                kinds[L] = "rwkv"
            else:
                kinds.setdefault(L, "attn")
    return kinds


def _rwkv7_value(name: str, shape: tuple[int, ...], rng: np.random.Generator,
                 cfg: dict[str, int], kinds: dict[int, str]) -> Any:
    """The rwkv7-scheme value of one tensor, float64."""
    C, N = cfg["n_embd"], cfg["head_size"]
    vocab = cfg["vocab_size"]
    i = np.arange(C, dtype=np.float64)
    frac = i / C
    lin = i / max(C - 1, 1) - 0.5
    s = ((i % N) - (N - 1) / 2) / ((N - 1) / 2) if N > 1 else np.zeros(C)
    zig = s * np.abs(s)
    if name == "emb":
        return rng.uniform(-1e-4, 1e-4, size=shape)
    if name == "head":
        gain = 0.5 * np.sqrt(vocab / C) if vocab > C else 0.5
        return _orthogonal(rng, shape[0], shape[1], gain)
    if name in ("ln0_w", "ln_out_w"):
        return np.ones(shape)
    if name in ("ln0_b", "ln_out_b"):
        return np.zeros(shape)
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"unknown parameter name {name!r}")
    L, rest = int(m.group(1)), m.group(2)
    nb = len(kinds)
    depth = L / (nb - 1) if nb > 1 else 0.0
    r1 = 1.0 - L / nb
    field = rest.split(".")[-1]
    if field in ("ln1_w", "ln2_w"):
        return np.ones(shape)
    if field in ("ln1_b", "ln2_b", "ln_x_b"):
        return np.zeros(shape)
    if field == "ffn_x_k":
        return 1.0 - frac ** (r1 ** 4)
    if field == "ffn_key_w":
        return _orthogonal(rng, shape[0], shape[1], 1.0)
    if field in ("ffn_value_w", "output_w"):
        return np.zeros(shape)
    if field in _LERP_POWER:
        return 1.0 - frac ** (_LERP_POWER[field] * r1)
    if field == "w0":
        return -6.0 + 6.0 * (i / max(C - 1, 1)) ** (1.0 + depth ** 0.3) + 0.5 + 2.5 * zig
    if field == "a0":
        return -0.19 + 0.3 * zig + 0.4 * lin
    if field == "v0":
        return 0.73 - 0.4 * lin
    if field == "k_k":
        return 0.71 - 0.1 * lin
    if field == "k_a":
        return np.full(shape, 1.02)
    if field == "r_k":
        return np.full(shape, -0.04)
    if field == "ln_x_w":
        return np.full(shape, ((1 + L) / nb) ** 0.7)
    if field in _LORA_DOWN:
        return np.zeros(shape)
    if field in _LORA_UP:
        gain = 0.1 * (np.sqrt(shape[0] / shape[1]) if shape[0] > shape[1] else 1.0)
        return _orthogonal(rng, shape[0], shape[1], gain)
    if field == "key_w" and kinds.get(L) == "rwkv":
        return _orthogonal(rng, shape[0], shape[1], 0.1)
    if field in ("receptance_w", "key_w", "value_w"):
        return _orthogonal(rng, shape[0], shape[1], 1.0)
    raise ValueError(f"no rwkv7 init rule for parameter {name!r}")


def init_model(model: RxPtModel, scheme: str = "rwkv7", seed: int = 0) -> RxPtModel:
    """Initialise model's parameters in place with the named scheme.

    model : anything with .param_names, .params (name -> writable float32
            view, docs/layout.md §Parameters names and shapes) and .config (dict)
    scheme: "rwkv7" (RWKV-7 training init) or "spec" (keep the C test init)
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown init scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "spec":
        return model
    cfg = model.config
    rng = np.random.Generator(np.random.PCG64(seed))
    kinds = _block_kinds(model.param_names)
    # The orthogonal matrices come from NumPy's QR. With BLAS threads running
    # it on a busy 2-core machine their spin-waits fought the other processes
    # and the init took 12 s instead of 0.3 s; the matrices are small, one
    # thread is plenty.
    with threadpool_limits(limits=1, user_api="blas"):
        for name in model.param_names:
            view = model.params[name]
            val = np.asarray(_rwkv7_value(name, view.shape, rng, cfg, kinds), dtype=np.float64)
            view[...] = np.broadcast_to(val, view.shape).astype(np.float32)
    return model
