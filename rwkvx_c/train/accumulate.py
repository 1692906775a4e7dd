"""Gradient accumulation (--grad-accum N): one optimiser step over N
micro-batches of --batch sequences, as one batch N times larger.

Each micro-batch's backward overwrites the grad buffers with the grad of
its own mean loss; the step needs the grad of the mean over all N of them,
the micro-batches' grads weighted by their share of the counted targets
(1/N each, unless a chat corpus's masks leave some targets out). The sum
runs in a buffer of the trained grads' size, allocated once per optimiser
(_core.axpby: no allocation inside a step, no copy back):

    micro 1 .. N-1:  acc  = w_k * grad + (k > 1) * acc
    micro N:         grad = w_N * grad + acc

so the optimiser finds the weighted sum where it reads its grads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.sampler import IGNORE, count_targets
from rwkvx_c.train.optim import AdamW

if TYPE_CHECKING:
    from rwkvx_c.train.finetune import PartsAdamW

__all__ = ["GradAccumulator"]


class GradAccumulator:
    """The weighted sum of N micro-batches' grads, into the buffers optim reads."""

    def __init__(self, optim: AdamW | PartsAdamW) -> None:
        self.optim = optim
        self.grads = optim.grad_buffers()
        acc = np.zeros(sum(g.size for g in self.grads), np.float32)
        self.acc: list[np.ndarray] = []
        off = 0
        for g in self.grads:
            self.acc.append(acc[off:off + g.size])
            off += g.size

    def backward(self, model: _core.RxPtModel, x: np.ndarray, y: np.ndarray,
                 rows: tuple[int, int], batch: int, masked: bool) -> float:
        """The step's mean loss over the micro-batches of `batch` sequences in
        (x, y) (this rank's `rows` of each), its grads in the optimiser's
        buffers. masked: a chat corpus, whose micro-batches weigh by their
        counted targets (without masks they are equal)."""
        lo, hi = rows
        n = len(x) // batch
        parts = [slice(k * batch + lo, k * batch + hi) for k in range(n)]
        counts = [count_targets(y[p]) for p in parts] if masked else [1] * n
        total = sum(counts) or n
        loss = 0.0
        for k, p in enumerate(parts):
            model.forward(x[p], return_logits=False)
            w = counts[k] / total
            loss += w * model.backward(y[p], IGNORE)
            self.add(k, n, w)
        return loss

    def add(self, k: int, n: int, weight: float) -> None:
        """Adds micro-batch k (0-based) of n, weighted, whose backward just ran."""
        for g, a in zip(self.grads, self.acc):
            if k < n - 1:
                _core.axpby(weight, g, 1.0 if k else 0.0, a)
            else:
                _core.axpby(1.0, a, weight, g)
