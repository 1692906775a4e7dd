"""Counts in messages: "1 file", "2 files", "1,024 windows"."""
from __future__ import annotations

__all__ = ["counted"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """n with its noun, singular for exactly one (plural: noun + "s" unless given)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
