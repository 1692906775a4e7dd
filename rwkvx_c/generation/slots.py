"""The slots a generation runs in: the C engine's GenState (csrc/gen.c),
or, on a build without it, SerialSlots: the same interface over one
InferState a slot, stepped one after another."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from rwkvx_c import _core

__all__ = ["Slots", "SerialSlots", "open_slots"]


class Slots(Protocol):
    n_slots: int
    max_tokens: int
    vocab_size: int

    def reset(self, slot: int) -> None: ...
    def copy(self, dst: int, src: int) -> None: ...
    def pos(self, slot: int) -> int: ...
    def step(self, slots: Sequence[int], counts: Sequence[int], tokens: np.ndarray,
             all_logits: bool = False, out: np.ndarray | None = None) -> np.ndarray: ...


class SerialSlots:
    """GenState's interface over an InferState a slot. copy replays what
    the source slot read since its reset, in the pieces it read them."""

    def __init__(self, model: _core.RxPtModel, n_slots: int, max_len: int = 4096,
                 max_tokens: int = 512) -> None:
        self.n_slots, self.max_len, self.max_tokens = n_slots, max_len, max_tokens
        self.vocab_size = int(model.config["vocab_size"])
        self.states = [_core.InferState(model, max_len=max_len) for _ in range(n_slots)]
        self.read: list[list[np.ndarray]] = [[] for _ in range(n_slots)]

    def reset(self, slot: int) -> None:
        self.states[slot].reset()
        self.read[slot] = []

    def copy(self, dst: int, src: int) -> None:
        self.reset(dst)
        for piece in self.read[src]:
            self.states[dst].forward(piece)
        self.read[dst] = list(self.read[src])

    def pos(self, slot: int) -> int:
        return int(self.states[slot].pos)

    def step(self, slots: Sequence[int], counts: Sequence[int], tokens: np.ndarray,
             all_logits: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        rows = []
        at = 0
        for k, c in zip(slots, counts):
            piece = np.ascontiguousarray(tokens[at:at + c], np.int32)
            at += c
            lg = self.states[k].forward(piece)
            self.read[k].append(piece)
            rows.append(lg if all_logits else lg[-1:])
        return np.concatenate(rows)


def open_slots(model: _core.RxPtModel, n_slots: int, max_len: int, max_tokens: int) -> Any:
    """n_slots slots of model: the C engine's when the build has it."""
    gen = getattr(_core, "GenState", None)
    if gen is not None:
        return gen(model, n_slots, max_len=max_len, max_tokens=max_tokens)
    return SerialSlots(model, n_slots, max_len, max_tokens)
