"""Training batches and validation windows from a 1-D token array.

Training: each batch draws B window starts uniformly with a seeded PCG64
generator whose state a checkpoint stores, so a resumed run draws the same
stream. Validation: fixed windows at evenly spaced offsets, the same at
every evaluation.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rwkvx_c.errors import DataError

__all__ = ["BatchSampler", "eval_windows", "eval_starts"]


class BatchSampler:
    """Random (B, T) training windows from a 1-D token array.

    Each batch draws B start offsets uniformly from [0, len - T - 1] with a
    numpy PCG64 Generator seeded by `seed`; inputs are tokens[o:o+T], targets
    tokens[o+1:o+T+1]. state()/set_state() capture the generator and the
    number of batches drawn, so a restored sampler continues the same stream.
    """

    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int) -> None:
        if len(tokens) < seq_len + 1:
            raise DataError(f"corpus split of {len(tokens)} tokens is shorter than "
                            f"seq_len + 1 = {seq_len + 1}")
        self.tokens, self.batch, self.seq_len = tokens, int(batch), int(seq_len)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.batches = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), both int32 (B, T)."""
        T = self.seq_len
        offs = self.rng.integers(0, len(self.tokens) - T, size=self.batch)
        win = np.stack([np.asarray(self.tokens[o:o + T + 1]) for o in offs]).astype(np.int32)
        self.batches += 1
        return np.ascontiguousarray(win[:, :T]), np.ascontiguousarray(win[:, 1:])

    def state(self) -> dict[str, Any]:
        """JSON-serialisable sampler state."""
        return {"bit_generator": self.rng.bit_generator.state, "batches": self.batches}

    def set_state(self, st: dict[str, Any]) -> None:
        self.rng.bit_generator.state = st["bit_generator"]
        self.batches = int(st["batches"])


def eval_starts(n_tokens: int, seq_len: int, n_windows: int) -> np.ndarray:
    """The starts of eval_windows' windows in a split of n_tokens tokens."""
    T = seq_len
    span = n_tokens - T - 1
    n = max(1, min(int(n_windows), span // T + 1 if span > 0 else 1))
    return np.linspace(0, max(span, 0), n).astype(np.int64)


def eval_windows(tokens: np.ndarray, seq_len: int,
                 n_windows: int) -> tuple[np.ndarray, np.ndarray]:
    """Fixed validation windows: up to n_windows (T+1)-token windows at evenly
    spaced offsets covering the split (the same every call)."""
    T = seq_len
    offs = eval_starts(len(tokens), T, n_windows)
    win = np.stack([np.asarray(tokens[o:o + T + 1]) for o in offs]).astype(np.int32)
    return np.ascontiguousarray(win[:, :T]), np.ascontiguousarray(win[:, 1:])
