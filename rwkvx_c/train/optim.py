"""AdamW over a model's flat parameter arena.

The update itself runs in C (``rwkvx_c.adamw_step``, csrc/optim.c) in place
on ``model.param_buffer``; the first and second moments live in two flat
float32 buffers of the same length. Weight decay applies to matrices only
(every 2-D parameter tensor); vectors -- lerps, biases, norm gains, decay and
gate offsets -- are never decayed.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from rwkvx_c._core import adamw_step, grad_norm

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel

__all__ = ["AdamW", "decay_ranges"]


def _offset(view: np.ndarray, base: np.ndarray) -> int:
    """Element offset of a float32 view inside the flat arena `base`."""
    return (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // 4


def decay_ranges(model: RxPtModel,
                 predicate: Callable[[str, np.ndarray], bool] | None = None) -> np.ndarray:
    """(R, 2) int64 [begin, end) element ranges of the arena that get weight decay.

    predicate(name, array) -> bool picks the tensors; the default is every 2-D
    tensor (projection matrices, LoRA factors, emb and head). Adjacent ranges
    are merged, so the C loop walks few segments.
    """
    if predicate is None:
        def predicate(name: str, a: np.ndarray) -> bool:
            return a.ndim == 2
    base = model.param_buffer
    spans: list[tuple[int, int]] = []
    for name in model.param_names:
        a = model.params[name]
        if predicate(name, a):
            b = _offset(a, base)
            spans.append((b, b + a.size))
    spans.sort()
    merged: list[list[int]] = []
    for b, e in spans:
        if merged and merged[-1][1] == b:
            merged[-1][1] = e
        else:
            merged.append([b, e])
    return np.array(merged, dtype=np.int64).reshape(-1, 2)


class AdamW:
    """Decoupled AdamW over flat buffers, with global grad-norm clipping.

    params, grads : the model's param_buffer / grad_buffer (float32 (n,), zero-copy)
    ranges        : weight-decay ranges (see decay_ranges)
    grad_clip     : clip the global grad norm to this (<= 0: no clipping)
    State: m, v (float32 (n,)) and t, the number of steps taken.
    """

    def __init__(self, params: np.ndarray, grads: np.ndarray, ranges: np.ndarray, *,
                 betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8,
                 weight_decay: float = 0.1, grad_clip: float = 1.0) -> None:
        self.params, self.grads = params, grads
        self.ranges = np.ascontiguousarray(ranges, dtype=np.int64).reshape(-1, 2)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.grad_clip = float(grad_clip)
        self.m = np.zeros_like(params)
        self.v = np.zeros_like(params)
        self.t = 0

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients this optimiser applies."""
        return grad_norm(self.grads)

    def grad_buffers(self) -> list[np.ndarray]:
        """The gradients this optimiser applies (what MPI ranks average)."""
        return [self.grads]

    def step(self, lr: float, norm: float | None = None) -> float:
        """One update with learning rate lr; returns the grad norm before
        clipping. norm: the global grad norm to clip by, when the caller has
        computed it already or these buffers are part of a larger set (None:
        theirs)."""
        if norm is None:
            norm = grad_norm(self.grads)
        if not math.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm}: the loss diverged "
                                     "(try a lower --lr)")
        scale = 1.0
        if self.grad_clip > 0 and norm > self.grad_clip:
            scale = self.grad_clip / (norm + 1e-6)
        self.t += 1
        adamw_step(self.params, self.grads, self.m, self.v, lr=lr, step=self.t,
                   beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                   weight_decay=self.weight_decay, decay_ranges=self.ranges,
                   grad_scale=scale)
        return norm
