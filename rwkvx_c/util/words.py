"""Counts and lists in messages: "1 file", "2 files", "1,024 windows";
"rwkv7, rwkvx, gguf or hf"."""
from __future__ import annotations

from collections.abc import Iterable

__all__ = ["counted", "listed"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """n with its noun, singular for exactly one (plural: noun + "s" unless given)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def listed(words: Iterable[str], last: str = "or") -> str:
    """'a, b or c' (last: the word before the final one)."""
    w = list(words)
    return w[0] if len(w) == 1 else f"{', '.join(w[:-1])} {last} {w[-1]}"
