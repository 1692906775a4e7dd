"""Training batches and validation windows from a 1-D token array.

Training: each batch draws B window starts uniformly with a seeded PCG64
generator whose state a checkpoint stores, so a resumed run draws the same
stream. Validation: fixed windows at evenly spaced offsets, the same at
every evaluation. With a chat corpus's mask (rwkvx_c.data.chat) a target
the loss leaves out is IGNORE, which the model's loss and backward take as
their ignore_index. Aligned (a state tune's windows), every window starts
where a conversation does (conversation_starts, those whose window holds
an assistant token): its first conversation begins from the model's
initial state, as a chat does at inference, which is what a state tune
learns. (Unaligned windows start anywhere, so a short T still sees the
assistant turns of long conversations.)
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rwkvx_c.data.chat import IGNORE, SEPARATOR
from rwkvx_c.errors import DataError
from rwkvx_c.model import memory

__all__ = ["BatchSampler", "eval_windows", "eval_starts", "IGNORE", "target_bytes",
           "count_targets", "conversation_starts"]


def _targets(tokens: np.ndarray, mask: np.ndarray | None, offs: np.ndarray,
             T: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) int32 (len(offs), T) of the windows at offs; a
    target whose mask is 0 is IGNORE."""
    win = np.stack([np.asarray(tokens[o:o + T + 1]) for o in offs]).astype(np.int32)
    y = win[:, 1:]
    if mask is not None:
        keep = np.stack([np.asarray(mask[o + 1:o + T + 1]) for o in offs]).astype(bool)
        y = np.where(keep, y, np.int32(IGNORE))
    return np.ascontiguousarray(win[:, :T]), np.ascontiguousarray(y, dtype=np.int32)


def conversation_starts(tokens: np.ndarray, mask: np.ndarray, seq_len: int) -> np.ndarray:
    """The offsets in a chat split where a conversation starts (its first
    token, and every token after a SEPARATOR), a (T+1)-token window fits
    and its targets hold a trained token (mask); DataError when none does
    (every prompt is longer than T)."""
    T = seq_len
    n = len(tokens) - T - 1
    starts = np.concatenate([[0], np.flatnonzero(np.asarray(tokens[:max(n, 0)]) == SEPARATOR)
                             + 1]).astype(np.int64)
    starts = starts[starts <= n]
    # trained targets in window o: mask[o+1 .. o+T], by a running count
    run = np.concatenate([[0], np.cumsum(np.asarray(mask, dtype=np.int64))])
    starts = starts[run[starts + T + 1] - run[starts + 1] > 0]
    if not starts.size:
        raise DataError(f"no conversation of the {len(tokens)}-token split reaches an assistant "
                        f"token within seq_len = {T} tokens of its start (a state tune's "
                        "windows start at conversations); raise --seq-len")
    return starts


def count_targets(y: np.ndarray) -> int:
    """The targets of y the loss counts (not IGNORE)."""
    return int(np.count_nonzero(y != IGNORE))


def target_bytes(y: np.ndarray, token_bytes: np.ndarray | None, is_bytes: bool) -> int | None:
    """The text bytes the counted targets of y decode to (val_bpb's
    divisor): by token_bytes, one each for bytes, None when unknown."""
    keep = y[y != IGNORE]
    if token_bytes is not None:
        return int(token_bytes[keep].sum())
    return keep.size if is_bytes else None


class BatchSampler:
    """Random (B, T) training windows from a 1-D token array.

    Each batch draws B start offsets uniformly from [0, len - T - 1] with a
    numpy PCG64 Generator seeded by `seed`; inputs are tokens[o:o+T], targets
    tokens[o+1:o+T+1]. state()/set_state() capture the generator and the
    number of batches drawn, so a restored sampler continues the same stream.
    mask: a chat corpus's trained-token mask (targets with mask 0 are
    IGNORE); aligned: the starts are drawn uniformly from its conversation
    starts instead.
    """

    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int,
                 mask: np.ndarray | None = None, aligned: bool = False) -> None:
        if len(tokens) < seq_len + 1:
            raise DataError(f"corpus split of {len(tokens)} tokens is shorter than "
                            f"seq_len + 1 = {seq_len + 1}")
        # checked before the first draw: a batch (x --grad-accum) far beyond
        # memory would grow until the process is killed
        memory.check(memory.batch_bytes(batch, seq_len), f"a step's {batch:,} windows of "
                     f"{seq_len + 1} tokens", "lower --batch or --grad-accum")
        self.tokens, self.batch, self.seq_len = tokens, int(batch), int(seq_len)
        self.mask = mask
        self.starts = conversation_starts(tokens, mask, self.seq_len) \
            if aligned and mask is not None else None
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.batches = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), both int32 (B, T)."""
        T = self.seq_len
        if self.starts is None:
            offs = self.rng.integers(0, len(self.tokens) - T, size=self.batch)
        else:
            offs = self.starts[self.rng.integers(0, self.starts.size, size=self.batch)]
        self.batches += 1
        return _targets(self.tokens, self.mask, offs, T)

    def state(self) -> dict[str, Any]:
        """JSON-serialisable sampler state."""
        return {"bit_generator": self.rng.bit_generator.state, "batches": self.batches}

    def set_state(self, st: dict[str, Any]) -> None:
        self.rng.bit_generator.state = st["bit_generator"]
        self.batches = int(st["batches"])


def eval_starts(n_tokens: int, seq_len: int, n_windows: int,
                conversations: np.ndarray | None = None) -> np.ndarray:
    """The starts of eval_windows' windows in a split of n_tokens tokens:
    evenly spaced; with a chat split's conversation starts, those of them
    that begin no earlier than the previous window's end (windows never
    overlap), evenly thinned to n_windows."""
    T = seq_len
    if conversations is not None:
        picked, end = [], -1
        for o in conversations.tolist():
            if o >= end:
                picked.append(o)
                end = o + T
        idx = np.linspace(0, len(picked) - 1, min(int(n_windows), len(picked)))
        return np.asarray(picked, np.int64)[np.unique(idx.round().astype(np.int64))]
    span = n_tokens - T - 1
    n = max(1, min(int(n_windows), span // T + 1 if span > 0 else 1))
    return np.linspace(0, max(span, 0), n).astype(np.int64)


def eval_windows(tokens: np.ndarray, seq_len: int, n_windows: int,
                 mask: np.ndarray | None = None,
                 aligned: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Fixed validation windows: up to n_windows (T+1)-token windows at evenly
    spaced offsets covering the split (the same every call); mask and
    aligned as BatchSampler's. DataError when a mask leaves no target in them."""
    conv = conversation_starts(tokens, mask, seq_len) if aligned and mask is not None else None
    x, y = _targets(tokens, mask, eval_starts(len(tokens), seq_len, n_windows, conv), seq_len)
    if mask is not None and not count_targets(y):
        raise DataError(f"the {len(y)} validation windows hold no assistant token to "
                        "score; give more conversations or a larger --eval-tokens")
    return x, y
