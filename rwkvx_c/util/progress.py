"""Progress of a training run on stderr: a tqdm bar on a terminal, plain
lines elsewhere.

A Slurm or nohup log is not a terminal: a carriage-return update per step
there is thousands of lines of noise, so PlainProgress writes one line at
most every PLAIN_INTERVAL_S seconds (and a last one at close).
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["PlainProgress", "PLAIN_INTERVAL_S", "make_progress"]

PLAIN_INTERVAL_S = 5.0


class PlainProgress:
    """The part of tqdm's interface the CLI uses, as rate-limited lines."""

    def __init__(self, total: float, initial: float = 0, unit: str = "step",
                 file: TextIO | None = None, interval: float = PLAIN_INTERVAL_S) -> None:
        self.total, self.n, self.unit = total, initial, unit
        self.file = file if file is not None else sys.stderr
        self.interval = interval
        self.post: dict = {}
        self._last = time.monotonic()
        self._written_n: float | None = None

    def set_postfix(self, post: dict, refresh: bool = False) -> None:
        self.post = dict(post)

    def update(self, k: float) -> None:
        self.n += k
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._write()

    def _write(self) -> None:
        self._written_n = self.n
        extra = "".join(f", {k} {v}" for k, v in self.post.items())
        self.file.write(f"{self.n:.0f}/{self.total:.0f} {self.unit}{extra}\n")
        self.file.flush()

    def close(self) -> None:
        if self._written_n != self.n:
            self._write()


def make_progress(total: float, initial: float, unit: str, **tqdm_kw: Any) -> Any:
    """tqdm on a terminal stderr, PlainProgress otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True, **tqdm_kw)
    return PlainProgress(total, initial, unit)
